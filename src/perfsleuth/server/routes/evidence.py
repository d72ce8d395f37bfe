"""An endpoint's evidence: ``GET /api/calltree`` (the call-site trie of its DB, HTTP or cache
calls) and ``GET /api/profile`` (its slow requests' stack samples, merged)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from perfsleuth.server import models, queries
from perfsleuth.server.deps import BackendDep, SinceQ, answer, window_of
from perfsleuth.store.base import Store

router = APIRouter()


@router.get(
    "/api/calltree",
    summary="The call-site trie of an endpoint's calls of one kind",
    response_model=models.CallTreeNode,
)
def calltree(
    be: BackendDep,
    endpoint: Annotated[str, Query(description="The endpoint.")],
    kind: Annotated[str, Query(pattern="^(db|http|cache)$")] = "db",
    since: SinceQ = "1h",
    min_share: Annotated[float, Query(ge=0, le=1)] = 0.01,
) -> Response:
    from perfsleuth.analysis import calltree

    w = window_of(since)

    def body(store: Store) -> dict[str, Any]:
        queries.check_endpoint(store, endpoint)
        tree = calltree.build(store, endpoint, kind=kind, since=w.since, min_share=min_share)
        return tree.to_dict()

    return answer(be, body)


@router.get(
    "/api/profile",
    summary="Stack samples of an endpoint's slow requests, merged",
    response_model=models.Profile,
)
def profile(
    be: BackendDep,
    endpoint: Annotated[str, Query(description="The endpoint.")],
    since: SinceQ = "1h",
) -> Response:
    from perfsleuth.analysis import profile

    w = window_of(since)

    def body(store: Store) -> dict[str, Any]:
        queries.check_endpoint(store, endpoint)
        p = profile.load(store, endpoint, since=w.since)
        return {
            "endpoint": endpoint,
            "requests": p.requests,
            "samples": p.samples,
            "states": p.states,
            "top": p.top(15),
            "tree": p.tree(),
        }

    return answer(be, body)
