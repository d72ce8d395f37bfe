"""Store queries against a real DuckDB file: top (exact percentiles), traces, trace, sql,
retention, locking, agent counters, and the schema rendered for both engines."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from perfsleuth.store import open_store, schema
from perfsleuth.store.base import StoreError, StoreLocked
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import MS, SegmentWriter, call

STACK = [
    ("app/main.py", 5, "main", True),
    ("app/views.py", 21, "order_detail", True),
    ("lib/orm.py", 80, "execute", False),
]
MINUTE = 60 * 10**9


@pytest.fixture
def data_dir(tmp_path: Any) -> str:
    return str(tmp_path / "data")


@pytest.fixture
def store(data_dir: str) -> Iterator[DuckDBStore]:
    s = DuckDBStore(data_dir)
    yield s
    s.close()


def durations(rng: random.Random, n: int) -> list[float]:
    """Lognormal durations in ms, with ns resolution like the agent's."""
    return [round(rng.lognormvariate(3, 1) * MS) / MS for _ in range(n)]


@pytest.fixture
def shop(data_dir: str, store: DuckDBStore) -> dict[str, Any]:
    """Requests over 10 minutes on three endpoints, users and tenants, web and background."""
    rng = random.Random(7)
    t0 = time.time_ns() - 20 * MINUTE
    w = SegmentWriter(data_dir)
    sent: list[dict[str, Any]] = []
    plan = [("GET /items", 400), ("POST /orders", 150), ("sync-avatars", 50)]
    for endpoint, n in plan:
        for i, dur in enumerate(durations(rng, n)):
            web = not endpoint.startswith("sync")
            calls = [call("db", f"SELECT {j}", dur_ms=dur / 10) for j in range(i % 4)]
            if i % 5 == 0:
                calls.append(call("http", "GET api/x", dur_ms=dur / 4, status=200))
            if i % 2 == 0:
                calls.append(call("cache", "GET k:?", dur_ms=0.5, hit=True))
            sent.append(
                w.request(
                    endpoint,
                    kind="web" if web else "background",
                    ts_ns=t0 + rng.randrange(10 * MINUTE),
                    dur_ms=dur,
                    status=500 if i % 20 == 0 else 200,
                    error="ValueError" if i % 50 == 1 else None,
                    user=f"u{i % 3}" if web else None,
                    tenant=f"t{i % 2}",
                    calls=calls,
                )
            )
    # pin the covered span to exactly 10 minutes
    sent.append(w.request("GET /items", ts_ns=t0, dur_ms=1.0, user="u0", tenant="t0"))
    sent.append(w.request("GET /items", ts_ns=t0 + 10 * MINUTE, dur_ms=1.0, user="u0", tenant="t0"))
    w.close()
    assert store.ingest().requests == len(sent)
    return {"sent": sent, "t0": t0}


def linear(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q, method="linear"))


# ---------------------------------------------------------------------------------- top


def test_top_percentiles_equal_numpy_and_aggregates_are_right(
    store: DuckDBStore, shop: dict[str, Any]
) -> None:
    rows = store.top()
    assert len(rows) == 3
    assert [r["total_ms"] for r in rows] == sorted((r["total_ms"] for r in rows), reverse=True)
    for row in rows:
        reqs = [s for s in shop["sent"] if s["endpoint"] == row["endpoint"]]
        d = [s["dur"] / MS for s in reqs]
        assert row["count"] == len(reqs)
        for key, q in (("p50_ms", 50), ("p95_ms", 95), ("p99_ms", 99)):
            # exact quantiles: DuckDB's interpolation may differ from numpy's in the last bit
            assert row[key] == pytest.approx(linear(d, q), rel=1e-12, abs=0)
        assert row["max_ms"] == max(d)
        assert row["total_ms"] == pytest.approx(sum(d), rel=1e-12)
        assert row["rate_per_min"] == pytest.approx(len(reqs) / 10)
        errors = [s for s in reqs if s["status"] >= 500 or s.get("error")]
        assert row["error_rate"] == pytest.approx(len(errors) / len(reqs))
        for kind in ("db", "http", "cache"):
            calls = [c for s in reqs for c in s["calls"] if c["kind"] == kind]
            assert row[f"{kind}_calls_per_request"] == pytest.approx(len(calls) / len(reqs))
            share = sum(c["dur"] for c in calls) / sum(s["dur"] for s in reqs)
            # a request's db/http/cache_ms are kept in whole microseconds
            assert row[f"{kind}_share"] == pytest.approx(min(1.0, share), rel=1e-4)
    assert set(rows[0]) == {
        "endpoint",
        "count",
        "rate_per_min",
        "p50_ms",
        "p95_ms",
        "p99_ms",
        "max_ms",
        "error_rate",
        "db_calls_per_request",
        "http_calls_per_request",
        "cache_calls_per_request",
        "db_share",
        "http_share",
        "cache_share",
        "gc_share",
        "total_ms",
    }
    json.dumps(rows)


