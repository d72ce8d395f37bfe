"""chatty_endpoint: endpoints making very many DB/HTTP/cache calls per request, spread over
many statements (no single repeated one to blame: that case is n_plus_one's), and spending a
large part of their time in them ("DB-dominated").

The cheap per-request counters in ``requests`` pick the candidates; only their calls are
grouped per statement.
"""

from __future__ import annotations

from perfsleuth.analysis import frames, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "chatty_endpoint"

_SQL = """
WITH ep AS (
    SELECT endpoint, count(*) AS requests,
        median(db_calls + http_calls + cache_calls) AS calls_p50,
        sum(db_ms + http_ms + cache_ms) AS call_ms, sum(duration_ms) AS total_ms,
        sum(db_ms) AS db_ms, sum(http_ms) AS http_ms, sum(cache_ms) AS cache_ms
    FROM r GROUP BY 1
    HAVING count(*) >= ? AND median(db_calls + http_calls + cache_calls) >= ?
        AND sum(db_ms + http_ms + cache_ms) >= ? * sum(duration_ms)
),
perfp AS (
    SELECT endpoint, trace_id, fingerprint_id, count(*) AS n FROM c
    WHERE endpoint IN (SELECT endpoint FROM ep) GROUP BY ALL
),
perreq AS (
    SELECT endpoint, trace_id, sum(n) AS n, max(n) AS top, count(*) AS statements
    FROM perfp GROUP BY ALL
)
SELECT p.endpoint, median(p.top / p.n) AS top_share, median(p.statements) AS statements,
    median(p.n) AS recorded_calls, max(p.n) AS max_calls,
    max_by(p.trace_id, (p.n, p.trace_id), 3) AS examples, any_value(ep.requests) AS requests,
    any_value(ep.calls_p50) AS calls_p50, any_value(ep.call_ms) AS call_ms,
    any_value(ep.total_ms) AS total_ms, any_value(ep.db_ms) AS db_ms,
    any_value(ep.http_ms) AS http_ms, any_value(ep.cache_ms) AS cache_ms
FROM perreq p JOIN ep USING (endpoint)
GROUP BY p.endpoint
HAVING median(p.top / p.n) <= ?
"""

_SPAN = "SELECT min(ts) AS first_ts, max(ts) AS last_ts FROM r WHERE endpoint = ?"

_SITES = """
SELECT site_id, count(*) AS calls, sum(duration_ms) AS ms FROM c
WHERE endpoint = ? GROUP BY 1 ORDER BY calls DESC LIMIT 5
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    baseline = int(ctx.t(KIND, "baseline_calls"))
    rows = ctx.query(
        _SQL,
        [
            int(ctx.t(KIND, "min_requests")),
            int(ctx.t(KIND, "min_calls_per_request")),
            float(ctx.t(KIND, "min_call_time_share")),
            float(ctx.t(KIND, "max_top_fingerprint_share")),
        ],
    )
    out = []
    for r in rows:
        span = ctx.query(_SPAN, [r["endpoint"]])[0]
        top_sites = ctx.query(_SITES, [r["endpoint"]])
        locs = frames.locations(ctx.store, (s["site_id"] for s in top_sites))
        calls = float(r["calls_p50"])
        share = r["call_ms"] / r["total_ms"] if r["total_ms"] else 0.0
        kinds = {"DB": r["db_ms"], "HTTP": r["http_ms"], "cache": r["cache_ms"]}
        main = max(kinds, key=lambda k: kinds[k] or 0)
        # The time of the calls beyond a healthy number per request.
        excess = float(r["call_ms"] or 0) * max(0.0, 1.0 - baseline / calls) if calls else 0.0
        title = (
            f"{r['endpoint']} makes {text.count(calls)} calls per request (median; up to "
            f"{text.count(r['max_calls'])}) over {text.count(r['statements'])} different "
            f"statements, and spends {text.pct(share)} of its time in them (mostly {main})."
        )
        out.append(
            Finding(
                id=stable_id(KIND, r["endpoint"]),
                kind=KIND,
                endpoint=r["endpoint"],
                title=title,
                impact_ms_per_min=ctx.per_min(excess),
                count_per_request=calls,
                example_trace_ids=list(r["examples"] or []),
                first_seen=iso(span["first_ts"]),
                last_seen=iso(span["last_ts"]),
                suggestion=(
                    "Fetch what the request needs in fewer, wider queries (joins, bulk "
                    "loads), cache what does not change per request, and check the call-site "
                    f"tree (perfsleuth calltree {r['endpoint']!r}) for the code paths that "
                    "issue most of them."
                ),
                evidence={
                    "calls_per_request_median": calls,
                    "calls_per_request_max": r["max_calls"],
                    "statements_per_request_median": r["statements"],
                    "top_statement_share_median": r["top_share"],
                    "call_time_share": share,
                    "db_ms": r["db_ms"],
                    "http_ms": r["http_ms"],
                    "cache_ms": r["cache_ms"],
                    "requests": r["requests"],
                    "ms_beyond_baseline": excess,
                    "top_call_sites": [
                        {
                            **(locs[s["site_id"]].site() if s["site_id"] in locs else {}),
                            "calls": s["calls"],
                            "ms": s["ms"],
                        }
                        for s in top_sites
                    ],
                },
            )
        )
    return out
