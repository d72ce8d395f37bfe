"""outlier_tenant: a tenant (or user) whose share of an endpoint's time is far above their
share of its requests, and without whom the endpoint's p95 drops a lot.

Per endpoint and tenant (then per user): share of requests, of time and of the slow requests
(over the endpoint's p95); kept when the time share is ``min_ratio`` times the request share,
large in itself, and the endpoint's p95 without them is ``min_p95_drop`` lower, and at
least ``min_p95_drop_ms`` lower (sub-millisecond endpoints vary by large shares of nothing),
and their median is ``min_median_ratio`` times everyone else's: an outlier tenant is slow as a
rule, while a tenant whose few requests met a noisy moment of the machine is slow by exception.
A user whose tenant is already reported for the endpoint is not reported again.
"""

from __future__ import annotations

from typing import Any

from perfsleuth.analysis import text
from perfsleuth.analysis.detectors import register
from perfsleuth.analysis.findings import Context, Finding, iso, stable_id

KIND = "outlier_tenant"

_SQL = """
WITH ep AS (
    SELECT endpoint, count(*) AS n, sum(duration_ms) AS ms,
        quantile_cont(duration_ms, 0.95) AS p95
    FROM r WHERE duration_ms IS NOT NULL GROUP BY 1 HAVING count(*) >= ?
),
g AS (
    SELECT r.endpoint, r.{dim} AS who, mode(r.tenant) AS tenant, count(*) AS n,
        sum(r.duration_ms) AS ms, quantile_cont(r.duration_ms, 0.95) AS p95,
        quantile_cont(r.duration_ms, 0.5) AS p50,
        count(*) FILTER (WHERE r.duration_ms > ep.p95) AS slow,
        min(r.ts) AS first_ts, max(r.ts) AS last_ts,
        max_by(r.trace_id, (r.duration_ms, r.trace_id), 3) AS examples
    FROM r JOIN ep USING (endpoint)
    WHERE r.{dim} IS NOT NULL AND r.duration_ms IS NOT NULL
    GROUP BY 1, 2
),
cand AS (
    SELECT g.*, ep.n AS ep_n, ep.ms AS ep_ms, ep.p95 AS ep_p95
    FROM g JOIN ep USING (endpoint)
    WHERE g.n >= ? AND g.n < ep.n AND g.ms >= ? * ep.ms AND g.ms / ep.ms >= ? * g.n / ep.n
)
SELECT cand.*,
    (SELECT count(*) FROM r x
     WHERE x.endpoint = cand.endpoint AND x.duration_ms > cand.ep_p95) AS ep_slow,
    (SELECT quantile_cont(x.duration_ms, [0.95, 0.5]) FROM r x
     WHERE x.endpoint = cand.endpoint AND x.{dim} IS DISTINCT FROM cand.who) AS without
FROM cand
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    flagged: set[tuple[str, str]] = set()  # (endpoint, tenant) already reported
    for dim in ctx.t(KIND, "dimensions"):
        if dim not in ("tenant", "user"):
            continue
        rows = ctx.query(
            _SQL.format(dim=f'"{dim}"'),
            [
                int(ctx.t(KIND, "min_endpoint_requests")),
                int(ctx.t(KIND, "min_requests")),
                float(ctx.t(KIND, "min_time_share")),
                float(ctx.t(KIND, "min_ratio")),
            ],
        )
        for r in rows:
            if r["without"] is None or not r["ep_p95"]:
                continue
            r["p95_without"], r["p50_without"] = r["without"]
            if r["p50"] < float(ctx.t(KIND, "min_median_ratio")) * r["p50_without"]:
                continue
            drop = 1.0 - r["p95_without"] / r["ep_p95"]
            if drop < float(ctx.t(KIND, "min_p95_drop")):
                continue
            if r["ep_p95"] - r["p95_without"] < float(ctx.t(KIND, "min_p95_drop_ms")):
                continue
            if dim == "user" and (r["endpoint"], r["tenant"]) in flagged:
                continue
            if dim == "tenant":
                flagged.add((r["endpoint"], r["who"]))
            out.append(_finding(ctx, dim, r, drop))
    return out


def _finding(ctx: Context, dim: str, r: dict[str, Any], drop: float) -> Finding:
    req_share = r["n"] / r["ep_n"]
    time_share = r["ms"] / r["ep_ms"]
    slow_share = r["slow"] / r["ep_slow"] if r["ep_slow"] else None
    # The time beyond what their requests would cost at everyone else's average.
    others_mean = (r["ep_ms"] - r["ms"]) / max(r["ep_n"] - r["n"], 1)
    excess = max(0.0, r["ms"] - r["n"] * others_mean)
    title = (
        f"{dim.capitalize()} {r['who']} makes {text.pct(req_share)} of {r['endpoint']} requests "
        f"but {text.pct(time_share)} of its time"
        + (f" and {text.pct(slow_share)} of its slow requests" if slow_share is not None else "")
        + f"; without them its p95 drops from {text.ms(r['ep_p95'])} to "
        f"{text.ms(r['p95_without'])}."
    )
    return Finding(
        id=stable_id(KIND, r["endpoint"], (dim, r["who"])),
        kind=KIND,
        endpoint=r["endpoint"],
        title=title,
        impact_ms_per_min=ctx.per_min(excess),
        example_trace_ids=list(r["examples"] or []),
        first_seen=iso(r["first_ts"]),
        last_seen=iso(r["last_ts"]),
        suggestion=(
            f"Look at what is different about this {dim}'s data (its size, its upstreams) in "
            "the example traces: page or cap their work, precompute it, or give them their "
            "own capacity; and watch the endpoint's p95 without them."
        ),
        evidence={
            "dimension": dim,
            dim: r["who"],
            "tenant": r["tenant"],
            "requests": r["n"],
            "endpoint_requests": r["ep_n"],
            "request_share": req_share,
            "time_share": time_share,
            "slow_request_share": slow_share,
            "their_p95_ms": r["p95"],
            "their_median_ms": r["p50"],
            "median_ms_of_others": r["p50_without"],
            "endpoint_p95_ms": r["ep_p95"],
            "endpoint_p95_ms_without_them": r["p95_without"],
            "p95_drop": drop,
            "ms": r["ms"],
            "ms_beyond_others_average": excess,
        },
    )
