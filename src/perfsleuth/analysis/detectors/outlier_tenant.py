"""outlier_tenant: a tenant (or user) whose requests to an endpoint are slow as a rule, judged
by their own latency distribution against the rest of the endpoint's requests.

Per endpoint and tenant (then per user), with ``min_requests`` of theirs and
``min_other_requests`` of everyone else's: kept when their share of the endpoint's time is
``min_ratio`` times their share of its requests and large in itself, their median is
``min_median_ratio`` times the others' and ``min_median_gap_ms`` above it, and a one-sided
Mann-Whitney U test says their requests rank above the others' by more than chance
(``max_p_value``). The endpoint's p95 is not asked to drop without them: an unrelated slow
cause (an event-loop blocker hitting every tenant) may set it, and their own distribution is
what tells them apart. A tenant whose few requests met a noisy moment of the machine is slow by
exception: their median is everyone's.

When one statement (or outbound call) takes most of its time in their requests, per request,
and explains a good part of their extra time, the finding names it: what to look at first.
A user whose tenant is already reported for the endpoint is not reported again.
"""

from __future__ import annotations

from typing import Any

from perfsleuth.analysis import frames, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register
from perfsleuth.analysis.stats import mann_whitney_greater

KIND = "outlier_tenant"

__all__ = ["detect", "mann_whitney_greater"]

# Ranks are averaged over ties (the normal approximation of U with the tie correction needs
# the sum of t^3 - t over groups of equal durations).
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
    WHERE g.n >= ? AND ep.n - g.n >= ? AND g.ms >= ? * ep.ms AND g.ms / ep.ms >= ? * g.n / ep.n
),
ranked AS (
    SELECT endpoint, {dim} AS who, duration_ms AS d,
        rank() OVER (PARTITION BY endpoint ORDER BY duration_ms)
            + (count(*) OVER (PARTITION BY endpoint, duration_ms) - 1) / 2.0 AS rk
    FROM r
    WHERE duration_ms IS NOT NULL AND endpoint IN (SELECT endpoint FROM cand)
),
ties AS (
    SELECT endpoint, sum(t * t * t - t) AS tie_sum
    FROM (SELECT endpoint, d, count(*)::DOUBLE AS t FROM ranked GROUP BY ALL)
    GROUP BY 1
),
stats AS (
    SELECT cand.endpoint, cand.who,
        sum(x.rk) FILTER (WHERE x.who = cand.who) AS rank_sum,
        quantile_cont(x.d, 0.5) FILTER (WHERE x.who IS DISTINCT FROM cand.who) AS p50_others,
        quantile_cont(x.d, 0.95) FILTER (WHERE x.who IS DISTINCT FROM cand.who) AS p95_others,
        count(*) FILTER (WHERE x.who IS DISTINCT FROM cand.who AND x.d > cand.ep_p95)
            AS slow_others
    FROM cand JOIN ranked x USING (endpoint)
    GROUP BY 1, 2
)
SELECT cand.*, stats.rank_sum, stats.p50_others, stats.p95_others, stats.slow_others,
    ties.tie_sum
FROM cand JOIN stats USING (endpoint, who) JOIN ties USING (endpoint)
"""

# Per statement (kind, fingerprint) of one endpoint: their calls and time, and everyone else's.
_STATEMENTS = """
SELECT c.kind, c.fingerprint_id, mode(c.site_id) AS site_id,
    count(*) FILTER (WHERE r.{dim} = ?) AS their_calls,
    coalesce(sum(c.duration_ms) FILTER (WHERE r.{dim} = ?), 0) AS their_ms,
    count(DISTINCT c.trace_id) FILTER (WHERE r.{dim} = ?) AS their_requests,
    count(*) FILTER (WHERE r.{dim} IS DISTINCT FROM ?) AS other_calls,
    coalesce(sum(c.duration_ms) FILTER (WHERE r.{dim} IS DISTINCT FROM ?), 0) AS other_ms
FROM c JOIN r USING (trace_id)
WHERE c.endpoint = ? AND c.fingerprint_id IS NOT NULL AND c.duration_ms IS NOT NULL
    AND r.duration_ms IS NOT NULL
GROUP BY 1, 2
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    flagged: set[tuple[str, str]] = set()  # (endpoint, tenant) already reported
    median_ratio = float(ctx.t(KIND, "min_median_ratio"))
    median_gap = float(ctx.t(KIND, "min_median_gap_ms"))
    max_p = float(ctx.t(KIND, "max_p_value"))
    for dim in ctx.t(KIND, "dimensions"):
        if dim not in ("tenant", "user"):
            continue
        rows = ctx.query(
            _SQL.format(dim=f'"{dim}"'),
            [
                int(ctx.t(KIND, "min_endpoint_requests")),
                int(ctx.t(KIND, "min_requests")),
                int(ctx.t(KIND, "min_other_requests")),
                float(ctx.t(KIND, "min_time_share")),
                float(ctx.t(KIND, "min_ratio")),
            ],
        )
        for r in sorted(rows, key=lambda r: (r["endpoint"], str(r["who"]))):
            if r["p50_others"] is None or r["rank_sum"] is None:
                continue
            if r["p50"] < median_ratio * r["p50_others"]:
                continue
            if r["p50"] - r["p50_others"] < median_gap:
                continue
            n1, n2 = int(r["n"]), int(r["ep_n"]) - int(r["n"])
            u, p = mann_whitney_greater(float(r["rank_sum"]), n1, n2, float(r["tie_sum"] or 0))
            if p > max_p:
                continue
            if dim == "user" and (r["endpoint"], r["tenant"]) in flagged:
                continue
            if dim == "tenant":
                flagged.add((r["endpoint"], r["who"]))
            r["u"], r["p_value"], r["other_n"] = u, p, n2
            out.append(_finding(ctx, dim, r))
    return out