def test_top_by_combinations_kind_and_since(store: DuckDBStore, shop: dict[str, Any]) -> None:
    sent = shop["sent"]
    rows = store.top(by=("endpoint", "user"))
    groups = {(s["endpoint"], s.get("user")) for s in sent}
    assert {(r["endpoint"], r["user"]) for r in rows} == groups
    for r in rows:
        d = [
            s["dur"] / MS
            for s in sent
            if (s["endpoint"], s.get("user")) == (r["endpoint"], r["user"])
        ]
        assert r["count"] == len(d)
        assert r["p95_ms"] == pytest.approx(linear(d, 95), rel=1e-12, abs=0)
    tenants = store.top(by=("tenant",))
    assert sorted(r["tenant"] for r in tenants) == ["t0", "t1"]
    assert sum(r["count"] for r in tenants) == len(sent)
    web = store.top(kind="web")
    assert "sync-avatars" not in {r["endpoint"] for r in web}
    bg = store.top(kind="background")
    assert [r["endpoint"] for r in bg] == ["sync-avatars"]
    hour = store.top(since=timedelta(hours=1))
    items = next(r for r in hour if r["endpoint"] == "GET /items")
    assert items["count"] == 402 and items["rate_per_min"] == pytest.approx(402 / 60)
    assert store.top(since=timedelta(minutes=1)) == []
    with pytest.raises(StoreError, match="cannot group by"):
        store.top(by=("endpoint", "password"))
    with pytest.raises(StoreError, match="unknown kind 'cron'"):
        store.top(kind="cron")


def test_queries_on_an_empty_store(store: DuckDBStore) -> None:
    assert store.top() == [] and store.traces() == [] and store.endpoints() == []
    assert store.sql("SELECT count(*) FROM calls")[1] == [(0,)]
    with pytest.raises(StoreError, match="no trace with id 'abc'"):
        store.trace("abc")


# ------------------------------------------------------------------------------ traces


def test_traces_newest_slowest_and_endpoint(store: DuckDBStore, shop: dict[str, Any]) -> None:
    sent = shop["sent"]
    newest = store.traces(limit=5)
    want = sorted(sent, key=lambda s: -s["ts"])[:5]
    assert [r["trace_id"] for r in newest] == [s["id"] for s in want]
    slow = store.traces(endpoint="POST /orders", slowest=3)
    orders = sorted((s for s in sent if s["endpoint"] == "POST /orders"), key=lambda s: -s["dur"])
    assert [r["trace_id"] for r in slow] == [s["id"] for s in orders[:3]]
    r = slow[0]
    assert set(r) == {
        "trace_id",
        "ts",
        "endpoint",
        "method",
        "path",
        "status",
        "duration_ms",
        "db_calls",
        "db_ms",
        "http_calls",
        "http_ms",
        "cache_calls",
        "cache_ms",
        "user",
        "tenant",
    }
    assert r["ts"].endswith("+00:00") and r["duration_ms"] == orders[0]["dur"] / MS
    assert store.traces(since=timedelta(minutes=1)) == []
    json.dumps(newest)


def test_unknown_endpoint_lists_close_matches(store: DuckDBStore, shop: dict[str, Any]) -> None:
    with pytest.raises(StoreError) as e:
        store.traces(endpoint="GET /item")
    assert str(e.value) == "unknown endpoint 'GET /item'; known: GET /items"
    with pytest.raises(StoreError, match=r"^unknown endpoint 'zzz'; known: "):
        store.traces(endpoint="zzz")
    assert store.endpoints() == ["GET /items", "POST /orders", "sync-avatars"]


