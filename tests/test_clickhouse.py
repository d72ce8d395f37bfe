"""The ClickHouse engine, on chDB (ClickHouse's engine in this process): its DDL, exactly-once
ingest (also across a crash between two inserts), and the same answers as DuckDB from the
reader, the detectors and the API on the same data (synthetic, and the real demo's).

The detector, compare and API test modules run on chDB too (tests/store_engines.py); the zoo's
findings are compared in tests/test_zoo.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import store_engines
from perfsleuth.store import open_store, schema
from perfsleuth.store.base import StoreError
from spoolwrite import SegmentWriter, call

pytestmark = pytest.mark.skipif(
    not store_engines.chdb_available(), reason="the clickhouse extra (chdb) is not installed"
)

SQL_ITEMS = "SELECT * FROM items WHERE order_id = ?"


def fill_shop(w: SegmentWriter, n: int = 30, start: int = 0) -> None:
    """Requests of a few endpoints and tenants, with DB, HTTP and cache calls (an N+1 loop
    among them), attributes and tags."""
    site = ("/app/shop.py", 42, "orders_page")
    for i in range(start, start + n):
        loop = 3 + i % 5
        w.request(
            "GET /orders/{id}",
            dur_ms=40.0 + i,
            tenant=f"t{i % 3}",
            user=f"u{i % 7}",
            calls=[call("db", "SELECT * FROM orders WHERE id = ?", dur_ms=1.5)]
            + [call("db", SQL_ITEMS, dur_ms=0.5 + j / 10, site=site) for j in range(loop)],
            attrs={"rows_loaded": i * 10},
            tags={"checkout_v2": "on" if i % 2 else "off"},
        )
        w.request(
            "GET /quote",
            dur_ms=200.0 + 3 * i,
            tenant="megacorp" if i % 4 == 0 else "t1",
            calls=[call("http", "GET https://carrier.example/quote", dur_ms=150.0 + i)],
        )
        w.request(
            "POST /cart",
            dur_ms=12.0 + i % 4,
            status=500 if i % 10 == 0 else 200,
            calls=[call("cache", "GET cart:{id}", dur_ms=0.2)] * 2,
        )


def fill_evidence(w: SegmentWriter, start: int) -> None:
    """Slow requests with their samples and event-loop blockers, a GC pause, agent counters."""
    stack = w.stack([("/app/shop.py", 42, "orders_page", True)])
    tid = ""
    for i in range(start, start + 3):
        tid = f"{0xE000 + i:016x}"
        w.request("GET /slow", trace_id=tid, dur_ms=300.0)
        samples = [[1_000_000, "cpu", stack], [2_000_000, "cpu", stack]]
        w.event(b"P", {"id": tid, "ts": time.time_ns(), "samples": samples})
        w.event(
            b"B",
            {"ts": time.time_ns(), "dur": 200_000_000, "delayed": 1, "id": tid,
             "endpoint": "GET /slow", "stacks": [[stack, 2]]},
        )  # fmt: skip
    w.event(b"G", {"pauses": [{"ts": time.time_ns(), "dur": 2_000_000, "gen": 2, "ids": [tid]}]})
    w.stats({"requests": 3})


def ingest_both(tmp_path: Path, fill: Any) -> tuple[Any, Any]:
    """The same spool ingested into DuckDB and into chDB."""
    w = SegmentWriter(str(tmp_path / "written"))
    fill(w)
    w.close()
    return ingest_written(tmp_path)


def ingest_written(tmp_path: Path) -> tuple[Any, Any]:
    """The spool under tmp_path/written ingested into DuckDB and into chDB."""
    stores = []
    for engine in ("duckdb", "chdb"):
        data = str(tmp_path / engine)
        shutil.copytree(tmp_path / "written" / "spool", Path(data) / "spool")
        s = store_engines.open_engine(engine, data)
        s.ingest()
        stores.append(s)
    store_engines.reset()
    return stores[0], stores[1]


def counts(store: Any) -> dict[str, int]:
    return {
        t: store.query(f"SELECT count(*) AS n FROM {t}")[0]["n"]
        for t in (
            *(t.name for t in schema.EVENT_TABLES),
            "agent_stats",
            "fingerprints",
            "locations",
            "stacks",
        )
    }


# ------------------------------------------------------------------------------------ DDL


def test_cluster_ddl_is_replicated_and_distributed() -> None:
    stmts = schema.clickhouse_ddl(database="ps", cluster="main", replicated=True, ttl_days=7)
    text = "\n".join(stmts)
    assert stmts[0] == 'CREATE DATABASE IF NOT EXISTS "ps" ON CLUSTER "main"'
    requests = next(s for s in stmts if '"ps"."requests_local"' in s)
    assert requests.startswith('CREATE TABLE IF NOT EXISTS "ps"."requests_local" ON CLUSTER "main"')
    assert (
        "ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', "
        "'{replica}')" in requests
    )
    assert "PARTITION BY toDate(ts)" in requests
    assert 'ORDER BY ("service", "endpoint", "ts")' in requests
    assert "TTL toDateTime(ts) + INTERVAL 7 DAY" in requests
    assert "ttl_only_drop_parts = 1" in requests
    assert (
        'CREATE TABLE IF NOT EXISTS "ps"."requests" ON CLUSTER "main" AS "ps"."requests_local"\n'
        'ENGINE = Distributed("main", "ps", "requests_local", cityHash64("trace_id"))'
    ) in text
    offsets = next(s for s in stmts if '"ps"."ingest_offsets_local"' in s)
    assert "ReplicatedReplacingMergeTree(" in offsets and ', "updated")' in offsets
    # every logical table has its local table and a Distributed one in front
    for t in schema.TABLES:
        assert f'"ps"."{t}_local" ON CLUSTER' in text
        assert f'"ps"."{t}" ON CLUSTER "main" AS' in text
    # without a cluster: plain MergeTree, deduplicating repeated inserts
    single = schema.clickhouse_create(schema.CALLS, database="ps")
    assert "ENGINE = MergeTree()" in single and "ON CLUSTER" not in single
    assert "non_replicated_deduplication_window" in single


def test_a_store_url_picks_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StoreError, match="unknown store 'mysql://x'"):
        open_store(str(tmp_path), url="mysql://x")
    # without the clickhouse extra: one sentence saying what to install
    monkeypatch.setitem(sys.modules, "clickhouse_connect", None)
    with pytest.raises(StoreError, match=r"pip install 'perfsleuth\[clickhouse\]'"):
        open_store(str(tmp_path), url="clickhouse://localhost:8123/ps")
    for name in [m for m in sys.modules if m.startswith(("sqlglot", "perfsleuth.store.click"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sqlglot", None)
    with pytest.raises(StoreError, match=r"perfsleuth\[clickhouse\]'.*sqlglot"):
        open_store(str(tmp_path), url="chdb:///tmp/x")


# ---------------------------------------------------------------------------- ingest


def test_ingest_is_exactly_once_across_a_crash_between_inserts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = str(tmp_path / "data")
    w = SegmentWriter(data)
    fill_shop(w, 20)
    fill_evidence(w, 0)
    store = store_engines.open_engine("chdb", data)
    try:
        client = store._client
        real = client.insert_arrow

        def crash_at_requests(table: str, tbl: pa.Table, settings: dict[str, Any]) -> None:
            if table == "requests":
                raise OSError("the collector died here")
            real(table, tbl, settings)

        # calls, attributes, dictionaries landed; requests and offsets did not
        monkeypatch.setattr(client, "insert_arrow", crash_at_requests)
        with pytest.raises(OSError):
            store.ingest()
        monkeypatch.setattr(client, "insert_arrow", real)
        assert counts(store)["requests"] == 0
        assert counts(store)["calls"] > 0
        # the segment grows before the next run: the batch is not the one that failed
        fill_shop(w, 10, start=20)
        fill_evidence(w, 3)
        w.close()
        store.ingest()
        store.ingest()  # nothing new: nothing added
        got = counts(store)
    finally:
        store.close()
        store_engines.reset()

    ref = open_store(str(tmp_path / "ref"), url="duckdb")
    try:
        w = SegmentWriter(str(tmp_path / "ref"))
        fill_shop(w, 20)
        fill_evidence(w, 0)
        fill_shop(w, 10, start=20)
        fill_evidence(w, 3)
        w.close()
        ref.ingest()
        assert got == counts(ref)
        assert got["requests"] == 96
        assert got["samples"] == 12 and got["blockers"] == 6 and got["gc_pauses"] == 2
    finally:
        ref.close()


def test_offsets_and_received_segments_are_kept(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    w = SegmentWriter(data)
    fill_shop(w, 5)
    w.close()
    store = store_engines.open_engine("chdb", data)
    try:
        first = store.ingest()
        assert first.requests == 15 and first.segments_done == 1
        assert store.ingest().requests == 0
        row = {"segment": "a~h-1-2-3", "token": "ci", "agent": "a", "host": "h"}
        store.record_received([row, row])
        store.record_received([{**row, "token": "other"}])  # a segment keeps its first row
        assert store.query("SELECT segment, token FROM segments_received") == [
            {"segment": "a~h-1-2-3", "token": "ci"}
        ]
        assert store.apply_retention(7) == []  # today's rows stay
        assert counts(store)["requests"] == 15
    finally:
        store.close()
        store_engines.reset()


# ---------------------------------------------------------------------- same answers


def test_the_reader_answers_as_duckdb_does(tmp_path: Path) -> None:
    duck, ch = ingest_both(tmp_path, fill_shop)
    try:
        for by in (("endpoint",), ("tenant",), ("endpoint", "user")):
            store_engines.same(duck.top(by=by), ch.top(by=by), f"top{by}")
        store_engines.same(
            duck.top(since=timedelta(hours=1)), ch.top(since=timedelta(hours=1)), "top 1h"
        )
        assert duck.endpoints() == ch.endpoints()
        for kw in ({}, {"endpoint": "GET /quote", "slowest": 5}):
            store_engines.same(duck.traces(**kw), ch.traces(**kw), f"traces {kw}")
        slowest = duck.traces(endpoint="GET /orders/{id}", slowest=1)[0]["trace_id"]
        store_engines.same(duck.trace(slowest[:12]), ch.trace(slowest[:12]), "trace")
        store_engines.same(duck.samples(slowest), ch.samples(slowest), "samples")
        store_engines.same(duck.blockers(), ch.blockers(), "blockers")
        assert ch.capture(slowest) is None
        with pytest.raises(StoreError, match="no trace"):
            ch.trace("ffffffffff")
        store_engines.same(duck.agent_drops(), ch.agent_drops(), "agent_drops")
        cols, rows = ch.sql("SELECT endpoint, count() AS n FROM requests GROUP BY 1 ORDER BY 1")
        assert cols == ["endpoint", "n"] and [r[1] for r in rows] == [30, 30, 30]
        with pytest.raises(StoreError, match="read-only"):
            ch.sql("DROP TABLE requests")
    finally:
        duck.close()
        ch.close()


def test_the_raw_top_in_the_table_s_order_answers_as_duckdb_does(tmp_path: Path) -> None:
    """ClickHouse's top by service and endpoint is aggregated per (service, endpoint) in the
    table's order and added up in Python: an endpoint that two services serve must still get
    its exact quantiles over both services' rows, and every other column as DuckDB's."""
    w = SegmentWriter(str(tmp_path / "written"), service="shop")
    w2 = SegmentWriter(str(tmp_path / "written"), service="billing", pid=4343, seq=2)
    for i in range(40):
        w.request("GET /health", dur_ms=1.0 + i % 7, status=500 if i % 9 == 0 else 200)
        w.request("GET /orders", dur_ms=30.0 + i, kind="background" if i % 4 else "web",
                  calls=[call("db", "SELECT 1", dur_ms=2.0)], tenant=f"t{i % 2}")  # fmt: skip
        # the same endpoint in the other service, slower: the merged quantiles move
        w2.request("GET /health", dur_ms=50.0 + 3 * i, error="Boom" if i % 10 == 1 else None)
        w2.request("POST /invoice", dur_ms=80.0 + i % 5,
                   calls=[call("http", "POST https://pay.example/x", dur_ms=40.0)])  # fmt: skip
    w.close()
    w2.close()
    duck, ch = ingest_written(tmp_path)
    try:
        groupings = (("endpoint",), ("service",), ("service", "endpoint"), ("endpoint", "service"))
        selections: tuple[dict[str, Any], ...] = (
            {},
            {"since": timedelta(hours=1)},
            {"kind": "web"},
            {"only": {"service": "billing"}},
        )
        for by in groupings:
            for kw in selections:
                got = ch.top(by=by, **kw)
                store_engines.same(duck.top(by=by, **kw), got, f"top{by} {kw}")
                assert got, f"top{by} {kw}: no rows"
        health = next(r for r in ch.top() if r["endpoint"] == "GET /health")
        durs = [1.0 + i % 7 for i in range(40)] + [50.0 + 3 * i for i in range(40)]
        assert health["count"] == 80
        assert health["p95_ms"] == pytest.approx(float(np.percentile(durs, 95)), rel=1e-12)
        one, _ = ch.top_answered(percentiles_for="GET /health")
        store_engines.same(duck.top_answered(percentiles_for="GET /health")[0], one, "one")
        assert [r["endpoint"] for r in one if r["p95_ms"] is not None] == ["GET /health"]
    finally:
        duck.close()
        ch.close()


def test_the_demo_gives_the_same_findings_and_pages_on_both(demo_data: str) -> None:
    from perfsleuth.analysis import find
    from perfsleuth.server import queries
    from perfsleuth.server.window import window

    duck = open_store(demo_data, read_only=True, url="duckdb")
    ch = store_engines.copy_into_chdb(duck)
    try:
        found = [f.to_dict() for f in find(duck)]
        assert len(found) >= 8  # the demo's planted problems
        store_engines.same(found, [f.to_dict() for f in find(ch)], "findings")
        w = window("all")
        store_engines.same(queries.overview(duck, w), queries.overview(ch, w), "overview")
        for ep in ("GET /customers/{customer_id}/orders", "GET /shipping/quote"):
            store_engines.same(
                queries.endpoint_detail(duck, w, ep),
                queries.endpoint_detail(ch, w, ep),
                f"endpoint {ep}",
            )
    finally:
        duck.close()
        ch.close()


def test_the_cli_runs_on_a_chdb_store(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    w = SegmentWriter(data)
    fill_shop(w, 10)
    w.close()
    url = f"chdb://{tmp_path / 'chdb'}?database=cli"

    def cli(*args: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "perfsleuth", "--store", url, *args, "--data", data],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert '"requests": 30' in cli("ingest", "--json")
    assert "GET /quote" in cli("top", "--json")
    cart = "SELECT count() AS n FROM requests WHERE endpoint = 'POST /cart'"
    assert '"n": 10' in cli("sql", cart, "--json")


def test_a_chdb_directory_in_use_is_said_so(tmp_path: Path) -> None:
    url = f"chdb://{tmp_path / 'chdb'}"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from perfsleuth.store import open_store; "
            f"s = open_store({str(tmp_path / 'a')!r}, url={url!r}); print('open', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        r = subprocess.run(
            [sys.executable, "-m", "perfsleuth", "--store", url, "top", "--data", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1, r.stderr
        assert "is in use by another process" in r.stderr
    finally:
        holder.communicate("", timeout=60)


def test_the_console_is_read_only_bounded_and_sealed(tmp_path: Path) -> None:
    from perfsleuth.server import console

    duck, ch = ingest_both(tmp_path, lambda w: fill_shop(w, 10))
    try:
        for query, message in (
            ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "disabled"),
            ("SELECT file('/etc/passwd')", "disabled"),
            ("SELECT * FROM url('http://127.0.0.1:9/')", "disabled"),
            ("INSERT INTO requests SELECT * FROM requests", "read-only"),
            ("SELEC 1", "syntax"),
        ):
            with pytest.raises(console.ConsoleError, match=message):
                console.run_on_store(ch, query, 10, None)
        with pytest.raises(console.ConsoleError, match=r"longer than 0\.5 s"):
            console.run_on_store(
                ch, "SELECT sum(sleepEachRow(0.05)) FROM requests", 10, None, time_limit=0.5
            )
        # the session still answers afterwards
        res = console.run_on_store(ch, "SELECT endpoint FROM requests ORDER BY ts", 5, None)
        assert len(res.encoded) == 5 and res.truncated_by == "rows"
        # the server stops once it has the rows asked for (an endless table here)
        res = console.run_on_store(ch, "SELECT number FROM system.numbers", 5, None, time_limit=20)
        assert res.encoded == ["[0]", "[1]", "[2]", "[3]", "[4]"] and res.truncated_by == "rows"
    finally:
        duck.close()
        ch.close()


def test_the_fleet_lists_sorted_tokens_hosts_and_services_on_both(tmp_path: Path) -> None:
    from perfsleuth.server.fleet import fleet
    from perfsleuth.server.window import window

    duck, ch = ingest_both(tmp_path, lambda w: fill_shop(w, 3))
    received = [
        {"segment": f"s{i}", "token": token, "agent": agent, "host": host, "service": "shop"}
        for i, (token, agent, host) in enumerate(
            [
                ("zeta", "a", "testbox"),
                ("alpha", "otlp", "testbox"),
                (None, "a", "testbox"),
                ("mid", "a", "testbox"),
                ("zeta", "a", "hostb"),
                ("zeta", "a", "hosta"),
            ]
        )
    ]
    try:
        got = []
        for store in (duck, ch):
            store.record_received(received)
            f = fleet(store, window("all"))
            got.append(f)
            (src,) = [s for s in f["sources"] if s["host"] == "testbox"]
            assert src["tokens"] == ["alpha", "mid", "zeta"]
            assert src["via"] == ["agent", "otlp"]
            (zeta,) = [t for t in f["tokens"] if t["token"] == "zeta"]
            assert zeta["hosts"] == ["hosta", "hostb", "testbox"]
        store_engines.same(got[0], got[1], "fleet")
    finally:
        duck.close()
        ch.close()


def test_a_store_keeps_to_its_tables_and_a_read_only_open_creates_nothing(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    w = SegmentWriter(data)
    fill_shop(w, 5)
    w.close()
    store = store_engines.open_engine("chdb", data)
    try:
        store.ingest()
        # no scratch table of the exactly-once check (another collector could share its name)
        tables = store._q(f"SELECT name FROM system.tables WHERE database = '{store.database}'")
        assert {r[0] for r in tables} == set(schema.TABLES)
        ro = open_store(data, url=store_engines.chdb_url("never_created"), read_only=True)
        try:
            dbs = {r[0] for r in store._q("SELECT name FROM system.databases")}
            assert "never_created" not in dbs
        finally:
            ro.close()
    finally:
        store.close()
        store_engines.reset()


def test_more_keys_than_one_query_holds_are_looked_up_in_chunks(tmp_path: Path) -> None:
    store = store_engines.open_engine("chdb", str(tmp_path / "data"))
    try:
        # 13,000 names of ~50 bytes: ~700 KB as one IN list, past max_query_size (256 KiB)
        rows = [
            {"segment": f"agent~host-{i:06d}-1764160000000000000-000001"} for i in range(13_000)
        ]
        rows[0]["segment"] = "otlp~it's?a\\token~svc/h/1~20261126"  # quoted as it is
        store.record_received(rows[:6_000])
        store.record_received(rows)
        assert store.query("SELECT count(*) AS n FROM segments_received") == [{"n": 13_000}]
    finally:
        store.close()
        store_engines.reset()


def test_a_trace_counts_the_samples_of_its_own_day(tmp_path: Path) -> None:
    duck, ch = ingest_both(tmp_path, lambda w: (fill_shop(w, 2), fill_evidence(w, 0)))
    try:
        tid = f"{0xE000:016x}"
        old = ch.query("SELECT * FROM samples WHERE trace_id = ? LIMIT 1", [tid])[0]
        old["ts"] -= timedelta(days=1)  # a row of the same id on another day
        ch._client.insert_arrow(
            "samples", pa.Table.from_pylist([old], schema=schema.SAMPLES.arrow_schema()), {}
        )
        assert ch.trace(tid)["samples"] == duck.trace(tid)["samples"] == 2
    finally:
        duck.close()
        ch.close()


def test_retention_drops_old_rows_and_on_a_cluster_deletes_from_local_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datetime import datetime

    data = str(tmp_path / "data")
    w = SegmentWriter(data)
    fill_shop(w, 2)
    w.close()
    store = store_engines.open_engine("chdb", data)
    try:
        store.ingest()
        old = datetime.utcnow() - timedelta(days=20)
        store._client.insert_arrow(
            "agent_stats",
            pa.Table.from_pylist(
                [{"ts": old, "service": "shop", "host": "gone", "pid": 9, "name": "x", "value": 1}],
                schema=schema.AGENT_STATS.arrow_schema(),
            ),
            {},
        )
        ns = int(old.timestamp() * 1e9)
        store.record_received(
            [
                {"segment": "old", "host": "gone", "pid": 9, "received_ns": ns, "started_ns": ns},
                {"segment": "live", "host": "testbox", "pid": 4242, "received_ns": ns},
            ]
        )
        assert store.apply_retention(days=7, rollup_days=90) == []
        assert store.query("SELECT count(*) AS n FROM agent_stats WHERE host = 'gone'") == [
            {"n": 0}
        ]
        # the process that still has requests keeps its row
        assert [r["segment"] for r in store.query("SELECT segment FROM segments_received")] == [
            "live"
        ]
        # on a cluster: every statement on the _local tables, ON CLUSTER
        sent: list[str] = []
        asked: list[str] = []
        monkeypatch.setattr(store, "cluster", "main")
        monkeypatch.setattr(store._client, "command", sent.append)
        old_part = [("requests_local", (old.date()).isoformat())]
        monkeypatch.setattr(
            store, "_q", lambda sql, params=(): asked.append(sql) or (old_part if params else [])
        )
        store.apply_retention(days=7, rollup_days=90)
        assert "clusterAllReplicas('main', system.parts)" in asked[0]
        assert sent[0].startswith('ALTER TABLE "t')
        assert '"requests_local" ON CLUSTER "main" DROP PARTITION' in sent[0]
        deletes = [s for s in sent if s.startswith("DELETE")]
        assert len(deletes) == 4
        assert all('_local" ON CLUSTER "main"' in s for s in deletes), deletes
    finally:
        store.close()
        store_engines.reset()


def test_the_store_option_stays_out_of_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--store`` reaches the command's store, not the processes it starts."""
    import os

    from typer.testing import CliRunner

    import perfsleuth.store
    from perfsleuth.cli.main import app
    from perfsleuth.store import STORE_ENV

    monkeypatch.delenv(STORE_ENV, raising=False)
    monkeypatch.setattr(perfsleuth.store, "cli_url", None)
    r = CliRunner().invoke(app, ["--store", "mysql://x", "top", "--data", str(tmp_path)])
    assert "unknown store 'mysql://x'" in r.output  # the command used it
    assert STORE_ENV not in os.environ


