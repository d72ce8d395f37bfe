"""DuckDB's compact calls (issue 20): a call row names its request by ``rid`` instead of
copying its ts, trace id, service and endpoint, keeps whole microseconds and numbers its
request's parameter hashes; the ``calls`` view reads back the logical columns. A store written
before (calls day tables with the logical layout) opens, reads and takes new rows."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from perfsleuth.analysis import find
from perfsleuth.store import schema
from perfsleuth.store.duckdb_store import DB_NAME, DuckDBStore
from perfsleuth.store.duckdb_writer import params_numbers
from perfsleuth.store.records import Batch
from perfsleuth.store.tables import Tables, _ms, whole_us
from spoolwrite import MS, SegmentWriter, call

DAY_NS = 86_400 * 10**9
LOGICAL = [c.name for c in schema.CALLS.columns]


def _loop(n: int, off_ms: float = 1.0) -> list[dict[str, Any]]:
    """An N+1 loop: the same statement with different parameters, and a repeated read."""
    out = [
        call(
            "db", "SELECT * FROM items WHERE id = ?", dur_ms=0.25, off_ms=off_ms + i, ph=i << 40 | i
        )
        for i in range(n)
    ]
    out += [call("db", "SELECT * FROM users WHERE id = ?", dur_ms=2.5, off_ms=40, ph=2**62 + 7)] * 3
    return out


def _write(data_dir: str, day_offset: int = 0, n: int = 4, prefix: str = "a") -> list[dict]:
    w = SegmentWriter(data_dir)
    ts = time.time_ns() - day_offset * DAY_NS - 60 * 10**9
    sent = [
        w.request(
            f"GET /e{i % 2}",
            trace_id=f"{prefix}{i:015x}",
            ts_ns=ts + i * MS,
            dur_ms=50 + i,
            calls=_loop(5 + i),
        )
        for i in range(n)
    ]
    w.close()
    return sent


def _calls(store: DuckDBStore) -> list[dict[str, Any]]:
    cols, rows = store.sql("SELECT * FROM calls ORDER BY trace_id, seq", limit=100_000)
    return [dict(zip(cols, r, strict=True)) for r in rows]


def _columns(path: str, table: str) -> list[str]:
    con = duckdb.connect(path, read_only=True)
    try:
        return [r[0] for r in con.execute(f"DESCRIBE {schema.quote(table)}").fetchall()]
    finally:
        con.close()


def _today() -> str:
    return f"{datetime.now(UTC):%Y%m%d}"


def test_calls_keep_a_request_number_not_its_columns(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    sent = _write(data)
    with DuckDBStore(data) as store:
        store.ingest()
        more = _write(data, prefix="b")  # a second batch into the same day: numbers go on
        store.ingest()
        calls = _calls(store)
        assert list(calls[0]) == LOGICAL
        by_trace: dict[str, list[dict[str, Any]]] = {}
        for c in calls:
            by_trace.setdefault(c["trace_id"], []).append(c)
        for req in sent + more:
            got = by_trace[req["id"]]
            assert [c["seq"] for c in got] == list(range(len(req["calls"])))
            assert {c["endpoint"] for c in got} == {req["endpoint"]}
            assert {c["service"] for c in got} == {"shop"}
            assert [c["offset_ms"] for c in got] == [c["off"] / MS for c in req["calls"]]
            assert [c["duration_ms"] for c in got] == [c["dur"] / MS for c in req["calls"]]
            ts = {c["ts"] for c in got}
            assert ts == {datetime.fromtimestamp(req["ts"] // 1000 / 1e6, UTC).replace(tzinfo=None)}
            hashes = [c["params_hash"] for c in got]
            assert len(set(hashes[:-3])) == len(hashes) - 3  # the loop's all differ
            assert len(set(hashes[-3:])) == 1  # the repeated read's are the same
            assert hashes[-3:] == [len(hashes) - 3] * 3  # numbered within the request
            assert hashes[:-3] == list(range(len(hashes) - 3))
            trace = store.trace(req["id"])
            assert [c["offset_ms"] for c in trace["calls"]] == [c["offset_ms"] for c in got]
        # the repeated read is found, the loop is not taken for one
        kinds = {f.kind for f in find(store)}
        assert "repeated_query" in kinds
    cols = _columns(os.path.join(data, DB_NAME), f"calls_d{_today()}")
    assert not {"ts", "trace_id", "service", "endpoint", "offset_ms"} & set(cols)
    assert {"rid", "offset_us", "duration_us", "params_hash"} <= set(cols)
    con = duckdb.connect(os.path.join(data, DB_NAME), read_only=True)
    try:
        (ph_type,) = con.execute(
            f"SELECT data_type FROM duckdb_columns() WHERE table_name = 'calls_d{_today()}' "
            "AND column_name = 'params_hash'"
        ).fetchone()
        assert ph_type == "INTEGER"
        rids = con.execute(f"SELECT rid FROM requests_d{_today()} ORDER BY rid").fetchall()
        assert [r[0] for r in rids] == list(range(8))
        assert "rid" not in [d[0] for d in con.execute("SELECT * FROM requests").description]
    finally:
        con.close()


def _old_store(src: str, dst: str) -> None:
    """A store as the previous version wrote it: every table of ``src`` with the logical
    layout (calls with their request's columns, requests without ``rid``), its views over
    them as that version made them."""
    os.makedirs(dst, exist_ok=True)
    con = duckdb.connect(os.path.join(dst, DB_NAME))
    try:
        con.execute(f"ATTACH '{os.path.join(src, DB_NAME)}' AS src (READ_ONLY)")
        for t in schema.GLOBAL_TABLES:
            con.execute(schema.duckdb_create(t))
            con.execute(f"INSERT INTO {schema.quote(t.name)} SELECT * FROM src.{t.name}")
        days = [
            schema.parse_day_table(r[0])
            for r in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = 'src'"
            ).fetchall()
        ]
        day_list = sorted({p[1] for p in days if p is not None and p[0] == "requests"})
        for t in schema.EVENT_TABLES:
            for d in day_list:
                name = schema.day_table(t, d)
                con.execute(schema.duckdb_create(t, name))  # the logical layout
                cols = ", ".join(schema.quote(c) for c in t.column_names)
                con.execute(
                    f"INSERT INTO {schema.quote(name)} SELECT {cols} FROM src.main.{t.name} "
                    f"WHERE ts >= '{d}' AND ts < '{d}'::DATE + 1"
                )
            con.execute(schema.duckdb_view(t, day_list))
        for t in schema.ROLLUP_TABLES:
            con.execute(schema.duckdb_view(t, []))
        con.execute("DETACH src")
    finally:
        con.close()
    assert "trace_id" in _columns(os.path.join(dst, DB_NAME), f"calls_d{_today()}")


def test_a_store_of_the_previous_layout_opens_reads_and_takes_new_rows(tmp_path: Any) -> None:
    new, old = str(tmp_path / "new"), str(tmp_path / "old")
    sent = _write(new)
    with DuckDBStore(new) as store:
        store.ingest()
        want = _calls(store)
        want_found = sorted((f.kind, f.endpoint) for f in find(store))
    _old_store(new, old)
    with DuckDBStore(old, read_only=True) as store:  # no migration: as it is
        assert _calls(store) == want
        assert [c["seq"] for c in store.trace(sent[1]["id"])["calls"]] == list(range(9))
    with DuckDBStore(old) as store:  # opened for writing: the old day keeps its layout
        assert _calls(store) == want
        assert sorted((f.kind, f.endpoint) for f in find(store)) == want_found
        assert "rid" not in store.query("SELECT * FROM requests LIMIT 1")[0]
        today = _write(old, prefix="b")  # into the day of the logical layout
        yesterday = _write(old, day_offset=1, prefix="c")  # a new day: compact
        store.ingest()
        calls = _calls(store)
        assert len(calls) == len(want) * 3
        for req in sent + today + yesterday:
            got = store.trace(req["id"])
            assert [c["duration_ms"] for c in got["calls"]] == [c["dur"] / MS for c in req["calls"]]
            assert got["endpoint"] == req["endpoint"]
    path = os.path.join(old, DB_NAME)
    assert "trace_id" in _columns(path, f"calls_d{_today()}")
    yday = datetime.fromtimestamp(yesterday[0]["ts"] / 1e9, UTC)
    assert "rid" in _columns(path, f"calls_d{yday:%Y%m%d}")
    assert "trace_id" not in _columns(path, f"calls_d{yday:%Y%m%d}")
    assert "rid" not in _columns(path, f"requests_d{_today()}")  # left as it was
    assert "rid" in _columns(path, f"requests_d{yday:%Y%m%d}")


def test_params_numbers_are_equal_exactly_when_the_hashes_are_within_a_request() -> None:
    rid = pa.array([5, 5, 5, 5, 5, 2, 2, 9], pa.int64())
    ph = pa.array([2**62 + 1, 1, None, 1 + 2**40, 1, 1, 1, None], pa.int64())
    got = params_numbers(rid, ph).to_pylist()
    # request 5: 1 < 1 + 2**40 < 2**62 + 1 (the low 32 bits of all three are the same)
    assert got == [2, 0, None, 1, 0, 0, 0, None]
    assert params_numbers(pa.array([], pa.int64()), pa.array([], pa.int64())).to_pylist() == []


def test_a_requests_db_ms_is_the_sum_of_its_calls_stored_durations(tmp_path: Any) -> None:
    """Requests' db/http/cache_ms and the compact calls round whole microseconds the same way
    (halves up): a 2,500 ns call is 3 us, and its request's db_ms 0.003 (was 0.002: np.round
    took halves to even, DuckDB's round() away from zero, and the sum was rounded, not its
    calls)."""
    data = str(tmp_path / "data")
    durs = [0.0025, 0.0035, 0.0015, 1.0005, 0.0004995, 0.0025, 0.0105]  # ms
    w = SegmentWriter(data)
    sent = [
        w.request(
            "GET /r",
            trace_id=f"d{i:015x}",
            dur_ms=20,
            calls=[call("db", "SELECT 1", dur_ms=d, off_ms=j) for j, d in enumerate(durs[i:])]
            + [call("cache", "GET k", dur_ms=0.0025, off_ms=9)],
        )
        for i in range(3)
    ]
    w.close()
    with DuckDBStore(data) as store:
        store.ingest()
        for req in sent:
            got = store.trace(req["id"])
            stored = {
                k: sum(round(c["duration_ms"] * 1000) for c in got["calls"] if c["kind"] == k)
                for k in ("db", "cache")
            }
            assert round(got["db_ms"] * 1000) == stored["db"]
            assert got["db_ms"] == stored["db"] / 1000
            assert got["cache_ms"] == stored["cache"] / 1000 == 0.003
        first = store.trace(sent[0]["id"])["calls"]
        assert [round(c["duration_ms"] * 1000) for c in first][:4] == [3, 4, 2, 1001]


def test_whole_us_rounds_halves_up_as_the_compact_calls_do() -> None:
    ns = np.array([0, 499, 500, 1500, 2500, 3500, 10**12 + 500, 2_500_000_000_500], np.int64)
    want = [0, 0, 1, 2, 3, 4, 10**9 + 1, 2_500_000_001]
    assert whole_us(ns).tolist() == want
    con = duckdb.connect()
    try:
        con.register("t", pa.table({"duration_ms": _ms(pa.array(ns))}))
        got = con.execute(f"SELECT {schema._COMPACT_WRITE['duration_us']} FROM t").fetchall()
    finally:
        con.close()
    assert [r[0] for r in got] == want


def test_the_compact_calls_layout_is_made_from_calls() -> None:
    assert schema.duckdb_compact_calls(schema.CALLS) == schema.DUCKDB_CALLS
    extra = schema.Column("retries", "int32")
    wider = schema.Table("calls", (*schema.CALLS.columns, extra), by_day=True)
    compact = schema.duckdb_compact_calls(wider)
    assert compact.columns == (*schema.DUCKDB_CALLS.columns, extra)
    names = compact.column_names
    assert names[0] == "rid" and not {"ts", "trace_id", "service", "endpoint"} & set(names)
    assert {"offset_us", "duration_us", "wait_us"} <= set(names)


def test_a_compact_calls_day_missing_a_column_still_reads(tmp_path: Any) -> None:
    """A compact calls day table written without a column its version did not have (here:
    ``wait_us`` and ``unfinished`` dropped) reads it as NULL, read-only; opened for writing,
    the migration adds it back and new rows fill it."""
    data = str(tmp_path / "data")
    sent = _write(data)
    with DuckDBStore(data) as store:
        store.ingest()
        want = _calls(store)
    con = duckdb.connect(os.path.join(data, DB_NAME))
    try:
        for col in ("wait_us", "unfinished"):
            con.execute(f"ALTER TABLE calls_d{_today()} DROP COLUMN {col}")
    finally:
        con.close()
    blank = [{**c, "wait_ms": None, "unfinished": None} for c in want]
    with DuckDBStore(data, read_only=True) as store:
        assert _calls(store) == blank
        got = store.trace(sent[1]["id"])["calls"]
        assert [c["seq"] for c in got] == list(range(9))
        assert {c["wait_ms"] for c in got} == {None}
    with DuckDBStore(data) as store:
        assert _calls(store) == blank
        more = _write(data, prefix="b")
        store.ingest()
        got = store.trace(more[0]["id"])["calls"]
        assert [c["duration_ms"] for c in got] == [c["dur"] / MS for c in more[0]["calls"]]
    assert {"wait_us", "unfinished"} <= set(
        _columns(os.path.join(data, DB_NAME), f"calls_d{_today()}")
    )


def _logical_tables(day: datetime, prefix: str) -> Tables:
    """Requests and calls as other code may build them: the logical columns, no ``rid``."""
    ts = day.replace(tzinfo=None)
    req = pa.Table.from_pylist(
        [
            {
                "ts": ts,
                "trace_id": f"{prefix}{i}",
                "service": "other",
                "kind": "web",
                "endpoint": f"GET /x{i}",
                "duration_ms": 10.0,
                "db_calls": 2 - i,
                "db_ms": 2.0 - i,
                "http_calls": 0,
                "http_ms": 0.0,
                "cache_calls": 0,
                "cache_ms": 0.0,
                "calls_dropped": 0,
            }
            for i in range(2)
        ],
        schema=schema.REQUESTS.arrow_schema(),
    )
    calls = pa.Table.from_pylist(
        [
            {
                "ts": ts,
                "trace_id": f"{prefix}{i}",
                "service": "other",
                "endpoint": f"GET /x{i}",
                "seq": seq,
                "kind": "db",
                "duration_ms": 1.0,
                "offset_ms": float(seq),
                "params_hash": 7,
            }
            for i, seq in ((1, 0), (0, 0), (0, 1))
        ],
        schema=schema.CALLS.arrow_schema(),
    )
    return Tables(days={ts.date(): {"requests": req, "calls": calls}})


def test_insert_tables_numbers_requests_given_without_rid(tmp_path: Any) -> None:
    """insert_tables takes requests and calls without ``rid`` (KeyError before): requests are
    numbered at insert, calls find theirs by trace id; a day of the logical layout takes
    them as they are."""
    now = datetime.now(UTC)
    new, old = str(tmp_path / "new"), str(tmp_path / "old")
    _write(new)
    with DuckDBStore(new) as store:
        store.ingest()
    _old_store(new, old)
    for data, prefix in ((new, "n"), (old, "o")):
        with DuckDBStore(data) as store:
            store.insert_tables(Batch(), _logical_tables(now, prefix))
            for i, n in ((0, 2), (1, 1)):
                got = store.trace(f"{prefix}{i}")
                assert got["endpoint"] == f"GET /x{i}"
                assert [c["offset_ms"] for c in got["calls"]] == [float(s) for s in range(n)]
                assert {c["params_hash"] for c in got["calls"]} == {0 if data == new else 7}
    cols = _columns(os.path.join(new, DB_NAME), f"requests_d{_today()}")
    assert "rid" in cols
    con = duckdb.connect(os.path.join(new, DB_NAME), read_only=True)
    try:
        rids = con.execute(f"SELECT rid FROM requests_d{_today()} ORDER BY rid").fetchall()
    finally:
        con.close()
    assert [r[0] for r in rids] == list(range(6))  # after the 4 ingested


def test_request_numbers_go_on_after_a_rolled_back_commit(tmp_path: Any, monkeypatch: Any) -> None:
    """The writer keeps each day's next ``rid`` (no max(rid) a commit); a commit that fails
    rolls its numbers back with its rows, and a reader sees a day made after it looked."""
    data = str(tmp_path / "data")
    now = datetime.now(UTC)
    with DuckDBStore(data) as store:
        store.insert_tables(Batch(), _logical_tables(now, "a"))
        assert store.trace("a0")["calls"]  # the layouts looked up, and kept
        real = store._commit

        def fail() -> None:
            raise duckdb.IOException("disk trouble")

        monkeypatch.setattr(store, "_commit", fail)
        with pytest.raises(duckdb.IOException):
            store.insert_tables(Batch(), _logical_tables(now, "b"))
        monkeypatch.setattr(store, "_commit", real)
        store.insert_tables(Batch(), _logical_tables(now, "c"))
        _write(data, day_offset=1, prefix="e")  # a new day, after the reader looked
        store.ingest()
        assert len(store.trace("e000000000000001")["calls"]) == 9
        assert [c["seq"] for c in store.trace("c0")["calls"]] == [0, 1]
        rids = store.query(f"SELECT rid, trace_id FROM requests_d{_today()} ORDER BY rid")
    assert [(r["rid"], r["trace_id"]) for r in rids] == [(0, "a0"), (1, "a1"), (2, "c0"), (3, "c1")]
