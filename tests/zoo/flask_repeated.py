"""repeated_query (Flask + SQLAlchemy Core on psycopg 3): the account page loads the account,
then two helpers each load it again: the same statement with the same parameters three times
per request. Clean twin: loaded once and passed to the helpers."""

from __future__ import annotations

from typing import Any

from flask import Blueprint
from sqlalchemy import Connection, Row, create_engine, text

from zoo import env

bp = Blueprint("repeated", __name__)
_engine = create_engine(env.PG_DSN.replace("postgresql://", "postgresql+psycopg://", 1))
# Connect once at import (outside any request) so the dialect's first-connect queries are not
# part of the first request's calls.
with _engine.connect():
    pass

ACCOUNT = text(
    "SELECT id, name, plan, seats, max_seats, country FROM zoo_repeated.account WHERE id = :id"
)
EU = {"DE", "FR", "NL"}


def _account(conn: Connection, account_id: int) -> Row[Any]:
    return conn.execute(ACCOUNT, {"id": account_id}).one()  # PLANTED: repeated_query


def _can_invite_bad(conn: Connection, account_id: int) -> bool:
    account = _account(conn, account_id)  # fetched again
    return bool(account.seats < account.max_seats)


def _tax_region_bad(conn: Connection, account_id: int) -> str:
    return "EU" if _account(conn, account_id).country in EU else "ROW"  # and again


@bp.get("/repeated/bad/<int:account_id>")
def account_bad(account_id: int) -> dict[str, Any]:
    with _engine.connect() as conn:
        account = _account(conn, account_id)
        return {"id": account.id, "name": account.name, "plan": account.plan,
                "can_invite": _can_invite_bad(conn, account_id),
                "tax_region": _tax_region_bad(conn, account_id)}  # fmt: skip


@bp.get("/repeated/clean/<int:account_id>")
def account_clean(account_id: int) -> dict[str, Any]:
    with _engine.connect() as conn:
        account = _account(conn, account_id)
    return {"id": account.id, "name": account.name, "plan": account.plan,
            "can_invite": account.seats < account.max_seats,
            "tax_region": "EU" if account.country in EU else "ROW"}  # fmt: skip