def test_a_dictionary_row_stored_twice_is_read_once(tmp_path: Path) -> None:
    """Two collectors can both store a new fingerprint before either sees the other's: the
    reader's answers do not double until a merge removes the copy."""
    duck, ch = ingest_both(tmp_path, lambda w: fill_shop(w, 3))
    try:
        for name in ("fingerprints", "locations"):
            t = schema.TABLES[name]
            cols = ", ".join(schema.quote(c) for c in t.column_names)
            copy = duck._con.sql(f"SELECT {cols} FROM {name}").to_arrow_table()
            ch._client.insert_arrow(name, copy.cast(t.arrow_schema()).slice(0, 1), {})
            ch._client.insert_arrow(name, copy.cast(t.arrow_schema()), {"insert_deduplicate": 0})
        slowest = duck.traces(endpoint="GET /orders/{id}", slowest=1)[0]["trace_id"]
        store_engines.same(duck.trace(slowest), ch.trace(slowest), "trace")
        store_engines.same(duck.top(), ch.top(), "top")
    finally:
        duck.close()
        ch.close()


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_reused_trace_id_is_stored_whatever_else_its_batch_holds(
    tmp_path: Path, engine: str
) -> None:
    """A request is a copy of a stored one when a stored request has its trace id at a ts
    within ingest.KNOWN_TRACE_MARGIN_US of its own (the same ts: a record repeated, a segment
    copied; 30 s later: a payload made again), decided per request on both engines: a trace id
    stored two days earlier is another request, stored whether or not its batch also holds
    an unrelated request three days old (/tmp/r2/window.py: DuckDB dropped it then, as its
    check covered the batch's whole span). The same-day rule ClickHouse had is gone too: a
    trace id stored 3 hours earlier the same day is another request, and a copy made again
    across midnight is still a copy. Each run reports the requests and calls it stored (on
    ClickHouse it counted those it left out too)."""
    now = time.time_ns()
    day = 86_400 * 10**9
    midnight = now // day * day
    noon_before = midnight - day // 2
    one = [call("db", "SELECT * FROM items WHERE id = ?", dur_ms=1.0)]
    got = []
    reported = []
    for unrelated_old in (False, True):
        data = str(tmp_path / f"{engine}-{unrelated_old}")
        store = store_engines.open_engine(engine, data)
        try:
            w = SegmentWriter(data, seq=1)
            w.request("GET /a", trace_id="00000000000000aa", ts_ns=now - 2 * day)
            w.request("GET /b", trace_id="00000000000000bb", calls=one, ts_ns=now - 60 * 10**9)
            w.request(
                "GET /c",
                trace_id="00000000000000cc",
                calls=one,
                ts_ns=noon_before - 3 * 3600 * 10**9,
            )
            w.request("GET /d", trace_id="00000000000000dd", ts_ns=midnight - 10 * 10**9)
            w.close()
            runs = [store.ingest()]
            w = SegmentWriter(data, seq=2)
            w.request("GET /a", trace_id="00000000000000aa", ts_ns=now)  # another request
            w.request(
                "GET /b", trace_id="00000000000000bb", calls=one, ts_ns=now - 60 * 10**9
            )  # a copy
            w.request(
                "GET /c", trace_id="00000000000000cc", calls=one, ts_ns=noon_before
            )  # another
            w.request("GET /d", trace_id="00000000000000dd", ts_ns=midnight + 10 * 10**9)  # again
            if unrelated_old:
                w.request("GET /z", trace_id="00000000000000ff", ts_ns=now - 3 * day)
            w.close()
            runs.append(store.ingest())
            w = SegmentWriter(data, seq=3)
            w.request(
                "GET /b", trace_id="00000000000000bb", calls=one, ts_ns=now - 30 * 10**9
            )  # again
            w.request("GET /a", trace_id="00000000000000aa", ts_ns=now - 2 * day + 10**6)
            w.close()
            runs.append(store.ingest())
            reported.append([(r.requests, r.calls) for r in runs])
            rows = store.query(
                "SELECT trace_id, endpoint, ts FROM requests WHERE trace_id <> '00000000000000ff'"
            )
            got.append(sorted((r["trace_id"], r["endpoint"], r["ts"]) for r in rows))
        finally:
            store.close()
            store_engines.reset()
    assert got[0] == got[1]
    assert reported == [[(4, 2), (2, 1), (0, 0)], [(4, 2), (3, 1), (0, 0)]]
    assert [(t, e) for t, e, _ in got[0]] == [
        ("00000000000000aa", "GET /a"),
        ("00000000000000aa", "GET /a"),
        ("00000000000000bb", "GET /b"),
        ("00000000000000cc", "GET /c"),
        ("00000000000000cc", "GET /c"),
        ("00000000000000dd", "GET /d"),
    ]


