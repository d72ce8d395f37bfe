"""Rollups on the ClickHouse engine (store.clickhouse_rollups), on chDB: written at ingest,
percentiles within 2 % of exact, the same answers as DuckDB's rollups for ``top`` and the API
pages that read them, written once across a crash and a re-run, retention by partitions, and
the rollup DDL (AggregatingMergeTree, partitions by day and resolution, cluster variants)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import store_engines
from perfsleuth.server import queries
from perfsleuth.server import window as window_mod
from perfsleuth.server.window import window
from perfsleuth.store import duckdb_reader, duckdb_rollups, rollups, schema
from perfsleuth.store.base import StoreError
from perfsleuth.store.clickhouse_rollups import partition_day
from test_rollups import HOUR_NS, bimodal, close_to, compare, narrow, skewed, write

pytestmark = pytest.mark.skipif(
    not store_engines.chdb_available(), reason="the clickhouse extra (chdb) is not installed"
)


@pytest.fixture
def force_rollups(monkeypatch: pytest.MonkeyPatch) -> None:
    """top() reads rollups whatever the number of requests, on both engines."""
    monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)


@contextmanager
def both(tmp_path: Path, fill: Any) -> Iterator[tuple[Any, Any]]:
    """The same spool (``fill(data_dir)``) ingested into DuckDB and into chDB."""
    stores = []
    try:
        for engine in ("duckdb", "chdb"):
            data = str(tmp_path / engine)
            fill(data)
            s = store_engines.open_engine(engine, data)
            stores.append(s)
            s.ingest()
        store_engines.reset()
        yield stores[0], stores[1]
    finally:
        for s in stores:
            s.close()
        store_engines.reset()


def shop(now: int) -> Any:
    def fill(data: str) -> None:
        rng = random.Random(11)  # the same requests in both
        endpoints = {"GET /skewed": skewed, "GET /bimodal": bimodal, "GET /narrow": narrow}
        write(data, rng, 1500, endpoints=endpoints, span_ns=30 * HOUR_NS, end_ns=now)
        write(
            data,
            rng,
            700,
            endpoints=endpoints,
            span_ns=3 * HOUR_NS,
            end_ns=now,
            host="web-2",
            service="billing",
            seq=2,
        )

    return fill


def sums_per_res(store: Any) -> dict[int, int]:
    return {
        int(r["res"]): int(r["n"])
        for r in store.query("SELECT res, sum(requests) AS n FROM rollup_stats GROUP BY res")
    }


def test_top_from_chdb_rollups_is_within_2_percent_and_as_duckdbs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with both(tmp_path, shop(time.time_ns())) as (duck, ch):
        assert sums_per_res(ch) == sums_per_res(duck) == {60: 6600, 3600: 6600, 86400: 6600}
        for by in (("endpoint",), ("service", "host"), ("endpoint", "kind")):
            raw, ans = ch.top_answered(since=timedelta(days=2), by=by)
            assert ans["source"] == "raw"
            monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
            roll, ans = ch.top_answered(since=timedelta(days=2), by=by)
            duck_roll, duck_ans = duck.top_answered(since=timedelta(days=2), by=by)
            monkeypatch.undo()
            assert ans == duck_ans and ans["source"] == "rollups"
            compare(raw, roll, by)
            store_engines.same(roll, duck_roll)
        # a grouping rollups lack is answered by raw rows
        assert ch.top_answered(by=("user",))[1]["source"] == "raw"


def test_api_pages_from_rollups_are_the_same_on_both_engines(
    tmp_path: Path, force_rollups: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with both(tmp_path, shop(time.time_ns())) as (duck, ch):
        now = datetime.utcnow() + timedelta(seconds=1)  # one clock for both engines' pages
        for mod in (window_mod, duckdb_rollups, duckdb_reader):
            monkeypatch.setattr(mod, "utcnow", lambda: now)
        for w in (window("24h"), window("7d"), window("all", host="web-2")):
            ov_d, ov_c = queries.overview(duck, w), queries.overview(ch, w)
            assert ov_c["source"]["source"] == ov_c["source"]["charts"] == "rollups"
            store_engines.same(ov_c, ov_d)
            for e in ("GET /bimodal", "GET /narrow"):
                ep_d = queries.endpoint_detail(duck, w, e)
                ep_c = queries.endpoint_detail(ch, w, e)
                assert ep_c["source"]["source"] == "rollups"
                for k in ("window", "source", "summary", "percentiles", "histogram"):
                    store_engines.same(ep_c[k], ep_d[k], k)
        # the chart series from chDB's rollups against the raw rows: counts exact, p95 2 %
        w = window("6h", service="billing")
        roll = queries.overview(ch, w)
        rollups.RAW_MAX_REQUESTS = 10**12
        try:
            raw = queries.overview(ch, w)
        finally:
            rollups.RAW_MAX_REQUESTS = -1
        assert raw["source"]["charts"] == "raw"
        assert roll["throughput"] == raw["throughput"]
        for s, r in zip(roll["p95"]["series"], raw["p95"]["series"], strict=True):
            for a, b in zip(s["values"], r["values"], strict=True):
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    assert close_to(a, b, 0.02), (s["endpoint"], a, b)


def test_an_endpoint_page_s_summary_is_its_row_of_the_endpoint_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The endpoint page computes the percentiles of its own endpoint only
    (top_answered's percentiles_for); its summary is still the endpoint table's row, time
    share included, from raw rows and from rollups, on both engines; what answers is decided
    on the whole window, as for the table."""
    with both(tmp_path, shop(time.time_ns())) as (duck, ch):
        now = datetime.utcnow() + timedelta(seconds=1)
        for mod in (window_mod, duckdb_rollups, duckdb_reader):
            monkeypatch.setattr(mod, "utcnow", lambda: now)
        for limit in (10**12, -1):  # raw rows, then rollups
            monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", limit)
            for w in (window("24h"), window("all", host="web-2")):
                for store in (duck, ch):
                    table = queries.endpoint_table(store, w)
                    for e in ("GET /bimodal", "GET /narrow", "GET /skewed"):
                        row = next((r for r in table if r["endpoint"] == e), None)
                        page = queries.endpoint_detail(store, w, e)
                        assert page["source"]["source"] == ("raw" if limit > 0 else "rollups")
                        assert row is not None
                        store_engines.same(page["summary"], row, f"{limit} {w.label} {e}")
        with pytest.raises(StoreError, match="grouped by endpoint"):
            duck.top_answered(by=("host",), percentiles_for="GET /narrow")


