"""large_request_body: request bodies over ``min_bytes`` whose size drives latency.

Per endpoint with enough large bodies: whether bigger bodies take longer, judged by the rank
(Spearman) correlation between body size and time over the endpoint's requests with a known
size: for the wall-clock duration over all of them, and for CPU time over those the agent
measured it for (it may measure a share of the requests; the others' ``cpu_ms`` is NULL).
Ranks, not values: on a busy machine a request that waited for a CPU takes several times its
usual time (its CPU time too can double: cache misses, page faults), and in CI one such request
among six pulled a Pearson correlation under the floor. Of the two fits the better-supported is
used, the larger ``rho * sqrt(n - 1)`` (the rank correlation's test statistic, normal
approximation): CPU time, the steadier signal, when enough requests have it; the duration of
all of them when only a few do. A tie (every request timed, both ranked alike) is CPU time's,
so that the engines' rounding does not choose.

A finding needs the correlation at ``min_correlation`` and its one-sided p-value (that
unrelated sizes and times rank this alike over this many requests) at most ``max_p_value``:
the correlation floor alone passed five requests of a size-blind endpoint one time in five.
When both fits were tried, the better one's p-value is doubled (Bonferroni: the better of two
tests at 5 % passed a size-blind endpoint about twice as often). ``max_p_value`` 0 finds
nothing. The p-value (so corrected) and the number of requests fitted are in the evidence.

The time attributed to the size is the fitted measure's least-squares slope (over all of the
endpoint's sized requests) times the bytes of the large requests, capped at their duration:
what a smaller body (a file upload, a streamed parse) would save.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from perfsleuth.analysis import text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "large_request_body"

# Used when the settings table has no ``max_p_value`` for this detector: a one-sided 5 % test.
MAX_P_VALUE = 0.05

# The rank correlations are over at most about FIT_MAX of an endpoint's requests (every k-th
# in the order of their trace ids, which both engines sort alike: their hash() differ, and
# sampled different requests): ranking is a sort per measure, and a few thousand requests
# settle a correlation; the slopes are over all of them.
FIT_MAX = 2_000

# Average ranks (tied values share theirs) within each endpoint, and within the requests of an
# endpoint that have a CPU time.
_SQL = """
WITH sized AS (
    SELECT endpoint, trace_id, req_bytes, duration_ms, cpu_ms, cpu_ms IS NULL AS untimed,
        row_number() OVER (PARTITION BY endpoint ORDER BY trace_id, ts, req_bytes, duration_ms)
            AS k
    FROM r WHERE req_bytes IS NOT NULL AND duration_ms IS NOT NULL
),
judged AS (        -- endpoints with enough large bodies to be judged at all
    SELECT endpoint, count(*) AS n,
        CAST(ceil(count(*) / ?) AS BIGINT) AS step,
        regr_slope(duration_ms, req_bytes) AS s_dur, regr_slope(cpu_ms, req_bytes) AS s_cpu
    FROM sized GROUP BY 1
    HAVING sum(CASE WHEN req_bytes >= ? THEN 1 ELSE 0 END) >= ?
),
kept AS (
    SELECT s.* FROM sized s JOIN judged j USING (endpoint)
    WHERE j.step <= 1 OR s.k % j.step = 0
),
ranked AS (
    SELECT endpoint, untimed,
        rank() OVER (PARTITION BY endpoint ORDER BY req_bytes)
            + (count(*) OVER (PARTITION BY endpoint, req_bytes) - 1) / 2.0 AS rank_bytes,
        rank() OVER (PARTITION BY endpoint ORDER BY duration_ms)
            + (count(*) OVER (PARTITION BY endpoint, duration_ms) - 1) / 2.0 AS rank_dur,
        rank() OVER (PARTITION BY endpoint, untimed ORDER BY req_bytes)
            + (count(*) OVER (PARTITION BY endpoint, untimed, req_bytes) - 1) / 2.0
            AS rank_bytes_timed,
        rank() OVER (PARTITION BY endpoint, untimed ORDER BY cpu_ms)
            + (count(*) OVER (PARTITION BY endpoint, untimed, cpu_ms) - 1) / 2.0 AS rank_cpu
    FROM kept
),
fit AS (
    SELECT f.endpoint, any_value(j.n) AS n, count(*) AS n_kept,
        sum(CASE WHEN NOT f.untimed THEN 1 ELSE 0 END) AS n_cpu_kept,
        corr(f.rank_bytes, f.rank_dur) AS r_dur_raw,
        corr(CASE WHEN NOT f.untimed THEN f.rank_bytes_timed END,
             CASE WHEN NOT f.untimed THEN f.rank_cpu END) AS r_cpu_raw,
        any_value(j.s_dur) AS s_dur, any_value(j.s_cpu) AS s_cpu
    FROM ranked f JOIN judged j USING (endpoint) GROUP BY 1
),
fit_ok AS (        -- NaN (no variation) as NULL: a comparison with NaN is false on both engines
    SELECT *, CASE WHEN r_dur_raw BETWEEN -2 AND 2 THEN r_dur_raw END AS r_dur,
        CASE WHEN r_cpu_raw BETWEEN -2 AND 2 THEN r_cpu_raw END AS r_cpu
    FROM fit
),
scored AS (        -- each fit's rho * sqrt(n - 1); CPU only over enough timed requests
    SELECT *, coalesce(r_dur * sqrt(n_kept - 1), -1e9) AS z_dur,
        CASE WHEN n_cpu_kept >= ? THEN coalesce(r_cpu * sqrt(n_cpu_kept - 1), -1e9)
             ELSE -1e9 END AS z_cpu
    FROM fit_ok
),
picked AS (        -- the CPU fit wins a tie (every request timed, CPU and duration ranked
                   -- alike): the engines' last bits of corr() must not pick for them
    SELECT *, z_cpu > -1e9 AND z_cpu >= z_dur - 1e-9 AS cpu_wins FROM scored
),
best AS (         -- n_tests: the fits tried (the better of two is held to max_p_value / 2)
    SELECT endpoint, n,
        CASE WHEN z_dur > -1e9 THEN 1 ELSE 0 END + CASE WHEN z_cpu > -1e9 THEN 1 ELSE 0 END
            AS n_tests,
        CASE WHEN cpu_wins THEN 'cpu' ELSE 'duration' END AS measure,
        CASE WHEN cpu_wins THEN r_cpu ELSE r_dur END AS corr,
        CASE WHEN cpu_wins THEN n_cpu_kept ELSE n_kept END AS n_fit,
        greatest(z_cpu, z_dur) AS z,
        CASE WHEN cpu_wins THEN s_cpu ELSE s_dur END AS slope
    FROM picked
)
SELECT r.endpoint, count(*) AS requests_large, median(r.req_bytes) AS bytes_p50,
    max(r.req_bytes) AS bytes_max, median(r.duration_ms) AS ms_p50, sum(r.duration_ms) AS ms,
    median(r.cpu_ms) AS cpu_p50,
    sum(least(r.duration_ms, greatest(best.slope, 0) * r.req_bytes)) AS size_ms,
    min(r.ts) AS first_ts, max(r.ts) AS last_ts,
    max_by(r.trace_id, (r.req_bytes, r.trace_id), 3) AS examples,
    any_value(best.corr) AS corr, any_value(best.slope) AS slope,
    any_value(best.measure) AS measure, any_value(best.n) AS n_sized,
    any_value(best.n_fit) AS n_fit, any_value(best.n_tests) AS n_tests
