"""``GET /api/fleet``: the hosts and services that sent requests, and which token sent what
(:mod:`perfsleuth.server.fleet`)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from perfsleuth.server import fleet as fleet_queries
from perfsleuth.server import models
from perfsleuth.server.deps import BackendDep, SinceQ, answer, window_of

router = APIRouter()


@router.get(
    "/api/fleet",
    summary="Hosts and services with requests, and the tokens that sent them",
    response_model=models.Fleet,
)
def fleet(be: BackendDep, since: SinceQ = "1h") -> Response:
    return answer(be, fleet_queries.fleet, window_of(since))
