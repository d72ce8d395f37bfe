"""``GET /api/status``: the data directory, the time span of its requests, the last ingest, the
agents' drop counters and the OTLP queue's."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from perfsleuth.server import models, queries
from perfsleuth.server.deps import BackendDep, answer
from perfsleuth.store.base import Store

router = APIRouter()


@router.get("/api/status", summary="Server and data status", response_model=models.Status)
def status(be: BackendDep) -> Response:
    def body(store: Store) -> dict[str, Any]:
        first, last = queries.data_span(store)
        return {
            "data": be.data_dir,
            "first": first,
            "last": last,
            "endpoints": len(store.endpoints()),
            "ingest": be.last_ingest,
            "ingest_every_s": be.ingest_every,
            "drops": store.agent_drops(),
            "otlp": be.otlp.status() if be.otlp is not None else None,
        }

    return answer(be, body)