def test_top_of_thousands_of_long_endpoints_from_rollups_is_as_duckdbs(
    tmp_path: Path, force_rollups: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3,000 endpoints of ~100 characters: their literals (~300 KB) would pass ClickHouse's
    max_query_size (256 KiB), so its top by endpoint from rollups reads the GROUP BY
    statement: the same rows as DuckDB's, which codes them (a join of their VALUES), and as
    DuckDB's and chDB's with CODED_KEYS_MAX below their number (both read the GROUP BY
    statement). Failed before on chDB: Max query size exceeded."""
    now = time.time_ns()
    names = [f"GET /api/v1/customers/{'c' * 64}/orders/{i:05d}" for i in range(3000)]

    def fill(data: str) -> None:
        rng = random.Random(23)
        endpoints = {e: narrow for e in names}
        write(data, rng, 2, endpoints=endpoints, span_ns=2 * HOUR_NS, end_ns=now)

    def top(store: Any) -> list[dict[str, Any]]:
        rows, ans = store.top_answered(since=timedelta(days=1))
        assert ans["source"] == "rollups"
        return rows

    with both(tmp_path, fill) as (duck, ch):
        coded_d, grouped_c = top(duck), top(ch)
        assert len(coded_d) == 3000 and {r["count"] for r in coded_d} == {2}
        store_engines.same(grouped_c, coded_d)
        monkeypatch.setattr(rollups, "CODED_KEYS_MAX", 100)
        store_engines.same(top(duck), coded_d)
        store_engines.same(top(ch), coded_d)


def test_rollups_are_written_once_across_a_crash_and_a_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash at the requests' insert: no rollups were written (they follow their requests),
    the re-run writes them once."""
    data = str(tmp_path / "data")
    end = time.time_ns() - 24 * HOUR_NS
    end -= end % (24 * HOUR_NS) - 20 * HOUR_NS  # 20:00 yesterday: the hour is in one day
    write(
        data,
        random.Random(3),
        400,
        endpoints={"GET /a": skewed},
        span_ns=HOUR_NS,
        end_ns=end,
    )
    store = store_engines.open_engine("chdb", data)
    try:
        client = store._client
        real = client.insert_arrow

        def crash_at_requests(table: str, tbl: pa.Table, settings: dict[str, Any]) -> None:
            if table == "requests":
                raise OSError("the collector died here")
            real(table, tbl, settings)

        monkeypatch.setattr(client, "insert_arrow", crash_at_requests)
        with pytest.raises(OSError):
            store.ingest()
        monkeypatch.setattr(client, "insert_arrow", real)
        assert sums_per_res(store) == {}  # rollups go in after their requests
        store.ingest()
        store.ingest()  # nothing new
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 400}]
        assert sums_per_res(store) == {60: 400, 3600: 400, 86400: 400}
        # ClickHouse's merges sum rows of equal key: no figure changes
        monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
        before = store.top_answered(by=("endpoint",))
        for t in schema.ROLLUP_TABLES:
            store._client.command(f"OPTIMIZE TABLE {store._t(t.name)} FINAL")
        merged = store.top_answered(by=("endpoint",))
        monkeypatch.undo()
        assert merged[1]["source"] == "rollups"
        store_engines.same(merged, before)
        assert store.query("SELECT count(*) AS n FROM rollup_stats WHERE res = 86400") == [{"n": 1}]
    finally:
        store.close()
        store_engines.reset()


