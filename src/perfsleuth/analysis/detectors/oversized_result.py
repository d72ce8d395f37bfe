"""oversized_result: statements returning far more rows (or bytes) than any page can show.

Per endpoint and statement: the calls returning ``max_rows`` rows or ``max_bytes`` bytes or
more, with what the endpoint sends back (response size, and the row count when the app
records one as an attribute). The time it costs is the query plus the application time of
those requests outside any call (turning the rows into objects, aggregating them in Python):
an upper bound, the honest one when the result is what the request spends its time on.
"""

from __future__ import annotations

from perfsleuth.analysis import frames, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "oversized_result"

_SQL = """
WITH big AS (
    SELECT endpoint, kind, fingerprint_id, trace_id, site_id, stack_id, rows, bytes, duration_ms, ts
    FROM c
    WHERE fingerprint_id IS NOT NULL AND (rows >= ? OR bytes >= ?)
),
ret AS (           -- rows the app says it returned (an attribute), when it records them
    SELECT trace_id, max(num) AS returned FROM attributes
    WHERE kind = 'attr' AND num IS NOT NULL AND list_contains(?, key)
        AND trace_id IN (SELECT trace_id FROM big)
    GROUP BY 1
),
per AS (           -- per request: the big calls, and the request's time outside all calls
    SELECT big.endpoint, big.kind, big.fingerprint_id, big.trace_id,
        any_value(ret.returned) AS returned,
        count(*) AS n, sum(big.duration_ms) AS ms, max(big.rows) AS max_rows,
        max(big.bytes) AS max_bytes, mode(big.site_id) AS site_id, mode(big.stack_id) AS stack_id,
        min(big.ts) AS ts,
        any_value(greatest(r.duration_ms - r.db_ms - r.http_ms - r.cache_ms, 0)) AS app_ms,
        any_value(r.resp_bytes) AS resp_bytes, any_value(r.duration_ms) AS req_ms
    FROM big JOIN r USING (trace_id) LEFT JOIN ret USING (trace_id)
    GROUP BY big.endpoint, big.kind, big.fingerprint_id, big.trace_id
)
SELECT endpoint, kind, fingerprint_id, mode(site_id) AS site_id, mode(stack_id) AS stack_id,
    count(*) AS requests_hit,
    sum(n) AS calls, median(max_rows) AS rows_p50, max(max_rows) AS rows_max,
    median(max_bytes) AS bytes_p50, max(max_bytes) AS bytes_max, sum(ms) AS ms,
    sum(app_ms) AS app_ms, median(returned) AS returned, median(resp_bytes) AS resp_bytes,
    median(req_ms) AS req_p50,
    min(ts) AS first_ts, max(ts) AS last_ts,
    max_by(trace_id, (coalesce(max_rows, 0) + coalesce(max_bytes, 0), trace_id), 3) AS examples
FROM per GROUP BY endpoint, kind, fingerprint_id
HAVING sum(n) >= ?
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    max_rows = int(ctx.t(KIND, "max_rows"))
    rows = ctx.query(
        _SQL,
        [
            max_rows,
            int(ctx.t(KIND, "max_bytes")),
            list(ctx.t(KIND, "returned_rows_keys")) or [""],
            int(ctx.t(KIND, "min_calls")),
        ],
    )
    if not rows:
        return []
    out = []
    stacks = frames.stacks(ctx.store, (r["stack_id"] for r in rows))
    for r, fp, callsite in ctx.with_statements(rows):
        returned = r["returned"]
        by_rows = r["rows_p50"] is not None and r["rows_p50"] >= max_rows
        loaded = f"{text.count(r['rows_p50'])} rows" if by_rows else text.size(r["bytes_p50"])
        if returned is not None:
            sends = f"to return {text.count(returned)} rows"
        elif r["resp_bytes"] is not None:
            sends = f"for a response of {text.size(r['resp_bytes'])}"
        else:
            sends = "per request"
        impact = float(r["ms"] or 0) + float(r["app_ms"] or 0)
        title = (
            f"{r['endpoint']} loads {loaded} (median) with `{text.statement(fp, 60)}` {sends}; "
            f"{r['requests_hit']:,} requests spent {text.ms(impact)} in the query and in the "
            "code handling its result."
        )
        out.append(
            Finding(
                id=stable_id(KIND, r["endpoint"], (r["kind"], fp)),
                kind=KIND,
                endpoint=r["endpoint"],
                title=title,
                impact_ms_per_min=ctx.per_min(impact),
                callsite=callsite,
                fingerprint=fp,
                count_per_request=None,
                example_trace_ids=list(r["examples"] or []),
                first_seen=iso(r["first_ts"]),
                last_seen=iso(r["last_ts"]),
                suggestion=(
                    "Let the database do the work: filter, aggregate (GROUP BY) and LIMIT in "
                    "the query, select only the columns needed, or page through the result."
                ),
                evidence={
                    "call_kind": r["kind"],
                    "calls": r["calls"],
                    "requests": r["requests_hit"],
                    "rows_median": r["rows_p50"],
                    "rows_max": r["rows_max"],
                    "bytes_median": r["bytes_p50"],
                    "bytes_max": r["bytes_max"],
                    "query_ms": r["ms"],
                    "app_ms_outside_calls": r["app_ms"],
                    "request_ms_median": r["req_p50"],
                    "response_bytes_median": r["resp_bytes"],
                    "rows_returned_median": returned,
                    # the application frames that led to the statement, outermost first: the
                    # caller that built it when the call site is a generic executor
                    "app_path": [f.site() for f in frames.app_frames(stacks.get(r["stack_id"], []))]
                    or None,
                },
            )
        )
    return out
