"""Crafted spool input (valid checksums, hostile contents), duplicates and full disks: ingest
skips and counts what it cannot read, commits the rest, never doubles a request and never
stalls. Spools are written with the real wire encoder (tests/spoolwrite.py)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.store.base import StoreError
from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.wire import (
    BLOCKER,
    CAPTURE,
    FINGERPRINT,
    GC,
    HEADER,
    LOCATION,
    RECORD_TYPES,
    REQUESTS,
    SAMPLES,
    STATS,
)
from perfsleuth.wire.batch import AGENT_ROW, INT_ROW
from perfsleuth.wire.segment import FILE_MAGIC, REC_MAGIC, encode_record, read_segment
from spoolwrite import MS, SegmentWriter, call
from tinyfs import tmpfs

BIG = 2**60  # ns: above 2**53, where a double stops holding every integer


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


def raw_record(rtype: bytes, payload: bytes) -> bytes:
    """A record with a valid checksum around any payload."""
    crc = zlib.crc32(payload, zlib.crc32(rtype))
    return struct.pack("<2scII", REC_MAGIC, rtype, len(payload), crc) + payload


def count(store: DuckDBStore, table: str = "requests") -> int:
    return int(store.sql(f"SELECT count(*) FROM {table}")[1][0][0])


def healthy_segment(data_dir: str, seq: int = 99) -> str:
    """A second, clean segment: it must commit whatever the first one holds."""
    w = SegmentWriter(data_dir, seq=seq, service="healthy")
    body = w.request("GET /healthy", calls=[call()])
    w.close()
    return str(body["id"])


def batch_record(n: int, **ints: list[int]) -> bytes:
    """A REQUESTS record (wire.batch) of ``n`` requests without calls; ``ints`` replace
    integer columns."""
    from perfsleuth.wire.batch import INT_COLUMNS

    values: dict[str, list[int]] = {
        "id": list(range(1, n + 1)),
        "ts": [1_700_000_000 * 10**9] * n,
        "dur": [MS] * n,
        "ncalls": [0] * n,
    }
    values.update(ints)
    obj = {"v": 2, "n": n, "endpoint": {"all": "GET /batch"}}
    null = -(2**63)
    packed = b"".join(
        INT_ROW.pack(*[values[c][i] if c in values else null for c in INT_COLUMNS])
        for i in range(n)
    )
    return raw_record(REQUESTS, json.dumps(obj).encode() + b"\x00" + packed)


# ------------------------------------------------------------------ item 1: crafted records


def test_figures_above_2_53_ns_are_read_not_fatal(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir)
    big = w.request("GET /big", dur_ms=BIG / MS, cpu_ns=BIG, gc_ns=BIG, calls=[call(dur_ms=1)])
    calls = w.request("GET /bigcall", calls=[call(dur_ms=BIG / MS, wait=BIG)])
    w.write(batch_record(2, dur=[BIG, 5], cpu_ns=[BIG, 1], gc_ns=[1, BIG]))
    w.close()
    other = healthy_segment(data_dir)
    rep = store.ingest()
    assert rep.requests == 5 and not rep.damaged
    got = store.trace(big["id"])
    assert got["duration_ms"] == pytest.approx(BIG / MS)
    assert store.trace(calls["id"])["calls"][0]["duration_ms"] == pytest.approx(BIG / MS)
    assert store.trace(other)["endpoint"] == "GET /healthy"
    assert count(store) == 5


def test_evidence_records_of_the_wrong_shape_are_read_alone(
    data_dir: str, store: DuckDBStore
) -> None:
    """A list field that is not a list reads as empty (its record adds no rows); figures past
    any range read as NULL or their nearest double: the other records of the segment and the
    other segments commit."""
    w = SegmentWriter(data_dir)
    req = w.request("GET /a")
    w.event(GC, {"pauses": 5})
    w.event(GC, {"pauses": {"gen": 2}})
    w.event(BLOCKER, {"stacks": 7, "dur": MS, "ts": req["ts"]})
    w.event(SAMPLES, {"id": req["id"], "samples": 3})
    w.event(SAMPLES, {"id": req["id"], "ts": req["ts"], "samples": [[BIG * 8, "cpu", 1]]})
    w.event(GC, {"pauses": [{"ts": req["ts"], "gen": 2, "dur": BIG, "ids": [req["id"]]}]})
    w.event(
        BLOCKER, {"ts": req["ts"], "dur": BIG, "stacks": [[1, 3]], "last_call": {"ms": 2**1100}}
    )
    w.request("GET /b")
    w.close()
    other = healthy_segment(data_dir)
    rep = store.ingest()
    assert rep.requests == 3 and not rep.damaged
    assert count(store) == 3 and store.trace(other)
    assert store.query("SELECT generation, duration_ms, trace_ids FROM gc_pauses") == [
        {"generation": 2, "duration_ms": BIG / MS, "trace_ids": req["id"]}
    ]
    assert store.query("SELECT stack_id, last_ms FROM blockers ORDER BY stack_id") == [
        {"stack_id": 1, "last_ms": None},
        {"stack_id": None, "last_ms": None},
    ]
    assert count(store, "samples") == 1


NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("rtype", sorted(RECORD_TYPES))
def test_deeply_nested_json_is_damage_alone(
    data_dir: str, store: DuckDBStore, rtype: bytes
) -> None:
    w = SegmentWriter(data_dir)
    w.request("GET /a")
    at = os.path.getsize(w.path)
    w.write(raw_record(rtype, b'{"id": "1", "v": 2, "n": 1, "x": ' + NESTED + b"}"))
    w.request("GET /b")
    w.close()
    other = healthy_segment(data_dir)
    rep = store.ingest()
    assert count(store) == 3
    assert store.trace(other)
    assert [(d.offset, d.reason) for d in rep.damaged] == [(at, "undecodable payload")]


def test_deeply_nested_json_after_damage_is_damage_alone(data_dir: str, store: DuckDBStore) -> None:
    """Past damage, records are decoded by wire.segment.read_segment: the same holds there."""
    w = SegmentWriter(data_dir)
    w.request("GET /a")
    w.write(b"\xa5\x5aNgarbage-bytes")
    w.write(raw_record(GC, b'{"pauses": ' + NESTED + b"}"))
    w.request("GET /b")
    w.close()
    rep = store.ingest()
    assert count(store) == 2
    assert [d.reason for d in rep.damaged] == ["impossible record length", "undecodable payload"]


def test_lone_surrogates_become_replacement_text(data_dir: str, store: DuckDBStore) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"), which no UTF-8 text holds."""
    w = SegmentWriter(data_dir)
    sur = b"\\ud800"
    w.write(raw_record(HEADER, b'{"service": "svc' + sur + b'", "pid": 7}'))
    w.write(raw_record(FINGERPRINT, b'{"id": 5, "kind": "db", "text": "SELECT ' + sur + b'"}'))
    w.write(raw_record(LOCATION, b'{"id": 6, "file": "' + sur + b'", "line": 1}'))
    w.write(raw_record(STATS, b'{"c' + sur + b'": 5}'))
    tid = "00000000000000ff"
    null = -(2**63)
    ints = INT_ROW.pack(0xFF, 1_700_000_000 * 10**9, MS, *[null] * 7, 0, 1)  # t0 0, one call
    w.write(
        raw_record(
            REQUESTS,
            b'{"v": 2, "n": 1, "endpoint": ["GET /' + sur + b'"], "sites": [[0]], '
            b'"site_table": [[5, ' + str(null).encode() + b", " + str(null).encode() + b", 0, 1]], "
            b'"attrs": {"0": {"k' + sur + b'": "v' + sur + b'"}}, '
            b'"cx": {"0": {"0": {"error": "E'
            + sur
            + b'"}}}}\x00'
            + ints
            + AGENT_ROW.pack(0, 1, 2, null, null),
        )
    )
    w.write(raw_record(CAPTURE, b'{"id": "' + tid.encode() + b'", "url": "/' + sur + b'"}'))
    w.write(raw_record(GC, b'{"pauses": [{"ids": ["' + sur + b'"], "gen": 1}]}'))
    w.close()
    rep = store.ingest()
    assert rep.requests == 1 and not rep.damaged
    got = store.trace(tid)
    assert got["endpoint"] == "GET /?" and got["service"] == "svc?"
    assert got["calls"][0]["error"] == "E?" and got["calls"][0]["fingerprint"] == "SELECT ?"
    assert store.query("SELECT key, value FROM attributes") == [{"key": "k?", "value": "v?"}]
    capture = store.capture(tid)
    assert capture is not None and capture["url"] == "/?"
    assert store.query("SELECT trace_ids FROM gc_pauses") == [{"trace_ids": "?"}]
    assert store.query("SELECT name FROM agent_stats WHERE value = 5") == [{"name": "c?"}]


