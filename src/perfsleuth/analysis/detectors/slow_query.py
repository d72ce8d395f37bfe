"""slow_query: statements whose own p95 is high, with their share of the endpoint's time.

Only statements that reach ``p95_ms`` at least once are ranked by percentile (a cheap max()
first), so the quantiles are computed over a few groups, not over every call.
"""

from __future__ import annotations

from perfsleuth.analysis import text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "slow_query"

_SQL = """
WITH cand AS (     -- statements slow at least once: the only ones worth a percentile
    SELECT endpoint, fingerprint_id FROM c
    WHERE fingerprint_id IS NOT NULL AND list_contains(?, kind)
    GROUP BY ALL HAVING max(duration_ms) >= ? AND count(*) >= ?
),
ep AS (SELECT endpoint, sum(duration_ms) AS total_ms FROM r GROUP BY 1)
SELECT c.endpoint, c.kind, c.fingerprint_id, count(*) AS calls,
    count(DISTINCT c.trace_id) AS requests,
    quantile_cont(c.duration_ms, 0.5) AS p50, quantile_cont(c.duration_ms, 0.95) AS p95,
    max(c.duration_ms) AS max_ms, sum(c.duration_ms) AS ms, median(c.rows) AS rows_p50,
    mode(c.site_id) AS site_id, min(c.ts) AS first_ts, max(c.ts) AS last_ts,
    max_by(c.trace_id, (c.duration_ms, c.trace_id), 3) AS examples,
    any_value(ep.total_ms) AS ep_total_ms
FROM c SEMI JOIN cand USING (endpoint, fingerprint_id)
    JOIN ep USING (endpoint)
GROUP BY c.endpoint, c.kind, c.fingerprint_id
HAVING quantile_cont(c.duration_ms, 0.95) >= ? AND sum(c.duration_ms) >= ? * any_value(ep.total_ms)
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    p95_ms = float(ctx.t(KIND, "p95_ms"))
    rows = ctx.query(
        _SQL,
        [
            list(ctx.t(KIND, "kinds")),
            p95_ms,
            int(ctx.t(KIND, "min_calls")),
            p95_ms,
            float(ctx.t(KIND, "min_time_share")),
        ],
    )
    if not rows:
        return []
    out = []
    for r, fp, callsite in ctx.with_statements(rows):
        share = r["ms"] / r["ep_total_ms"] if r["ep_total_ms"] else 0.0
        title = (
            f"`{text.statement(fp, 70)}` in {r['endpoint']} takes {text.ms(r['p95'])} at p95 "
            f"(median {text.ms(r['p50'])}, {r['calls']:,} calls): {text.pct(share)} of the "
            "endpoint's time."
        )
        out.append(
            Finding(
                id=stable_id(KIND, r["endpoint"], (r["kind"], fp)),
                kind=KIND,
                endpoint=r["endpoint"],
                title=title,
                impact_ms_per_min=ctx.per_min(r["ms"]),
                callsite=callsite,
                fingerprint=fp,
                count_per_request=r["calls"] / max(r["requests"], 1),
                example_trace_ids=list(r["examples"] or []),
                first_seen=iso(r["first_ts"]),
                last_seen=iso(r["last_ts"]),
                suggestion=(
                    "Look at its plan (EXPLAIN ANALYZE): a missing index, a scan of a big "
                    "table, or lock waits; or cache its result if it cannot be made fast."
                ),
                evidence={
                    "call_kind": r["kind"],
                    "calls": r["calls"],
                    "requests": r["requests"],
                    "p50_ms": r["p50"],
                    "p95_ms": r["p95"],
                    "max_ms": r["max_ms"],
                    "ms": r["ms"],
                    "rows_median": r["rows_p50"],
                    "share_of_endpoint_time": share,
                },
            )
        )
    return out