def _their_statement(ctx: Context, dim: str, r: dict[str, Any], excess: float) -> dict[str, Any]:
    """The statement (or call) that is theirs: most of its per-request time is in their
    requests and it explains a good part of their extra time; {} when none is."""
    who = r["who"]
    rows = ctx.query(_STATEMENTS.format(dim=f'"{dim}"'), [who] * 5 + [r["endpoint"]])
    n1, n2 = max(int(r["n"]), 1), max(int(r["other_n"]), 1)
    min_share = float(ctx.t(KIND, "statement_min_share"))
    min_excess = float(ctx.t(KIND, "statement_min_excess_share")) * excess
    best: dict[str, Any] | None = None
    for s in rows:
        theirs, others = float(s["their_ms"]) / n1, float(s["other_ms"]) / n2
        extra = (theirs - others) * n1
        if theirs <= 0 or theirs / (theirs + others) < min_share or extra < min_excess:
            continue
        if best is None or extra > best["extra"]:
            best = {**s, "theirs": theirs, "others": others, "extra": extra}
    if best is None:
        return {}
    fp = ctx.fingerprints({best["fingerprint_id"]}).get(best["fingerprint_id"])
    site = frames.locations(ctx.store, [best["site_id"]]).get(best["site_id"])
    return {
        "call_kind": best["kind"],
        "fingerprint": fp,
        "call_site": site.site() if site is not None else None,
        "their_ms_per_request": best["theirs"],
        "others_ms_per_request": best["others"],
        "their_calls_per_request": best["their_calls"] / n1,
        "others_calls_per_request": best["other_calls"] / n2,
        "their_requests_with_it": best["their_requests"],
        "share_of_their_extra_time": best["extra"] / excess if excess else None,
    }


def _finding(ctx: Context, dim: str, r: dict[str, Any]) -> Finding:
    req_share = r["n"] / r["ep_n"]
    time_share = r["ms"] / r["ep_ms"]
    slow_all = r["slow"] + r["slow_others"]
    slow_share = r["slow"] / slow_all if slow_all else None
    # The time beyond what their requests would cost at everyone else's average.
    others_mean = (r["ep_ms"] - r["ms"]) / max(r["ep_n"] - r["n"], 1)
    excess = max(0.0, r["ms"] - r["n"] * others_mean)
    stmt = _their_statement(ctx, dim, r, excess)
    title = (
        f"{dim.capitalize()} {r['who']} makes {text.pct(req_share)} of {r['endpoint']} requests "
        f"but {text.pct(time_share)} of its time: their median is {text.ms(r['p50'])} against "
        f"{text.ms(r['p50_others'])} for everyone else"
    )
    if stmt:
        quoted = f"`{text.statement(stmt['fingerprint'], 60)}`"
        if stmt["others_calls_per_request"] == 0:
            title += (
                f"; {quoted} runs only for them "
                f"({text.ms(stmt['their_ms_per_request'])} per request)"
            )
        else:
            title += (
                f"; {quoted} takes {text.ms(stmt['their_ms_per_request'])} per request for "
                f"them, {text.ms(stmt['others_ms_per_request'])} for the others"
            )
    title += "."
    what = (
        f"Start with `{text.statement(stmt['fingerprint'], 60)}`, which runs (or costs) far more "
        "for them: "
        if stmt
        else f"Look at what is different about this {dim}'s data (its size, its upstreams) in "
        "the example traces: "
    )
    return Finding(
        id=stable_id(KIND, r["endpoint"], (dim, r["who"])),
        kind=KIND,
        endpoint=r["endpoint"],
        title=title,
        impact_ms_per_min=ctx.per_min(excess),
        callsite=stmt.get("call_site"),
        fingerprint=stmt.get("fingerprint"),
        example_trace_ids=list(r["examples"] or []),
        first_seen=iso(r["first_ts"]),
        last_seen=iso(r["last_ts"]),
        suggestion=(
            what + "page or cap their work, precompute it, or give them their own capacity; "
            "and watch their median against everyone else's."
        ),
        evidence={
            "dimension": dim,
            dim: r["who"],
            "tenant": r["tenant"],
            "requests": r["n"],
            "other_requests": r["other_n"],
            "endpoint_requests": r["ep_n"],
            "request_share": req_share,
            "time_share": time_share,
            "slow_request_share": slow_share,
            "their_median_ms": r["p50"],
            "median_ms_of_others": r["p50_others"],
            "their_p95_ms": r["p95"],
            "p95_ms_of_others": r["p95_others"],
            "endpoint_p95_ms": r["ep_p95"],
            "endpoint_p95_ms_without_them": r["p95_others"],
            "rank_test_p_value": r["p_value"],
            # The chance that one of their requests is slower than one of the others'.
            "chance_slower_than_others": r["u"] / (r["n"] * r["other_n"]),
            "ms": r["ms"],
            "ms_beyond_others_average": excess,
            "statement": stmt or None,
        },
    )