def old_rollups(days_ago: int, n: int = 10) -> dict[str, pa.Table]:
    """Rollup rows of n requests ``days_ago`` days ago (one day)."""
    t = datetime.utcnow().replace(hour=12, minute=0, second=0, microsecond=0)
    t -= timedelta(days=days_ago)
    req = pa.Table.from_pylist(
        [
            {
                "ts": t + timedelta(minutes=i),
                "trace_id": f"old{days_ago}-{i}",
                "service": "shop",
                "host": "web-1",
                "kind": "web",
                "endpoint": "GET /old",
                "duration_ms": 10.0 + i,
                "db_calls": 0,
                "db_ms": 0.0,
                "http_calls": 0,
                "http_ms": 0.0,
                "cache_calls": 0,
                "cache_ms": 0.0,
                "calls_dropped": 0,
            }
            for i in range(n)
        ],
        schema=schema.REQUESTS.arrow_schema(),
    )
    (parts,) = rollups.rollups_of({t.date(): {"requests": req}}).values()
    return parts


def test_retention_drops_minute_partitions_after_7_days_and_rollup_days_after_90(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = str(tmp_path / "data")
    write(
        data,
        random.Random(4),
        20,
        endpoints={"GET /a": skewed},
        span_ns=HOUR_NS,
        end_ns=time.time_ns(),
    )
    store = store_engines.open_engine("chdb", data)
    try:
        store.ingest()
        for ago in (10, 100):
            for name, tbl in old_rollups(ago).items():
                store._client.insert_arrow(name, tbl, {})
        assert sums_per_res(store) == {60: 40, 3600: 40, 86400: 40}
        assert store.apply_retention(days=7, rollup_days=90) == []
        # 10 days ago: hours and days kept, minutes gone; 100 days ago: all gone
        assert sums_per_res(store) == {60: 20, 3600: 30, 86400: 30}
        parts = store._parts(["rollup_stats", "rollup_hist"])
        assert parts and all(isinstance(partition_day(p)[1], int) for _, p in parts)
        # a window over the 10-day-old day begins at its first whole hour, from hour rows
        monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
        rows, ans = store.top_answered(since=timedelta(days=30))
        assert ans["source"] == "rollups" and ans["resolution_s"] == 60
        assert {r["endpoint"]: r["count"] for r in rows} == {"GET /a": 20, "GET /old": 10}
        # raw rows gone for a day the rollups hold: rollups answer whatever the count
        monkeypatch.undo()
        assert store.top_answered(since=timedelta(days=30))[1]["source"] == "rollups"
        assert store.top_answered(since=timedelta(days=5))[1]["source"] == "raw"
        # on a cluster: the rollup partitions of the _local tables, ON CLUSTER
        sent: list[str] = []
        monkeypatch.setattr(store, "cluster", "main")
        monkeypatch.setattr(store._client, "command", sent.append)
        old = (date.today() - timedelta(days=100)).isoformat()
        mid = (date.today() - timedelta(days=10)).isoformat()
        listed = [
            ("rollup_stats_local", f"('{old}',3600)"),
            ("rollup_hist_local", f"('{mid}',60)"),
            ("rollup_hist_local", f"('{mid}',3600)"),
        ]
        monkeypatch.setattr(store, "_q", lambda sql, params=(): listed if params else [])
        store.apply_retention(days=7, rollup_days=90)
        drops = [s for s in sent if "DROP PARTITION" in s]
        assert drops == [
            f'ALTER TABLE "{store.database}"."rollup_stats_local" ON CLUSTER "main" '
            f"DROP PARTITION ('{old}',3600)",
            f'ALTER TABLE "{store.database}"."rollup_hist_local" ON CLUSTER "main" '
            f"DROP PARTITION ('{mid}',60)",
        ]
    finally:
        store.close()
        store_engines.reset()


def test_rollup_ddl_sums_by_the_whole_key_in_day_and_resolution_partitions() -> None:
    stmts = schema.clickhouse_ddl(database="ps", cluster="main", replicated=True, ttl_days=7)
    hist = next(s for s in stmts if '"ps"."rollup_hist_local" ON CLUSTER "main" (' in s)
    assert "ENGINE = ReplicatedAggregatingMergeTree('/clickhouse/tables/{shard}" in hist
    assert "PARTITION BY (toDate(ts), res)" in hist
    assert 'ORDER BY ("res", "service", "endpoint", "ts", "bucket", "host", "kind")' in hist
    assert '"requests" SimpleAggregateFunction(sum, Int64)' in hist
    assert "TTL toDateTime(ts) + toIntervalDay(if(res = 60, 7, 90))" in hist
    assert "allow_nullable_key = 1" in hist
    text = "\n".join(stmts)
    assert (
        'CREATE TABLE IF NOT EXISTS "ps"."rollup_stats" ON CLUSTER "main" AS '
        '"ps"."rollup_stats_local"\n'
        'ENGINE = Distributed("main", "ps", "rollup_stats_local", rand())'
    ) in text
    stats = schema.clickhouse_create(schema.ROLLUP_STATS, database="ps")
    assert "ENGINE = AggregatingMergeTree()" in stats and "TTL" not in stats
    assert '"max_ms" SimpleAggregateFunction(max, Nullable(Float64))' in stats
    assert '"duration_ms" SimpleAggregateFunction(sum, Nullable(Float64))' in stats
    assert 'ORDER BY ("res", "service", "endpoint", "ts", "host", "kind")' in stats
    # the event tables keep their layout
    requests = schema.clickhouse_create(schema.REQUESTS, database="ps", ttl_days=7)
    assert "PARTITION BY toDate(ts)" in requests
    assert "TTL toDateTime(ts) + INTERVAL 7 DAY" in requests


def test_batches_without_spool_ranges_are_all_stored(tmp_path: Path) -> None:
    """Two OTLP-like commits (no segments: no spool ranges to make a token of) both land, and
    both are rolled up. Failed before: both carried the same deduplication token, so the
    server dropped the second payload's requests and rollups."""
    from perfsleuth.store.records import Batch
    from perfsleuth.store.tables import Tables

    store = store_engines.open_engine("chdb", str(tmp_path / "data"))
    try:
        for ago in (1, 2):
            t = datetime.utcnow() - timedelta(hours=ago)
            req = pa.Table.from_pylist(
                [
                    {
                        "ts": t,
                        "trace_id": f"otlp-{ago}",
                        "service": "shop",
                        "kind": "web",
                        "endpoint": "GET /a",
                        "duration_ms": 5.0,
                        "db_calls": 0,
                        "db_ms": 0.0,
                        "http_calls": 0,
                        "http_ms": 0.0,
                        "cache_calls": 0,
                        "cache_ms": 0.0,
                        "calls_dropped": 0,
                    }
                ],
                schema=schema.REQUESTS.arrow_schema(),
            )
            store.insert_tables(Batch(), Tables(days={t.date(): {"requests": req}}))
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 2}]
        assert sums_per_res(store) == {60: 2, 3600: 2, 86400: 2}
    finally:
        store.close()
        store_engines.reset()


