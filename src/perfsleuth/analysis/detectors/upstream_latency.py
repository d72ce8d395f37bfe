"""upstream_latency: endpoints whose time is mostly spent waiting on one outbound host.

"Their slowness" versus "our slowness": for each endpoint and host, the endpoint's p95 as
measured and with the time spent waiting on that host taken out (our own part), and the same
for the whole site, since one slow upstream can move the site-wide p95 while our code is fine
(the lessons' Graphite case). Which tenants the waiting comes from is part of the evidence.
"""

from __future__ import annotations

from typing import Any

from perfsleuth.analysis import frames, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "upstream_latency"

_SQL = """
WITH h AS (        -- per request and host: the time spent waiting on it
    SELECT trace_id, host, count(*) AS n, sum(duration_ms) AS ms, mode(site_id) AS site_id,
        mode(fingerprint_id) AS fingerprint_id
    FROM c WHERE kind = 'http' AND host IS NOT NULL
    GROUP BY ALL
),
ep AS (
    SELECT endpoint, count(*) AS requests, sum(duration_ms) AS total_ms,
        quantile_cont(duration_ms, 0.95) AS p95
    FROM r GROUP BY 1
)
SELECT r.endpoint, h.host, count(*) AS requests_calling, sum(h.n) AS calls,
    sum(h.ms) AS upstream_ms, quantile_cont(h.ms, 0.5) AS upstream_p50,
    quantile_cont(h.ms, 0.95) AS upstream_p95,
    quantile_cont(greatest(r.duration_ms - h.ms, 0), 0.95) AS ours_p95_calling,
    quantile_cont(r.duration_ms, 0.95) AS p95_calling,
    quantile_cont(h.ms / greatest(r.duration_ms, h.ms, 1e-9), 0.5) AS median_share,
    mode(h.site_id) AS site_id, mode(h.fingerprint_id) AS fingerprint_id,
    min(r.ts) AS first_ts, max(r.ts) AS last_ts,
    max_by(r.trace_id, (h.ms, r.trace_id), 3) AS examples,
    any_value(ep.requests) AS ep_requests, any_value(ep.total_ms) AS ep_total_ms,
    any_value(ep.p95) AS ep_p95
FROM h JOIN r USING (trace_id) JOIN ep ON ep.endpoint = r.endpoint
GROUP BY r.endpoint, h.host
HAVING count(*) >= ?
    AND (sum(h.ms) >= ? * any_value(ep.total_ms)
         OR (quantile_cont(h.ms / greatest(r.duration_ms, h.ms, 1e-9), 0.5) >= ?
             AND count(*) >= 0.5 * any_value(ep.requests)))
    AND quantile_cont(h.ms, 0.5) >= ? AND sum(h.ms) / sum(h.n) >= ?
"""

