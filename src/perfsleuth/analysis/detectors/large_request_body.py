"""large_request_body: request bodies over ``min_bytes`` whose size drives latency.

Per endpoint: the requests with large bodies, and the Pearson correlation between body size
and time over all of the endpoint's requests with a known size, for both the wall-clock
duration and the request's CPU time where the agent measures it. CPU time is the steadier
signal (parsing a body is CPU work, and waits for other requests blur the duration under
load), so the better-correlated of the two is used. The time attributed to the size is that
regression's slope times the bytes of the large requests (capped at their duration): what a
smaller body (a file upload, a streamed parse) would save.
"""

from __future__ import annotations

from perfsleuth.analysis import text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "large_request_body"

_SQL = """
WITH fit AS (
    SELECT endpoint, count(*) AS n,
        corr(req_bytes, duration_ms) AS r_dur, regr_slope(duration_ms, req_bytes) AS s_dur,
        corr(req_bytes, cpu_ms) AS r_cpu, regr_slope(cpu_ms, req_bytes) AS s_cpu,
        count(cpu_ms) AS n_cpu
    FROM r WHERE req_bytes IS NOT NULL AND duration_ms IS NOT NULL
    GROUP BY 1 HAVING count(*) >= ?
),
best AS (          -- the better-correlated of duration and CPU time (NaN: no variation)
    SELECT endpoint, n,
        CASE WHEN n_cpu >= ? AND coalesce(nullif(r_cpu, 'NaN'::DOUBLE), -1)
                               > coalesce(nullif(r_dur, 'NaN'::DOUBLE), -1)
             THEN 'cpu' ELSE 'duration' END AS measure,
        CASE WHEN n_cpu >= ? AND coalesce(nullif(r_cpu, 'NaN'::DOUBLE), -1)
                               > coalesce(nullif(r_dur, 'NaN'::DOUBLE), -1)
             THEN r_cpu ELSE nullif(r_dur, 'NaN'::DOUBLE) END AS corr,
        CASE WHEN n_cpu >= ? AND coalesce(nullif(r_cpu, 'NaN'::DOUBLE), -1)
                               > coalesce(nullif(r_dur, 'NaN'::DOUBLE), -1)
             THEN s_cpu ELSE s_dur END AS slope
    FROM fit
)
SELECT r.endpoint, count(*) AS requests_large, median(r.req_bytes) AS bytes_p50,
    max(r.req_bytes) AS bytes_max, median(r.duration_ms) AS ms_p50, sum(r.duration_ms) AS ms,
    median(r.cpu_ms) AS cpu_p50,
    sum(least(r.duration_ms, greatest(best.slope, 0) * r.req_bytes)) AS size_ms,
    min(r.ts) AS first_ts, max(r.ts) AS last_ts,
    max_by(r.trace_id, (r.req_bytes, r.trace_id), 3) AS examples,
    any_value(best.corr) AS corr, any_value(best.slope) AS slope,
    any_value(best.measure) AS measure, any_value(best.n) AS n_sized
FROM r JOIN best USING (endpoint)
WHERE r.req_bytes >= ?
GROUP BY r.endpoint
HAVING count(*) >= ? AND any_value(best.corr) >= ?
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    n_min = int(ctx.t(KIND, "min_requests"))
    rows = ctx.query(
        _SQL,
        [
            n_min,
            n_min,
            n_min,
            n_min,
            int(ctx.t(KIND, "min_bytes")),
            n_min,
            float(ctx.t(KIND, "min_correlation")),
        ],
    )
    out = []
    for r in rows:
        per_mb = float(r["slope"] or 0) * 1_000_000
        what = "CPU time" if r["measure"] == "cpu" else "latency"
        title = (
            f"{r['endpoint']} receives {text.size(r['bytes_p50'])} request bodies (median; up "
            f"to {text.size(r['bytes_max'])}) and its {what} grows with their size "
            f"(~{text.ms(per_mb)} per MB, r={r['corr']:.2f}; median request "
            f"{text.ms(r['ms_p50'])})."
        )
        out.append(
            Finding(
                id=stable_id(KIND, r["endpoint"]),
                kind=KIND,
                endpoint=r["endpoint"],
                title=title,
                impact_ms_per_min=ctx.per_min(r["size_ms"]),
                example_trace_ids=list(r["examples"] or []),
                first_seen=iso(r["first_ts"]),
                last_seen=iso(r["last_ts"]),
                suggestion=(
                    "Parse the body once (not per field or per thread), stream it, or send "
                    "large content as a file upload or in a separate request; cap the size."
                ),
                evidence={
                    "requests_with_large_body": r["requests_large"],
                    "requests_with_known_size": r["n_sized"],
                    "body_bytes_median": r["bytes_p50"],
                    "body_bytes_max": r["bytes_max"],
                    "correlation": r["corr"],
                    "correlated_with": "cpu_ms" if r["measure"] == "cpu" else "duration_ms",
                    "request_cpu_ms_median": r["cpu_p50"],
                    "ms_per_mb": per_mb,
                    "request_ms_median": r["ms_p50"],
                    "ms": r["ms"],
                    "ms_attributed_to_size": r["size_ms"],
                },
            )
        )
    return out