# ------------------------------------------------------------------ item 8: linear resync


class CrcBytes:
    """zlib for wire.segment, counting the bytes its crc32 reads (the resync's work)."""

    def __init__(self) -> None:
        self.bytes = 0

    def crc32(self, data: Any, value: int = 0) -> int:
        self.bytes += len(data)
        return zlib.crc32(data, value)


def header_run(size: int) -> bytes:
    """``size`` bytes of record headers, each claiming the rest of the run as its payload
    (wrong checksums): every one is a candidate for resynchronising."""
    k = size // 11
    return b"".join(
        struct.pack("<2scII", REC_MAGIC, REQUESTS, (k - i - 1) * 11, 0) for i in range(k)
    )


@pytest.mark.parametrize("size", [100_000, 400_000])
def test_resync_past_a_run_of_crafted_headers_is_linear(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    from perfsleuth.wire import segment

    crc = CrcBytes()
    monkeypatch.setattr(segment, "zlib", crc)
    good = encode_record(LOCATION, {"id": "after"})
    before = encode_record(LOCATION, {"id": "before"})
    data = FILE_MAGIC + before + b"\xa5\x5aZ" + header_run(size)
    res = read_segment(data + good)
    assert [obj["id"] for _, obj in res.records] == ["before", "after"]
    assert [d.reason for d in res.damaged] == ["unknown record type b'Z'"]
    # each byte's crc is read a bounded number of times (checking each candidate over its
    # payload read ~size**2 / 22 bytes: 450 MB for 100 kB)
    assert crc.bytes <= 4 * len(data)


def test_resync_finds_every_valid_record_among_damage() -> None:
    """The linear check agrees with checking each record's crc directly, for payloads of
    every size up to a megabyte, between damaged records and stray markers."""
    import random

    rng = random.Random(17)
    parts, want = [FILE_MAGIC, b"\xa5\x5aZ"], []
    for i in range(60):
        size = int(2 ** rng.uniform(0, 20))
        rec = encode_record(rng.choice([LOCATION, GC, STATS]), {"i": i, "pad": "x" * size})
        if i % 3 == 0:  # damaged: one bit of its payload flipped
            flip = bytearray(rec)
            flip[rng.randrange(11, len(rec))] ^= 1 << rng.randrange(8)
            rec = bytes(flip)
        else:
            want.append(i)
        stray = REC_MAGIC + bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
        parts += [rec, stray]
    res = read_segment(b"".join(parts))
    assert [obj["i"] for _, obj in res.records] == want


# ------------------------------------------------------------------ item 9: duplicates


def ids_and_counts(store: DuckDBStore) -> tuple[int, int, int, int]:
    """(requests, distinct trace ids, calls, attributes) in the store."""
    (row,) = store.sql(
        "SELECT (SELECT count(*) FROM requests), (SELECT count(DISTINCT trace_id) FROM "
        "requests), (SELECT count(*) FROM calls), (SELECT count(*) FROM attributes)"
    )[1]
    return row


def test_a_record_repeated_in_a_segment_adds_its_request_once(
    data_dir: str, store: DuckDBStore
) -> None:
    w = SegmentWriter(data_dir)
    w.request("GET /a", calls=[call(), call("cache", "GET k")], attrs={"plan": "gold"})
    with open(w.path, "rb") as fh:
        whole = fh.read()
    last = whole.rindex(REC_MAGIC + REQUESTS)
    w.write(whole[last:])  # the request record again
    w.write(batch_record(2) * 2)  # a batch of two, twice
    w.close()
    rep = store.ingest()
    assert ids_and_counts(store) == (3, 3, 2, 1)
    assert (rep.requests, rep.calls) == (3, 2) and not rep.damaged


def test_a_segment_copied_under_another_name_adds_nothing(
    data_dir: str, store: DuckDBStore
) -> None:
    w = SegmentWriter(data_dir, seq=1)
    for i in range(5):
        w.request(f"GET /e{i}", calls=[call()], attrs={"i": i})
    w.write(batch_record(3))
    w.close()
    with open(w.path, "rb") as fh:
        content = fh.read()

    def copy(seq: int) -> None:
        name = os.path.basename(w.path).replace("-000001.", f"-{seq:06d}.")
        with open(os.path.join(data_dir, "spool", name), "wb") as fh:
            fh.write(content)

    copy(2)
    store.batch_requests = 4  # the copy's requests meet the original's in other batches too
    rep = store.ingest()
    assert ids_and_counts(store) == (8, 8, 5, 5)
    assert rep.requests == 8 and rep.segments_done == 2
    copy(3)  # and once more, in a later run
    rep = store.ingest()
    assert rep.requests == 0 and rep.calls == 0 and rep.segments_done == 1
    assert ids_and_counts(store) == (8, 8, 5, 5)


# ------------------------------------------------------------------ item 6: a full disk


@pytest.fixture
def small_fs(tmp_path: Any) -> Iterator[str]:
    """A real 4 MiB filesystem (tmpfs), mounted for the test; skipped where one cannot be."""
    with tmpfs(Path(tmp_path) / "small", "4m") as mnt:
        yield str(mnt)


def fill(fs: str, leave: int) -> str:
    """Fill ``fs`` up to ``leave`` bytes of free space; returns the filler's path."""
    st = os.statvfs(fs)
    path = os.path.join(fs, "filler")
    with open(path, "wb") as fh:
        try:
            fh.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
        except OSError:
            pass
    return path


@pytest.mark.parametrize("leave", [0, 4096, 8192, 20_000])
def test_a_store_first_created_on_a_full_disk_leaves_no_stub(small_fs: str, leave: int) -> None:
    data = os.path.join(small_fs, "data")
    healthy_segment(data)
    filler = fill(small_fs, leave)
    with pytest.raises(StoreError, match=f"the disk holding {data} is full"):
        DuckDBStore(data)
    assert sorted(os.listdir(data)) == ["spool"]
    os.remove(filler)
    with DuckDBStore(data) as s:
        assert s.ingest().requests == 1


def test_a_stub_left_by_an_earlier_version_is_replaced(data_dir: str) -> None:
    """An earlier version created the file in place: a full disk left its first 4 KiB."""
    with open(os.path.join(data_dir, "perfsleuth.duckdb"), "wb") as fh:
        fh.write(b"\0" * 4096)
    tid = healthy_segment(data_dir)
    with DuckDBStore(data_dir) as s:
        s.ingest()
        assert s.trace(tid)
    with DuckDBStore(data_dir, read_only=True) as s:
        assert s.trace(tid)


def test_a_full_disk_during_ingest_says_so_and_loses_nothing(small_fs: str) -> None:
    data = os.path.join(small_fs, "data")
    DuckDBStore(data).close()
    ids = []
    for seq in range(3):
        w = SegmentWriter(data, seq=seq + 1)
        for i in range(400):
            body = w.request(
                f"GET /e{i % 7}", calls=[call(), call("cache", "GET k")], attrs={"i": i}
            )
            ids.append(body["id"])
        w.close()
    filler = fill(small_fs, 16_384)  # room to open the store, not to add the rows
    with DuckDBStore(data) as s, pytest.raises(StoreError, match=f"disk holding {data} is full"):
        s.ingest()
    cli = [sys.executable, "-c", "from perfsleuth.cli.main import main; main()"]
    cli += ["ingest", "--data", data]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert f"the disk holding {data} is full" in done.stderr
    assert len(os.listdir(os.path.join(data, "spool"))) == 3  # nothing retired
    os.remove(filler)
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with DuckDBStore(data, read_only=True) as s:
        assert ids_and_counts(s) == (1200, 1200, 2400, 1200)
        assert sorted(
            r[0] for r in s.sql("SELECT trace_id FROM requests", limit=10**6)[1]
        ) == sorted(ids)


def test_a_conversion_failing_on_unforeseen_values_is_damage_not_a_stall(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the requests of a batch fail to convert on values no check foresees (a fault
    injected here: the real inputs that did are fixed above), they are damage of the segments
    that sent them, and the batch's other records and later ingests go on."""
    from perfsleuth.store import tables

    def fail(*args: Any) -> None:
        raise OverflowError("an unforeseen value")

    w = SegmentWriter(data_dir)
    req = w.request("GET /a")
    w.event(GC, {"pauses": [{"ts": req["ts"], "gen": 2, "dur": MS}]})
    w.close()
    with monkeypatch.context() as m:
        m.setattr(tables, "event_tables", fail)
        rep = store.ingest()
    assert [d.reason for d in rep.damaged] == [
        "requests the store could not convert (OverflowError: an unforeseen value)"
    ]
    assert rep.quarantined == [os.path.basename(w.path)]
    assert count(store) == 0 and count(store, "gc_pauses") == 1
    other = healthy_segment(data_dir)
    assert store.ingest().requests == 1 and store.trace(other)