def request_tables(rows: list[tuple[str, int, str, int]]) -> Any:
    """The store's tables of requests (trace id, ts in ns, endpoint, number of DB calls), each
    with an attribute, made by the builder the spool ingest and OTLP use
    (tables.event_tables)."""
    import numpy as np

    from perfsleuth.store.decode import REQUEST_WIRE
    from perfsleuth.store.records import Batch, SegmentState
    from perfsleuth.store.tables import Tables, event_tables

    n = len(rows)
    batch = Batch()
    batch.touch(SegmentState("shop/h1", "shop/h1", 0, "shop", "h1"))
    given = {
        "id": [r[0] for r in rows],
        "ts": [r[1] for r in rows],
        "dur": [5_000_000] * n,
        "kind": ["web"] * n,
        "endpoint": [r[2] for r in rows],
        "calls": [
            [
                {"kind": "db", "system": "postgresql", "fp": 7, "off": j * 10**6, "dur": 500_000}
                for j in range(r[3])
            ]
            for r in rows
        ],
    }
    wire = pa.table(
        {
            f.name: pa.array(given[f.name], f.type) if f.name in given else pa.nulls(n, f.type)
            for f in REQUEST_WIRE
        },
        schema=REQUEST_WIRE,
    )
    out = Tables()
    attrs = [(i, {"attrs": {"n": i}}) for i in range(n)]
    event_tables(out, wire, np.zeros(n, np.int64), attrs, batch, time.time_ns())
    return out


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_batch_with_a_copy_and_a_new_request_of_one_trace_id_stores_the_new_one(
    tmp_path: Path, engine: str
) -> None:
    """Each request of a batch is judged on its own: one that a stored request of its trace id
    is within ingest.KNOWN_TRACE_MARGIN_US of is a copy and is left out with its calls and
    attributes; another of the same trace id further from every stored one (the id reused 10
    minutes later; a second request of the trace 2 minutes later) is stored with its calls,
    attributes and rollups. Before, the copy took every row of its trace id out of the batch."""
    from perfsleuth.store.records import Batch

    now = time.time_ns()
    minute = 60 * 10**9
    first = now - 10 * minute
    store = store_engines.open_engine(engine, str(tmp_path / "data"))
    try:
        store.insert_tables(Batch(), request_tables([("aa", first, "GET /a", 2)]))
        store.insert_tables(Batch(), request_tables([("bb", first, "GET /b", 1)]))
        tables = request_tables(
            [
                ("aa", first, "GET /a", 2),  # a copy
                ("aa", now, "GET /a", 3),  # the trace id reused
                ("bb", first + minute // 2, "GET /b", 1),  # made again: a copy
                ("bb", first + 2 * minute, "GET /c", 4),  # the trace's second request
            ]
        )
        store.insert_tables(Batch(), tables)

        def per_request(table: str) -> list[tuple[str, str, int]]:
            rows = store.query(
                f"SELECT trace_id, endpoint, count(*) AS n FROM {table}"
                " GROUP BY trace_id, endpoint, ts"
            )
            return sorted((r["trace_id"], r["endpoint"], int(r["n"])) for r in rows)

        assert per_request("requests") == [
            ("aa", "GET /a", 1), ("aa", "GET /a", 1), ("bb", "GET /b", 1), ("bb", "GET /c", 1),
        ]  # fmt: skip
        assert per_request("calls") == [
            ("aa", "GET /a", 2), ("aa", "GET /a", 3), ("bb", "GET /b", 1), ("bb", "GET /c", 4),
        ]  # fmt: skip
        assert per_request("attributes") == [
            ("aa", "GET /a", 1), ("aa", "GET /a", 1), ("bb", "GET /b", 1), ("bb", "GET /c", 1),
        ]  # fmt: skip
        rolled = store.query("SELECT res, sum(requests) AS n FROM rollup_stats GROUP BY res")
        assert {int(r["res"]): int(r["n"]) for r in rolled} == {60: 4, 3600: 4, 86400: 4}
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_copy_across_midnight_is_found_in_the_day_before(tmp_path: Path, engine: str) -> None:
    """DuckDB looks for stored copies in the day tables of the batch's span widened by the
    margin only: a copy whose ts is 20 s past midnight, of a request stored 10 s before it (in
    the day before's table), is left out; a request of a day that holds no table yet (nothing
    stored there) is stored, and so is one whose only namesake is a day earlier."""
    from perfsleuth.store.records import Batch

    day = 86_400 * 10**9
    midnight = (time.time_ns() // day) * day
    second = 10**9
    store = store_engines.open_engine(engine, str(tmp_path / "data"))
    try:
        store.insert_tables(Batch(), request_tables([("cc", midnight - 10 * second, "GET /a", 1)]))
        store.insert_tables(Batch(), request_tables([("dd", midnight - day, "GET /b", 1)]))
        store.insert_tables(
            Batch(),
            request_tables(
                [
                    ("cc", midnight + 20 * second, "GET /a", 1),  # a copy, the day after
                    ("dd", midnight + 30 * second, "GET /b", 2),  # a day later: not a copy
                    ("ee", midnight + 40 * second, "GET /c", 3),
                ]
            ),
        )
        rows = store.query("SELECT trace_id, count(*) AS n FROM requests GROUP BY 1 ORDER BY 1")
        assert [(r["trace_id"], int(r["n"])) for r in rows] == [("cc", 1), ("dd", 2), ("ee", 1)]
        calls = store.query("SELECT count(*) AS n FROM calls")
        assert int(calls[0]["n"]) == 1 + 1 + 2 + 3
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_spool_batch_with_a_copy_and_a_reuse_of_one_trace_id_stores_the_reuse(
    tmp_path: Path, engine: str
) -> None:
    """Through the spool: a segment holding a copy of a stored request, that record repeated,
    and the trace id reused 10 minutes later stores the reuse alone (decode.once_per_trace
    keeps one request per trace id and ts; the store judges each request on its own)."""
    now = time.time_ns()
    minute = 60 * 10**9
    data = str(tmp_path / "data")
    store = store_engines.open_engine(engine, data)
    try:
        w = SegmentWriter(data, seq=1)
        w.request("GET /a", trace_id="00000000000000aa", ts_ns=now - 10 * minute)
        w.close()
        assert store.ingest().requests == 1
        w = SegmentWriter(data, seq=2)
        w.request("GET /a", trace_id="00000000000000aa", ts_ns=now - 10 * minute)  # a copy
        w.request("GET /a", trace_id="00000000000000aa", ts_ns=now - 10 * minute)  # repeated
        w.request("GET /a", trace_id="00000000000000aa", ts_ns=now)  # the id reused
        w.close()
        assert store.ingest().requests == 1
        rows = store.query("SELECT trace_id, ts FROM requests ORDER BY ts")
        assert [r["trace_id"] for r in rows] == ["00000000000000aa"] * 2
    finally:
        store.close()
        store_engines.reset()


def fill_late_evidence(w: SegmentWriter, start: int) -> None:
    """Evidence of requests stored by an earlier segment, without them: more samples and a
    blocker of a trace (they can arrive after their request), a GC pause of two hours
    earlier, agent counters."""
    stack = w.stack([("/app/shop.py", 42, "orders_page", True)])
    tid = f"{0xE000 + start:016x}"
    now = time.time_ns()
    w.event(b"P", {"id": tid, "ts": now, "samples": [[3_000_000, "cpu", stack]]})
    w.event(
        b"B",
        {"ts": now, "dur": 150_000_000, "delayed": 2, "id": tid,
         "endpoint": "GET /slow", "stacks": [[stack, 1]]},
    )  # fmt: skip
    # a pause of two hours before: the rows looked for are in two ts ranges
    early = now - 7_200 * 10**9
    w.event(b"G", {"pauses": [{"ts": early, "dur": 3_000_000, "gen": 1, "ids": [tid]}]})
    w.stats({"requests": 5})


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_copied_segment_stores_its_samples_pauses_and_counters_once(
    tmp_path: Path, engine: str
) -> None:
    """A segment copied under another name (a spool restored from a backup, a file copied
    by hand) doubles nothing: its samples, blockers, GC pauses and agent counters already
    stored are told apart by their key columns within the batch's time range, on DuckDB as
    on ClickHouse, also when their requests are not in that segment (evidence of a trace
    that arrives after its request). DuckDB stored the copy's samples, GC pauses and agent
    counters again (and the blockers of a trace whose request the copy did not hold).
    Evidence that is new (other ts, other offsets) is stored."""
    data = str(tmp_path / "data")
    store = store_engines.open_engine(engine, data)

    def copy_of(kept: str, path: str, seq: int) -> None:
        """``kept`` (a copy of segment ``path``) in the spool under another name."""
        shutil.copy(kept, path.replace("-000001.seg", f"-{seq:06d}.seg"))

    try:
        w = SegmentWriter(data, seq=1)
        fill_shop(w, 5)
        fill_evidence(w, 0)
        whole = w.close()
        kept = str(tmp_path / "whole.seg")
        shutil.copy(whole, kept)
        store.ingest()
        first = counts(store)
        assert first["samples"] == 6 and first["gc_pauses"] == 1 and first["agent_stats"] == 1
        copy_of(kept, whole, 2)
        store.ingest()
        assert counts(store) == first

        w = SegmentWriter(data, seq=1, pid=4242)
        fill_late_evidence(w, 2)
        late = w.close()
        kept = str(tmp_path / "late.seg")
        shutil.copy(late, kept)
        store.ingest()
        second = counts(store)
        grew = {k: second[k] - first[k] for k in second if second[k] != first[k]}
        assert grew == {"samples": 1, "blockers": 1, "gc_pauses": 1, "agent_stats": 1}
        copy_of(kept, late, 3)
        store.ingest()
        assert counts(store) == second
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_segment_and_its_copy_in_one_batch_store_it_once(tmp_path: Path, engine: str) -> None:
    """A segment and a copy of it ingested in the same run (one batch) store each row once:
    the batch keeps one request per trace id and ts (decode.once_per_trace) and one sample,
    blocker, GC pause and agent counter per tables.ROW_KEYS. Both engines stored the
    samples, blockers, GC pauses and agent counters twice (6 -> 12, 3 -> 6, 1 -> 2, 1 -> 2)."""
    alone = str(tmp_path / "alone")
    w = SegmentWriter(alone, seq=1)
    fill_shop(w, 5)
    fill_evidence(w, 0)
    path = w.close()
    twice = str(tmp_path / "twice")
    shutil.copytree(Path(alone) / "spool", Path(twice) / "spool")
    name = Path(path).name
    shutil.copy(path, Path(twice) / "spool" / name.replace("-000001.seg", "-000002.seg"))
    got = []
    for data in (alone, twice):
        store = store_engines.open_engine(engine, data)
        try:
            store.ingest()
            got.append(counts(store))
        finally:
            store.close()
            store_engines.reset()
    assert got[0]["samples"] == 6 and got[0]["blockers"] == 3
    assert got[1] == got[0]


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_loop_blocks_without_a_trace_id_are_told_apart_by_process_ts_and_duration(
    tmp_path: Path, engine: str
) -> None:
    """A blocker row is told apart by its trace id, process, ts and duration
    (tables.ROW_KEYS), a null trace id (the loop blocked outside any request) equal to
    another: two byte-identical records of a block outside any request are one block (a
    process cannot be blocked twice from the same instant, and a copied segment repeats
    its records), in one batch and across batches; a block of another duration at that ts
    is another block. On both engines."""
    data = str(tmp_path / "data")
    store = store_engines.open_engine(engine, data)
    ts = time.time_ns()
    try:
        for seq in (1, 2):
            w = SegmentWriter(data, seq=seq)
            stack = w.stack([("/app/loop.py", 10 * seq, "tick", True)])
            for _ in range(2):
                w.event(b"B", {"ts": ts, "dur": 150_000_000 * seq, "stacks": [[stack, 1]]})
            w.close()
            store.ingest()
        assert counts(store)["blockers"] == 2
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_copy_s_calls_go_with_it(tmp_path: Path, engine: str) -> None:
    """A request that is a copy by the requests table (its trace id within a minute of a
    stored one) leaves its calls out too, also when the stored one had no calls for the
    calls table to find (ClickHouse judged each table on its own and kept them)."""
    from perfsleuth.store.records import Batch

    now = time.time_ns()
    store = store_engines.open_engine(engine, str(tmp_path / "data"))
    try:
        store.insert_tables(Batch(), request_tables([("bb", now, "GET /b", 0)]))
        store.insert_tables(Batch(), request_tables([("bb", now + 30 * 10**9, "GET /c", 2)]))
        assert [r["endpoint"] for r in store.query("SELECT endpoint FROM requests")] == ["GET /b"]
        assert store.query("SELECT endpoint FROM calls") == []
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
def test_a_copy_s_loop_block_is_stored_once_beside_a_reused_trace_id(
    tmp_path: Path, engine: str
) -> None:
    """A segment copied, with the trace id reused ten minutes later in the copy: the copy's
    loop block is not stored again, whatever request of its trace id the batch keeps."""
    now = time.time_ns()
    minute = 60 * 10**9
    data = str(tmp_path / "data")
    tid = "00000000000000aa"
    block = {"ts": now - 10 * minute, "dur": 200_000_000, "delayed": 1, "id": tid}
    block["endpoint"] = "GET /a"
    store = store_engines.open_engine(engine, data)
    try:
        w = SegmentWriter(data, seq=1)
        w.request("GET /a", trace_id=tid, ts_ns=now - 10 * minute, dur_ms=300.0)
        w.event(b"B", block)
        w.close()
        store.ingest()
        w = SegmentWriter(data, seq=2)
        w.request("GET /a", trace_id=tid, ts_ns=now - 10 * minute, dur_ms=300.0)
        w.event(b"B", block)
        w.request("GET /b", trace_id=tid, ts_ns=now)
        w.close()
        store.ingest()
        assert store.query("SELECT count(*) AS n FROM blockers") == [{"n": 1}]
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 2}]
    finally:
        store.close()
        store_engines.reset()


