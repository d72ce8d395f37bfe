"""What the API pages show, computed from the store (store.top / traces / trace and SQL over
the logical views). Every function takes the store and a :class:`Window`; none holds state.

Chart series are column arrays for uPlot: ``x`` (bucket starts, unix seconds) and one array
per series with None where a bucket has no data.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from perfsleuth.server.window import WEEK, Window, step_seconds
from perfsleuth.store import rollups
from perfsleuth.store.base import Store
from perfsleuth.store.filters import only_where
from perfsleuth.suggest import did_you_mean

TOP_SERIES = 8  # endpoints drawn in the P95-over-time chart
SLOW_MS = (1000, 2000, 5000)  # the "over 1 s / 2 s / 5 s" counts
HIST_PER_DECADE = 10  # latency histogram: log-spaced bins


class NotFound(LookupError):
    """An unknown endpoint, trace or finding; the message is one sentence."""


class Ambiguous(ValueError):
    """An id prefix that matches several traces (``candidates``, the first few)."""

    def __init__(self, message: str, candidates: list[str]) -> None:
        super().__init__(message)
        self.candidates = candidates


def resolve_trace(store: Store, trace_id: str) -> str:
    """The full id of a trace given by id or unique prefix; NotFound, or Ambiguous with the
    first ten matching ids."""
    prefix = trace_id.strip().lower()
    if not prefix:
        raise NotFound("give a trace id (or a unique prefix of one)")
    ids = [
        r["trace_id"]
        for r in store.query(
            "SELECT DISTINCT trace_id FROM requests WHERE starts_with(trace_id, ?) "
            "ORDER BY 1 LIMIT 11",
            [prefix],
        )
    ]
    if not ids:
        raise NotFound(f"no trace with id {trace_id.strip()[:100]!r}")
    if len(ids) > 1:
        more = ", ..." if len(ids) > 10 else ""
        raise Ambiguous(
            f"trace id prefix {trace_id.strip()[:100]!r} is ambiguous: it matches "
            + ", ".join(ids[:10])
            + more,
            ids[:10],
        )
    return str(ids[0])


def _epoch(ts: datetime) -> int:
    return int((ts - datetime(1970, 1, 1)).total_seconds())


def data_span(
    store: Store, table: str = "requests", where: str = "true", params: list[Any] | None = None
) -> tuple[datetime | None, datetime | None]:
    """The first and last ``ts`` of ``table``'s rows (``where``): the requests, or, for
    ``rollup_stats``, the first rollup period and the last one's start."""
    if table == "rollup_stats":
        return _rollup_span(store, where, params or [])
    rows = store.query(
        f"SELECT min(ts) AS a, max(ts) AS b FROM {table} WHERE {where}", params or []
    )
    return rows[0]["a"], rows[0]["b"]


def _rollup_span(
    store: Store, where: str, params: list[Any]
) -> tuple[datetime | None, datetime | None]:
    """The rollups' first period: the first minute row's, unless hour (day) rows begin in an
    earlier hour (day), whose minutes (hours) are gone (retention). An hour or day row's ts is
    its period's start, earlier than the first request in it: the minute rows say when in
    the hour the data begins."""
    first: datetime | None = None
    last: datetime | None = None
    for r in store.query(
        f"SELECT res, min(ts) AS a, max(ts) AS b FROM rollup_stats WHERE {where} "
        "GROUP BY res ORDER BY res",
        params,
    ):
        if first is None or r["a"] < _floor(first, int(r["res"])):
            first = r["a"]
        last = r["b"] if last is None else max(last, r["b"])
    return first, last


def _bounds(store: Store, w: Window, table: str = "requests") -> tuple[datetime, datetime, int]:
    """The charts' time axis: the window, but starting at its first request (a service that
    started ten minutes ago gets ten minutes of fine buckets, not one point in an hour);
    ``table``: requests, or rollup_stats when rollups answer. The first request is looked
    for from the minute the window starts in, to the minute: rollups know which minutes had
    requests, not when in them, and the axis is the same whichever answers."""
    first = last = None
    if w.since is None:
        first, last = data_span(store, table)
        if last is not None:
            last = last + timedelta(seconds=1)
    start, end = w.bounds(first, last)
    if w.start is not None:
        a = data_span(store, table, "ts >= ?", [_floor(w.start, 60)])[0]
        if a is not None:
            start = max(start, _floor(a, 60))
    return start, end, step_seconds(start, end)


def _axis(start: datetime, end: datetime, step: int) -> list[int]:
    a = _epoch(start) // step * step
    b = _epoch(end)
    return list(range(a, b + 1, step))


def _bucket(step: int, shift_s: int = 0) -> str:
    """SQL for the bucket start (unix seconds) of ``ts``, optionally shifted forward."""
    return f"(epoch_us(ts) // {step * 1_000_000}) * {step} + {shift_s}"


