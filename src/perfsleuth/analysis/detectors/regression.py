"""regression: an endpoint's p95 (or its share of requests over 1, 2 or 5 s) shifted up and
stayed there.

On each endpoint's time series (per bucket: p95, mean, shares over the thresholds), as Sentry's
statistical detectors do: a fast moving average rising above a slow one spots a possible shift;
a before/after test at the best breakpoint (the least-squares step of the log p95s and mean
log durations) confirms it: the buckets after rank above those before by a one-sided
Mann-Whitney test (``max_p_value``), the median p95 after is ``min_change`` above the one before and
``min_change_ms`` in absolute terms, and the last half of the after-side is still up (it stayed
there), and the requests after it rank above those before (the same test on the requests
themselves: spikes clustering after a point raise bucket p95s without shifting the endpoint).
A share over a threshold is tested the same way with a two-proportion test.

Week over week: when the store holds the same hours a week earlier, the last
``week_hours`` are compared with them (the requests of both, rank test and p95 change).

A finding names when it started, by how much, the release or tag value that appeared then (if
any), and what moved with it: calls per request, statements first seen after the breakpoint,
the upstream whose wait per request grew most.

It is one module because a detector is one file registered by name (as every detector in
this package); its parts (shift search, the confirming tests, week over week, the finding's
context) serve this detector alone.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from perfsleuth.analysis import stats, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "regression"

_NICE_MINUTES = (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440)

_SERIES = """
SELECT endpoint, floor(epoch(ts) / ?)::BIGINT AS b, count(*) AS n,
    quantile_cont(duration_ms, 0.95) AS p95, avg(duration_ms) AS mean,
    avg(ln(greatest(duration_ms, 0.001))) AS log_mean,
    count(*) FILTER (WHERE duration_ms > ?) AS over1,
    count(*) FILTER (WHERE duration_ms > ?) AS over2,
    count(*) FILTER (WHERE duration_ms > ?) AS over3
FROM r WHERE duration_ms IS NOT NULL GROUP BY 1, 2 ORDER BY 1, 2
"""

# The rank sum of the requests after the breakpoint among all since the first bucket (ties get
# their average rank; the tie correction needs the sum of t^3 - t over equal durations).
_RANKS = """
WITH x AS (
    SELECT ts >= ? AS after, duration_ms AS d FROM r
    WHERE endpoint = ? AND ts >= ? AND duration_ms IS NOT NULL
),
ranked AS (
    SELECT after, d, rank() OVER (ORDER BY d) + (count(*) OVER (PARTITION BY d) - 1) / 2.0 AS rk
    FROM x
)
SELECT count(*) AS n, count(*) FILTER (WHERE after) AS n_after,
    sum(rk) FILTER (WHERE after) AS rank_sum,
    (SELECT sum(t * t * t - t) FROM (SELECT count(*)::DOUBLE AS t FROM x GROUP BY d)) AS tie_sum
FROM ranked
"""

_MOVED = """
SELECT ts >= ? AS after, count(*) AS n, avg(db_calls) AS db_calls, avg(http_calls) AS http_calls,
    avg(cache_calls) AS cache_calls, avg(db_ms) AS db_ms, avg(http_ms) AS http_ms
FROM r WHERE endpoint = ? AND ts >= ? GROUP BY 1
"""

# Statements of the endpoint first seen after the breakpoint, by their time.
_NEW_STATEMENTS = """
SELECT kind, fingerprint_id, count(*) AS calls, count(DISTINCT trace_id) AS requests,
    sum(duration_ms) AS ms
FROM c WHERE endpoint = ? AND fingerprint_id IS NOT NULL AND ts >= ?
GROUP BY 1, 2 HAVING min(ts) >= ? ORDER BY ms DESC NULLS LAST LIMIT 3
"""

_UPSTREAMS = """
SELECT c.host, sum(c.duration_ms) FILTER (WHERE c.ts >= ?) AS ms_after,
    sum(c.duration_ms) FILTER (WHERE c.ts < ?) AS ms_before
