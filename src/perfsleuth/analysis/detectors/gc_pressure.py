"""gc_pressure: endpoints whose requests spend a notable share of their time in garbage
collections they started (the agent charges each collection to the request whose code ran when
it began; the requests that only waited for it are not charged).

When the collections cost about the same share on most endpoints, what they scan is the
service's own heap (a large long-lived heap: every full collection walks it, whichever request
triggered it), not any endpoint's allocations: one finding for the service, with the heap's
size as the agent last sampled it (``agent_stats``: ``gc_heap_objects``) and the
``gc.freeze()`` remedy, instead of one per endpoint.
"""

from __future__ import annotations

from typing import Any

from perfsleuth.analysis import text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "gc_pressure"
SERVICE = "<service>"  # the endpoint of a service-wide finding

# ``typical_*``: the same sums without the endpoint's costliest tenth of requests by GC time
# (at least one request), so that a few requests that happened to start a full collection of
# the service's heap do not make a page that allocates little look like it collects a lot.
_SQL = """
WITH ranked AS (
    SELECT *, row_number() OVER (PARTITION BY endpoint ORDER BY gc_ms DESC NULLS LAST) AS rk,
        CASE WHEN ? > 0 THEN greatest(1, ceil(count(*) OVER (PARTITION BY endpoint) * ?))
            ELSE 0 END AS cut
    FROM r
)
SELECT endpoint, count(*) AS requests, sum(duration_ms) AS ms,
    coalesce(sum(gc_ms), 0) AS gc_ms, coalesce(sum(gc_count), 0) AS collections,
    max(gc_ms) AS max_gc_ms,
    max_by(CASE WHEN gc_ms > 0 THEN trace_id END, (coalesce(gc_ms, 0), trace_id), 3) AS examples,
    min(ts) AS first_ts, max(ts) AS last_ts, list(DISTINCT service) AS services,
    count(*) FILTER (WHERE rk > cut) AS typical_requests,
    sum(duration_ms) FILTER (WHERE rk > cut) AS typical_ms,
    coalesce(sum(gc_ms) FILTER (WHERE rk > cut), 0) AS typical_gc_ms
FROM ranked
GROUP BY endpoint
HAVING count(*) >= ?
"""

_HEAP_SQL = """
SELECT max(value) AS objects FROM agent_stats
WHERE name = 'gc_heap_objects' AND list_contains(?, service) AND (? IS NULL OR ts >= ?)
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    trim = float(ctx.t(KIND, "trim_share"))
    rows = ctx.query(_SQL, [trim, trim, int(ctx.t(KIND, "min_requests"))])
    min_share = float(ctx.t(KIND, "min_time_share"))
    min_ms = float(ctx.t(KIND, "min_ms_per_request"))
    for r in rows:
        r["share"] = r["gc_ms"] / r["ms"] if r["ms"] else 0.0
        r["per_req"] = r["gc_ms"] / r["requests"]
        typical_n, typical_ms = r["typical_requests"], r["typical_ms"]
        r["typical_share"] = r["typical_gc_ms"] / typical_ms if typical_ms else 0.0
        r["typical_per_req"] = r["typical_gc_ms"] / typical_n if typical_n else 0.0
    flagged = [
        r
        for r in rows
        if r["gc_ms"] > 0
        and min(r["share"], r["typical_share"]) >= min_share
        and min(r["per_req"], r["typical_per_req"]) >= min_ms
    ]
    if not flagged:
        return []
    shares = [r["share"] for r in flagged]
    if (
        len(flagged) >= int(ctx.t(KIND, "service_min_endpoints"))
        and len(flagged) >= float(ctx.t(KIND, "service_coverage")) * len(rows)
        and max(shares) <= float(ctx.t(KIND, "service_spread")) * min(shares)
    ):
        return [_service_finding(ctx, rows, flagged)]
    return [_endpoint_finding(ctx, r) for r in flagged]


def _endpoint_finding(ctx: Context, r: dict[str, Any]) -> Finding:
    title = (
        f"Requests of {r['endpoint']} spend {text.pct(r['share'])} of their time in garbage "
        f"collections they started ({text.ms(r['per_req'])} per request, "
        f"{r['collections'] / r['requests']:.1f} collections per request)."
    )
    return Finding(
        id=stable_id(KIND, r["endpoint"]),
        kind=KIND,
        endpoint=r["endpoint"],
        title=title,
        impact_ms_per_min=ctx.per_min(r["gc_ms"]),
        example_trace_ids=[t for t in r["examples"] or () if t],  # requests that collected
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
            "gc_share": r["share"],
            "gc_ms_per_request": r["per_req"],
            "collections": r["collections"],
            "max_gc_ms": r["max_gc_ms"],
            "gc_share_without_costliest": r["typical_share"],
        },
    )


def _service_finding(
    ctx: Context, rows: list[dict[str, Any]], flagged: list[dict[str, Any]]
) -> Finding:
    services = sorted({s for r in rows for s in r["services"] or ()})
    heap = ctx.store.query(_HEAP_SQL, [services, ctx.cutoff, ctx.cutoff])
    objects = heap[0]["objects"] if heap else None
    requests = sum(r["requests"] for r in rows)
    gc_ms = sum(r["gc_ms"] for r in rows)
    ms = sum(r["ms"] or 0.0 for r in rows)
    share = gc_ms / ms if ms else 0.0
    shares = [r["share"] for r in flagged]
    size = f" a heap of about {objects:,} objects," if objects else ""
    name = ", ".join(services) or "the service"
    title = (
        f"Garbage collection takes {text.pct(share)} of request time across {name}, about the "
        f"same on {len(flagged)} of {len(rows)} endpoints ({text.pct(min(shares))} to "
        f"{text.pct(max(shares))}):{size} scanned by every full collection, whichever request "
        f"starts it ({text.ms(gc_ms / requests)} per request)."
    )
    examples = [
        t for r in sorted(flagged, key=lambda r: -r["gc_ms"]) for t in r["examples"] or () if t
    ]
    return Finding(
        id=stable_id(KIND, SERVICE, tuple(services)),
        kind=KIND,
        endpoint=SERVICE,
        title=title,
        impact_ms_per_min=ctx.per_min(gc_ms),
        example_trace_ids=examples[:3],
        first_seen=iso(min(r["first_ts"] for r in rows)),
        last_seen=iso(max(r["last_ts"] for r in rows)),
        suggestion=(
            "Call gc.freeze() once the service has loaded (after imports and warm-up, before "
            "serving; in a pre-fork server, in the master before forking): the long-lived "
            "objects then move to a generation the collector never scans, and full "
            "collections only walk what requests allocate. Raising the thresholds "
            "(gc.set_threshold) makes collections rarer; `perfsleuth heap` shows what is live."
        ),
        evidence={
            "requests": requests,
            "gc_ms": gc_ms,
            "gc_share": share,
            "gc_ms_per_request": gc_ms / requests,
            "collections": sum(r["collections"] for r in rows),
            "heap_objects": objects,
            "endpoints": [
                {"endpoint": r["endpoint"], "gc_share": r["share"], "requests": r["requests"]}
                for r in sorted(flagged, key=lambda r: -r["share"])
            ],
        },
    )
