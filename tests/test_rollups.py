"""Rollups (store.rollups, store.duckdb_rollups) on real ingested spool data in a real DuckDB
store: percentiles within 2 % of the exact ones (skewed and bimodal latencies), rows of many
batches, minutes and hours merged, compaction changing no figure, retention by whole days, and
rollups written once when a segment is ingested again."""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import store_engines
from perfsleuth.server import queries
from perfsleuth.server.window import window
from perfsleuth.store import duckdb_rollups, rollups, schema
from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.store.records import Batch
from perfsleuth.store.tables import Tables
from perfsleuth.wire import HEADER
from perfsleuth.wire.segment import encode_record
from spoolwrite import SegmentWriter, call

HOUR_NS = 3600 * 10**9
DAY_NS = 24 * HOUR_NS


@pytest.fixture
def data_dir(tmp_path: Any) -> str:
    return str(tmp_path / "data")


@pytest.fixture
def store(data_dir: str) -> Iterator[DuckDBStore]:
    s = DuckDBStore(data_dir)
    yield s
    s.close()


@pytest.fixture
def from_rollups(monkeypatch: pytest.MonkeyPatch) -> None:
    """top() reads rollups whatever the number of requests."""
    monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)


def skewed(rng: random.Random) -> float:
    return rng.lognormvariate(2.5, 1.5)


def bimodal(rng: random.Random) -> float:
    # 90 % fast, 10 % ~100x slower: p95 and p99 fall in the slow mode, p50 in the fast one
    return rng.lognormvariate(1.5, 0.3) if rng.random() < 0.9 else rng.lognormvariate(6.2, 0.2)


def write(
    data_dir: str,
    rng: random.Random,
    n: int,
    *,
    endpoints: dict[str, Any],
    span_ns: int,
    end_ns: int,
    host: str = "web-1",
    service: str = "shop",
    seq: int = 1,
) -> list[dict[str, Any]]:
    """n requests per endpoint, spread over [end - span, end), in one closed segment."""
    w = SegmentWriter(data_dir, host=host, service=service, seq=seq, header=False)
    header = {"v": 1, "host": host, "pid": 4242, "service": service, "agent": "test"}
    w.write(encode_record(HEADER, header))
    specs = []
    for endpoint, dist in endpoints.items():
        for i in range(n):
            specs.append(
                {
                    "endpoint": endpoint,
                    "ts_ns": end_ns - 1 - rng.randrange(span_ns),
                    "dur_ms": round(dist(rng), 6),
                    "status": 500 if i % 40 == 0 else 200,
                    "calls": [call("db", "SELECT 1", dur_ms=0.5)] * (i % 3),
                }
            )
    sent = w.write_requests(specs)
    w.close()
    return sent