FROM c WHERE c.endpoint = ? AND c.kind = 'http' AND c.host IS NOT NULL AND c.ts >= ?
GROUP BY 1
"""

_TAGS = """
SELECT kind, key, value, count(*) FILTER (WHERE ts >= ?) AS n_after,
    count(*) FILTER (WHERE ts < ?) AS n_before
FROM attributes WHERE endpoint = ? AND kind = 'tag' AND ts >= ? AND ts <= ?
GROUP BY 1, 2, 3
"""

_VERSIONS = """
SELECT version AS value, count(*) FILTER (WHERE ts >= ?) AS n_after,
    count(*) FILTER (WHERE ts < ?) AS n_before
FROM r WHERE endpoint = ? AND version IS NOT NULL AND ts >= ? GROUP BY 1
"""

_WEEK = """
SELECT endpoint, ts >= ? AS recent, list(duration_ms) AS d
FROM requests
WHERE duration_ms IS NOT NULL AND ((ts >= ? AND ts <= ?) OR (ts >= ? AND ts <= ?))
    AND (CAST(? AS VARCHAR) IS NULL OR endpoint = ?)
GROUP BY 1, 2
"""


def bucket_seconds(ctx: Context) -> float:
    """``bucket_minutes``, or (0) the window cut into about ``target_buckets`` buckets of a
    round number of minutes."""
    fixed = float(ctx.t(KIND, "bucket_minutes"))
    if fixed > 0:
        return fixed * 60.0
    if ctx.first_seen is None or ctx.last_seen is None:
        return 60.0
    span_min = (ctx.last_seen - ctx.first_seen).total_seconds() / 60.0
    want = span_min / max(int(ctx.t(KIND, "target_buckets")), 1)
    return 60.0 * next((m for m in _NICE_MINUTES if m >= want), _NICE_MINUTES[-1])


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    thresholds = sorted(float(x) for x in ctx.t(KIND, "slow_thresholds_ms"))[:3]
    while len(thresholds) < 3:
        thresholds.append(math.inf)
    size = bucket_seconds(ctx)
    rows = ctx.query(_SERIES, [size, *[t if math.isfinite(t) else 1e300 for t in thresholds]])
    per_ep: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        per_ep.setdefault(r["endpoint"], []).append(r)
    out: list[Finding] = []
    flagged: set[str] = set()
    for ep, series in sorted(per_ep.items()):
        shift = _p95_shift(ctx, series)
        if shift is not None and not _requests_rank_higher(ctx, ep, shift, size):
            shift = None
        shift = shift or _rate_shift(ctx, series, thresholds)
        if shift is None:
            continue
        shift["bucket_seconds"] = size
        flagged.add(ep)
        out.append(_finding(ctx, ep, shift, size))
    out.extend(_week_over_week(ctx, flagged))
    return out


# --------------------------------------------------------------------------- breakpoints


def _ema(y: np.ndarray, span: int) -> np.ndarray:
    alpha = 2.0 / (span + 1.0)
    out = np.empty_like(y)
    acc = y[0]
    for i, v in enumerate(y):
        acc = alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def _best_split(series: list[np.ndarray], min_side: int) -> tuple[int, float] | None:
    """The split k (buckets [:k] before, [k:] after) that a step up explains best, over one or
    more series at once: the sum of k (n - k) / n (mean after - mean before)^2, each series
    scaled by its bucket-to-bucket noise (a robust spread of successive differences). The log
    p95 with the mean log duration locates a shift of the bulk to the bucket (p95s alone miss
    it by a few buckets when spikes sit near it); a tail-only shift moves the p95 term alone."""
    n = len(series[0])
    noise = [_noise(y) for y in series]
    best: tuple[int, float] | None = None
    for k in range(min_side, n - min_side + 1):
        score = 0.0
        for y, v in zip(series, noise, strict=True):
            step = float(y[k:].mean() - y[:k].mean())
            if step > 0:
                score += k * (n - k) / n * step * step / v
        if score > 0 and (best is None or score > best[1]):
            best = (k, score)
    return best


def _noise(y: np.ndarray) -> float:
    """The variance of one bucket's value around its level: from the median absolute
    deviation of successive differences (a step adds one outlying difference, not a bias)."""
    d = np.diff(y)
    mad = float(np.median(np.abs(d - np.median(d)))) if len(d) else 0.0
    return max((mad / 0.6745) ** 2 / 2.0, 1e-12)


def _usable(ctx: Context, series: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    s = [r for r in series if int(r["n"]) >= int(ctx.t(KIND, "min_bucket_requests"))]
    if len(s) < int(ctx.t(KIND, "min_buckets")):
        return None
    return s


def _p95_shift(ctx: Context, series: list[dict[str, Any]]) -> dict[str, Any] | None:
    s = _usable(ctx, series)
    if s is None:
        return None
    y = np.array([float(r["p95"]) for r in s])
    min_side = int(ctx.t(KIND, "min_side_buckets"))
    min_change = float(ctx.t(KIND, "min_change"))
    # Spot: the fast average rose above the slow one by half the change asked for.
    fast = _ema(y, int(ctx.t(KIND, "fast_buckets")))
    slow = _ema(y, int(ctx.t(KIND, "slow_buckets")))
    if not np.any(fast[min_side:] >= slow[min_side:] * (1 + min_change / 2)):
        return None
    log_mean = np.array([float(r["log_mean"]) for r in s])
    split = _best_split([np.log(np.maximum(y, 1e-3)), log_mean], min_side)
    if split is None:
        return None
    k = split[0]
    before, after = y[:k], y[k:]
    test = stats.mann_whitney(before, after)
    p_one_sided = test.p_value / 2 if test.delta > 0 else 1.0
    med_b, med_a = float(np.median(before)), float(np.median(after))
    tail = after[len(after) // 2 :]
    if (
        p_one_sided > float(ctx.t(KIND, "max_p_value"))
        or med_a < med_b * (1 + min_change)
        or med_a - med_b < float(ctx.t(KIND, "min_change_ms"))
        or float(np.median(tail)) < med_b * (1 + min_change / 2)  # it stayed there
    ):
        return None
    return _shift(s, k, "p95", med_b, med_a, p_one_sided)


def _requests_rank_higher(ctx: Context, ep: str, shift: dict[str, Any], size: float) -> bool:
    """The requests after the breakpoint rank above those before it (one-sided Mann-Whitney on
    the requests themselves): bucket p95s that rose only because a few spikes happened to
    cluster after the breakpoint are not a shift of the endpoint's latency."""
    start = _bucket_time(shift["first_bucket"], size)
    split = _bucket_time(shift["split_bucket"], size)
    row = ctx.query(_RANKS, [split, ep, start])[0]
    if not row["n_after"] or not row["n"] or row["n"] <= row["n_after"]:
        return False
    n_after, n_before = int(row["n_after"]), int(row["n"]) - int(row["n_after"])
    _, p = stats.mann_whitney_greater(
        float(row["rank_sum"]), n_after, n_before, float(row["tie_sum"] or 0.0)
    )
    shift["requests_p_value"] = p
    return p <= float(ctx.t(KIND, "max_p_value"))