FROM r JOIN best USING (endpoint)
WHERE r.req_bytes >= ?
GROUP BY r.endpoint
HAVING any_value(best.corr) >= ?
    AND any_value(best.z) >= CASE WHEN any_value(best.n_tests) > 1 THEN ? ELSE ? END
"""


def z_of(p: float) -> float:
    """The one-sided normal threshold of a p-value (no threshold from 1 on)."""
    return NormalDist().inv_cdf(1.0 - p) if p < 1.0 else -1e9


def p_value(rho: float, n: int) -> float:
    """One-sided p-value of a rank correlation ``rho`` over ``n`` pairs: the chance that
    unrelated values rank at least this alike (normal approximation, rho * sqrt(n - 1))."""
    if n < 2:
        return 1.0
    return 0.5 * math.erfc(rho * math.sqrt(n - 1) / math.sqrt(2.0))


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    n_min = int(ctx.t(KIND, "min_requests"))
    min_bytes = int(ctx.t(KIND, "min_bytes"))
    max_p = float(ctx.config.settings.get(KIND, {}).get("max_p_value", MAX_P_VALUE))
    if not max_p > 0.0:  # (0, or NaN: no correlation is that sure)
        return []
    min_corr = float(ctx.t(KIND, "min_correlation"))
    rows = ctx.query(
        _SQL,
        [FIT_MAX, min_bytes, n_min, n_min, min_bytes, min_corr, z_of(max_p / 2), z_of(max_p)],
    )
    out = []
    for r in rows:
        per_mb = float(r["slope"] or 0) * 1_000_000
        what = "CPU time" if r["measure"] == "cpu" else "latency"
        n_fit = int(r["n_fit"])
        title = (
            f"{r['endpoint']} receives {text.size(r['bytes_p50'])} request bodies (median; up "
            f"to {text.size(r['bytes_max'])}) and its {what} grows with their size "
            f"(~{text.ms(per_mb)} per MB, rank correlation {r['corr']:.2f} over {n_fit} "
            f"requests; median request {text.ms(r['ms_p50'])})."
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
                    "requests_fitted": n_fit,
                    "body_bytes_median": r["bytes_p50"],
                    "body_bytes_max": r["bytes_max"],
                    "correlation": r["corr"],
                    "correlation_method": "spearman",
                    "p_value": min(1.0, int(r["n_tests"]) * p_value(float(r["corr"]), n_fit)),
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
