"""Rollups of requests: per minute, hour and day, per service, host, kind and endpoint, the
request counts and sums ``top`` shows, and the latency histogram in fixed log buckets.

Histogram: DDSketch-style buckets of the duration in microseconds, bucket
``k = ceil(ln(us) / ln(GAMMA))`` holding (GAMMA**(k-1), GAMMA**k] (bucket 0: up to 1 us),
counted as plain integers. The boundaries are fixed, so histograms of any minutes, hours,
hosts or batches merge by summing their counts, in any order, on any engine; no engine's own
sketch state is ever the truth (see the store design notes). A bucket is read as
``2 * GAMMA**k / (GAMMA + 1)``, within (GAMMA - 1) / (GAMMA + 1) = 0.99 % of any duration in it,
and a percentile is interpolated between the two ranks around ``q * (n - 1)`` as
``quantile_cont`` does on raw rows: within 1 % of the exact figure.

:func:`rollups_of` is pure: the Arrow tables of one ingest batch (after the requests the store
holds already were left out) -> the rollup rows of that batch, per day, at every resolution.
The writer inserts them in the transaction that inserts the raw rows, so a request is rolled up
exactly when it is stored. Rows of the same key from different batches are summed by readers;
an engine may compact them (``duckdb_rollups``), which changes no sum.

:func:`plan` cuts a time range into whole days, whole hours and minutes, each read from its
resolution, so a 30-day range reads ~30 day rows, up to 46 hour rows and 118 minute rows per
key instead of 43,200 minute rows. :func:`top_sql` and :func:`top_rows` are the portable SQL and
the arithmetic behind ``top`` from rollups.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import schema
from perfsleuth.store.values import EPOCH

GAMMA = 1.02
_LN_GAMMA = math.log(GAMMA)
MINUTE, HOUR, DAY = 60, 3600, 86400
RESOLUTIONS = (MINUTE, HOUR, DAY)
SLOW_MS = (1000, 2000, 5000)  # requests over these are counted exactly (over_1000, ...)
ROLLUP_DAYS = 90  # rollups are kept this long; raw rows for the store's retention (7 days)
KEY = ("ts", "res", "service", "host", "kind", "endpoint")
_SUMS = ("duration_ms", "cpu_ms", "db_ms", "http_ms", "cache_ms", "gc_ms")
_COUNTS = ("errors", "db_calls", "http_calls", "cache_calls", *(f"over_{t}" for t in SLOW_MS))


def bucket_of(duration_ms: np.ndarray) -> np.ndarray:
    """Histogram bucket of each duration (ms): ceil(ln(us) / ln(GAMMA)), 0 up to 1 us."""
    us = np.asarray(duration_ms, dtype=np.float64) * 1000.0
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.ceil(np.log(np.maximum(us, 1.0)) / _LN_GAMMA)
    # ln(GAMMA**k) / ln(GAMMA) can land a hair above k: a duration on a boundary stays in k.
    k = np.where(np.power(GAMMA, k - 1) >= us, k - 1, k)
    return np.maximum(k, 0).astype(np.int32)


def value_of(bucket: float | np.ndarray) -> Any:
    """The duration (ms) a bucket stands for: within 0.99 % of every duration in it."""
    return 2.0 * np.power(GAMMA, bucket) / (GAMMA + 1.0) / 1000.0


# ------------------------------------------------------------------------------- writing


def rollups_of(days: dict[date, dict[str, pa.Table]]) -> dict[date, dict[str, pa.Table]]:
    """The rollup rows (``rollup_stats``, ``rollup_hist``) of a batch's ``requests`` tables,
    per day (``Tables.days``), at each of RESOLUTIONS. Grouping is numpy over integer keys (the
    dictionary codes of service, host, kind and endpoint and the period): ~0.3 s of CPU per
    million requests."""
    out: dict[date, dict[str, pa.Table]] = {}
    for d, parts in days.items():
        req = parts.get("requests")
        if req is not None and req.num_rows:
            out[d] = _day_rollups(req.combine_chunks())
    return out


_DIMS = ("service", "host", "kind", "endpoint")
_NB = 1 << 12  # bucket < 4096: durations up to 1.02**4096 us


def _codes(col: pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """Dictionary codes of a string column (NULL as the last code) and the values coded."""
    enc = pc.dictionary_encode(col.combine_chunks())
    values = enc.dictionary
    codes = pc.fill_null(enc.indices, len(values)).to_numpy(zero_copy_only=False)
    return codes.astype(np.int64), pa.concat_arrays([values, pa.nulls(1, values.type)])


def _group(parts: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows grouped by several integer columns (each with its number of values): the index
    of each group's first row, and each row's group (groups in key order)."""
    key = np.zeros(len(parts[0][0]), np.int64)
    span = 1
    for codes, n in parts:
        if span * n >= 1 << 62:  # renumber densely before the key would overflow
            key = np.unique(key, return_inverse=True)[1].astype(np.int64)
            span = int(key.max()) + 1 if len(key) else 1
        key = key * n + codes
        span *= n
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)