def _bucket_time(bucket: int, size: float) -> datetime:
    return datetime(1970, 1, 1) + timedelta(seconds=bucket * size)


def _rate_shift(
    ctx: Context, series: list[dict[str, Any]], thresholds: list[float]
) -> dict[str, Any] | None:
    s = _usable(ctx, series)
    if s is None:
        return None
    n = np.array([float(r["n"]) for r in s])
    min_side = int(ctx.t(KIND, "min_side_buckets"))
    min_rate = float(ctx.t(KIND, "min_rate_change"))
    for i, limit in enumerate(thresholds):
        if not math.isfinite(limit):
            continue
        over = np.array([float(r[f"over{i + 1}"]) for r in s])
        if over.sum() == 0:
            continue
        split = _best_split([over / n], min_side)
        if split is None:
            continue
        k = split[0]
        rb, ra = over[:k].sum() / n[:k].sum(), over[k:].sum() / n[k:].sum()
        tail = slice(k + (len(s) - k) // 2, None)
        tail_rate = over[tail].sum() / max(n[tail].sum(), 1.0)
        p = _two_proportion_greater(over[:k].sum(), n[:k].sum(), over[k:].sum(), n[k:].sum())
        if (
            p <= float(ctx.t(KIND, "max_p_value"))
            and over[k:].sum() >= int(ctx.t(KIND, "min_slow_requests"))
            and ra - rb >= min_rate
            and ra >= 2 * rb
            and tail_rate - rb >= min_rate / 2
        ):
            shift = _shift(s, k, f"over_{limit:g}ms", rb, ra, p)
            shift["threshold_ms"] = limit
            return shift
    return None


def _two_proportion_greater(x1: float, n1: float, x2: float, n2: float) -> float:
    """One-sided p-value that the second proportion exceeds the first (pooled z test)."""
    pooled = (x1 + x2) / (n1 + n2)
    var = pooled * (1 - pooled) * (1 / n1 + 1 / n2)
    if var <= 0:
        return 1.0
    z = (x2 / n2 - x1 / n1) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _shift(
    s: list[dict[str, Any]], k: int, metric: str, before: float, after: float, p: float
) -> dict[str, Any]:
    n = np.array([float(r["n"]) for r in s])
    mean = np.array([float(r["mean"]) for r in s])
    mean_before = float((mean[:k] * n[:k]).sum() / n[:k].sum())
    extra_ms = float(((mean[k:] - mean_before).clip(min=0) * n[k:]).sum())
    return {
        "metric": metric,
        "split_bucket": int(s[k]["b"]),
        "first_bucket": int(s[0]["b"]),
        "before": before,
        "after": after,
        "p_value": p,
        "buckets_before": k,
        "buckets_after": len(s) - k,
        "requests_before": int(n[:k].sum()),
        "requests_after": int(n[k:].sum()),
        "extra_ms": extra_ms,
    }


# ------------------------------------------------------------------------- what moved with it


def _context(ctx: Context, ep: str, started: datetime, since: datetime) -> dict[str, Any]:
    moved: dict[str, Any] = {}
    rows = {bool(r["after"]): r for r in ctx.query(_MOVED, [started, ep, since])}
    if True in rows and False in rows:
        for key in ("db_calls", "http_calls", "cache_calls", "db_ms", "http_ms"):
            b, a = rows[False][key], rows[True][key]
            if b is not None and a is not None:
                moved[key] = {"before": float(b), "after": float(a)}
    new = ctx.query(_NEW_STATEMENTS, [ep, since, started])
    texts = ctx.fingerprints({r["fingerprint_id"] for r in new})
    new_statements = [
        {
            "kind": r["kind"],
            "fingerprint": texts.get(r["fingerprint_id"]),
            "calls": r["calls"],
            "requests": r["requests"],
            "ms": r["ms"],
        }
        for r in new
    ]
    n_before = max(int(rows[False]["n"]), 1) if False in rows else 1
    n_after = max(int(rows[True]["n"]), 1) if True in rows else 1
    upstream = None
    for r in ctx.query(_UPSTREAMS, [started, started, ep, since]):
        grew = float(r["ms_after"] or 0) / n_after - float(r["ms_before"] or 0) / n_before
        if grew > 0 and (upstream is None or grew > upstream["ms_per_request_added"]):
            upstream = {"host": r["host"], "ms_per_request_added": grew}
    changes = _value_changes(ctx, ep, started, since)
    return {
        "moved": moved,
        "new_statements": new_statements,
        "upstream": upstream,
        "changes": changes,
    }


def _value_changes(
    ctx: Context, ep: str, started: datetime, since: datetime
) -> list[dict[str, Any]]:
    """Tag values (and releases) rare before the breakpoint and common after it."""
    end = ctx.last_seen or started
    rows = [
        {**r, "what": f"tag {r['key']}={r['value']}"}
        for r in ctx.store.query(_TAGS, [started, started, ep, since, end])
    ]
    if _has_version(ctx):
        rows += [
            {**r, "what": f"release {r['value']}"}
            for r in ctx.query(_VERSIONS, [started, started, ep, since])
        ]
    totals = ctx.query(
        "SELECT count(*) FILTER (WHERE ts >= ?) AS a, count(*) FILTER (WHERE ts < ?) AS b "
        "FROM r WHERE endpoint = ? AND ts >= ?",
        [started, started, ep, since],
    )[0]
    na, nb = max(int(totals["a"]), 1), max(int(totals["b"]), 1)
    out = []
    for r in rows:
        share_a, share_b = int(r["n_after"]) / na, int(r["n_before"]) / nb
        if share_a >= 0.5 and share_b <= 0.05:
            out.append({"change": r["what"], "share_after": share_a, "share_before": share_b})
    return sorted(out, key=lambda x: -x["share_after"])


def _has_version(ctx: Context) -> bool:
    rows = ctx.store.query(
        "SELECT count(*) AS n FROM information_schema.columns "
        "WHERE table_name = 'requests' AND column_name = 'version'"
    )
    return bool(rows and rows[0]["n"])


def _span(seconds: float) -> str:
    if seconds % 3600 == 0:
        h = int(seconds // 3600)
        return f"{h} h"
    return f"{int(seconds // 60)} min"


def _minute(t: datetime, seconds: bool = False) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S" if seconds else "%Y-%m-%dT%H:%M")


def _finding(ctx: Context, ep: str, sh: dict[str, Any], size: float) -> Finding:
    started = _bucket_time(sh["split_bucket"], size)
    since = _bucket_time(sh["first_bucket"], size)
    why = _context(ctx, ep, started, since)
    when = started.strftime("%Y-%m-%d %H:%M UTC")
    if sh["metric"] == "p95":
        change = sh["after"] / sh["before"] - 1 if sh["before"] else None
        what = (
            f"{ep} p95 rose from {text.ms(sh['before'])} to {text.ms(sh['after'])} "
            f"(+{text.pct(change)}) from {when}"
        )
    else:
        what = (
            f"{ep}: requests over {text.ms(sh['threshold_ms'])} went from "
            f"{text.pct(sh['before'])} to {text.pct(sh['after'])} of its traffic from {when}"
        )
    title = f"{what} and stayed there ({sh['buckets_after']} buckets of {_span(size)})"
    extras = [c["change"] for c in why["changes"][:2]]
    for key, label in (("db_calls", "DB"), ("http_calls", "HTTP"), ("cache_calls", "cache")):
        m = why["moved"].get(key)
        if m and m["after"] - m["before"] >= max(1.0, 0.25 * m["before"]):
            extras.append(f"{label} calls per request {m['before']:.1f} → {m['after']:.1f}")
    if why["new_statements"]:
        extras.append(f"new statement `{text.statement(why['new_statements'][0]['fingerprint'])}`")
    if why["upstream"] and why["upstream"]["ms_per_request_added"] >= 5:
        up = why["upstream"]
        extras.append(f"{up['host']} +{text.ms(up['ms_per_request_added'])} per request")
    if extras:
        title += "; with it: " + ", ".join(extras)
    title += "."
    return Finding(
        id=stable_id(KIND, ep, sh["metric"]),
        kind=KIND,
        endpoint=ep,
        title=title,
        impact_ms_per_min=ctx.per_min(sh["extra_ms"]),
        fingerprint=why["new_statements"][0]["fingerprint"] if why["new_statements"] else None,
        first_seen=iso(started),
        last_seen=iso(ctx.last_seen),
        suggestion=(
            "Compare the requests before and after it: `perfsleuth compare --a "
            f"{_minute(since)}/{_minute(started)} --b {_minute(started)}/"
            f"{_minute(ctx.last_seen or started, seconds=True)}` "
            "and look at what the deploy or config change at that time did to this endpoint."
        ),
        evidence={
            "metric": sh["metric"],
            "started": iso(started),
            "before": sh["before"],
            "after": sh["after"],
            "p_value": sh["p_value"],
            "requests_p_value": sh.get("requests_p_value"),
            "bucket_seconds": size,
            "buckets_before": sh["buckets_before"],
            "buckets_after": sh["buckets_after"],
            "requests_before": sh["requests_before"],
            "requests_after": sh["requests_after"],
            "baseline": "before the breakpoint",
            **why,
        },
    )


# --------------------------------------------------------------------------- week over week


def _span_words(d: timedelta) -> str:
    h = d.total_seconds() / 3600
    return f"{h:g} h" if h >= 1 and float(h).is_integer() else f"{d.total_seconds() / 60:.0f} min"


def _week_over_week(ctx: Context, flagged: set[str]) -> list[Finding]:
    hours = float(ctx.t(KIND, "week_hours"))
    if hours <= 0 or ctx.last_seen is None:
        return []
    end = ctx.last_seen
    start = end - timedelta(hours=hours)
    if ctx.cutoff is not None and ctx.cutoff > start:  # the window asked for, when shorter
        start = ctx.cutoff
    week = timedelta(days=7)
    rows = ctx.store.query(
        _WEEK,
        [start, start, end, start - week, end - week, ctx.endpoint, ctx.endpoint],
    )
    sides: dict[str, dict[bool, np.ndarray]] = {}
    for r in rows:
        sides.setdefault(r["endpoint"], {})[bool(r["recent"])] = np.sort(
            np.asarray(r["d"], dtype=np.float64)
        )
    out = []
    min_n = int(ctx.t(KIND, "min_requests"))
    min_change = float(ctx.t(KIND, "min_change"))
    for ep, s in sorted(sides.items()):
        if ep in flagged or True not in s or False not in s:
            continue
        now, then = s[True], s[False]
        if len(now) < min_n or len(then) < min_n:
            continue
        p95_now, p95_then = float(np.quantile(now, 0.95)), float(np.quantile(then, 0.95))
        test = stats.mann_whitney(then, now)
        p = test.p_value / 2 if test.delta > 0 else 1.0
        if (
            p > float(ctx.t(KIND, "max_p_value"))
            or p95_now < p95_then * (1 + min_change)
            or p95_now - p95_then < float(ctx.t(KIND, "min_change_ms"))
        ):
            continue
        extra = max(0.0, float(now.mean() - then.mean())) * len(now)
        title = (
            f"{ep} p95 is {text.ms(p95_now)} over the last {_span_words(end - start)} against "
            f"{text.ms(p95_then)} in the same hours last week "
            f"(+{text.pct(p95_now / p95_then - 1)})."
        )
        out.append(
            Finding(
                id=stable_id(KIND, ep, "week_over_week"),
                kind=KIND,
                endpoint=ep,
                title=title,
                impact_ms_per_min=ctx.per_min(extra),
                first_seen=iso(start),
                last_seen=iso(end),
                suggestion=(
                    "Compare the two weeks: `perfsleuth compare --a "
                    f"{(start - week).strftime('%Y-%m-%dT%H:%M')}/"
                    f"{(end - week).strftime('%Y-%m-%dT%H:%M')} --b "
                    f"{start.strftime('%Y-%m-%dT%H:%M')}/{end.strftime('%Y-%m-%dT%H:%M:%S')}`."
                ),
                evidence={
                    "metric": "p95",
                    "baseline": "same hours last week",
                    "before": p95_then,
                    "after": p95_now,
                    "p_value": p,
                    "requests_before": len(then),
                    "requests_after": len(now),
                },
            )
        )
    return out
