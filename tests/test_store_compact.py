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
import pyarrow as pa

from perfsleuth.analysis import find
from perfsleuth.store import schema
from perfsleuth.store.duckdb_store import DB_NAME, DuckDBStore
from perfsleuth.store.duckdb_writer import params_numbers
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
