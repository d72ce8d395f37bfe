"""Comparisons: ``GET /api/compare`` (two time ranges, or two values of a tag, attribute or
release, per endpoint with the verdict; the two latency distributions for the chart) and
``GET /api/compare/values`` (the values a ``by`` takes, for the page's pickers)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from perfsleuth.analysis import compare as cmp
from perfsleuth.server import models
from perfsleuth.server.deps import BackendDep, error, ok
from perfsleuth.store.base import StoreError

router = APIRouter()


@router.get(
    "/api/compare",
    summary="Compare two time ranges or two tag/attribute values",
    response_model=models.CompareResult,
)
def compare(
    be: BackendDep,
    a: Annotated[
        str | None,
        Query(description="Side a: START/END (UTC ISO 8601) or last-1h; with by, a value."),
    ] = None,
    b: Annotated[str | None, Query(description="Side b, as a.")] = None,
    by: Annotated[
        str | None, Query(description="tag:NAME, attr:NAME or release: compare its values.")
    ] = None,
    window: Annotated[
        str | None, Query(description="With by: only requests in this time range.")
    ] = None,
    findings: Annotated[bool, Query(description="Findings appeared and gone.")] = True,
    alpha: Annotated[float, Query(gt=0, lt=1)] = cmp.ALPHA,
) -> Response:
    try:
        with be.use() as store:
            if by:
                scope = cmp.time_side(window) if window else None
                side_a, side_b = cmp.value_sides(store, by, a or None, b or None, scope)
            else:
                if not a or not b:
                    return error(400, "give two sides: a=START/END&b=last-1h, or by=tag:NAME")
                side_a, side_b = cmp.time_side(a), cmp.time_side(b)
            result = cmp.compare(store, side_a, side_b, alpha=alpha, findings=findings)
            result["histograms"] = cmp.histograms(store, side_a, side_b)
    except cmp.CompareError as e:
        return error(400, str(e))
    except StoreError as e:
        return error(400, str(e).splitlines()[0])
    return ok(result)


@router.get(
    "/api/compare/values",
    summary="The values of a tag, attribute or release",
    response_model=list[models.CompareValue],
)
def values(
    be: BackendDep,
    by: Annotated[str, Query(description="tag:NAME, attr:NAME or release.")],
) -> Response:
    try:
        with be.use() as store:
            rows = cmp.values_of(store, by)
    except cmp.CompareError as e:
        return error(400, str(e))
    return ok([{"value": r["value"], "requests": r["n"], "first": r["first"]} for r in rows])