def _max_by(inv: np.ndarray, groups: int, values: np.ndarray) -> np.ndarray:
    """Per group, the largest of ``values`` (NaN counts as no value; a group with none: NaN)."""
    out = np.full(groups, -np.inf)
    order = np.argsort(inv, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(inv[order]) != 0])
    v = np.where(np.isnan(values), -np.inf, values)[order]
    out[inv[order][starts]] = np.maximum.reduceat(v, starts)
    return np.where(np.isinf(out), np.nan, out)


def _day_rollups(req: pa.Table) -> dict[str, pa.Table]:
    n = req.num_rows
    ts_us = pc.cast(req["ts"], pa.int64()).to_numpy(zero_copy_only=False)
    minute = ts_us // (MINUTE * 1_000_000)
    dims = {c: _codes(req[c]) for c in _DIMS}

    def num(c: str) -> np.ndarray:
        return pc.cast(req[c], pa.float64()).to_numpy(zero_copy_only=False)

    dur = num("duration_ms")
    status = pc.fill_null(req["status"], 0)
    error = pc.or_(pc.greater_equal(status, 500), pc.is_valid(req["error"]))
    cols: dict[str, np.ndarray] = {
        "requests": np.ones(n),
        "errors": error.to_numpy(zero_copy_only=False).astype(np.float64),
    }
    for c in ("db_calls", "http_calls", "cache_calls", *_SUMS):
        cols[c] = num(c)
    for t in SLOW_MS:
        cols[f"over_{t}"] = (dur > t).astype(np.float64)
    timed = ~np.isnan(dur)
    bucket = np.zeros(n, np.int64)
    bucket[timed] = np.minimum(bucket_of(dur[timed]), _NB - 1)

    m0 = int(minute.min())
    period = minute - m0
    dim_parts = [(dims[c][0], len(dims[c][1])) for c in _DIMS]
    # Each level's columns, concatenated and made into one table at the end (a table per
    # level cost three times the Arrow calls: most of the ~3 ms of a 100-request batch).
    stats: dict[str, list[np.ndarray]] = {}
    hist: dict[str, list[np.ndarray]] = {}
    row_codes = {c: dims[c][0] for c in _DIMS}
    row_max = dur
    row_hist = (np.flatnonzero(timed), bucket[timed], np.ones(int(timed.sum())))
    # NaN (no value) counts as 0 in the sums; the sums of the finer level have none
    cols = {c: np.nan_to_num(v) for c, v in cols.items()}
    for res in RESOLUTIONS:
        # coarser levels group the rows of the finer one: sums of sums, max of maxes
        step = res // MINUTE
        p = (period + m0) // step * step - m0 if res != MINUTE else period
        p_code = p - p.min()
        first, inv = _group([(p_code, int(p_code.max()) + 1), *dim_parts])
        g = len(first)
        sums = {c: np.bincount(inv, weights=v, minlength=g) for c, v in cols.items()}
        mx = _max_by(inv, g, row_max)
        key = {c: row_codes[c][first] for c in _DIMS}
        ts = ((p[first] + m0) * MINUTE * 1_000_000).astype(np.int64)
        _add(stats, res=np.full(g, res, np.int32), ts=ts, **key, **sums, max_ms=mx)
        rows, b, counts = row_hist
        hk = inv[rows] * _NB + b
        uk, hc = _sum_by_key(hk, counts)
        grp = uk // _NB
        _add(
            hist,
            res=np.full(len(uk), res, np.int32),
            ts=ts[grp],
            **{c: key[c][grp] for c in _DIMS},
            bucket=(uk % _NB).astype(np.int32),
            requests=hc,
        )
        # the next level starts from this one's groups
        period, cols, row_max = p[first], sums, mx
        row_codes = key
        dim_parts = [(key[c], len(dims[c][1])) for c in _DIMS]
        row_hist = (grp, uk % _NB, hc)
    return {
        "rollup_stats": _table(schema.ROLLUP_STATS, stats, dims),
        "rollup_hist": _table(schema.ROLLUP_HIST, hist, dims),
    }