def close_to(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def compare(raw: list[dict[str, Any]], roll: list[dict[str, Any]], by: tuple[str, ...]) -> None:
    """Rollup rows against exact rows: the same groups and counts, percentiles within 2 %."""
    exact = {tuple(r[b] for b in by): r for r in raw}
    assert {tuple(r[b] for b in by) for r in roll} == set(exact)
    for r in roll:
        e = exact[tuple(r[b] for b in by)]
        assert r["count"] == e["count"]
        for k in ("p50_ms", "p95_ms", "p99_ms"):
            assert close_to(r[k], e[k], 0.02), (r[by[0]], k, r[k], e[k])
        assert r["max_ms"] == pytest.approx(e["max_ms"])
        assert r["error_rate"] == pytest.approx(e["error_rate"])
        assert r["db_calls_per_request"] == pytest.approx(e["db_calls_per_request"])
        assert r["db_share"] == pytest.approx(e["db_share"])
        assert r["total_ms"] == pytest.approx(e["total_ms"])
        # rollups know minutes: over hours of requests, the rate within 1 %
        assert close_to(r["rate_per_min"], e["rate_per_min"], 0.01), (r["rate_per_min"], e)


def test_percentiles_from_rollups_are_within_2_percent_of_exact(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(11)
    now = time.time_ns()
    endpoints = {"GET /skewed": skewed, "GET /bimodal": bimodal}
    # over 30 hours: minutes, hours and a day boundary; two hosts of two services
    write(data_dir, rng, 3000, endpoints=endpoints, span_ns=30 * HOUR_NS, end_ns=now)
    write(
        data_dir,
        rng,
        1000,
        endpoints=endpoints,
        span_ns=30 * HOUR_NS,
        end_ns=now,
        host="web-2",
        service="billing",
        seq=2,
    )
    store.ingest()
    for by in (("endpoint",), ("service", "host", "endpoint")):
        raw, answered = store.top_answered(by=by)
        assert answered["source"] == "raw"  # few requests: exact figures
        monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
        roll, answered = store.top_answered(by=by)
        monkeypatch.undo()
        assert answered["source"] == "rollups" and answered["resolution_s"] == 60
        compare(raw, roll, by)
    # the bimodal endpoint's p95 is in its slow mode, its p50 in the fast one
    bi = next(r for r in roll if r["endpoint"] == "GET /bimodal")
    assert bi["p50_ms"] < 10 < 300 < bi["p95_ms"]


def test_rollups_of_many_batches_merge_and_compaction_changes_no_figure(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three ingest runs over the same minutes give three rows per key; sums over minutes,
    hours and the day agree, and so do the figures before and after compaction."""
    # no compaction while ingesting: each run leaves its own rows
    monkeypatch.setattr(DuckDBStore, "compact_rollups", lambda self, **kw: [])
    rng = random.Random(5)
    end = time.time_ns() - 2 * DAY_NS  # a finished day
    end -= end % DAY_NS - 20 * HOUR_NS  # 20:00 that day
    for seq in (1, 2, 3):
        write(
            data_dir,
            rng,
            400,
            endpoints={"GET /a": skewed},
            span_ns=3 * HOUR_NS,
            end_ns=end,
            seq=seq,
        )
        store.ingest()
    monkeypatch.undo()
    keys = "res, ts, service, host, kind, endpoint, bucket"
    rows, distinct = store.sql(f"SELECT count(*), count(DISTINCT ({keys})) FROM rollup_hist")[1][0]
    assert rows > distinct  # rows of the same key from different batches
    by_res = dict(store.sql("SELECT res, sum(requests) FROM rollup_stats GROUP BY 1")[1])
    assert by_res == {60: 1200, 3600: 1200, 86400: 1200}
    hist = store.sql("SELECT res, sum(requests) FROM rollup_hist GROUP BY 1")[1]
    assert dict(hist) == by_res
    raw, _ = store.top_answered()
    monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
    before, _ = store.top_answered()
    compare(raw, before, ("endpoint",))

    assert store.compact_rollups(final=True)  # the day is over: compacted
    rows, distinct = store.sql(f"SELECT count(*), count(DISTINCT ({keys})) FROM rollup_hist")[1][0]
    assert rows == distinct
    after, _ = store.top_answered()
    for a, b in zip(before, after, strict=True):
        for k, v in a.items():
            assert b[k] == pytest.approx(v), k
    assert store.compact_rollups(final=True) == []  # nothing changed since


def test_plan_reads_whole_days_and_hours_and_the_minutes_around_them() -> None:
    start = datetime(2026, 11, 1, 22, 30, 15)
    end = datetime(2026, 11, 4, 1, 10)
    spans = rollups.plan(start, end)
    got = sorted((s.res, s.lo, s.hi) for s in spans)
    assert got == [
        (60, datetime(2026, 11, 1, 22, 30), datetime(2026, 11, 1, 23, 0)),
        (60, datetime(2026, 11, 4, 1, 0), datetime(2026, 11, 4, 1, 10)),
        (3600, datetime(2026, 11, 1, 23, 0), datetime(2026, 11, 2, 0, 0)),
        (3600, datetime(2026, 11, 4, 0, 0), datetime(2026, 11, 4, 1, 0)),
        (86400, datetime(2026, 11, 2), datetime(2026, 11, 4)),
    ]
    # the spans tile the range: no minute read twice or missed
    assert sum(((s.hi - s.lo) for s in spans), timedelta()) == end - datetime(2026, 11, 1, 22, 30)


def test_retention_drops_raw_days_after_7_and_rollup_days_after_90(
    data_dir: str, store: DuckDBStore
) -> None:
    rng = random.Random(3)
    now = time.time_ns() - DAY_NS
    now -= now % DAY_NS - 20 * HOUR_NS  # 20:00 yesterday: each age's hour lies in one day
    w = SegmentWriter(data_dir)
    ages = (120, 50, 10, 3, 0)
    first_kept = now
    for age in ages:
        for _ in range(5):
            ts = now - age * DAY_NS - rng.randrange(HOUR_NS)
            w.request("GET /a", ts_ns=ts, dur_ms=5.0)
            if age == 50:
                first_kept = min(first_kept, ts)
    w.close()
    store.ingest()
    dropped = store.apply_retention(7)
    assert len(dropped) == 3  # raw rows: 120, 50 and 10 days old
    _, tables = store.sql("SELECT table_name FROM duckdb_tables()")
    days = {}
    for (name,) in tables:
        parsed = schema.parse_day_table(name)
        if parsed:
            days.setdefault(parsed[0], set()).add(parsed[1])
    assert len(days["requests"]) == 2
    assert len(days["rollup_stats"]) == len(days["rollup_hist"]) == 4  # 120 days old: gone
    assert store.sql("SELECT count(*) FROM requests")[1] == [(10,)]
    # minute rows go with the raw rows; hours and days stay for 90 days
    by_res = dict(store.sql("SELECT res, sum(requests) FROM rollup_stats GROUP BY 1")[1])
    assert by_res == {60: 10, 3600: 20, 86400: 20}
    assert dict(store.sql("SELECT res, sum(requests) FROM rollup_hist GROUP BY 1")[1]) == by_res
    # all data: the rollups answer, 50 and 10 days ago included, 120 days ago not
    rows, answered = store.top_answered()
    assert answered["source"] == "rollups" and rows[0]["count"] == 20
    # the charts begin in the hour of the first request kept (its minutes are gone), not at
    # the start of its day
    ov = queries.overview(store, window("all"))
    assert ov["source"]["charts"] == "rollups"
    assert ov["window"]["start"] == first_kept // 10**9 // 3600 * 3600
    assert sum(ov["throughput"]["requests"]) == 20
    # a window the raw rows cover is answered by them
    rows, answered = store.top_answered(since=timedelta(days=5))
    assert answered["source"] == "raw" and rows[0]["count"] == 10


def test_rollups_are_written_once_when_a_segment_is_ingested_again(
    data_dir: str, store: DuckDBStore
) -> None:
    rng = random.Random(8)
    write(data_dir, rng, 300, endpoints={"GET /a": skewed}, span_ns=HOUR_NS, end_ns=time.time_ns())
    spool = os.path.join(data_dir, "spool")
    (seg,) = [f for f in os.listdir(spool) if f.endswith(".seg")]
    kept = os.path.join(data_dir, "kept.seg")
    shutil.copy(os.path.join(spool, seg), kept)
    store.ingest()

    def rolled() -> dict[int, int]:
        return dict(store.sql("SELECT res, sum(requests) FROM rollup_stats GROUP BY 1")[1])

    assert rolled() == {60: 300, 3600: 300, 86400: 300}
    store.ingest()  # nothing new
    # the same segment back under another name (a copy restored from a backup)
    host, pid, ns, n = seg[: -len(".seg")].rsplit("-", 3)
    shutil.copy(kept, os.path.join(spool, f"{host}-{pid}-{int(ns) + 1}-{n}.seg"))
    store.ingest()
    assert store.sql("SELECT count(*) FROM requests")[1] == [(300,)]
    assert rolled() == {60: 300, 3600: 300, 86400: 300}


def test_overview_and_endpoint_pages_say_rollups_answered(
    data_dir: str, store: DuckDBStore, from_rollups: None
) -> None:
    rng = random.Random(4)
    write(
        data_dir,
        rng,
        500,
        endpoints={"GET /a": skewed, "GET /b": bimodal},
        span_ns=20 * HOUR_NS,
        end_ns=time.time_ns(),
    )
    store.ingest()
    w = window("24h")
    ov = queries.overview(store, w)
    assert ov["source"]["source"] == "rollups" and ov["source"]["charts"] == "rollups"
    assert ov["window"]["step"] % 60 == 0
    assert sum(ov["throughput"]["requests"]) == ov["totals"]["requests"] == 1000
    assert any(v is not None for s in ov["p95"]["series"] for v in s["values"])
    ep = queries.endpoint_detail(store, w, "GET /b")
    assert ep["source"]["source"] == "rollups"
    assert sum(c or 0 for c in ep["percentiles"]["count"]) == 500
    assert sum(b["count"] for b in ep["histogram"]) == 500


def test_a_failed_commit_leaves_no_rollup_day_behind_that_later_batches_count_on(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that fails rolls back the day's new rollup tables; a later commit (here one
    with no requests) must not take the day as made, or every batch of it fails after."""
    rng = random.Random(5)
    write(data_dir, rng, 50, endpoints={"GET /a": skewed}, span_ns=HOUR_NS, end_ns=time.time_ns())
    real_commit = store._commit

    def fails_once() -> None:
        monkeypatch.setattr(store, "_commit", real_commit)
        raise OSError("commit refused")

    monkeypatch.setattr(store, "_commit", fails_once)
    with pytest.raises(OSError, match="commit refused"):
        store.ingest()
    store.insert_tables(Batch(), Tables())  # a commit of nothing (an OTLP payload of no rows)
    store.ingest()
    assert store.sql("SELECT sum(requests) FROM rollup_stats WHERE res = 60")[1] == [(50,)]


def test_a_failed_compaction_does_not_fail_the_commit_that_stored_the_rows(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows and offsets are committed before compaction runs: a rebuild that fails (a
    full disk) is counted and logged, and the commit and the ingest run succeed."""
    rng = random.Random(6)
    now = time.time_ns()
    # two segments, committed apart: a day of one batch's rows is compact as made
    for seq in (1, 2):
        write(data_dir, rng, 25, endpoints={"GET /a": skewed}, span_ns=HOUR_NS, end_ns=now, seq=seq)

    def full(d: Any, where: str = "true") -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_rebuild_day", full)
    monkeypatch.setattr(duckdb_rollups, "COMPACT_MIN_ROWS", 1)
    monkeypatch.setattr(store, "batch_requests", 25)
    monkeypatch.setattr(store, "group_requests", 25)  # a commit per batch: the second grows the day
    report = store.ingest()
    assert report.requests == 50
    assert store.sql("SELECT count(*) FROM requests")[1] == [(50,)]
    assert store.compactions_failed >= 1
    monkeypatch.undo()
    assert store.compact_rollups(force=True)  # once there is room, the day is compacted


def narrow(rng: random.Random) -> float:
    # dense around 60 ms: a bucket's exact p95 and its rollup p95 differ by the 1 % sketch
    return rng.lognormvariate(4.1, 0.25)


def by_bucket(x: list[int], values: list[Any]) -> dict[int, Any]:
    return {t: v for t, v in zip(x, values, strict=True) if v}


def test_chart_series_from_rollups_match_the_raw_ones_with_fleet_filters(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overview's and endpoint page's charts for one host or service: from rollups (forced)
    against from raw rows, bucket by bucket: counts exact, p95 within 2 %."""
    rng = random.Random(19)
    now = time.time_ns()
    endpoints = {"GET /a": narrow, "GET /b": narrow}
    write(data_dir, rng, 6000, endpoints=endpoints, span_ns=2 * HOUR_NS, end_ns=now)
    write(
        data_dir,
        rng,
        4000,
        endpoints=endpoints,
        span_ns=3 * HOUR_NS,
        end_ns=now,
        host="web-2",
        service="billing",
        seq=2,
    )
    store.ingest()
    for w, n in (
        (window("6h", host="web-2"), 4000),
        (window("6h", service="shop"), 6000),
        (window("all", host="web-1"), 6000),
    ):
        raw_ov = queries.overview(store, w)
        raw_ep = queries.endpoint_detail(store, w, "GET /a")
        assert raw_ov["source"]["charts"] == "raw"
        monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
        ov = queries.overview(store, w)
        ep = queries.endpoint_detail(store, w, "GET /a")
        monkeypatch.undo()
        assert ov["source"]["charts"] == ep["source"]["charts"] == "rollups"
        assert ov["totals"]["requests"] == raw_ov["totals"]["requests"] == 2 * n
        assert ov["window"]["step"] == raw_ov["window"]["step"], (ov["window"], raw_ov["window"])
        for k in ("requests", "errors"):
            assert by_bucket(ov["throughput"]["x"], ov["throughput"][k]) == by_bucket(
                raw_ov["throughput"]["x"], raw_ov["throughput"][k]
            ), k
        assert sum(ov["throughput"]["requests"]) == 2 * n
        for s, r in zip(ov["p95"]["series"], raw_ov["p95"]["series"], strict=True):
            assert s["endpoint"] == r["endpoint"]
            got = by_bucket(ov["p95"]["x"], s["values"])
            want = by_bucket(raw_ov["p95"]["x"], r["values"])
            assert got.keys() == want.keys()
            for t, v in want.items():
                assert close_to(got[t], v, 0.02), (s["endpoint"], t, got[t], v)
        x, raw_x = ep["percentiles"]["x"], raw_ep["percentiles"]["x"]
        assert by_bucket(x, ep["percentiles"]["count"]) == by_bucket(
            raw_x, raw_ep["percentiles"]["count"]
        )
        assert sum(c or 0 for c in ep["percentiles"]["count"]) == n
        for p in ("p50", "p95"):
            got = by_bucket(x, ep["percentiles"][p])
            want = by_bucket(raw_x, raw_ep["percentiles"][p])
            assert got.keys() == want.keys()
            for t, v in want.items():
                assert close_to(got[t], v, 0.02), (p, t, got[t], v)
        assert sum(b["count"] for b in ep["histogram"]) == n
        assert sum(b["count"] for b in raw_ep["histogram"]) == n


def test_a_day_of_one_batch_is_not_rebuilt_and_a_second_batch_compacts_it(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollups_of groups a batch's rows by key: the day tables a commit makes hold no two rows
    of one key, and are not rebuilt (the rebuild cost ~0.15 s per 50k requests and merged
    nothing). Rows of a second batch on the same day are compacted as before."""
    rng = random.Random(8)
    now = time.time_ns()
    write(data_dir, rng, 40, endpoints={"GET /a": skewed}, span_ns=HOUR_NS // 60, end_ns=now)
    rebuilt: list[Any] = []
    real = store._rebuild_day
    monkeypatch.setattr(
        store, "_rebuild_day", lambda d, where="true": rebuilt.append(d) or real(d, where)
    )
    monkeypatch.setattr(duckdb_rollups, "COMPACT_MIN_ROWS", 1)
    assert store.ingest().requests == 40
    assert rebuilt == []
    keys = "ts, res, service, host, kind, endpoint"
    dup = (
        f"SELECT count(*) FROM (SELECT {keys}, bucket FROM rollup_hist"
        " GROUP BY ALL HAVING count(*) > 1)"
    )
    assert store.sql(dup)[1] == [(0,)]
    write(data_dir, rng, 40, endpoints={"GET /a": skewed}, span_ns=HOUR_NS // 60, end_ns=now, seq=2)
    assert store.ingest().requests == 40
    assert len(rebuilt) == 1  # two batches' rows for one day: compacted
    assert store.sql(dup)[1] == [(0,)]
    assert store.sql("SELECT sum(requests) FROM rollup_stats WHERE res = 60")[1] == [(80,)]


def test_a_backlog_of_later_minutes_is_not_rebuilt_and_a_round_within_stored_minutes_is(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of minutes after those stored (a backlog drained in rounds) adds rows that
    merge with none but its hour's and day's: the day is not rebuilt for it (each rebuild
    rewrote the whole day: 0.1 / 0.2 / 0.3 s in benchmarks/ingest.py's rounds, merging next
    to nothing). A batch within minutes stored (a server's rounds in one minute) is compacted
    as before. Before, the second batch's rebuild came first."""
    rng = random.Random(9)
    end = time.time_ns() - 2 * DAY_NS
    end -= end % DAY_NS - 20 * HOUR_NS  # 20:00 on a past day, made today: no final compaction
    today = datetime.fromtimestamp(end / 1e9, UTC).replace(tzinfo=None)
    monkeypatch.setattr(duckdb_rollups, "utcnow", lambda: today)
    # the second batch's hour and day rows may merge (272 histogram rows here); with the
    # third's minutes, 753
    monkeypatch.setattr(duckdb_rollups, "COMPACT_MIN_ROWS", 500)
    rebuilt: list[Any] = []
    real = store._rebuild_day
    monkeypatch.setattr(
        store, "_rebuild_day", lambda d, where="true": rebuilt.append(d) or real(d, where)
    )
    twenty_min = HOUR_NS // 3
    for seq, end_ns in ((1, end - 2 * twenty_min), (2, end)):  # 19:00-19:20, then 19:40-20:00
        write(
            data_dir,
            rng,
            200,
            endpoints={"GET /a": skewed},
            span_ns=twenty_min,
            end_ns=end_ns,
            seq=seq,
        )
        assert store.ingest().requests == 200
    assert rebuilt == []
    write(data_dir, rng, 200, endpoints={"GET /a": skewed}, span_ns=twenty_min, end_ns=end, seq=3)
    assert store.ingest().requests == 200  # 19:40-20:00 again
    assert rebuilt == [today.date()]
    keys = "res, ts, service, host, kind, endpoint, bucket"
    rows, distinct = store.sql(f"SELECT count(*), count(DISTINCT ({keys})) FROM rollup_hist")[1][0]
    assert rows == distinct
    by_res = dict(store.sql("SELECT res, sum(requests) FROM rollup_stats GROUP BY 1")[1])
    assert by_res == {60: 600, 3600: 600, 86400: 600}


@pytest.mark.parametrize(
    "engine",
    [
        "duckdb",
        pytest.param(
            "chdb",
            marks=pytest.mark.skipif(
                not store_engines.chdb_available(), reason="chdb is not installed"
            ),
        ),
    ],
)
def test_a_window_starting_before_the_first_rollup_day_is_answered_by_raw_rows(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """Rollups begin later than the raw rows (a store upgraded two days ago: its older days
    have no rollups; made here by dropping them): a 7-day ``top`` (and one over everything)
    reads the raw rows, which hold the whole window, not the two days of rollups; a window
    within the rollup days still reads rollups. Failed before on both engines: rollups
    answered for the shorter window (counts of two or three days of five)."""
    data = str(tmp_path / "data")
    write(
        data,
        random.Random(7),
        300,
        endpoints={"GET /a": skewed},
        span_ns=5 * DAY_NS,
        end_ns=time.time_ns(),
    )
    store = store_engines.open_engine(engine, data)
    try:
        store.ingest()
        store.apply_retention(days=30, rollup_days=2)  # rollups of the last days only
        first = store.query("SELECT min(ts) AS t FROM rollup_stats")[0]["t"]
        raw_first = store.query("SELECT min(ts) AS t FROM requests")[0]["t"]
        assert raw_first.date() < first.date()
        monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
        for since in (timedelta(days=7), None):
            rows, ans = store.top_answered(since=since, by=("endpoint",))
            assert ans["source"] == "raw", since
            assert [r["count"] for r in rows] == [300]
        assert store.top_answered(since=timedelta(hours=12))[1]["source"] == "rollups"
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize(
    "engine",
    [
        "duckdb",
        pytest.param(
            "chdb",
            marks=pytest.mark.skipif(
                not store_engines.chdb_available(), reason="chdb is not installed"
            ),
        ),
    ],
)
def test_a_rollup_window_that_matches_nothing_is_an_empty_table(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """Rollups answer and the filters keep none of their rows (a host no request came from):
    ``top`` is an empty table and the overview has no endpoints, on both engines. Failed
    before on DuckDB (ArrowInvalid, the overview a 500): the histogram statement coded an
    empty list of endpoints as an untyped NULL, a column of Arrow's null type that
    coded_hist_rows could not fill."""
    data = str(tmp_path / "data")
    rng = random.Random(5)
    write(data, rng, 50, endpoints={"GET /a": skewed}, span_ns=HOUR_NS, end_ns=time.time_ns())
    store = store_engines.open_engine(engine, data)
    try:
        store.ingest()
        monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
        rows, ans = store.top_answered(since=timedelta(days=30), by=("endpoint",))
        assert ans["source"] == "rollups" and [r["count"] for r in rows] == [50]
        for since in (timedelta(days=30), None):
            rows, ans = store.top_answered(since=since, only={"host": "no-such-host"})
            assert (rows, ans["source"]) == ([], "rollups"), since
        for w in (window("all", host="no-such-host"), window("7d", service="no-such")):
            page = queries.overview(store, w)
            assert page["source"]["source"] == "rollups"
            assert page["endpoints"] == [], w
    finally:
        store.close()
        store_engines.reset()


def test_numpy_merged_histograms_give_the_histogram_statement_s_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rollups.coded_hist_query + coded_hist_rows (numpy sums by key, and by period and key)
    give the rows of top_sql's histogram statement exactly: the same n and rank buckets per
    group, a NULL key included, a key with one request, and keys without rows left out."""
    import duckdb
    import pyarrow as pa

    rng = random.Random(3)
    rows = []
    for key, n in (("GET /a", 3000), ("GET /b", 1), (None, 40), ("GET /c", 700)):
        for _ in range(n):
            b = rng.choice((0, 60, 120))
            rows.append((key, b, rng.randrange(0, 900), rng.randrange(1, 4)))
    hist = pa.table(
        {
            "endpoint": pa.array([r[0] for r in rows], pa.string()),
            "b": pa.array([r[1] for r in rows], pa.int64()),
            "bucket": pa.array([r[2] for r in rows], pa.int32()),
            "requests": pa.array([r[3] for r in rows], pa.int64()),
        }
    )
    con = duckdb.connect()
    con.register("h", hist)

    def by_sql(by: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
        sql = rollups.top_sql("h", "h", by, "bucket >= 0")[1]
        cur = con.execute(sql)
        cols = [d[0] for d in cur.description or ()]
        out = {}
        for r in cur.fetchall():
            d = dict(zip(cols, r, strict=True))
            out[tuple(d[b] for b in by)] = d
        return out

    keys = ["GET /a", "GET /b", None, "GET /c", "GET /none"]
    periods = [0, 60, 120, 180]
    for many in (False, True):  # keys coded by a CASE, and by a join of VALUES
        monkeypatch.setattr(rollups, "CASE_KEYS", 0 if many else 16)
        sql, params = rollups.coded_hist_query("h", "bucket >= ?", [0], keys)
        t = con.sql(sql, params=params).to_arrow_table()
        got = {(r["endpoint"],): r for r in rollups.coded_hist_rows(t, keys)}
        assert got == by_sql(("endpoint",))
        assert ("GET /none",) not in got
        assert got[("GET /b",)]["n"] == sum(r[3] for r in rows if r[0] == "GET /b")
        sql, params = rollups.coded_hist_query("h", "bucket >= ?", [0], keys, period=True)
        t = con.sql(sql, params=params).to_arrow_table()
        got = {(r["b"], r["endpoint"]): r for r in rollups.coded_hist_rows(t, keys, periods)}
        assert got == by_sql(("b", "endpoint"))
    # no keys (a filter that kept no stats row): a typed column of NULL codes, no groups
    sql, params = rollups.coded_hist_query("h", "bucket >= ?", [0], [])
    t = con.sql(sql, params=params).to_arrow_table()
    assert t.num_rows == len(rows) and rollups.coded_hist_rows(t, []) == []


def _key_rows(n_keys: int, rng: random.Random) -> list[tuple[Any, int, int, int]]:
    """Histogram rows (endpoint, b, bucket, requests) of many keys, sparse buckets: most keys
    a few rows in a few buckets, some one request, one far bucket (a 10-minute task), a NULL
    key."""
    rows: list[tuple[Any, int, int, int]] = []
    for k in range(n_keys):
        name = f"GET /api/v1/items/{k:05d}"
        for _ in range(rng.choice((1, 1, 2, 5, 30))):
            bucket = rng.choice((rng.randrange(0, 40), rng.randrange(300, 500), 1021))
            rows.append((name, rng.choice((0, 60, 120)), bucket, rng.randrange(1, 4)))
    rows += [(None, 60, 7, 2), (None, 0, 900, 1)]
    return rows


@pytest.mark.parametrize(
    ("cells", "passes"), [(0, 8), (1 << 40, 8), (1 << 18, 1000)], ids=["sorted", "dense", "passes"]
)
def test_merged_histograms_of_many_keys_with_sparse_buckets_give_the_statement_s_rows(
    monkeypatch: pytest.MonkeyPatch, cells: int, passes: int
) -> None:
    """merged_buckets gives top_sql's histogram statement's rows exactly, per key and per
    period and key, for 3,002 keys x 1,022 buckets, its cells summed by a sort of the rows,
    in one dense array, and in dense arrays of 256 groups at a time (12 and 47 passes)."""
    import duckdb
    import pyarrow as pa

    monkeypatch.setattr(rollups, "DENSE_CELLS", cells)
    monkeypatch.setattr(rollups, "DENSE_PASSES", passes)
    rows = _key_rows(3000, random.Random(17))
    hist = pa.table(
        {
            "endpoint": pa.array([r[0] for r in rows], pa.string()),
            "b": pa.array([r[1] for r in rows], pa.int64()),
            "bucket": pa.array([r[2] for r in rows], pa.int32()),
            "requests": pa.array([r[3] for r in rows], pa.int64()),
        }
    )
    con = duckdb.connect()
    con.register("h", hist)
    keys = [*sorted({r[0] for r in rows if r[0] is not None})[::-1], None, "GET /none"]
    for by, periods in ((("endpoint",), None), (("b", "endpoint"), [0, 60, 120, 180])):
        cur = con.execute(rollups.top_sql("h", "h", by, "bucket >= 0")[1])
        cols = [d[0] for d in cur.description or ()]
        want = {}
        for r in cur.fetchall():
            d = dict(zip(cols, r, strict=True))
            want[tuple(d[b] for b in by)] = d
        sql, params = rollups.coded_hist_query("h", "true", [], keys, period=periods is not None)
        t = con.sql(sql, params=params).to_arrow_table()
        got = rollups.coded_hist_rows(t, keys, periods)
        assert {tuple(r[b] for b in by): r for r in got} == want
        assert len(got) == len(want)


def test_merging_the_histograms_of_20000_keys_takes_memory_of_their_rows() -> None:
    """coded_hist_rows of 20,000 endpoints, one of them a 10-minute task (bucket ~1,020):
    a few MB traced (numpy's arrays are traced by tracemalloc). Failed before: merged_buckets
    made dense groups x buckets arrays (20,000 x 1,022 float64: 163 MB each)."""
    import tracemalloc

    import numpy as np
    import pyarrow as pa

    n = 20_000
    code = np.arange(n + 1, dtype=np.int64) % n
    bucket = np.full(n + 1, 300, np.int32)
    bucket[-1] = int(rollups.bucket_of(np.array([600_000.0]))[0])
    t = pa.table({"code": code, "bucket": bucket, "requests": np.ones(n + 1, np.int64)})
    keys = [f"GET /items/{i}" for i in range(n)]
    tracemalloc.start()
    try:
        got = rollups.coded_hist_rows(t, keys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got) == n and got[0]["n"] == 2 and got[0]["p99_hi"] == bucket[-1]
    assert peak < 40_000_000, peak


def test_the_slowest_traces_found_in_two_steps_are_the_plain_top_n(
    data_dir: str, store: DuckDBStore
) -> None:
    """traces(slowest=n) first finds the n-th longest duration, then sorts the rows at or
    above it: the same rows, in the same order, as sorting all of them (ties at the n-th
    duration broken by time), and all rows when there are fewer than n."""
    rng = random.Random(9)
    now = time.time_ns()

    def tied(r: random.Random) -> float:
        return r.choice((5.0, 7.0, 9.0))  # many requests share each duration

    write(
        data_dir, rng, 60, endpoints={"GET /t": tied, "GET /s": skewed}, span_ns=HOUR_NS, end_ns=now
    )
    store.ingest()
    for endpoint in ("GET /t", "GET /s"):
        for n in (1, 20, 59, 60, 80):
            plain = store.query(
                "SELECT trace_id FROM requests WHERE endpoint = ? "
                "ORDER BY duration_ms DESC NULLS LAST, ts DESC LIMIT ?",
                [endpoint, n],
            )
            got = store.traces(endpoint=endpoint, since=timedelta(days=1), slowest=n)
            assert [r["trace_id"] for r in got] == [r["trace_id"] for r in plain], (endpoint, n)


def test_the_chart_axis_is_the_same_from_rollups_as_from_raw_rows(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The axis starts at the window's first request, looked for to the minute: rollups know
    which minutes had requests, not when in them. A window starting in the last minute of a
    5-minute bucket, with a request in that minute after its start: the raw rows' axis began
    at that bucket and the rollups' at the next (their first minute row at or after the
    window's start), so the two answers' axes differed (chDB's test saw it, at random)."""
    from perfsleuth.server import window as window_mod
    from perfsleuth.store import duckdb_reader

    bucket = time.time_ns() // 10**9 // 300 * 300 - 7 * 3600  # a 5-minute bucket's start
    start_s = bucket + 4 * 60 + 39  # the window's start: in the bucket's last minute
    now = datetime(1970, 1, 1) + timedelta(seconds=start_s + 6 * 3600)
    for mod in (window_mod, duckdb_rollups, duckdb_reader):
        monkeypatch.setattr(mod, "utcnow", lambda: now)
    w = SegmentWriter(data_dir, host="web-1", service="shop", seq=1, header=False)
    w.write(encode_record(HEADER, {"v": 1, "host": "web-1", "pid": 1, "service": "shop"}))
    at = [-3600, 5, 120, 400, 5 * 3600]  # seconds from the window's start
    w.write_requests([{"endpoint": "GET /a", "ts_ns": (start_s + s) * 10**9} for s in at])
    w.close()
    store.ingest()
    win = window("6h")
    assert win.start == datetime(1970, 1, 1) + timedelta(seconds=start_s)
    raw = queries.overview(store, win)
    monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
    roll = queries.overview(store, win)
    assert (raw["source"]["charts"], roll["source"]["charts"]) == ("raw", "rollups")
    assert roll["throughput"]["x"][0] == raw["throughput"]["x"][0] == bucket
    assert roll["throughput"] == raw["throughput"]
    assert roll["p95"]["x"] == raw["p95"]["x"]
    assert sum(raw["throughput"]["requests"]) == 4