def otlp_requests(ids: list[str], t: datetime, endpoint: str = "GET /a") -> Any:
    """One day's tables of requests ``ids`` at ``t`` (an OTLP payload's, no spool ranges)."""
    from perfsleuth.store.tables import Tables

    req = pa.Table.from_pylist(
        [
            {
                "ts": t + timedelta(seconds=i),
                "trace_id": tid,
                "service": "shop",
                "kind": "web",
                "endpoint": endpoint,
                "duration_ms": 5.0 + i,
                "db_calls": 0,
                "db_ms": 0.0,
                "http_calls": 0,
                "http_ms": 0.0,
                "cache_calls": 0,
                "cache_ms": 0.0,
                "calls_dropped": 0,
            }
            for i, tid in enumerate(ids)
        ],
        schema=schema.REQUESTS.arrow_schema(),
    )
    return Tables(days={t.date(): {"requests": req}})


def failing(store: Any, monkeypatch: pytest.MonkeyPatch, table: str, after: bool) -> Any:
    """Make the next insert into ``table`` fail once: before it reaches the server, or
    (``after``) once the server has stored it (the answer lost)."""
    client = store._client
    real = client.insert_arrow
    left = [1]

    def insert(name: str, tbl: pa.Table, settings: dict[str, Any]) -> None:
        if name == table and left:
            left.pop()
            if after:
                real(name, tbl, settings)
            raise OSError(f"the insert into {name} failed")
        real(name, tbl, settings)

    monkeypatch.setattr(client, "insert_arrow", insert)


