"""gc_pressure: endpoints whose requests spend a notable share of their time in garbage
collections (the agent adds every collection's pause to the requests in flight).
"""

from __future__ import annotations

from perfsleuth.analysis import text
from perfsleuth.analysis.detectors import register
from perfsleuth.analysis.findings import Context, Finding, iso, stable_id

KIND = "gc_pressure"

_SQL = """
SELECT endpoint, count(*) AS requests, sum(duration_ms) AS ms, sum(gc_ms) AS gc_ms,
    sum(gc_count) AS collections, max(gc_ms) AS max_gc_ms,
    max_by(trace_id, (gc_ms, trace_id), 3) AS examples, min(ts) AS first_ts, max(ts) AS last_ts
FROM r
GROUP BY endpoint
HAVING count(*) >= ? AND sum(gc_ms) >= ? * sum(duration_ms) AND sum(gc_ms) >= ? * count(*)
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    rows = ctx.query(
        _SQL,
        [
            int(ctx.t(KIND, "min_requests")),
            float(ctx.t(KIND, "min_time_share")),
            float(ctx.t(KIND, "min_ms_per_request")),
        ],
    )
    out = []
    for r in rows:
        share = r["gc_ms"] / r["ms"] if r["ms"] else 0.0
        per_req = r["gc_ms"] / r["requests"]
        title = (
            f"Requests of {r['endpoint']} spend {text.pct(share)} of their time in garbage "
            f"collection ({text.ms(per_req)} per request, "
            f"{r['collections'] / r['requests']:.1f} collections per request)."
        )
        out.append(
            Finding(
                id=stable_id(KIND, r["endpoint"]),
                kind=KIND,
                endpoint=r["endpoint"],
                title=title,
                impact_ms_per_min=ctx.per_min(r["gc_ms"]),
                example_trace_ids=list(r["examples"] or []),
                first_seen=iso(r["first_ts"]),
                last_seen=iso(r["last_ts"]),
                suggestion=(
                    "Allocate less per request (stream instead of building big lists, avoid "
                    "re-creating large structures), call gc.freeze() after start-up so "
                    "long-lived objects are not re-scanned, or raise gc thresholds "
                    "(gc.set_threshold) for this service; `perfsleuth heap` shows what is live."
                ),
                evidence={
                    "requests": r["requests"],
                    "gc_ms": r["gc_ms"],
                    "gc_share": share,
                    "gc_ms_per_request": per_req,
                    "collections": r["collections"],
                    "max_gc_ms": r["max_gc_ms"],
                },
            )
        )
    return out
