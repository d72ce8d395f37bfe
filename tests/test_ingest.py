"""Ingest from the spool into DuckDB: exactly once, across crashes, growing segments, damage
and garbage. Spools are written with the real wire encoder (tests/spoolwrite.py)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from perfsleuth.store.base import IngestReport
from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.wire import REQUESTS
from perfsleuth.wire.calls import NULL
from perfsleuth.wire.segment import REC_MAGIC
from spoolwrite import MS, SegmentWriter, call

STACK = [("app/main.py", 5, "main", True), ("lib/orm.py", 80, "query", False)]


@pytest.fixture
def data_dir(tmp_path: Any) -> str:
    d = str(tmp_path / "data")
    os.makedirs(os.path.join(d, "spool"))
    return d


@pytest.fixture
def store(data_dir: str) -> Iterator[DuckDBStore]:
    s = DuckDBStore(data_dir)
    yield s
    s.close()


def count(store: DuckDBStore, table: str = "requests") -> int:
    return int(store.sql(f"SELECT count(*) FROM {table}")[1][0][0])


def whole_us_ms(ns: int) -> float:
    """ns in ms as DuckDB's compact calls keep them: whole microseconds, halves up."""
    return (ns + 500) // 1000 / 1000


def trace_ids(store: DuckDBStore) -> list[str]:
    return sorted(r[0] for r in store.sql("SELECT trace_id FROM requests", limit=10**9)[1])


def spool_names(data_dir: str) -> list[str]:
    d = os.path.join(data_dir, "spool")
    return sorted(n for n in os.listdir(d) if not os.path.isdir(os.path.join(d, n)))


def write_segments(data_dir: str, n_segments: int, per_segment: int) -> list[str]:
    """Closed segments of requests with two calls each; returns all trace ids."""
    ids = []
    for s in range(n_segments):
        w = SegmentWriter(data_dir, seq=s + 1)
        for i in range(per_segment):
            body = w.request(
                f"GET /e{i % 3}",
                dur_ms=5 + i,
                calls=[call(dur_ms=1, stack=STACK), call("cache", "GET user:?", dur_ms=0.5)],
            )
            ids.append(body["id"])
        w.close()
    return sorted(ids)


def raw_record(rtype: bytes, payload: bytes) -> bytes:
    """A record with a valid checksum around any payload (even one that is not JSON)."""
    crc = zlib.crc32(payload, zlib.crc32(rtype))
    return struct.pack("<2scII", REC_MAGIC, rtype, len(payload), crc) + payload


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------ basics


def test_ingest_rows_content_and_removes_closed_segments(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir, service="shop")
    sent = w.request(
        "POST /orders",
        dur_ms=42.5,
        status=201,
        user="alice",
        tenant="acme",
        cpu_ns=7 * MS,
        req_bytes=100,
        resp_bytes=2000,
        calls=[
            call(
                "db",
                "INSERT INTO orders VALUES (?)",
                dur_ms=3,
                off_ms=1,
                rows=1,
                ph=99,
                stack=STACK,
            ),
            call("db", "SELECT * FROM stock WHERE id = ?", dur_ms=2, off_ms=5, rows=10),
            call(
                "http",
                "POST pay.example.com/charge",
                dur_ms=20,
                off_ms=8,
                status=200,
                host="pay.example.com",
                wait=MS // 2,
            ),
            call("cache", "SET order:?", dur_ms=0.25, off_ms=30, hit=False, error="Timeout"),
        ],
        attrs={"rows_loaded": 12, "plan": "gold", "ratio": 0.5},
        tags={"variant": "B"},
    )
    w.close()
    rep = store.ingest()
    assert (rep.requests, rep.calls, rep.segments_read, rep.segments_done) == (1, 4, 1, 1)
    assert not rep.damaged and not rep.quarantined and not rep.truncated_tails
    assert spool_names(data_dir) == []
    cols, rows = store.sql("SELECT * FROM requests")
    r = dict(zip(cols, rows[0], strict=True))
    assert r["trace_id"] == sent["id"] and r["service"] == "shop" and r["host"] == "testbox"
    assert (r["kind"], r["method"], r["endpoint"], r["path"]) == (
        "web",
        "POST",
        "POST /orders",
        "/orders",
    )
    assert (r["status"], r["duration_ms"], r["cpu_ms"], r["user"], r["tenant"]) == (
        201,
        42.5,
        7.0,
        "alice",
        "acme",
    )
    assert (r["req_bytes"], r["resp_bytes"], r["pid"], r["calls_dropped"]) == (100, 2000, 4242, 0)
    assert (r["db_calls"], r["db_ms"], r["http_calls"], r["http_ms"]) == (2, 5.0, 1, 20.0)
    assert (r["cache_calls"], r["cache_ms"]) == (1, 0.25)
    assert r["ts"].timestamp() == pytest.approx(sent["ts"] / 1e9, abs=2e-6)  # µs truncation
    cols, rows = store.sql("SELECT * FROM calls ORDER BY seq")
    calls = [dict(zip(cols, row, strict=True)) for row in rows]
    assert [c["seq"] for c in calls] == [0, 1, 2, 3]
    assert {c["endpoint"] for c in calls} == {"POST /orders"}
    assert {c["trace_id"] for c in calls} == {sent["id"]}
    assert [c["kind"] for c in calls] == ["db", "db", "http", "cache"]
    assert [c["offset_ms"] for c in calls] == [1.0, 5.0, 8.0, 30.0]
    # DuckDB numbers a request's distinct parameter hashes (its only one here: 99)
    assert (calls[0]["rows"], calls[0]["params_hash"]) == (1, 0)
    # the agent's call site is the innermost application frame of the call's stack; a call
    # given no stack has its site's frame alone
    t = store.trace(sent["id"])
    frames = [(f["file"], f["line"], f["function"], f["app"]) for f in t["calls"][0]["stack"]]
    assert frames == STACK
    assert t["calls"][0]["site"] == {"file": "app/main.py", "line": 5, "function": "main"}
    assert [f["function"] for f in t["calls"][1]["stack"]] == ["show"]
    assert calls[0]["stack_id"] != calls[1]["stack_id"] == calls[2]["stack_id"]
    assert (calls[2]["status"], calls[2]["host"], calls[2]["wait_ms"]) == (
        200,
        "pay.example.com",
        0.5,
    )
    assert (calls[3]["hit"], calls[3]["error"]) == (False, "Timeout")
    _, attrs = store.sql("SELECT kind, key, value, num FROM attributes ORDER BY kind, key")
    assert attrs == [
        ("attr", "plan", "gold", None),
        ("attr", "ratio", "0.5", 0.5),
        ("attr", "rows_loaded", "12", 12.0),
        ("tag", "variant", "B", None),
    ]
    assert count(store, "fingerprints") == 4 and count(store, "stacks") == 2
    assert count(store, "locations") == 3  # two stack frames and the other calls' site