def test_trace_resolves_fingerprints_sites_and_stacks(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir)
    body = w.request(
        "GET /orders/{id}",
        trace_id="abcdef0123456789",
        dur_ms=30,
        user="bob",
        calls=[
            call(
                "db",
                "SELECT * FROM orders WHERE id = ?",
                dur_ms=4,
                off_ms=1,
                rows=1,
                stack=STACK,
                site=("app/views.py", 21, "order_detail"),
            ),
            call(
                "http",
                "GET api.example.com/users/{id}",
                dur_ms=9,
                off_ms=6,
                status=404,
                host="api.example.com",
                site=None,
            ),
            call(
                "cache",
                "GET order:?",
                dur_ms=0.5,
                off_ms=16,
                hit=False,
                wait=2 * MS,
                stack=STACK[:2],
            ),
        ],
        attrs={"items": 3, "plan": "gold"},
        tags={"variant": "new-checkout"},
    )
    w.request("GET /orders/{id}", trace_id="abcdef9999999999")
    w.close()
    store.ingest()
    with pytest.raises(StoreError, match="ambiguous"):
        store.trace("abcdef")
    t = store.trace("ABCDEF01")  # a unique prefix, any case
    assert t["trace_id"] == body["id"] and t["user"] == "bob" and t["duration_ms"] == 30.0
    assert t["attributes"] == {"items": 3, "plan": "gold"}
    assert t["tags"] == {"variant": "new-checkout"}
    c0, c1, c2 = t["calls"]
    assert (c0["seq"], c0["kind"], c0["fingerprint"], c0["op"]) == (
        0,
        "db",
        "SELECT * FROM orders WHERE id = ?",
        "SELECT",
    )
    assert (c0["offset_ms"], c0["duration_ms"], c0["rows"]) == (1.0, 4.0, 1)
    assert c0["site"] == {"file": "app/views.py", "line": 21, "function": "order_detail"}
    assert c0["stack"] == [
        {"file": f, "line": ln, "function": fn, "app": app} for f, ln, fn, app in STACK
    ]
    assert (c1["status"], c1["host"], c1["site"], c1["stack"]) == (404, "api.example.com", None, [])
    assert (c2["hit"], c2["wait_ms"], [f["function"] for f in c2["stack"]]) == (
        False,
        2.0,
        ["main", "order_detail"],
    )
    for key in (
        "seq",
        "kind",
        "system",
        "offset_ms",
        "duration_ms",
        "fingerprint",
        "op",
        "rows",
        "bytes",
        "host",
        "status",
        "hit",
        "wait_ms",
        "error",
        "site",
        "stack",
    ):
        assert key in c0
    json.dumps(t)


# --------------------------------------------------------------------------------- sql


def test_sql_runs_read_only_statements(store: DuckDBStore, shop: dict[str, Any]) -> None:
    cols, rows = store.sql(
        "SELECT endpoint, count(*) AS n FROM requests GROUP BY ALL ORDER BY n DESC"
    )
    assert cols == ["endpoint", "n"] and rows[0] == ("GET /items", 402)
    cols, rows = store.sql("SELECT * FROM calls", limit=7)
    assert len(rows) == 7 and "fingerprint_id" in cols
    assert store.sql("EXPLAIN SELECT * FROM requests")[1]
    assert store.sql("WITH x AS (SELECT 1 AS a) SELECT a FROM x;")[1] == [(1,)]
    assert store.sql("DESCRIBE requests")[1]