def _add(into: dict[str, list[np.ndarray]], **cols: np.ndarray) -> None:
    for c, v in cols.items():
        into.setdefault(c, []).append(v)


def _table(
    t: schema.Table, parts: dict[str, list[np.ndarray]], dims: dict[str, tuple[Any, pa.Array]]
) -> pa.Table:
    """The rows of every level, as ``t``'s columns: dimension codes looked up, counts as
    whole numbers, sums as doubles, a NaN max as NULL."""
    cols: dict[str, Any] = {}
    for c, chunks in parts.items():
        v = np.concatenate(chunks)
        if c in _DIMS:
            cols[c] = dims[c][1].take(pa.array(v))
        elif c == "max_ms":
            cols[c] = pa.array(v, from_pandas=True)
        elif c in _SUMS or c in ("ts", "res", "bucket"):
            cols[c] = pa.array(v)
        else:  # counts: requests, errors, calls, over_*
            cols[c] = pa.array(np.rint(v).astype(np.int64))
    return _as(t, pa.table(cols))


def _sum_by_key(key: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uk, inv = np.unique(key, return_inverse=True)
    return uk, np.bincount(inv.reshape(-1), weights=weights, minlength=len(uk))


def _as(t: schema.Table, data: pa.Table) -> pa.Table:
    return data.select(t.column_names).cast(t.arrow_schema())


# ------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Span:
    """Rows of resolution ``res`` with lo <= ts < hi."""

    res: int
    lo: datetime
    hi: datetime


def _floor(t: datetime, res: int) -> datetime:
    s = (t - EPOCH_DT).total_seconds()
    return EPOCH_DT + timedelta(seconds=int(s // res * res))


def ceil_to(t: datetime, res: int) -> datetime:
    """``t`` rounded up to a whole period of ``res`` seconds."""
    return _ceil(t, res)


def _ceil(t: datetime, res: int) -> datetime:
    f = _floor(t, res)
    return f if f == t else f + timedelta(seconds=res)


EPOCH_DT = datetime(EPOCH.year, EPOCH.month, EPOCH.day)


def plan(start: datetime, end: datetime) -> list[Span]:
    """[start, end) as whole days, whole hours and minutes (start rounded down to its minute:
    rollups know no finer time), coarsest first; each span is read from its resolution."""
    lo = _floor(start, MINUTE)
    spans: list[Span] = []

    def cut(a: datetime, b: datetime, levels: tuple[int, ...]) -> None:
        if a >= b:
            return
        res, finer = levels[0], levels[1:]
        if not finer:
            spans.append(Span(res, a, b))
            return
        ca, fb = _ceil(a, res), _floor(b, res)
        if ca < fb:
            spans.append(Span(res, ca, fb))
            cut(a, ca, finer)
            cut(fb, b, finer)
        else:
            cut(a, b, finer)

    # the last minute may be partial: its row holds what is stored so far
    cut(lo, _ceil(end, MINUTE), (DAY, HOUR, MINUTE))
    return spans


# Groupings rollups are keyed by (a top by user, tenant, ... reads raw rows).
ROLLUP_GROUPS = ("endpoint", "service", "host", "kind")
# top() reads rollups when the window holds more requests than this (raw quantiles over this
# many rows take ~0.3 s here; see benchmarks/scale.py), or starts before the raw rows kept.
RAW_MAX_REQUESTS = 5_000_000


@dataclass(frozen=True)
class Choice:
    """Rollups can answer ``top`` over [lo, now): read ``spans``. ``raw_if_few``: the raw
    rows hold the whole window too, so they answer instead when it holds at most
    RAW_MAX_REQUESTS requests (the engine counts them from the rollups' ``spans``)."""

    lo: datetime
    spans: list[Span]
    raw_if_few: bool


def choose(
    start: datetime | None,
    by: tuple[str, ...],
    days: list[date],
    raw_first: date | None,
    has_minutes: Callable[[date], bool],
    now: datetime,
    *,
    force: bool = False,
) -> Choice | None:
    """Whether rollups answer ``top`` over [start, now) (start None: all), the same decision
    on every engine. ``days``: the days holding rollups (sorted), ``raw_first``: the first day
    of raw requests (None: none), ``has_minutes(d)``: day d's rollups still hold minute rows
    (retention keeps those only as long as raw rows). None (raw rows answer): a grouping
    rollups lack (user, tenant, ...), no rollups, or, unless ``force``, a window starting
    before the first rollup day when raw rows begin earlier (rollups are written from the
    upgrade on: they would answer for a shorter window than asked)."""
    if any(b not in ROLLUP_GROUPS for b in by) or not days:
        return None
    first = datetime.combine(days[0], datetime.min.time())
    early = raw_first is not None and raw_first < days[0]
    if not force and (start is None or start < first) and early:
        return None
    lo = max(start, first) if start is not None else first
    if not has_minutes(lo.date()):  # retention left hours: start at a whole hour
        lo = ceil_to(lo, HOUR)
    # Raw rows are complete for the window unless retention dropped days rollups still hold.
    in_window = [d for d in days if d >= lo.date()]
    raw_complete = not in_window or (raw_first is not None and raw_first <= in_window[0])
    return Choice(lo, plan(lo, now + timedelta(minutes=1)), raw_complete and not force)


def answered_by(spans: list[Span]) -> dict[str, Any]:
    """What answered a ``top`` from rollups (StoreReader.top_answered's second value)."""
    return {
        "source": "rollups",
        "resolution_s": min((s.res for s in spans), default=MINUTE),
        "start": min(s.lo for s in spans).replace(tzinfo=UTC).isoformat() if spans else None,
    }


def top_from(
    choice: Choice,
    stats: str,
    hist: str,
    by: tuple[str, ...],
    where: str,
    params: list[Any],
    percentiles_for: str | None,
    *,
    execute: Callable[[str, list[Any]], Any],
    rows: Callable[[str, list[Any]], list[dict[str, Any]]],
    coded: Callable[[list[Any]], pa.Table | None],
    minutes: Callable[[], float],
) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """``top`` from the rollup rows ``stats`` and ``hist`` (tables or SELECTs) that ``where``
    keeps, with what answered: each engine's ``rollup_top`` once it has made its ``choice``.
    None when raw rows answer instead: ``choice.raw_if_few`` and the window holds at most
    RAW_MAX_REQUESTS requests. The engine reads: ``execute(sql, params)`` (a cursor), ``rows``
    (dicts), ``coded(endpoints)`` (:func:`coded_hist_query`'s rows over ``hist`` for those
    endpoints, None where the engine cannot: :func:`top_sql`'s GROUP BY reads them then) and
    ``minutes()`` (the window's length in minutes, read only when rows answer)."""
    if choice.raw_if_few:
        n = execute(f"SELECT coalesce(sum(requests), 0) FROM {stats} WHERE {where}", params)
        got = n.fetchone()
        if got is None or int(got[0]) <= RAW_MAX_REQUESTS:
            return None
    stats_q, hist_q = top_statements(stats, hist, by, where, params, percentiles_for)
    stat_rows = rows(*stats_q)
    answer = answered_by(choice.spans)
    if not stat_rows:  # nothing kept: no histogram to read
        return [], answer
    keys = [r["endpoint"] for r in stat_rows] if by == ("endpoint",) else []
    table = None
    if keys and percentiles_for is None and len(keys) <= CODED_KEYS_MAX:
        # the overview's table: histogram rows coded by endpoint, summed by numpy
        table = coded(keys)
    hist_rows = rows(*hist_q) if table is None else coded_hist_rows(table, keys)
    return top_rows(stat_rows, hist_rows, by, max(minutes(), 1.0)), answer


def span_where(spans: list[Span]) -> tuple[str, list[Any]]:
    """SQL condition (and its parameters) selecting the rows of ``spans``."""
    if not spans:
        return "false", []
    conds, params = [], []
    for s in spans:
        conds.append("(res = ? AND ts >= ? AND ts < ?)")
        params += [s.res, s.lo, s.hi]
    return "(" + " OR ".join(conds) + ")", params


PERCENTILES = (0.5, 0.95, 0.99)


def top_sql(stats: str, hist: str, by: tuple[str, ...], where: str) -> tuple[str, str]:
    """Two portable statements over the rollup tables (or SELECTs of them) ``stats`` and
    ``hist``, both filtered by ``where``, grouped by ``by``: the sums of each group, and, per
    group and percentile, the buckets holding the ranks either side of ``q * (n - 1)``."""
    g = ", ".join(schema.quote(b) for b in by)
    sums = ", ".join(f"sum({c}) AS {c}" for c in ("requests", *_COUNTS, *_SUMS))
    stats_sql = (
        f"SELECT {g}, {sums}, max(max_ms) AS max_ms, min(ts) AS first_ts, max(ts) AS last_ts "
        f"FROM {stats} WHERE {where} GROUP BY {g}"
    )
    picks = []
    for q in PERCENTILES:
        name = f"p{round(q * 100)}"
        picks.append(f"min(bucket) FILTER (WHERE cum > floor({q} * (n - 1))) AS {name}_lo")
        picks.append(f"min(bucket) FILTER (WHERE cum > ceil({q} * (n - 1))) AS {name}_hi")
    hist_sql = f"""
        WITH h AS (
            SELECT {g}, bucket, sum(requests) AS c FROM {hist} WHERE {where}
            GROUP BY {g}, bucket
        ), r AS (
            SELECT {g}, bucket,
                sum(c) OVER (PARTITION BY {g} ORDER BY bucket
                    ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum,
                sum(c) OVER (PARTITION BY {g}) AS n
            FROM h
        )
        SELECT {g}, max(n) AS n, {", ".join(picks)} FROM r GROUP BY {g}"""
    return stats_sql, hist_sql


def top_statements(
    stats: str,
    hist: str,
    by: tuple[str, ...],
    where: str,
    params: list[Any],
    percentiles_for: str | None = None,
) -> tuple[tuple[str, list[Any]], tuple[str, list[Any]]]:
    """:func:`top_sql`'s two statements with their parameters; ``percentiles_for``: the
    histogram statement reads that endpoint's rows only (the other groups get no
    percentiles)."""
    hist_where, hist_params = where, params
    if percentiles_for is not None:
        hist_where, hist_params = f"{where} AND endpoint = ?", [*params, percentiles_for]
    stats_sql = top_sql(stats, hist, by, where)[0]
    hist_sql = top_sql(stats, hist, by, hist_where)[1]
    return (stats_sql, params), (hist_sql, hist_params)


CASE_KEYS = 16  # coded_hist_query: up to this many keys by a CASE, more by a join of VALUES
# top by endpoint codes the histogram rows of up to this many endpoints (coded_hist_query: a
# join of their VALUES on DuckDB, transform() of their literals on ClickHouse) and reads
# top_sql's GROUP BY statement for more: binding the VALUES costs ~50 us a key. DuckDB, CPU of
# top, coded / GROUP BY, median of 5 interleaved: 300 endpoints x 200 requests 0.046 / 0.074 s,
# 1,000 x 100 0.092 / 0.122 s, 3,000 x 20 0.225 / 0.182 s, 20,000 x 1 1.71 / 0.74 s.
CODED_KEYS_MAX = 2_000


def coded_hist_query(
    hist: str,
    where: str,
    params: list[Any],
    keys: list[Any],
    key: str = "endpoint",
    period: bool = False,
) -> tuple[str, list[Any]]:
    """Portable SQL (and its parameters) over the histogram rows ``hist`` (a table or a
    SELECT) kept by ``where`` (with ``params``): ``code`` (the index of the row's ``key``
    among ``keys``, NULL for another or a NULL one), ``bucket``, ``requests``, and with
    ``period`` the ``b`` that ``hist`` selects. An integer per row lets
    :func:`coded_hist_rows` sum the rows by key and bucket with numpy's direct indexing,
    where an engine's GROUP BY endpoint, bucket hashed ~60,000 groups (~0.1 us a row)."""
    cols = ", ".join((key, "bucket", "requests", *(("b",) if period else ())))
    out = ", ".join(f"h.{c} AS {c}" for c in ("bucket", "requests", *(("b",) if period else ())))
    rows = f"(SELECT {cols} FROM {hist} WHERE {where}) AS h"
    if len(keys) <= CASE_KEYS:  # a chart's few series: compared in turn, no join to plan
        whens = " ".join(f"WHEN ? THEN {i}" for i in range(len(keys)))
        # typed: a column of NULL alone would be Arrow's null type
        code = f"CASE h.{key} {whens} END" if keys else "CAST(NULL AS INTEGER)"
        return f"SELECT {code} AS code, {out} FROM {rows}", [*keys, *params]
    values = ", ".join(f"(?, {i})" for i in range(len(keys)))
    return (
        f"SELECT g.code AS code, {out} FROM {rows} "
        f"LEFT JOIN (VALUES {values}) AS g(key_value, code) ON h.{key} = g.key_value",
        [*params, *keys],
    )


# merged_buckets sums the rows by (group, bucket) into dense arrays of at most DENSE_CELLS
# cells (8 MB of float64), a range of groups at a time, in up to DENSE_PASSES passes over the
# rows, and by a sort of the rows beyond (a dense array for 20,000 endpoints x ~1,000 buckets
# took 160 MB). Rows of the 30-day overview's table (3.5M rows, 300 endpoints) and of its
# chart (1.6M rows, 8 endpoints x 121 periods), CPU median of 7: dense 64 and 107 ms, sorted
# 418 and 224 ms.
DENSE_CELLS = 1 << 20
DENSE_PASSES = 8


def merged_buckets(
    group: np.ndarray, bucket: np.ndarray, requests: np.ndarray, groups: int
) -> list[dict[str, Any]]:
    """Per group (0 <= group < ``groups``): ``n`` (requests counted) and, per percentile q,
    the buckets holding the ranks either side of q * (n - 1) (``p95_lo``, ``p95_hi``), as the
    histogram statement of :func:`top_sql` gives them; None where a group has no rows.

    Works over the (group, bucket) cells present, in key order: their counts' running sum
    over all groups, minus the requests of the groups before, is each group's cumulative
    histogram, so a rank's bucket is the first cell whose running sum passes the group's start
    plus the rank (a binary search). Memory grows with the rows, not with groups x buckets."""
    out: list[dict[str, Any]] = [{"n": None} for _ in range(groups)]
    if not len(group):
        return out
    nb = int(bucket.max()) + 1
    key = group.astype(np.int64) * nb + bucket.astype(np.int64)
    weights = requests.astype(np.float64)
    span = max(1, DENSE_CELLS // nb)  # groups per dense pass
    if -(-groups // span) <= DENSE_PASSES:  # direct indexing beats a sort of the rows
        cells, cell_sums = [], []
        for g0 in range(0, groups, span):
            k, w = key, weights
            if span < groups:  # this pass's groups only, numbered from g0
                sel = (group >= g0) & (group < g0 + span)
                k, w = key[sel] - g0 * nb, weights[sel]
            flat = np.bincount(k, weights=w, minlength=min(span, groups - g0) * nb)
            present = np.flatnonzero(flat)
            cells.append(present + g0 * nb if g0 else present)
            cell_sums.append(flat[present])
        cell, sums = np.concatenate(cells), np.concatenate(cell_sums)
    else:
        cell, inv = np.unique(key, return_inverse=True)
        sums = np.bincount(inv.reshape(-1), weights=weights, minlength=len(cell))
    if not len(cell):
        return out
    counts = np.rint(sums).astype(np.int64)
    cell_group, cell_bucket = cell // nb, cell % nb
    cum = np.cumsum(counts)  # requests are counts (>= 0): non-decreasing
    start = np.flatnonzero(np.r_[True, cell_group[1:] != cell_group[:-1]])
    end = np.r_[start[1:], len(cell)]
    before = cum[start] - counts[start]  # the requests of the groups before
    n = cum[end - 1] - before
    counted = n > 0
    picks: dict[str, list[Any]] = {}
    for q in PERCENTILES:
        name = f"p{round(q * 100)}"
        pos = q * (n - 1)
        for side, rank in (("lo", np.floor(pos)), ("hi", np.ceil(pos))):
            # the group's first cell whose cumulative count passes the rank
            at = np.searchsorted(cum, before + rank.astype(np.int64), side="right")
            found = counted & (at < end)
            b = cell_bucket[np.minimum(at, len(cell) - 1)]
            picks[f"{name}_{side}"] = np.where(found, b, -1).tolist()
    names = list(picks)
    for j, (g, total) in enumerate(zip(cell_group[start].tolist(), n.tolist(), strict=True)):
        if total:
            row: dict[str, Any] = {"n": total}
            for c in names:
                v = picks[c][j]
                row[c] = v if v >= 0 else None
            out[g] = row
    return out


def coded_hist_rows(
    t: pa.Table, keys: list[Any], periods: list[int] | None = None, key: str = "endpoint"
) -> list[dict[str, Any]]:
    """The rows :func:`top_sql`'s histogram statement gives, grouped by ``key`` (by ``b`` and
    ``key`` with ``periods``, the values of ``b``), from the rows of :func:`coded_hist_query`
    (``t``: code, bucket, requests, and b with ``periods``; a code that is NULL or not an
    index of ``keys`` stands for the NULL key), summed with numpy."""
    null_code = len(keys)  # a NULL code: another key's (none of keys: the NULL key's)
    # cast first: an engine may type a column of NULLs alone as Arrow's null type
    code = pc.fill_null(pc.cast(t["code"], pa.int64()), null_code).to_numpy()
    other = (code < 0) | (code >= len(keys))
    group = np.where(other, keys.index(None) if None in keys else -1, code)
    n_groups = len(keys)
    if periods is not None:
        index = {b: i for i, b in enumerate(periods)}
        b = t["b"].to_numpy(zero_copy_only=False).astype(np.int64)
        b_index = np.array([index.get(int(v), -1) for v in np.unique(b)], np.int64)
        b_i = b_index[np.searchsorted(np.unique(b), b)] if len(b) else b
        group = np.where((group >= 0) & (b_i >= 0), b_i * len(keys) + group, -1)
        n_groups *= len(periods)
    kept = group >= 0
    rows = merged_buckets(
        group[kept],
        t["bucket"].to_numpy(zero_copy_only=False)[kept],
        t["requests"].to_numpy(zero_copy_only=False)[kept],
        n_groups,
    )
    out = []
    for g, r in enumerate(rows):
        if r["n"] is None:
            continue
        r[key] = keys[g % len(keys)]
        if periods is not None:
            r["b"] = periods[g // len(keys)]
        out.append(r)
    return out


def percentile(n: int, q: float, lo: int | None, hi: int | None, max_ms: float | None) -> Any:
    """The q-quantile of a group of n timed requests from the buckets of the ranks around
    q * (n - 1), interpolated like quantile_cont, never above the group's max."""
    if not n or lo is None or hi is None:
        return None
    pos = q * (n - 1)
    frac = pos - math.floor(pos)
    v = float(value_of(lo) + frac * (value_of(hi) - value_of(lo)))
    return min(v, max_ms) if max_ms is not None else v


def top_rows(
    stats: list[dict[str, Any]], hist: list[dict[str, Any]], by: tuple[str, ...], minutes: float
) -> list[dict[str, Any]]:
    """``top``'s rows (see StoreReader.top) from the results of :func:`top_sql`, busiest
    first."""
    pct = {tuple(r[b] for b in by): r for r in hist}
    out = []
    for r in stats:
        n = int(r["requests"] or 0)
        if not n:
            continue
        total = float(r["duration_ms"] or 0.0)
        h = pct.get(tuple(r[b] for b in by), {})
        timed = int(h.get("n") or 0)
        row = {b: r[b] for b in by}
        row.update(
            count=n,
            rate_per_min=n / minutes,
            **{
                f"p{round(q * 100)}_ms": percentile(
                    timed,
                    q,
                    h.get(f"p{round(q * 100)}_lo"),
                    h.get(f"p{round(q * 100)}_hi"),
                    r["max_ms"],
                )
                for q in PERCENTILES
            },
            max_ms=r["max_ms"],
            error_rate=int(r["errors"] or 0) / n,
            db_calls_per_request=int(r["db_calls"] or 0) / n,
            http_calls_per_request=int(r["http_calls"] or 0) / n,
            cache_calls_per_request=int(r["cache_calls"] or 0) / n,
            db_share=_share(r["db_ms"], total),
            http_share=_share(r["http_ms"], total),
            cache_share=_share(r["cache_ms"], total),
            gc_share=_share(r["gc_ms"], total),
            total_ms=total,
        )
        out.append(row)
    out.sort(key=lambda x: (-x["total_ms"], -x["count"], *(str(x[b]) for b in by)))
    return out


def _share(part: float | None, total: float) -> float:
    return min(1.0, float(part or 0.0) / total) if total > 0 else 0.0


def day_of(ts_us: int) -> date:
    return EPOCH + timedelta(days=ts_us // (DAY * 1_000_000))