def test_ingest_twice_adds_nothing(data_dir: str, store: DuckDBStore) -> None:
    ids = write_segments(data_dir, 3, 20)
    assert store.ingest().requests == 60
    rep = store.ingest()
    assert (rep.requests, rep.segments_read) == (0, 0)
    assert trace_ids(store) == ids
    assert count(store, "calls") == 120


def test_dictionaries_are_global_and_inserted_once(data_dir: str, store: DuckDBStore) -> None:
    # Every segment repeats the L/S/F records it uses; the tables hold each id once.
    write_segments(data_dir, 4, 5)
    store.ingest()
    write_segments(data_dir, 2, 5)
    store.ingest()
    assert count(store, "fingerprints") == 2
    assert count(store, "stacks") == 2  # STACK, and the cache call's site alone
    assert count(store, "locations") == 3


def test_batches_split_segments_without_loss(data_dir: str, store: DuckDBStore) -> None:
    ids = write_segments(data_dir, 5, 33)
    store.batch_requests = 10
    seen: list[tuple[int, int]] = []
    rep = store.ingest(progress=lambda done, total: seen.append((done, total)))
    assert rep.requests == 165 and rep.segments_done == 5
    assert trace_ids(store) == ids
    assert len(seen) >= 16 and seen[-1][0] == seen[-1][1]
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_report_to_dict_is_json_ready(data_dir: str, store: DuckDBStore) -> None:
    with open(os.path.join(data_dir, "spool", "junk.seg"), "wb") as fh:
        fh.write(b"garbage" * 10)
    d = store.ingest().to_dict()
    json.dumps(d)
    assert d["damaged"][0]["segment"] == "junk.seg" and d["quarantined"] == ["junk.seg"]


# -------------------------------------------------------------------- exactly once


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from perfsleuth.store.duckdb_store import DuckDBStore

    class Slow(DuckDBStore):
        batch_requests = 25
        group_requests = 25  # a transaction per batch
        commits = 0

        def _commit(self):
            Slow.commits += 1
            print("inserted", flush=True)
            if Slow.commits == 3:
                time.sleep(300)  # killed here: the rows are in, the transaction is open
            super()._commit()

    Slow(sys.argv[1]).ingest(progress=lambda done, total: print("committed", flush=True))
    """
)


def test_ingest_killed_mid_transaction_then_rerun_gives_exactly_n(data_dir: str) -> None:
    ids = write_segments(data_dir, 12, 20)  # 240 requests, ~10 transactions
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, data_dir], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if lines.count("inserted") == 3:  # two batches committed, the third in flight
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lines == ["inserted", "committed", "inserted", "committed", "inserted"]
    with DuckDBStore(data_dir) as store:
        assert count(store) == 50  # the two committed batches, nothing of the third
        assert len(spool_names(data_dir)) < 12  # and their finished segments are gone
        rep = store.ingest()
        assert rep.requests == 190
        assert trace_ids(store) == ids
        assert count(store, "calls") == 480
        assert spool_names(data_dir) == []


def test_a_group_of_wide_requests_commits_at_its_byte_cap(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog's group is committed once its batches' request payloads reach group_bytes,
    well before group_requests when the requests are wide (40 calls and a 1 kB attribute
    each): each
    commit comes at the first batch that takes the group's bytes to the cap."""
    w = SegmentWriter(data_dir, seq=1)
    for i in range(120):
        calls = [call(dur_ms=1 + j, stack=STACK) for j in range(40)]  # a wide request
        w.request(f"GET /e{i % 3}", attrs={"blob": os.urandom(500).hex()}, calls=calls)
    w.close()
    monkeypatch.setattr(store, "batch_requests", 10)
    monkeypatch.setattr(store, "group_requests", 1_000)  # not reached
    monkeypatch.setattr(store, "group_bytes", 50_000, raising=False)  # 2-3 batches
    events: list[int] = []  # each batch's request payload bytes; -1: a commit
    real_stage, real_commit = store.stage, store._commit

    def stage(batch: Any, tables: Any) -> None:
        events.append(batch.request_bytes)
        real_stage(batch, tables)

    def commit() -> None:
        events.append(-1)
        real_commit()

    monkeypatch.setattr(store, "stage", stage)
    monkeypatch.setattr(store, "_commit", commit)
    assert store.ingest().requests == 120
    assert count(store) == 120
    staged = 0
    commits = 0
    for n in events:
        if n < 0:
            assert staged >= 50_000 or commits == events.count(-1) - 1  # the cap, or the end
            staged, commits = 0, commits + 1
        else:
            assert staged < 50_000  # a group at its cap was committed before this batch
            staged += n
    assert events.count(-1) >= 4 and events[-1] == -1 and staged == 0


