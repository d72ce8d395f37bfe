"""The overview and endpoint pages: ``GET /api/overview`` (endpoint table and charts),
``GET /api/endpoints`` (the table alone) and ``GET /api/endpoint`` (one endpoint)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from perfsleuth.server import models, queries
from perfsleuth.server.deps import BackendDep, HostQ, ServiceQ, SinceQ, answer, window_of

router = APIRouter()


@router.get(
    "/api/overview",
    summary="Endpoint table, P95 per endpoint, slow counts, throughput",
    response_model=models.Overview,
)
def overview(
    be: BackendDep, since: SinceQ = "1h", host: HostQ = None, service: ServiceQ = None
) -> Response:
    return answer(be, queries.overview, window_of(since, host, service))


@router.get(
    "/api/endpoints",
    summary="The endpoint table (store.top) with time share",
    response_model=list[models.TopRow],
)
def endpoints(
    be: BackendDep, since: SinceQ = "1h", host: HostQ = None, service: ServiceQ = None
) -> Response:
    return answer(be, queries.endpoint_table, window_of(since, host, service))


@router.get(
    "/api/endpoint",
    summary="One endpoint: percentiles, histogram, calls, traces",
    response_model=models.EndpointDetail,
)
def endpoint(
    be: BackendDep,
    name: Annotated[str, Query(description='The endpoint, e.g. "GET /orders/{id}".')],
    since: SinceQ = "1h",
    host: HostQ = None,
    service: ServiceQ = None,
) -> Response:
    return answer(be, queries.endpoint_detail, window_of(since, host, service), name)
