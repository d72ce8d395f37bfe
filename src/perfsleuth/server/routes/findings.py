"""Findings: ``GET /api/findings`` (highest impact first) and ``GET /api/findings/{id}`` (one,
by id or unique prefix, with the source line of its call site). Both read the backend's
findings cache."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from perfsleuth.server import models, queries
from perfsleuth.server.deps import ApiError, BackendDep, SinceQ, answer, window_of
from perfsleuth.store.base import Store

router = APIRouter()


@router.get(
    "/api/findings",
    summary="Findings, highest impact first",
    response_model=list[models.Finding],
)
def findings(be: BackendDep, endpoint: str | None = None, since: SinceQ = "1h") -> Response:
    w = window_of(since)

    def body(store: Store) -> list[dict[str, Any]]:
        if endpoint is not None and endpoint not in store.endpoints():
            # A service-wide finding's endpoint ("<service>") names no requests.
            mine = [f.to_dict() for f in be.findings(store, w) if f.endpoint == endpoint]
            if mine:
                return mine
            queries.check_endpoint(store, endpoint)
        return [f.to_dict() for f in be.findings(store, w, endpoint)]

    return answer(be, body)


@router.get(
    "/api/findings/{finding_id}",
    summary="One finding with its evidence",
    response_model=models.FindingDetail,
)
def finding(be: BackendDep, finding_id: str, since: SinceQ = "1h") -> Response:
    from perfsleuth.analysis import loops

    w = window_of(since)

    def body(store: Store) -> dict[str, Any]:
        want = finding_id.strip().lower()
        found = be.findings(store, w)
        matches = [f for f in found if want and f.id.startswith(want)]
        if not matches:
            raise queries.NotFound(f"no finding with id {finding_id!r} in this window")
        if len(matches) > 1:
            raise ApiError(
                400,
                f"finding id prefix {finding_id!r} is ambiguous: it matches "
                f"{len(matches)} findings",
                candidates=sorted(f.id for f in matches)[:10],
            )
        f = matches[0]
        site = f.callsite or {}
        code = loops.source_line(site.get("file"), site.get("line")) if site else None
        return {**f.to_dict(), "source_line": code}

    return answer(be, body)