GROUP_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from perfsleuth.store.duckdb_store import DuckDBStore

    class Slow(DuckDBStore):
        batch_requests = 25
        group_requests = 100  # four batches a transaction
        commits = 0

        def _commit(self):
            Slow.commits += 1
            print("commit", flush=True)
            if Slow.commits == 2:
                time.sleep(300)  # killed here: four batches are in, the transaction is open
            super()._commit()

    Slow(sys.argv[1]).ingest(progress=lambda done, total: print("batch", flush=True))
    """
)


def test_ingest_killed_mid_group_transaction_then_rerun_gives_exactly_n(data_dir: str) -> None:
    ids = write_segments(data_dir, 12, 20)  # 240 requests: groups of 100, 100 and 40
    proc = subprocess.Popen(
        [sys.executable, "-c", GROUP_KILL_SCRIPT, data_dir], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if lines.count("commit") == 2:  # one group committed, the second in flight
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # progress follows each batch, after the commit its batch completes
    assert lines == ["batch"] * 3 + ["commit"] + ["batch"] * 4 + ["commit"]
    with DuckDBStore(data_dir) as store:
        assert count(store) == 100  # the first group, nothing of the second
        assert 6 <= len(spool_names(data_dir)) < 12  # the first group's finished segments gone
        rep = store.ingest()
        assert rep.requests == 140
        assert trace_ids(store) == ids
        assert count(store, "calls") == 480
        assert spool_names(data_dir) == []


def test_a_backlog_is_committed_in_one_transaction(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches are converted 25 requests at a time and committed together: one commit, one
    rollup insert per day (nothing for the compaction to merge), the segments retired after
    it, and the same rows as a transaction per batch."""
    ids = write_segments(data_dir, 12, 20)
    monkeypatch.setattr(store, "batch_requests", 25)
    commits: list[int] = []
    real = store._commit

    def commit() -> None:
        commits.append(len(spool_names(data_dir)))
        real()

    monkeypatch.setattr(store, "_commit", commit)
    rep = store.ingest()
    assert commits == [12]  # one transaction; every segment still in the spool at its commit
    assert (rep.requests, rep.calls, rep.segments_done) == (240, 480, 12)
    assert trace_ids(store) == ids and count(store, "calls") == 480
    assert spool_names(data_dir) == []
    rolled = store.query("SELECT sum(requests) AS n FROM rollup_stats WHERE res = 60")
    assert rolled[0]["n"] == 240
    assert store.compact_rollups() == []