@pytest.mark.parametrize(
    ("table", "after"),
    [("requests", False), ("rollup_stats", False), ("rollup_hist", True), ("rollup_hist", False)],
)
def test_otlp_rollups_follow_the_stored_requests_across_a_group_retried_payload_by_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str, after: bool
) -> None:
    """An OTLP group commit (two payloads, no spool ranges) fails at one insert, then each
    payload is committed on its own (server/otlp.py), and an exporter sends the first again:
    every request stored once, rolled up once. Failed before at the requests' insert: the
    rollups went in first, without deduplication, and were made again (4 per resolution);
    at the rollups' insert (after the requests, as now) without the retry's repair: 0 or 1."""
    from perfsleuth.store.records import Batch
    from perfsleuth.store.tables import Tables

    t = datetime.utcnow().replace(second=0, microsecond=0) - timedelta(hours=1)
    p1, p2 = otlp_requests(["a1", "a2"], t), otlp_requests(["b1"], t, "GET /b")
    group = Tables(
        days={
            t.date(): {
                "requests": pa.concat_tables(
                    [p1.days[t.date()]["requests"], p2.days[t.date()]["requests"]]
                )
            }
        }
    )
    store = store_engines.open_engine("chdb", str(tmp_path / "data"))
    try:
        failing(store, monkeypatch, table, after)
        with pytest.raises(OSError):
            store.insert_tables(Batch(), group)
        for p in (p1, p2, p1):  # each alone, then an exporter's retry of the first
            store.insert_tables(
                Batch(),
                otlp_requests(
                    [str(i) for i in p.days[t.date()]["requests"]["trace_id"].to_pylist()],
                    t,
                    p.days[t.date()]["requests"]["endpoint"][0].as_py(),
                ),
            )
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 3}]
        assert sums_per_res(store) == {60: 3, 3600: 3, 86400: 3}
        hist = store.query("SELECT res, sum(requests) AS n FROM rollup_hist GROUP BY res")
        assert {int(r["res"]): int(r["n"]) for r in hist} == {60: 3, 3600: 3, 86400: 3}
        monkeypatch.setattr(rollups, "RAW_MAX_REQUESTS", -1)
        rows, ans = store.top_answered(since=timedelta(hours=3))
        assert ans["source"] == "rollups"
        assert {r["endpoint"]: r["count"] for r in rows} == {"GET /a": 2, "GET /b": 1}
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize("after", [False, True])
def test_spool_rollups_are_written_once_when_their_insert_fails_after_the_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: bool
) -> None:
    """A crash at the rollups' insert (before or after the server stored it): the re-run of
    the same ranges finds the requests stored and writes their rollups if missing, once."""
    data = str(tmp_path / "data")
    write(
        data,
        random.Random(5),
        300,
        endpoints={"GET /a": skewed},
        span_ns=HOUR_NS,
        end_ns=time.time_ns(),
    )
    store = store_engines.open_engine("chdb", data)
    try:
        failing(store, monkeypatch, "rollup_stats", after)
        with pytest.raises(OSError):
            store.ingest()
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 300}]
        store.ingest()
        store.ingest()  # nothing new
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 300}]
        assert sums_per_res(store) == {60: 300, 3600: 300, 86400: 300}
    finally:
        store.close()
        store_engines.reset()