@pytest.mark.parametrize(
    "query",
    [
        "INSERT INTO fingerprints VALUES (1, 'db', 'SELECT', 'x')",
        "DROP TABLE fingerprints",
        "DELETE FROM ingest_offsets",
        "UPDATE locations SET line = 0",
        "COPY requests TO '/tmp/out.csv'",
        "ATTACH '/tmp/other.duckdb' AS other",
        "CREATE TABLE t AS SELECT 1",
        "EXPLAIN ANALYZE INSERT INTO fingerprints VALUES (2, 'db', 'SELECT', 'x')",
        "SET threads = 1",
        "CHECKPOINT",
    ],
)
def test_sql_rejects_writes(store: DuckDBStore, shop: dict[str, Any], query: str) -> None:
    before = store.sql("SELECT count(*) FROM fingerprints")[1]
    with pytest.raises(StoreError, match="only read-only queries are allowed"):
        store.sql(query)
    assert store.sql("SELECT count(*) FROM fingerprints")[1] == before
    assert not os.path.exists("/tmp/out.csv") or "COPY" not in query


def test_sql_errors_carry_the_engine_message(store: DuckDBStore) -> None:
    with pytest.raises(StoreError, match="one statement at a time"):
        store.sql("SELECT 1; DROP TABLE stacks")
    with pytest.raises(StoreError, match="syntax error"):
        store.sql("SELEC 1")
    with pytest.raises(StoreError, match="no_such_table"):
        store.sql("SELECT * FROM no_such_table")
    with pytest.raises(StoreError, match="empty"):
        store.sql("  ")


# --------------------------------------------------------------------------- retention


def test_retention_drops_whole_days_and_views_keep_working(
    data_dir: str, store: DuckDBStore
) -> None:
    day = 86_400 * 10**9
    now = time.time_ns()
    w = SegmentWriter(data_dir)
    for age in (10, 9, 3, 0):
        w.request("GET /a", ts_ns=now - age * day, calls=[call()], attrs={"age": age})
    w.close()
    store.ingest()
    assert len(store.sql("SELECT * FROM requests")[1]) == 4
    dropped = store.apply_retention(7)
    assert len(dropped) == 2 and dropped == sorted(dropped)
    _, ages = store.sql("SELECT num FROM attributes ORDER BY num")
    assert ages == [(0.0,), (3.0,)]
    assert store.sql("SELECT count(*) FROM calls")[1] == [(2,)]
    _, tables = store.sql(
        "SELECT table_name FROM duckdb_tables() WHERE table_name LIKE '%\\_d%' ESCAPE '\\'"
    )
    # two days of raw rows left; rollups keep all four (90 days)
    assert len(tables) == 2 * len(schema.EVENT_TABLES) + 4 * len(schema.ROLLUP_TABLES)
    assert store.top(since=timedelta(days=7))[0]["count"] == 2
    # all data: the rollups still hold the two days whose raw rows went
    rows, answered = store.top_answered()
    assert rows[0]["count"] == 4 and answered["source"] == "rollups"
    assert store.apply_retention(7) == []
    with pytest.raises(StoreError, match="at least 1 day"):
        store.apply_retention(0)


def test_views_stay_valid_when_every_day_is_dropped(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir)
    w.request("GET /b", ts_ns=time.time_ns() - 30 * 86_400 * 10**9, calls=[call()], tags={"a": 1})
    w.close()
    store.ingest()
    assert len(store.apply_retention(7)) == 1
    for table in ("requests", "calls", "attributes"):
        assert store.sql(f"SELECT count(*) FROM {table}")[1] == [(0,)]
    assert store.top(since=timedelta(days=7)) == [] and store.endpoints() == []
    cols, _ = store.sql("SELECT * FROM calls")
    assert cols == schema.CALLS.column_names


# ------------------------------------------------------------------ locking, read-only