@pytest.mark.parametrize("engine", ["duckdb", "chdb"])
@pytest.mark.parametrize("one_batch", [True, False])
def test_a_copied_loop_block_without_a_trace_id_is_stored_once(
    tmp_path: Path, engine: str, one_batch: bool
) -> None:
    """A segment holding a loop block outside any request (no trace id), and a copy of it,
    ingested in one batch or two: the block is stored once (it was twice on both engines:
    a null trace id was never taken for another)."""
    alone = str(tmp_path / "alone")
    w = SegmentWriter(alone, seq=1)
    stack = w.stack([("/app/loop.py", 10, "tick", True)])
    w.event(b"B", {"ts": time.time_ns(), "dur": 150_000_000, "stacks": [[stack, 1]]})
    path = w.close()
    twice = str(tmp_path / "twice")
    shutil.copytree(Path(alone) / "spool", Path(twice) / "spool")
    copy = Path(twice) / "spool" / Path(path).name.replace("-000001.seg", "-000002.seg")
    store = store_engines.open_engine(engine, twice)
    try:
        if one_batch:
            shutil.copy(path, copy)
            store.ingest()
        else:
            store.ingest()
            shutil.copy(path, copy)
            store.ingest()
        assert counts(store)["blockers"] == 1
    finally:
        store.close()
        store_engines.reset()