def test_a_rerun_over_a_grown_segment_rolls_up_the_stored_and_the_new_requests_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollups' insert landed but the collector died before hearing so (offsets not
    written); the segment grows by more requests of the same minute and endpoint before the
    re-run. The re-run's batch holds the stored requests and the new ones: only the new ones
    are rolled up (the requests table's count of that minute includes only what was stored
    before this attempt's requests went in)."""
    from perfsleuth.wire import HEADER
    from perfsleuth.wire.segment import encode_record
    from spoolwrite import SegmentWriter

    data = str(tmp_path / "data")
    w = SegmentWriter(data, host="web-1", service="shop", seq=1, header=False)
    w.write(encode_record(HEADER, {"v": 1, "host": "web-1", "pid": 1, "service": "shop"}))
    t0 = (time.time_ns() - 2 * HOUR_NS) // 60_000_000_000 * 60_000_000_000

    def specs(start: int, n: int) -> list[dict[str, Any]]:
        return [
            {"endpoint": "GET /a", "ts_ns": t0 + (start + i) * 10**8, "dur_ms": 3.0 + i}
            for i in range(n)
        ]

    w.write_requests(specs(0, 5))
    store = store_engines.open_engine("chdb", data)
    try:
        failing(store, monkeypatch, "rollup_hist", True)
        with pytest.raises(OSError):
            store.ingest()
        w.write_requests(specs(5, 8))
        w.close()
        store.ingest()
        store.ingest()
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 13}]
        assert sums_per_res(store) == {60: 13, 3600: 13, 86400: 13}
        hist = store.query("SELECT res, sum(requests) AS n FROM rollup_hist GROUP BY res")
        assert {int(r["res"]): int(r["n"]) for r in hist} == {60: 13, 3600: 13, 86400: 13}
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_reused_trace_id_alone_in_its_batch_is_rolled_up_again(
    tmp_path: Path, engine: str
) -> None:
    """A trace id reused 10 minutes later the same day, alone in its batch, is another request
    (tables.copied_requests) and is rolled up too. On ClickHouse its rollup insert carried the
    same deduplication token as the first one's (the day and the trace ids), and the server
    dropped it: 2 requests, 1 in every rollup."""
    from spoolwrite import SegmentWriter

    data = str(tmp_path / "data")
    noon = time.time_ns() // (24 * HOUR_NS) * (24 * HOUR_NS) - 12 * HOUR_NS  # yesterday
    store = store_engines.open_engine(engine, data)
    try:
        for seq, ts in ((1, noon), (2, noon + HOUR_NS // 6)):
            w = SegmentWriter(data, seq=seq)
            w.request("GET /a", trace_id="00000000000000aa", ts_ns=ts)
            w.close()
            store.ingest()
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 2}]
        assert sums_per_res(store) == {60: 2, 3600: 2, 86400: 2}
    finally:
        store.close()
        store_engines.reset()