# The endpoint's and the site's p95 with this host's waiting taken out; its top tenants.
_WITHOUT = """
WITH h AS (SELECT trace_id, sum(duration_ms) AS ms FROM c WHERE kind = 'http' AND host = ?
           GROUP BY 1),
x AS (SELECT r.endpoint, r.kind, r.tenant, r.duration_ms AS d,
             greatest(r.duration_ms - coalesce(h.ms, 0), 0) AS ours, coalesce(h.ms, 0) AS up
      FROM r LEFT JOIN h USING (trace_id))
SELECT
    quantile_cont(ours, 0.95) FILTER (WHERE endpoint = ?) AS ep_ours_p95,
    quantile_cont(d, 0.95) FILTER (WHERE kind = 'web') AS site_p95,
    quantile_cont(ours, 0.95) FILTER (WHERE kind = 'web') AS site_ours_p95,
    (SELECT list({'tenant': tenant, 'ms': ms} ORDER BY ms DESC)[1:3] FROM (
        SELECT tenant, sum(up) AS ms FROM x WHERE endpoint = ? AND up > 0 AND tenant IS NOT NULL
        GROUP BY 1)) AS tenants
FROM x
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    rows = ctx.query(
        _SQL,
        [
            int(ctx.t(KIND, "min_requests")),
            float(ctx.t(KIND, "min_time_share")),
            float(ctx.t(KIND, "min_typical_share")),
            float(ctx.t(KIND, "min_ms_per_request")),
            float(ctx.t(KIND, "min_ms_per_call")),
        ],
    )
    if not rows:
        return []
    sites = frames.locations(ctx.store, (r["site_id"] for r in rows))
    fps = ctx.fingerprints({r["fingerprint_id"] for r in rows})
    out = []
    for r in rows:
        w = ctx.query(_WITHOUT, [r["host"], r["endpoint"], r["endpoint"]])[0]
        out.append(_finding(ctx, r, w, sites.get(r["site_id"]), fps.get(r["fingerprint_id"])))
    return out


def _finding(
    ctx: Context, r: dict[str, Any], w: dict[str, Any], site: frames.Frame | None, fp: str | None
) -> Finding:
    share = r["upstream_ms"] / r["ep_total_ms"] if r["ep_total_ms"] else 0.0
    tenants = [
        {"tenant": t["tenant"], "ms": t["ms"], "share": t["ms"] / r["upstream_ms"]}
        for t in (w["tenants"] or [])
        if r["upstream_ms"]
    ]
    # The typical request's share too: a few requests slowed by something else (a blocked
    # event loop, a starved CPU) can sink the total share while most requests still wait on
    # the host for most of their time.
    median = r["median_share"] or 0.0
    spends = (
        f"spends {text.pct(share)} of its time"
        if share >= float(ctx.t(KIND, "min_time_share"))
        else f"spends {text.pct(median)} of a typical request's time ({text.pct(share)} of all"
        " its time: other waits slow its slowest requests)"
    )
    title = (
        f"{r['endpoint']} {spends} waiting on {r['host']} "
        f"({text.ms(r['upstream_p50'])} per request, {text.ms(r['upstream_p95'])} at p95): its "
        f"p95 is {text.ms(r['ep_p95'])}, of which our own part is "
        f"{text.ms(w['ep_ours_p95'])}; site-wide p95 {text.ms(w['site_p95'])}, "
        f"{text.ms(w['site_ours_p95'])} without this host."
    )
    return Finding(
        id=stable_id(KIND, r["endpoint"], _hostname(r["host"])),
        kind=KIND,
        endpoint=r["endpoint"],
        title=title,
        impact_ms_per_min=ctx.per_min(r["upstream_ms"]),
        callsite=site.site() if site is not None else None,
        fingerprint=None,
        count_per_request=r["calls"] / max(r["requests_calling"], 1),
        example_trace_ids=list(r["examples"] or []),
        first_seen=iso(r["first_ts"]),
        last_seen=iso(r["last_ts"]),
        suggestion=(
            "This is the upstream's slowness, not ours: set a tight timeout, cache its "
            "answers, call it concurrently or in the background, and take the numbers to its "
            "owner; judge our own latency by the p95 without it."
        ),
        evidence={
            "host": r["host"],
            "example_request": fp,
            "requests_calling": r["requests_calling"],
            "endpoint_requests": r["ep_requests"],
            "calls": r["calls"],
            "upstream_ms": r["upstream_ms"],
            "share_of_endpoint_time": share,
            "median_share_of_request_time": median,
            "upstream_ms_per_request_p50": r["upstream_p50"],
            "upstream_ms_per_request_p95": r["upstream_p95"],
            "endpoint_p95_ms": r["ep_p95"],
            "endpoint_p95_ms_without_upstream": w["ep_ours_p95"],
            "site_p95_ms": w["site_p95"],
            "site_p95_ms_without_upstream": w["site_ours_p95"],
            "top_tenants": tenants,
        },
    )


def _hostname(host: str) -> str:
    """The host without its port, for the id: a local service on a fresh port each run is
    still the same upstream."""
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() and "]" not in port else host