def _floor(t: datetime, res: int) -> datetime:
    """``t`` rounded down to a multiple of ``res`` seconds (a rollup period's start)."""
    return datetime(1970, 1, 1) + timedelta(seconds=_epoch(t) // res * res)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def check_endpoint(store: Store, endpoint: str) -> None:
    # a known endpoint stops at its first row; the list is read for an unknown one only
    if store.query("SELECT 1 AS x FROM requests WHERE endpoint = ? LIMIT 1", [endpoint]):
        return
    known = store.endpoints()
    if endpoint in known:
        return
    if not known:
        raise NotFound(f"unknown endpoint {endpoint!r}: no requests have been ingested yet")
    raise NotFound(f"unknown endpoint {endpoint!r}{did_you_mean(endpoint, known)}")


# ---------------------------------------------------------------------------------- overview


def endpoint_table(store: Store, w: Window) -> list[dict[str, Any]]:
    """store.top per endpoint, with each endpoint's share of all request time."""
    return _endpoint_table(store, w)[0]


def _endpoint_table(
    store: Store, w: Window, percentiles_for: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """endpoint_table, and what answered it (store.top_answered's source); with
    ``percentiles_for``, the percentiles of that endpoint's row only (the others: None)."""
    rows, answered = store.top_answered(since=w.since, only=w.only, percentiles_for=percentiles_for)
    total = sum(float(r["total_ms"] or 0) for r in rows) or 1.0
    for r in rows:
        r["time_share"] = float(r["total_ms"] or 0) / total
    return rows, answered


def _rollup_res(answered: dict[str, Any], step: int) -> int | None:
    """The rollup resolution the charts read when rollups answered the table and the chart
    step is whole minutes (hours when it allows), else None: raw rows."""
    if answered["source"] != "rollups" or step % rollups.MINUTE:
        return None
    return rollups.HOUR if step % rollups.HOUR == 0 else rollups.MINUTE


def _rollup_percentiles(
    store: Store,
    res: int,
    step: int,
    where: str,
    params: list[Any],
    endpoints: list[str],
    periods: list[int],
) -> list[dict[str, Any]]:
    """Per chart bucket ``b`` (of ``periods``) and endpoint (of ``endpoints``): count and
    p50/p95/p99 from the rollups of resolution ``res`` (rows filtered by ``where``); the
    histogram rows summed by numpy (rollups.coded_hist_rows), not by a GROUP BY of ~200,000
    (bucket, endpoint, histogram bucket) groups."""
    src = "(SELECT *, {b} AS b FROM {t} WHERE res = {res})"
    by = ("b", "endpoint")
    hist_src = src.format(b=_bucket(step), t="rollup_hist", res=int(res))
    stats_sql = rollups.top_sql(
        src.format(b=_bucket(step), t="rollup_stats", res=int(res)), hist_src, by, where
    )[0]
    stats = store.query(stats_sql, params)
    coded = store.query_arrow(
        *rollups.coded_hist_query(hist_src, where, params, list(endpoints), period=True)
    )
    hist = rollups.coded_hist_rows(coded, list(endpoints), periods)
    return rollups.top_rows(stats, hist, by, step / 60)


def _chart_axis(
    store: Store, w: Window, answered: dict[str, Any]
) -> tuple[datetime, datetime, int, int | None]:
    """The charts' axis and the rollup resolution they read (None: raw rows): the axis of
    the rollups when they answered the table and its step is whole minutes."""
    if answered["source"] == "rollups":
        start, end, step = _bounds(store, w, "rollup_stats")
        res = _rollup_res(answered, step)
        if res is not None:
            return start, end, step, res
    start, end, step = _bounds(store, w)
    return start, end, step, None


def overview(store: Store, w: Window) -> dict[str, Any]:
    rows, answered = _endpoint_table(store, w)
    start, end, step, res = _chart_axis(store, w, answered)
    x = _axis(start, end, step)
    index = {t: i for i, t in enumerate(x)}
    top = [r["endpoint"] for r in rows[:TOP_SERIES]]

    only, only_params = only_where(w.only)  # the fleet filters (host, service)
    p95: dict[str, list[float | None]] = {e: [None] * len(x) for e in top}
    if top and res is not None:
        for r in _rollup_percentiles(
            store,
            res,
            step,
            # IN, not list_contains: ClickHouse prunes granules by it (its sort key), not by has()
            f"ts >= ? AND ts < ? AND endpoint IN ({', '.join('?' * len(top))}) AND {only}",
            [_floor(start, res), end, *top, *only_params],
            top,
            x,
        ):
            i = index.get(r["b"])
            if i is not None:
                p95[r["endpoint"]][i] = _clean(r["p95_ms"])
    elif top:
        for r in store.query(
            f"""SELECT {_bucket(step)} AS b, endpoint,
                quantile_cont(duration_ms, 0.95) AS p95
            FROM requests WHERE ts >= ? AND ts < ? AND list_contains(?, endpoint) AND {only}
            GROUP BY ALL""",
            [start, end, top, *only_params],
        ):
            i = index.get(r["b"])
            if i is not None:
                p95[r["endpoint"]][i] = _clean(r["p95"])

    def counts(shift: timedelta) -> dict[str, list[int]]:
        out = {k: [0] * len(x) for k in ("requests", "errors", *(f"over_{t}" for t in SLOW_MS))}
        b = _bucket(step, int(shift.total_seconds()))
        if res is not None:  # rollups count requests over each threshold exactly
            slow = ", ".join(f"sum(over_{t}) AS over_{t}" for t in SLOW_MS)
            sql = f"""SELECT {b} AS b, sum(requests) AS requests, sum(errors) AS errors, {slow}
                FROM rollup_stats WHERE res = {int(res)} AND ts >= ? AND ts < ? AND {only}
                GROUP BY 1"""
            params = [_floor(start, res) - shift, end - shift, *only_params]
        else:
            slow = ", ".join(
                f"count(*) FILTER (WHERE duration_ms > {t}) AS over_{t}" for t in SLOW_MS
            )
            sql = f"""SELECT {b} AS b, count(*) AS requests,
                count(*) FILTER (WHERE status >= 500 OR error IS NOT NULL) AS errors, {slow}
                FROM requests WHERE ts >= ? AND ts < ? AND {only} GROUP BY 1"""
            params = [start - shift, end - shift, *only_params]
        for r in store.query(sql, params):
            i = index.get(r["b"])
            if i is not None:
                for k in out:
                    out[k][i] = int(r[k] or 0)
        return out

    now = counts(timedelta(0))
    before = counts(WEEK)
    slow_totals = [
        {
            "threshold_ms": t,
            "now": sum(now[f"over_{t}"]),
            "week_ago": sum(before[f"over_{t}"]),
        }
        for t in SLOW_MS
    ]
    return {
        "window": {"since": w.label, "start": _epoch(start), "end": _epoch(end), "step": step},
        "source": {**answered, "charts": "raw" if res is None else "rollups"},
        "totals": {
            "requests": sum(int(r["count"]) for r in rows),
            "endpoints": len(rows),
            "errors": sum(now["errors"]),
        },
        "endpoints": rows,
        "p95": {"x": x, "series": [{"endpoint": e, "values": p95[e]} for e in top]},
        "throughput": {"x": x, "requests": now["requests"], "errors": now["errors"]},
        "slow": {
            "x": x,
            "thresholds": list(SLOW_MS),
            "now": {str(t): now[f"over_{t}"] for t in SLOW_MS},
            "week_ago": {str(t): before[f"over_{t}"] for t in SLOW_MS},
            "totals": slow_totals,
        },
    }


# ---------------------------------------------------------------------------------- endpoint


def _where(w: Window, endpoint: str, alias: str = "", calls: bool = False) -> tuple[str, list[Any]]:
    """The endpoint's rows of the window and the fleet filters, of requests or (``calls``) of
    calls: those carry no process host, so theirs are the calls of the requests kept."""
    p = f"{alias}." if alias else ""
    cond = f"{p}endpoint = ?"
    params: list[Any] = [endpoint]
    if w.start is not None:
        cond, params = f"{cond} AND {p}ts >= ?", [*params, w.start]
    if w.only:
        only, only_params = only_where(w.only)
        if calls:
            only = f"{p}trace_id IN (SELECT trace_id FROM requests WHERE endpoint = ? AND {only})"
            only_params = [endpoint, *only_params]
        else:
            only = only_where(w.only, alias)[0]
        cond, params = f"{cond} AND {only}", [*params, *only_params]
    return cond, params


def endpoint_detail(store: Store, w: Window, endpoint: str) -> dict[str, Any]:
    check_endpoint(store, endpoint)
    table, answered = _endpoint_table(store, w, percentiles_for=endpoint)
    summary = next((r for r in table if r["endpoint"] == endpoint), None)
    start, end, step, res = _chart_axis(store, w, answered)
    x = _axis(start, end, step)
    index = {t: i for i, t in enumerate(x)}
    series: dict[str, list[Any]] = {k: [None] * len(x) for k in ("p50", "p95", "p99", "count")}
    only, only_params = only_where(w.only)  # the fleet filters (host, service)
    if res is not None:
        for r in _rollup_percentiles(
            store,
            res,
            step,
            f"endpoint = ? AND ts >= ? AND ts < ? AND {only}",
            [endpoint, _floor(start, res), end, *only_params],
            [endpoint],
            x,
        ):
            i = index.get(r["b"])
            if i is not None:
                for p in ("p50", "p95", "p99"):
                    series[p][i] = _clean(r[f"{p}_ms"])
                series["count"][i] = int(r["count"])
    for r in (
        []
        if res is not None
        else store.query(
            f"""SELECT {_bucket(step)} AS b, count(*) AS count,
            quantile_cont(duration_ms, [0.5, 0.95, 0.99]) AS q
        FROM requests WHERE endpoint = ? AND ts >= ? AND ts < ? AND {only} GROUP BY 1""",
            [endpoint, start, end, *only_params],
        )
    ):
        i = index.get(r["b"])
        if i is None:
            continue
        q = r["q"] or [None, None, None]
        series["p50"][i], series["p95"][i], series["p99"][i] = (_clean(v) for v in q)
        series["count"][i] = int(r["count"])

    where, params = _where(w, endpoint)

    def bin_of(v: str) -> str:
        return f"floor(log10(greatest({v}, 0.001)) * {HIST_PER_DECADE})::INT"

    if answered["source"] == "rollups":  # the rollups' buckets, each binned by its value
        spans = rollups.plan(w.start or datetime(1970, 1, 1), end + timedelta(minutes=1))
        cond, span_params = rollups.span_where(spans)
        value = f"2 * pow({rollups.GAMMA}, bucket) / {rollups.GAMMA + 1} / 1000"
        hist_sql = f"""SELECT {bin_of(value)} AS k, sum(requests) AS n
            FROM rollup_hist WHERE endpoint = ? AND {cond} AND {only} GROUP BY 1 ORDER BY 1"""
        hist_params: list[Any] = [endpoint, *span_params, *only_params]
    else:
        hist_sql = f"""SELECT {bin_of("duration_ms")} AS k, count(*) AS n
            FROM requests WHERE {where} AND duration_ms IS NOT NULL GROUP BY 1 ORDER BY 1"""
        hist_params = params
    hist = [
        {
            "lo_ms": 10 ** (r["k"] / HIST_PER_DECADE),
            "hi_ms": 10 ** ((r["k"] + 1) / HIST_PER_DECADE),
            "count": int(r["n"]),
        }
        for r in store.query(hist_sql, hist_params)
    ]
    requests = int(summary["count"]) if summary else 0
    call_where, call_params = _where(w, endpoint, "c", calls=True)
    fps = store.query(
        f"""SELECT c.fingerprint_id, any_value(c.kind) AS kind, any_value(f.text) AS statement,
            count(*) AS calls, count(DISTINCT c.trace_id) AS requests,
            sum(c.duration_ms) AS total_ms, quantile_cont(c.duration_ms, 0.95) AS p95_ms,
            avg(c.rows) AS avg_rows
        FROM calls c LEFT JOIN fingerprints f ON f.id = c.fingerprint_id
        WHERE {call_where} AND c.fingerprint_id IS NOT NULL
        GROUP BY 1 ORDER BY total_ms DESC NULLS LAST LIMIT 15""",
        call_params,
    )
    call_where, call_params = _where(w, endpoint, calls=True)
    for r in fps:
        r["fingerprint_id"] = str(r["fingerprint_id"])  # 63-bit: beyond JS numbers
        r["calls_per_request"] = r["calls"] / requests if requests else None
    hosts = store.query(
        f"""SELECT coalesce(host, '?') AS host, count(*) AS calls,
            sum(duration_ms) AS total_ms, quantile_cont(duration_ms, 0.95) AS p95_ms,
            count(*) FILTER (WHERE status >= 500 OR error IS NOT NULL) AS errors
        FROM calls WHERE {call_where} AND kind = 'http'
        GROUP BY 1 ORDER BY total_ms DESC LIMIT 15""",
        call_params,
    )

    def who(col: str) -> list[dict[str, Any]]:
        return store.query(
            f"""SELECT "{col}" AS name, count(*) AS count, sum(duration_ms) AS total_ms,
                quantile_cont(duration_ms, 0.95) AS p95_ms
            FROM requests WHERE {where} AND "{col}" IS NOT NULL
            GROUP BY 1 ORDER BY total_ms DESC LIMIT 10""",
            params,
        )

    return {
        "endpoint": endpoint,
        "window": {"since": w.label, "start": _epoch(start), "end": _epoch(end), "step": step},
        "source": {**answered, "charts": "raw" if res is None else "rollups"},
        "summary": summary,
        "percentiles": {"x": x, **series},
        "histogram": hist,
        "fingerprints": fps,
        "hosts": hosts,
        "slowest": store.traces(endpoint=endpoint, since=w.since, slowest=20, only=w.only),
        "users": who("user"),
        "tenants": who("tenant"),
    }
