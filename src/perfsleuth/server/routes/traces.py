"""Requests: ``GET /api/traces`` (newest first, or the slowest N) and
``GET /api/traces/{trace_id}`` (one request with its calls, samples, blockers and capture)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from perfsleuth.server import models, queries
from perfsleuth.server.deps import BackendDep, SinceQ, answer, resolve_trace, window_of
from perfsleuth.server.routes.captures import replay_of
from perfsleuth.store.base import Store, StoreError

router = APIRouter()


@router.get(
    "/api/traces",
    summary="Requests, newest first or the slowest N",
    response_model=list[models.TraceRow],
)
def traces(
    be: BackendDep,
    endpoint: str | None = None,
    since: SinceQ = "1h",
    slowest: Annotated[int | None, Query(ge=1, le=1000)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> Response:
    w = window_of(since)

    def body(store: Store) -> list[dict[str, Any]]:
        if endpoint is not None:
            queries.check_endpoint(store, endpoint)
        return store.traces(endpoint=endpoint, since=w.since, slowest=slowest, limit=limit)

    return answer(be, body)


@router.get(
    "/api/traces/{trace_id}",
    summary="One request: calls, attributes, samples",
    response_model=models.Trace,
)
def trace(be: BackendDep, trace_id: str) -> Response:
    def body(store: Store) -> dict[str, Any]:
        from perfsleuth.analysis import profile

        try:
            t = store.trace(resolve_trace(store, trace_id))
        except StoreError as e:
            raise queries.NotFound(str(e)) from e
        tid = t["trace_id"]
        t["stack_samples"] = store.samples(tid) if t.get("samples") else []
        # The same samples merged by function: the request's own flame graph.
        t["profile"] = (
            profile.load(store, t["endpoint"], trace_id=tid).tree() if t["stack_samples"] else None
        )
        t["blocker_events"] = store.blockers(trace_id=tid) if t.get("blockers") else []
        t["replay"] = replay_of(store, tid)
        return t

    return answer(be, body)
