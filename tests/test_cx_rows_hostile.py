"""Per-call values as cx rows (REQUESTS layout 3) under odd input: a request the encoder drops
leaves none of its rows to the next one, a host that cannot be written loses only its own
request, and the decoder and the store's bulk read agree on malformed JSON ``cx`` entries
mixed with rows (the store's slow path reads a record through the decoder)."""

from __future__ import annotations

import json
import os
import random
import struct
from typing import Any

import duckdb
import pytest

from perfsleuth.agent.spool.encode import encode_requests
from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.wire import REQUESTS
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire.calls import NULL
from perfsleuth.wire.segment import encode_payload
from spoolwrite import SegmentWriter, call
from test_wire_cx_rows import _decoded_calls, _ingest, _record, _stored_calls, _write_payload


def _encode_and_store(data_dir: str, specs: list[dict[str, Any]], sql: str) -> list[Any]:
    w = SegmentWriter(data_dir)
    built = [w.finished(**spec) for spec in specs]
    w.write(encode_requests([r for r, _ in built], w.interned, encoder=w.encoder))
    w.close()
    store = DuckDBStore(data_dir)
    try:
        store.ingest()
    finally:
        store.close()
    con = duckdb.connect(os.path.join(data_dir, "perfsleuth.duckdb"), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_a_dropped_request_s_cx_rows_do_not_land_on_the_next(tmp_path: Any) -> None:
    """GET /a's second call has a URL with a lone surrogate (its FINGERPRINT record cannot be
    UTF-8): the encoder drops GET /a after writing its first call's row; GET /b's database
    call, at the same index in the batch, got that row's status and host before."""
    specs = [
        {
            "endpoint": "GET /a",
            "calls": [
                call("http", "GET a.example/x", status=500),
                call("http", "GET b.example/caf\udce9", off_ms=1, status=200),
            ],
        },
        {"endpoint": "GET /b", "calls": [call("db", "SELECT 1")]},
    ]
    rows = _encode_and_store(
        str(tmp_path / "data"),
        specs,
        "SELECT endpoint, seq, kind, status, host FROM calls ORDER BY endpoint, seq",
    )
    assert ("GET /b", 0, "db", None, None) in rows


def test_one_unwritable_host_loses_only_its_request(tmp_path: Any) -> None:
    """A host that cannot be written (not UTF-8) sends the batch to one record per request:
    each record names its own hosts, so the requests of other hosts are kept."""
    bad = "GET caf\udce9.example/x"
    specs = [
        {"endpoint": "GET /a", "calls": [call("http", bad, status=200)]},
        {"endpoint": "GET /b", "calls": [call("db", "SELECT 1")]},
        {"endpoint": "GET /c", "calls": [call("http", bad, status=200)]},
        {"endpoint": "GET /d", "calls": [call("http", "GET ok.example/y", status=201)]},
    ]
    got = [
        r[0]
        for r in _encode_and_store(
            str(tmp_path / "data"), specs, "SELECT endpoint FROM requests ORDER BY 1"
        )
    ]
    assert "GET /b" in got and "GET /d" in got


N = NULL


@pytest.mark.parametrize("cx", [{"0": 5}, {"0": {"0": 5}}, {"0": {"0": None}}])
def test_a_non_map_cx_entry_does_not_hide_a_row(tmp_path: Any, cx: Any) -> None:
    data_dir = str(tmp_path / "data")
    payload = _record({"hosts": ["h"], "cx": cx}, [1], [(0, 0, N, 201, N, N, N, 0)])
    _write_payload(data_dir, payload)
    _ingest(data_dir)
    stored = _stored_calls(data_dir)
    assert [r[3:5] for r in stored] == [(201, "h")]
    assert stored == _decoded_calls([payload])


def test_a_record_on_the_slow_path_keeps_its_rows_under_a_non_map_entry(tmp_path: Any) -> None:
    """``user`` a number, which the bulk read cannot take: the record goes the slow path."""
    data_dir = str(tmp_path / "data")
    payload = _record(
        {"hosts": ["h"], "cx": {"0": {"0": 5}}, "user": [7]}, [1], [(0, 0, N, 201, N, N, N, 0)]
    )
    _write_payload(data_dir, payload)
    rep = _ingest(data_dir)
    assert (rep.requests, rep.damaged) == (1, [])
    assert [r[3:5] for r in _stored_calls(data_dir)] == [(201, "h")]


@pytest.mark.parametrize("x", [{"status": None}, {"hit": None}, {"hit": 1}])
def test_an_entry_s_null_or_odd_value_over_a_row_s(tmp_path: Any, x: Any) -> None:
    data_dir = str(tmp_path / "data")
    payload = _record({"cx": {"0": {"0": x}}}, [1], [(0, 0, N, 201, N, N, 1, N)])
    _write_payload(data_dir, payload)
    _ingest(data_dir)
    assert _stored_calls(data_dir) == _decoded_calls([payload])


def _random_cx(rng: random.Random, requests: int) -> dict[str, Any]:
    vals = [None, 0, 1, 200, 2**31, True, False, "h", 5.0]
    keys = ["status", "bytes", "wait", "hit", "host", "fp", "error"]
    cx: dict[str, Any] = {}
    for _ in range(rng.randint(0, 4)):
        rk, ck = str(rng.randint(0, requests)), str(rng.randint(0, 3))
        kind = rng.random()
        if kind < 0.1:
            cx[rk] = rng.choice([5, None, "x"])
            continue
        per = cx.setdefault(rk, {}) if isinstance(cx.get(rk, {}), dict) else {}
        if kind < 0.2:
            per[ck] = rng.choice([5, None, []])
            continue
        x = {k: rng.choice(vals) for k in rng.sample(keys, rng.randint(1, 3))}
        if "fp" in x:
            x["fp"] = rng.choice([None, 3, 9])
        if "host" in x:
            x["host"] = rng.choice([None, "e.example"])
        if "error" in x:
            x["error"] = rng.choice([None, "Boom"])
        for k in ("status", "bytes", "wait"):
            if k in x and type(x[k]) not in (int, type(None)):
                x[k] = rng.choice([None, 4])
        if "hit" in x:
            x["hit"] = rng.choice([None, True, False])
        per[ck] = x
    return cx


@pytest.mark.parametrize("seed", range(12))
def test_random_rows_and_entries_are_stored_as_the_decoder_reads_them(
    tmp_path: Any, seed: int
) -> None:
    rng = random.Random(seed)
    data_dir = str(tmp_path / "data")
    payloads = []
    for r in range(6):
        ncalls = [rng.randint(0, 3) for _ in range(rng.randint(1, 3))]
        rows = [
            (
                rng.randint(0, len(ncalls)),
                rng.randint(0, 3),
                *[rng.choice([NULL, 1, 7, 300]) for _ in range(4)],
                rng.choice([NULL, 0, 1]),
                rng.choice([NULL, 0, 1]),
            )
            for _ in range(rng.randint(0, 6))
        ]
        cx = _random_cx(rng, len(ncalls))
        payload = _record(
            {"hosts": ["a.example", "b.example"], "cx": cx}, ncalls, rows, t0=50_000 + r
        )
        head, sep, rest = payload.partition(b"\0")
        obj = json.loads(head)
        obj["endpoint"] = [f"GET /{r}/{i}" for i in range(len(ncalls))]
        ints = bytearray(rest[: len(ncalls) * wbatch.INT_ROW.size])
        for i in range(len(ncalls)):  # trace ids of their own
            struct.pack_into("<q", ints, i * wbatch.INT_ROW.size, 1000 * r + i + 1)
        payloads.append(json.dumps(obj).encode() + sep + bytes(ints) + rest[len(ints) :])
    w = SegmentWriter(data_dir, seq=2)
    for p in payloads:
        w.write(encode_payload(REQUESTS, p))
    w.close()
    rep = _ingest(data_dir)
    assert rep.damaged == []
    stored, decoded = _stored_calls(data_dir), _decoded_calls(payloads)
    assert [r[:7] + r[8:] for r in stored] == [r[:7] + r[8:] for r in decoded]
