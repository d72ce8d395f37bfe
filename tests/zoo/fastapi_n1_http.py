"""n_plus_one over HTTP (FastAPI + httpx): a team page fetches each member's avatar from the
avatar service, one request per member. Clean twin: one batch request for the whole team."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import APIRouter

from zoo import db, env

router = APIRouter()
_avatars = httpx.Client(base_url=env.UPSTREAM, timeout=30.0)


def _members(team: int) -> list[int]:
    rows = db.pg().execute(
        "SELECT user_id FROM zoo_n1_http.member WHERE team_id = %s ORDER BY user_id", (team,)
    )
    return [r[0] for r in rows.fetchall()]


@router.get("/n1-http/bad")
def team_bad(team: int = 1) -> dict[str, Any]:
    avatars = []
    for user_id in _members(team):
        avatars.append(_avatars.get(f"/avatars/{user_id}").json())  # PLANTED: n_plus_one
    return {"team": team, "avatars": avatars}


@router.get("/n1-http/clean")
def team_clean(team: int = 1) -> dict[str, Any]:
    ids = ",".join(str(u) for u in _members(team))
    return {"team": team, "avatars": _avatars.get("/avatars", params={"ids": ids}).json()}