def test_a_group_that_fails_mid_way_stores_none_of_it(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of a group failing rolls back the batches staged before it (their day tables
    included); the same store then ingests everything, once."""
    ids = write_segments(data_dir, 6, 20)
    monkeypatch.setattr(store, "batch_requests", 25)
    real = store._insert_requests
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("insert failed")
        real(*args, **kwargs)

    monkeypatch.setattr(store, "_insert_requests", failing)
    with pytest.raises(RuntimeError):
        store.ingest()
    assert count(store) == 0 and len(spool_names(data_dir)) == 6
    rep = store.ingest()
    assert rep.requests == 120 and trace_ids(store) == ids
    assert count(store, "calls") == 240 and spool_names(data_dir) == []
    rolled = store.query("SELECT sum(requests) AS n FROM rollup_stats WHERE res = 60")
    assert rolled[0]["n"] == 120


def test_finished_segment_left_behind_is_never_reingested(
    data_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from perfsleuth.store import spool

    ids = write_segments(data_dir, 2, 10)
    with monkeypatch.context() as m, DuckDBStore(data_dir) as s:
        # as if the process died right after the commit
        m.setattr(spool, "retire", lambda *args, **kwargs: (0, []))
        s.ingest()
    assert len(spool_names(data_dir)) == 2
    with DuckDBStore(data_dir) as store:
        rep = store.ingest()
        assert rep.requests == 0 and rep.segments_done == 2
        assert trace_ids(store) == ids
        assert spool_names(data_dir) == []


def test_open_segment_is_read_incrementally_as_it_grows(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir, pid=os.getpid())  # a live writer: this process
    for i in range(10):
        w.request("GET /a", dur_ms=i + 1, calls=[call()])
    assert store.ingest().requests == 10
    assert spool_names(data_dir) == [w.name]  # still open: kept
    for i in range(5):
        w.request("GET /b", dur_ms=i + 1, calls=[call()])
    rec = batch_record(1, id=[-1], ts=[w.requests[0]["ts"]], kind=["web"], endpoint=["GET /c"])
    w.write(rec[:20])  # a record being written right now
    rep = store.ingest()
    assert rep.requests == 5 and not rep.damaged and not rep.truncated_tails
    assert store.ingest().requests == 0
    w.write(rec[20:])
    w.close()
    rep = store.ingest()
    assert (rep.requests, rep.segments_done) == (1, 1) and not rep.truncated_tails
    assert trace_ids(store) == sorted([r["id"] for r in w.requests] + ["f" * 16])
    assert count(store, "calls") == 15
    assert spool_names(data_dir) == []
    # the header was read in the first pass only; later passes still know the service
    assert store.sql("SELECT DISTINCT service, host, pid FROM requests")[1] == [
        ("shop", "testbox", os.getpid())
    ]


def test_open_segment_of_dead_writer_is_finished_once_idle(
    data_dir: str, store: DuckDBStore
) -> None:
    w = SegmentWriter(data_dir, pid=dead_pid())
    for _ in range(3):
        w.request("GET /a")
    w.write(batch_record(1)[:-3])  # torn by the crash
    rep = store.ingest()  # changed just now: maybe the writer is only slow
    assert rep.requests == 3 and spool_names(data_dir) == [w.name]
    store.open_idle_seconds = 0
    rep = store.ingest()
    assert (rep.requests, rep.segments_done, rep.truncated_tails) == (0, 1, [w.name])
    assert spool_names(data_dir) == [] and count(store) == 3


def test_truncated_tail_of_closed_segment_is_reported(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir)
    for _ in range(4):
        w.request("GET /a")
    w.write(batch_record(1)[:15])
    w.close()
    rep = store.ingest()
    assert rep.requests == 4 and rep.truncated_tails == [os.path.basename(w.path)]
    assert not rep.damaged and spool_names(data_dir) == []


# -------------------------------------------------------------------- damage, garbage


def test_corrupt_segment_keeps_good_records_and_is_quarantined(
    data_dir: str, store: DuckDBStore
) -> None:
    w = SegmentWriter(data_dir)
    ends = []
    for i in range(30):
        w.request("GET /a", dur_ms=i + 1, calls=[call(stack=STACK)])
        ends.append(os.path.getsize(w.path))
    path = w.close()
    with open(path, "r+b") as fh:  # flip bytes inside the 16th request record
        fh.seek(ends[14] + 40)
        b = fh.read(4)
        fh.seek(ends[14] + 40)
        fh.write(bytes(x ^ 0xFF for x in b))
    with open(path, "rb") as fh:
        original = fh.read()
    rep = store.ingest()
    name = os.path.basename(path)
    assert rep.requests == 29
    assert [(d.segment, d.offset, d.reason) for d in rep.damaged] == [
        (name, ends[14], "checksum mismatch")
    ]
    assert rep.quarantined == [name] and spool_names(data_dir) == []
    with open(os.path.join(data_dir, "spool", "corrupt", name), "rb") as fh:
        assert fh.read() == original  # nothing lost: kept for inspection
    lost = w.requests[15]["id"]
    assert trace_ids(store) == sorted(r["id"] for r in w.requests if r["id"] != lost)
    rep = store.ingest()
    assert rep.requests == 0 and not rep.damaged and count(store) == 29


def test_damage_in_open_segment_is_reported_once_and_quarantined_when_closed(
    data_dir: str, store: DuckDBStore
) -> None:
    w = SegmentWriter(data_dir, pid=os.getpid())
    w.request("GET /a")
    w.write(b"\xa5\x5aNnonsense bytes here")
    w.request("GET /b")
    rep = store.ingest()
    assert rep.requests == 2 and len(rep.damaged) == 1 and not rep.quarantined
    w.request("GET /c")
    rep = store.ingest()
    assert rep.requests == 1 and not rep.damaged
    w.close()
    rep = store.ingest()
    assert rep.quarantined == [os.path.basename(w.path)] and count(store) == 3


def test_garbage_files_are_reported_and_quarantined(data_dir: str, store: DuckDBStore) -> None:
    write_segments(data_dir, 1, 5)
    spool = os.path.join(data_dir, "spool")
    with open(os.path.join(spool, "garbage.seg"), "wb") as fh:
        fh.write(os.urandom(5000))
    with open(os.path.join(spool, "junk.open"), "wb") as fh:  # no writer named: final when idle
        fh.write(b"PSLSEG\x00\x01" + b"\x00" * 100)
    with open(os.path.join(spool, "empty.seg"), "wb"):
        pass  # created by a writer that died at once: nothing to say
    with open(os.path.join(spool, "short.seg"), "wb") as fh:
        fh.write(b"PSL")
    with open(os.path.join(spool, "notes.txt"), "w") as fh:
        fh.write("not ours: left alone")
    store.open_idle_seconds = 0
    rep = store.ingest()
    assert rep.requests == 5
    assert {d.segment for d in rep.damaged} == {"garbage.seg", "junk.open"}
    assert sorted(rep.quarantined) == ["garbage.seg", "junk.open"]
    assert rep.truncated_tails == ["short.seg"]
    assert spool_names(data_dir) == ["notes.txt"]
    assert sorted(os.listdir(os.path.join(spool, "corrupt"))) == ["garbage.seg", "junk.open"]
    assert store.ingest() == IngestReport()


def test_undecodable_payload_with_valid_checksum_is_damage(
    data_dir: str, store: DuckDBStore
) -> None:
    w = SegmentWriter(data_dir)
    w.request("GET /a")
    at = os.path.getsize(w.path)
    w.write(raw_record(REQUESTS, b'{"id": "broken'))
    w.request("GET /b")
    w.close()
    rep = store.ingest()
    assert rep.requests == 2
    assert [(d.offset, d.reason) for d in rep.damaged] == [(at, "undecodable payload")]
    assert rep.quarantined == [os.path.basename(w.path)]


def test_requests_are_split_into_day_tables(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir)
    day = 86_400 * 10**9
    base = w.request("GET /a", calls=[call()])["ts"]
    w.request("GET /a", ts_ns=base - 3 * day, calls=[call(), call()], attrs={"k": 1})
    w.request("GET /a", ts_ns=base - 3 * day + 1, calls=[call()])
    w.close()
    store.ingest()
    _, rows = store.sql(
        "SELECT table_name FROM duckdb_tables() WHERE table_name LIKE 'calls_d%' ORDER BY 1"
    )
    assert len(rows) == 2
    _, per_table = store.sql(
        f"SELECT (SELECT count(*) FROM {rows[0][0]}), (SELECT count(*) FROM {rows[1][0]})"
    )
    assert per_table == [(3, 1)]
    assert count(store, "attributes") == 1


# ------------------------------------------------------------------ the real agent


AGENT_SCRIPT = textwrap.dedent(
    """
    import sys
    import perfsleuth.agent as ps
    from perfsleuth.agent import recorder

    assert ps.start(sys.argv[1], service="agent-it", instrument=False, flush_seconds=0.05)

    def load(i):
        c = recorder.start_call("db", "sqlite", f"SELECT * FROM t WHERE id = {i}", (i,))
        c.rows = 1
        c.finish()

    for i in range(20):
        with ps.task("job"):
            ps.attr("n", i)
            load(i)
    """
)


def test_segments_of_the_real_agent(data_dir: str) -> None:
    pytest.importorskip("perfsleuth.wire.fingerprint")
    from spoolread import read_spool

    subprocess.run([sys.executable, "-c", AGENT_SCRIPT, data_dir], check=True, timeout=60)
    sent = read_spool(data_dir)
    assert len(sent) == 20
    with DuckDBStore(data_dir) as store:
        rep = store.ingest()
        assert (rep.requests, rep.calls) == (20, 20) and not rep.damaged
        for req in sent:
            got = store.trace(req["id"])
            assert got["endpoint"] == "job" and got["kind"] == "background"
            assert got["service"] == "agent-it"
            assert got["attributes"] == req["attrs"]
            (c,) = got["calls"]
            want = req["calls"][0]
            assert (c["fingerprint"], c["op"], c["rows"]) == (want["fingerprint"], want["op"], 1)
            assert c["site"]["file"] == want["site_loc"]["file"]
            assert c["site"]["line"] == want["site_loc"]["line"]
            assert [f["function"] for f in c["stack"]] == [
                loc["func"] for loc in want["stack_locs"]
            ]


BINARY_SCRIPT = textwrap.dedent(
    """
    import sqlite3, sys
    import perfsleuth.agent as ps
    from perfsleuth.agent import recorder
    ps.start(sys.argv[1], service="bin")
    con = sqlite3.connect(":memory:")
    con.execute("create table t (id integer primary key, v text)")
    req = recorder.begin("web", "GET", "/b")
    req.endpoint = "GET /b"
    con.executemany("insert into t values (?, ?)", [(i, "x") for i in range(5)])
    for i in range(3):
        con.execute("select v from t where id = ?", (1,)).fetchall()
    try:
        con.execute("select nope from t")
    except sqlite3.OperationalError:
        pass
    recorder.end(req)
    ps.flush()
    """
)


def test_records_of_two_writers_ingest_together(data_dir: str) -> None:
    """The agent's records from a real process and from the tests' writer land in one batch,
    each call with its values."""
    subprocess.run([sys.executable, "-c", BINARY_SCRIPT, data_dir], check=True, timeout=60)
    w = SegmentWriter(data_dir, service="json-writer")
    body = w.request("GET /j", dur_ms=3, calls=[call(dur_ms=1, rows=2), call("cache", "GET k")])
    w.close()
    with DuckDBStore(data_dir) as store:
        rep = store.ingest()
        assert (rep.requests, rep.calls) == (2, 2 + 5) and not rep.damaged
        (b,) = store.traces(endpoint="GET /b")
        got = store.trace(b["trace_id"])
        calls = got["calls"]
        assert [c["seq"] for c in calls] == [0, 1, 2, 3, 4]
        assert [c["op"] for c in calls] == ["INSERT", "SELECT", "SELECT", "SELECT", "SELECT"]
        assert calls[0]["rows"] == 5 and calls[0]["error"] is None
        assert [c["rows"] for c in calls[1:4]] == [1, 1, 1]
        # the same values three times: one parameter hash
        assert len({c["params_hash"] for c in calls[1:4]}) == 1
        assert calls[1]["params_hash"] is not None
        assert calls[4]["error"] == "OperationalError" and calls[4]["hit"] is None
        assert all(c["system"] == "sqlite" and c["kind"] == "db" for c in calls)
        assert all(c["site"]["function"] == "<module>" for c in calls)
        assert {c["unfinished"] for c in calls} == {None}
        j = store.trace(body["id"])
        assert [(c["kind"], c["rows"]) for c in j["calls"]] == [("db", 2), ("cache", None)]
        assert (got["db_calls"], j["db_calls"], j["cache_calls"]) == (5, 1, 1)


# ------------------------------------------------------------------ the agent's batch records

BATCH_SCRIPT = textwrap.dedent(
    """
    import sqlite3, sys
    import perfsleuth.agent as ps
    from perfsleuth.agent import recorder
    ps.start(sys.argv[1], service="batch")
    con = sqlite3.connect(":memory:")
    con.execute("create table t (id integer primary key, v text)")
    con.executemany("insert into t values (?, ?)", [(i, "x") for i in range(30)])

    def lookup(i):
        return con.execute("select v from t where id = ?", (i,)).fetchall()

    for n in range(int(sys.argv[2])):
        req = recorder.begin("web", "GET", f"/b/{n}")
        req.endpoint = "GET /b/{n}"
        recorder.attr("n", n)
        for i in range(n % 4):
            lookup(i)
        con.execute("select v from t where id < ?", (n,)).fetchall()
        if n % 5 == 0:
            try:
                con.execute("select nope from t")
            except sqlite3.OperationalError:
                pass
        recorder.end(req)
    ps.flush()
    """
)


def test_batched_records_ingest_as_the_python_decoder_reads_them(data_dir: str) -> None:
    """The store reads the agent's REQUESTS records vectorised; wire.batch.decode reads them
    request by request in Python: both give every request, call and value alike."""
    from perfsleuth.agent.shipper import BATCH_MAX
    from spoolread import read_spool

    n = 2 * BATCH_MAX + 8  # more than two records' worth: the last one partly full
    subprocess.run([sys.executable, "-c", BATCH_SCRIPT, data_dir, str(n)], check=True, timeout=60)
    sent = read_spool(data_dir)
    assert len(sent) == n
    # per request: n % 4 lookups, one range query, a failing statement every fifth
    calls = sum(i % 4 + 1 + (i % 5 == 0) for i in range(n))
    with DuckDBStore(data_dir) as store:
        rep = store.ingest()
        assert rep.requests == n and not rep.damaged
        assert rep.calls == sum(len(r["calls"]) for r in sent) == calls
        for req in sent:
            got = store.trace(req["id"])
            assert got["path"] == req["path"] and got["attributes"] == req["attrs"]
            assert got["duration_ms"] == pytest.approx(req["dur"] / 1e6)
            assert len(got["calls"]) == len(req["calls"])
            for c, want in zip(got["calls"], req["calls"], strict=True):
                assert c["fingerprint"] == want["fingerprint"]
                # DuckDB keeps a call's times in whole microseconds, halves up
                assert c["offset_ms"] == pytest.approx(whole_us_ms(want["off"]), abs=1e-9)
                assert c["duration_ms"] == pytest.approx(whole_us_ms(want["dur"]), abs=1e-9)
                assert c["rows"] == want.get("rows")
                assert c["error"] == want.get("error")
                assert c["site"]["line"] == want["site_loc"]["line"]
                assert [f["function"] for f in c["stack"]] == [
                    loc["func"] for loc in want["stack_locs"]
                ]
            lookups = [c for c in got["calls"] if "id = ?" in c["fingerprint"]]
            assert len({c["site"]["line"] for c in lookups}) <= 1
            assert [c["rows"] for c in lookups] == [1] * len(lookups)


def batch_record(n: int, rows: bytes = b"", ints: bytes | None = None, **columns: Any) -> bytes:
    """A hand-made REQUESTS record (wire.batch) of ``n`` requests: ``columns`` of the integer
    columns go into its ints (None: NULL), the others into its JSON; ``ints`` replaces them."""
    from perfsleuth.wire.batch import INT_COLUMNS

    values: dict[str, Any] = {"id": list(range(1, n + 1)), "ts": [10**18] * n, "dur": [MS] * n}
    values["ncalls"] = [0] * n
    obj: dict[str, Any] = {"v": 2, "n": n, "endpoint": ["GET /x"] * n}
    for name, col in columns.items():
        (values if name in INT_COLUMNS else obj)[name] = col
    if ints is None:
        ints = b"".join(
            struct.pack("<q", NULL if (c := values.get(name)) is None or c[i] is None else c[i])
            for i in range(n)
            for name in INT_COLUMNS
        )
    return raw_record(REQUESTS, json.dumps(obj).encode() + b"\x00" + ints + rows)


def test_malformed_batch_records_are_damage_and_lose_only_themselves(
    data_dir: str, store: DuckDBStore
) -> None:
    from perfsleuth.wire.batch import AGENT_ROW, INT_ROW

    row = AGENT_ROW.pack(0, 100_000, 200_000, 1, 7)  # µs: what DuckDB keeps
    w = SegmentWriter(data_dir)
    table = {"site_table": [[1, 2, 3, 0, 0]]}
    w.write(batch_record(2, ncalls=[1, 0], t0=[50_000, 50_000], sites=[[0], None], **table))
    w.write(batch_record(2, rows=row, ncalls=[1, 0], t0=[50_000, 50_000], sites=[[0], []], **table))
    w.write(batch_record(3, method=["GET", "GET"]))  # a column that is not 3 long
    w.write(batch_record(1, rows=row * 2, ncalls=[1], t0=[50_000], sites=[[0]], **table))
    w.write(batch_record(1, rows=row, ncalls=[1], sites=[[0]], id=[9], **table))  # no t0
    w.write(batch_record(1, rows=row, ncalls=[1], t0=[50_000], sites=[[1]], **table))  # no site 1
    w.write(batch_record(2, ints=INT_ROW.pack(*[1] * 12)))  # ints for one request of two
    w.write(batch_record(1, ncalls=[-1]))  # a negative count
    w.write(batch_record(1, v=1))  # the first layout (its ints in the JSON)
    w.write(batch_record(1, method={"every": "GET"}))  # a shared value's map, misspelt
    w.request("GET /fine", dur_ms=1)
    w.close()
    rep = store.ingest()
    # the first record says one call but has no rows; the third and fourth do not add up;
    # the fifth has rows it cannot place (no t0), the sixth a site its table has not; the
    # seventh is short of ints, the eighth counts -1 calls, the ninth is of a layout not
    # written any more, the tenth's map is not {"all": value}: damage, each; the second is fine
    assert sorted(d.reason for d in rep.damaged) == [
        "call rows without sites",
        *["undecodable payload"] * 8,
    ]
    assert count(store) == 2 + 1 + 1  # the fine batch, the JSON request, the one without t0
    (c,) = store.trace("0" * 15 + "1")["calls"]
    assert (c["offset_ms"], c["duration_ms"], c["rows"]) == (50_000 / MS, 100_000 / MS, 1)
    assert count(store, "calls") == 1


def test_a_value_every_request_of_a_batch_shares_is_written_once(
    data_dir: str, store: DuckDBStore
) -> None:
    from perfsleuth.wire.batch import AGENT_ROW, decode

    rows = b"".join(AGENT_ROW.pack(0, 100 + i, 200 + i, i, 7) for i in range(3))
    shared = {"endpoint": {"all": "GET /y"}, "tenant": {"all": None}, "sites": {"all": [0]}}
    record = batch_record(
        3, rows=rows, ncalls=[1] * 3, t0=[50] * 3, site_table=[[1, 2, 3, 0, 0]], **shared
    )
    decoded = decode(memoryview(record)[11:])  # the payload after the record head
    assert [r["endpoint"] for r in decoded] == ["GET /y"] * 3
    assert all("tenant" not in r for r in decoded)
    assert [[c["rows"] for c in r["calls"]] for r in decoded] == [[0], [1], [2]]
    w = SegmentWriter(data_dir)
    w.write(record)
    w.close()
    rep = store.ingest()
    assert rep.requests == 3 and rep.calls == 3 and not rep.damaged
    got = store.query("SELECT endpoint, tenant, count(*) AS n FROM requests GROUP BY ALL")
    assert got == [{"endpoint": "GET /y", "tenant": None, "n": 3}]
    assert count(store, "calls") == 3


def test_odd_values_in_a_batch_are_coerced_not_fatal(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir)
    big_id = (1 << 64) - 2  # a trace id over 2**63 travels as a negative int64
    w.write(batch_record(2, id=[big_id - (1 << 64), 2], status=[None, 404], user=[7, None]))
    w.close()
    rep = store.ingest()
    assert rep.requests == 2 and not rep.damaged
    got = {r["trace_id"]: r for r in store.query("SELECT trace_id, status, user FROM requests")}
    assert got[f"{big_id:016x}"] == {"trace_id": f"{big_id:016x}", "status": None, "user": "7"}
    assert got["0" * 15 + "2"]["status"] == 404


def test_the_cyclic_collector_runs_while_a_batch_is_committed(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ingest keeps the collector off only while it reads and builds a batch (a server's
    other threads run beside it): on during the commit, on and nothing left frozen after."""
    import gc

    write_segments(data_dir, 3, 20)
    monkeypatch.setattr(store, "batch_requests", 20)
    monkeypatch.setattr(store, "group_requests", 20)  # a transaction per batch
    seen: list[bool] = []
    real = store._commit

    def commit() -> None:
        seen.append(gc.isenabled())
        real()

    monkeypatch.setattr(store, "_commit", commit)
    assert gc.isenabled()
    report = store.ingest()
    assert report.requests == 60
    assert len(seen) >= 3 and all(seen)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_ingest_allocates_arrow_memory_from_malloc_and_restores_the_pool(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ingest's Arrow buffers come from the system allocator (store.ingest.malloc_pool); the
    pool before is the default again after the run, also after a run that failed."""
    import pyarrow as pa

    before = pa.default_memory_pool().backend_name
    write_segments(data_dir, 2, 10)
    seen: list[str] = []
    real = store._commit

    def commit() -> None:
        seen.append(pa.default_memory_pool().backend_name)
        real()

    monkeypatch.setattr(store, "_commit", commit)
    assert store.ingest().requests == 20
    assert seen == ["system"] and pa.default_memory_pool().backend_name == before

    def failing() -> None:
        raise RuntimeError("commit failed")

    write_segments(data_dir, 1, 10)
    monkeypatch.setattr(store, "_commit", failing)
    with pytest.raises(RuntimeError):
        store.ingest()
    assert pa.default_memory_pool().backend_name == before


def test_overlapping_malloc_pools_of_two_threads_restore_the_pool_before_both() -> None:
    """Two ingest runs in two threads overlap (A enters, B enters, A leaves, B leaves): the
    pool is process-wide, so the system pool stays set until the last leaves and the pool
    before both is the default again after (each run restoring what it found left the
    system pool for good)."""
    import threading

    import pyarrow as pa

    from perfsleuth.store.ingest import malloc_pool

    before = pa.default_memory_pool().backend_name
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    inside: dict[str, str] = {}

    def run_a() -> None:
        with malloc_pool():
            a_in.set()
            b_in.wait(10)
        inside["a_left"] = pa.default_memory_pool().backend_name  # B is still inside
        a_out.set()

    def run_b() -> None:
        a_in.wait(10)
        with malloc_pool():
            b_in.set()
            a_out.wait(10)
            inside["b"] = pa.default_memory_pool().backend_name

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert inside == {"a_left": "system", "b": "system"}
    assert pa.default_memory_pool().backend_name == before


def test_dictionary_records_stored_by_an_earlier_run_are_not_decoded_again(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every segment repeats its locations, stacks and fingerprints: a later run of the same
    store (a collector's next round) skips those it stored, unless the run before failed."""
    from perfsleuth.store import records

    decoded: list[bytes] = []
    real_loads = records.loads

    def loads(payload: bytes) -> Any:
        decoded.append(payload)
        return real_loads(payload)

    monkeypatch.setattr(records, "loads", loads)
    write_segments(data_dir, 2, 5)
    store.ingest()
    first = len(decoded)
    assert first > 0
    write_segments(data_dir, 2, 5)
    decoded.clear()
    assert store.ingest().requests == 10
    assert not [p for p in decoded if b'"frames"' in p or b'"text"' in p]
    assert count(store, "fingerprints") == 2 and count(store, "stacks") == 2
    assert count(store, "locations") == 3
    got = store.query("SELECT count(*) AS n FROM calls WHERE stack_id IS NOT NULL")
    assert got[0]["n"] == 40

    real_commit = store._commit

    def failing() -> None:
        raise RuntimeError("commit failed")

    write_segments(data_dir, 1, 5)
    monkeypatch.setattr(store, "_commit", failing)
    with pytest.raises(RuntimeError):
        store.ingest()
    monkeypatch.setattr(store, "_commit", real_commit)
    decoded.clear()
    assert store.ingest().requests == 5
    assert [p for p in decoded if b'"frames"' in p]  # read again after the failed run


DAY_NS = 86_400 * 10**9


def test_stored_traces_are_looked_for_in_the_batch_s_time_span(
    data_dir: str, store: DuckDBStore
) -> None:
    """A request already stored is left out when it comes again (the same trace id, at its
    time or within ingest.KNOWN_TRACE_MARGIN_US, a minute: a payload made again); the check
    reads only the stored requests of the batch's time span and the margin around (zone maps
    prune the rest), and a trace id stored two days before (another request) is not taken
    for it (decided per request: tests/test_clickhouse.py's
    test_a_reused_trace_id_is_stored_whatever_else_its_batch_holds)."""
    now = __import__("time").time_ns()
    w = SegmentWriter(data_dir, seq=1)
    w.request("GET /a", trace_id="00000000000000aa", ts_ns=now - 2 * DAY_NS)
    w.request("GET /b", trace_id="00000000000000bb", ts_ns=now - 60 * 10**9)
    w.close()
    assert store.ingest().requests == 2
    w = SegmentWriter(data_dir, seq=2)
    w.request("GET /a", trace_id="00000000000000aa", ts_ns=now)  # another request
    w.request("GET /b", trace_id="00000000000000bb", ts_ns=now - 60 * 10**9)  # a copy
    w.close()
    assert store.ingest().requests == 1
    w = SegmentWriter(data_dir, seq=3)
    w.request("GET /b", trace_id="00000000000000bb", ts_ns=now - 30 * 10**9)  # made again
    w.close()
    assert store.ingest().requests == 0
    got = store.query("SELECT trace_id, endpoint FROM requests ORDER BY ts")
    assert [(r["trace_id"], r["endpoint"]) for r in got] == [
        ("00000000000000aa", "GET /a"),
        ("00000000000000bb", "GET /b"),
        ("00000000000000aa", "GET /a"),
    ]


def test_a_copy_of_a_request_whose_ts_is_not_a_time_is_stored_once(
    data_dir: str, store: DuckDBStore
) -> None:
    """A request whose ts is not a time takes the time of its conversion, so its copy in a
    later run has another ts: those batches are checked against every stored request."""
    for seq in (1, 2):
        w = SegmentWriter(data_dir, seq=seq)
        w.request("GET /a", trace_id="00000000000000cc", ts_ns=0)
        w.close()
        store.ingest()
    assert trace_ids(store) == ["00000000000000cc"]