HOLD_SCRIPT = textwrap.dedent(
    """
    import sys
    from perfsleuth.store.duckdb_store import DuckDBStore
    s = DuckDBStore(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def test_second_writer_gets_a_clear_store_locked_error(data_dir: str) -> None:
    DuckDBStore(data_dir).close()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_SCRIPT, data_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLocked) as e:
            DuckDBStore(data_dir)
        msg = str(e.value)
        assert msg.startswith(
            f"the store {os.path.join(os.path.abspath(data_dir), 'perfsleuth.duckdb')} "
            "is in use by another perfsleuth process"
        )
        assert f"PID {proc.pid}" in msg
        with pytest.raises(StoreLocked):
            DuckDBStore(data_dir, read_only=True)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    with DuckDBStore(data_dir, read_only=True) as ro:
        assert ro.top() == []


def test_read_only_store_reads_and_refuses_writes(data_dir: str) -> None:
    ro = open_store(data_dir, read_only=True)  # before anything was ingested
    try:
        assert ro.top() == [] and ro.endpoints() == []
    finally:
        ro.close()
    with DuckDBStore(data_dir) as s:
        w = SegmentWriter(data_dir)
        w.request("GET /a", calls=[call()])
        w.close()
        s.ingest()
    with DuckDBStore(data_dir, read_only=True) as ro:
        assert ro.endpoints() == ["GET /a"]
        with pytest.raises(StoreError, match="read-only"):
            ro.ingest()
        with pytest.raises(StoreError, match="read-only"):
            ro.apply_retention(7)


# ------------------------------------------------------------------------ agent drops


def test_agent_drops_sums_status_files_and_stats_records(data_dir: str, store: DuckDBStore) -> None:
    agents = os.path.join(data_dir, "agents")
    os.makedirs(agents)
    for pid, (rec, dropped, err, ns) in {
        11: (100, 5, "OSError: disk full", 2),
        12: (50, 0, "", 3),
        13: (10, 1, "OSError: old", 1),
    }.items():
        with open(os.path.join(agents, f"box-{pid}.json"), "w") as fh:
            json.dump(
                {
                    "pid": pid,
                    "host": "box",
                    "requests_recorded": rec,
                    "requests_written": rec - dropped,
                    "dropped_queue_full": dropped,
                    "dropped_spool_full": 0,
                    "dropped_events": 4,  # evidence records: not requests, not in the total
                    "write_errors": 1 if err else 0,
                    "last_error": err,
                    "updated_ns": ns,
                    "queued": 3,
                    "service": "shop",
                },
                fh,
            )
    with open(os.path.join(agents, "broken.json"), "w") as fh:
        fh.write("{not json")
    w = SegmentWriter(data_dir, pid=99)  # a process known only from its STATS records
    w.stats({"pid": 99, "requests_recorded": 7, "dropped_queue_full": 1})
    w.stats({"pid": 99, "requests_recorded": 9, "dropped_queue_full": 2})
    w.close()
    store.ingest()
    d = store.agent_drops()
    assert d["processes"] == 4
    assert d["requests_recorded"] == 169 and d["requests_written"] == 154
    assert d["dropped_queue_full"] == 8 and d["dropped_total"] == 8
    assert d["write_errors"] == 2 and d["last_error"] == "OSError: disk full"
    assert "queued" not in d
    json.dumps(d)


# ------------------------------------------------------------------------------ schema


def test_schema_renders_for_duckdb_and_clickhouse() -> None:
    ddl = schema.duckdb_create(schema.REQUESTS, "requests_d20261123")
    assert ddl.startswith('CREATE TABLE IF NOT EXISTS "requests_d20261123" ("ts" TIMESTAMP NOT')
    assert '"user" VARCHAR' in ddl and '"duration_ms" DOUBLE' in ddl
    assert "PRIMARY KEY" in schema.duckdb_create(schema.FINGERPRINTS)
    ch = schema.clickhouse_create(schema.CALLS, cluster="c1", replicated=True, ttl_days=14)
    assert 'ON CLUSTER "c1"' in ch
    assert "ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}'" in ch
    assert "PARTITION BY toDate(ts)" in ch and 'ORDER BY ("service", "endpoint", "ts")' in ch
    assert "TTL toDateTime(ts) + INTERVAL 14 DAY" in ch and "ttl_only_drop_parts = 1" in ch
    assert '"endpoint" LowCardinality(String)' in ch
    assert '"fingerprint_id" Nullable(Int64)' in ch
    stacks = schema.clickhouse_create(schema.STACKS)
    assert "ReplacingMergeTree" in stacks and '"frames" Array(Int64)' in stacks
    for t in schema.TABLES.values():  # sort keys are never nullable (ClickHouse needs that)
        cols = {c.name: c for c in t.columns}
        assert all(not cols[k].nullable for k in t.order_by), t.name
    assert schema.parse_day_table("calls_d20261123") == (
        "calls",
        __import__("datetime").date(2026, 11, 23),
    )
    assert schema.parse_day_table("fingerprints_d20261123") is None
