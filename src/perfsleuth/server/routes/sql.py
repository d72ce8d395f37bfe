"""``POST /api/sql``: one read-only statement on a console cursor (see
:mod:`perfsleuth.server.console`), with a row cap, a byte cap and a time limit."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Body
from fastapi.responses import Response

from perfsleuth.server import console, models
from perfsleuth.server.backend import Busy
from perfsleuth.server.deps import ApiError, BackendDep, LimitsDep, json_value

router = APIRouter()


@router.post(
    "/api/sql",
    summary="One read-only SQL statement, with a row cap, a byte cap and a time limit",
    response_model=models.SqlResult,
)
def sql(
    be: BackendDep,
    limits: LimitsDep,
    query: Annotated[str, Body(embed=True, description="SELECT or EXPLAIN of one.")],
    limit: Annotated[int, Body(embed=True, ge=1, le=console.MAX_ROWS)] = 1000,
) -> Response:
    if not query.strip():
        raise ApiError(400, "the query is empty")
    try:
        res = be.console(query, limit, limits.sql_max_bytes, limits.sql_time_limit)
    except Busy as e:
        raise ApiError(429, str(e)) from e
    except console.ConsoleError as e:
        raise ApiError(400, str(e)) from e
    head = json.dumps(
        {
            "columns": json_value(res.columns),
            "truncated": res.truncated,
            "truncated_by": res.truncated_by,
            "limit": limit,
            "max_bytes": limits.sql_max_bytes,
            "bytes": res.bytes,
            "elapsed_ms": res.elapsed_ms,
        },
        ensure_ascii=False,
    )
    # The rows were encoded one by one within the time limit; they are joined, not re-encoded.
    return Response(
        head[:-1] + ', "rows": [' + ",".join(res.encoded) + "]}",
        media_type="application/json",
    )
