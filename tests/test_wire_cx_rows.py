"""REQUESTS records of layout 3 (wire.batch, issue 20: ingest speed): the per-call values a
call row has no room for (an HTTP call's status, host and fingerprint, a cache call's hit)
travel as binary cx rows after the agent rows, not as a JSON map per call, which was most of
a batch's JSON and of the store's reading. What a row cannot hold stays in the JSON ``cx``;
the store's bulk read and the Python decoder (wire.batch.decode) read both alike; records of
layout 2 are read as before (tests/test_store_decode.py writes its edited records in it)."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import duckdb
import pytest

from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.store.spool import read_from
from perfsleuth.wire import REQUESTS
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire.calls import NULL
from perfsleuth.wire.segment import encode_payload
from spoolwrite import SegmentWriter, call

MS = 1_000_000


def _payloads(path: str) -> list[bytes]:
    with open(path, "rb") as fh:
        data = fh.read()
    return [bytes(p) for t, p, _, _ in read_from(data, 0).raw if t == REQUESTS]


def _stored_calls(data_dir: str) -> list[tuple[Any, ...]]:
    """(endpoint, seq, kind, status, host, hit, bytes, wait_ms, error, fingerprint_id)."""
    con = duckdb.connect(os.path.join(data_dir, "perfsleuth.duckdb"), read_only=True)
    try:
        return con.execute(
            "SELECT endpoint, seq, kind, status, host, hit, bytes, wait_ms, error, "
            "fingerprint_id FROM calls ORDER BY endpoint, seq"
        ).fetchall()
    finally:
        con.close()


def _decoded_calls(payloads: list[bytes]) -> list[tuple[Any, ...]]:
    """What wire.batch.decode reads of the same records, in the columns of _stored_calls."""
    out = []
    for payload in payloads:
        for req in wbatch.decode(payload):
            for seq, c in enumerate(req["calls"]):
                wait, status = c.get("wait"), c.get("status")
                if status is not None and not -(2**31) < status < 2**31:
                    status = None  # the store keeps an int32 (out of range: none)
                out.append(
                    (
                        req.get("endpoint"),
                        seq,
                        c.get("kind"),
                        status,
                        c.get("host"),
                        c.get("hit"),
                        c.get("bytes"),
                        None if wait is None else wait / MS,
                        c.get("error"),
                        c.get("fp"),
                    )
                )
    return sorted(out, key=lambda r: (r[0], r[1]))


def _ingest(data_dir: str) -> Any:
    store = DuckDBStore(data_dir)
    try:
        return store.ingest()
    finally:
        store.close()


def test_the_agent_writes_per_call_values_as_cx_rows_read_alike_by_store_and_decoder(
    tmp_path: Any,
) -> None:
    data_dir = str(tmp_path / "data")
    w = SegmentWriter(data_dir)
    w.write_requests(
        [
            {
                "endpoint": "GET /a",
                "calls": [
                    call("http", "GET api.example.com/x", status=200, bytes=512, wait=2 * MS),
                    call("cache", "GET k1", off_ms=2, hit=True),
                    call("db", "SELECT 1", off_ms=3, error="OperationalError"),
                    call("cache", "GET k2", off_ms=4, hit=False),
                ],
            },
            {"endpoint": "GET /b", "calls": [call("db", "SELECT 2")]},
            {
                "endpoint": "GET /c",
                "calls": [
                    call("http", "GET other.example/y", status=503),
                    call("http", "POST api.example.com/z", off_ms=1, status=201),
                ],
            },
        ]
    )
    path = w.close()
    (payload,) = _payloads(path)
    parts = wbatch.split(payload)
    # five calls' values in rows; the error in the JSON (a row has no room for text)
    assert parts.obj["v"] == 3 and parts.obj["ncx"] == 5
    assert parts.obj["hosts"] == ["api.example.com", "other.example"]
    assert len(parts.cx) == 5 * wbatch.CX_ROW.size
    assert parts.obj["cx"] == {"0": {"2": {"error": "OperationalError"}}}
    rep = _ingest(data_dir)
    assert (rep.requests, rep.calls, rep.damaged) == (3, 7, [])
    stored = _stored_calls(data_dir)
    assert stored == _decoded_calls([payload])
    got = {(r[0], r[1]): r[3:9] for r in stored}
    assert got[("GET /a", 0)] == (200, "api.example.com", None, 512, 2.0, None)
    assert got[("GET /a", 1)] == (None, None, True, None, None, None)
    assert got[("GET /a", 2)] == (None, None, None, None, None, "OperationalError")
    assert got[("GET /a", 3)] == (None, None, False, None, None, None)
    assert got[("GET /b", 0)] == (None, None, None, None, None, None)
    assert got[("GET /c", 0)][:2] == (503, "other.example")
    assert got[("GET /c", 1)][:2] == (201, "api.example.com")
    # each HTTP call and cache command has its own fingerprint (its URL or key's shape)
    fps = {r[1]: r[9] for r in stored if r[0] == "GET /c"}
    assert fps[0] is not None and fps[1] is not None and fps[0] != fps[1]


def test_pack_cx_leaves_in_the_json_what_a_row_cannot_hold() -> None:
    cx = {
        "0": {
            "0": {"status": 200, "host": "h.example", "fp": -5},  # a row
            "1": {"hit": True},  # a row
            "2": {"error": "Timeout", "status": 504},  # text: JSON
            "3": {"fp": 2**64},  # past 64 bits: JSON
            "4": {"status": "200"},  # not an integer: JSON
            "5": {"hit": 1},  # not a bool: JSON
            "01": {"status": 1},  # not how the agent writes an index: JSON
            "9": {"status": 2},  # not a call of the request: JSON
        },
        "1": {"0": {"wait": 7, "bytes": 8}},  # a row
        "2": {"0": {"status": 3}},  # not a request of the batch: JSON
    }
    hosts: dict[str, int] = {}
    rest, rows = wbatch.pack_cx(cx, [7, 1], hosts)
    assert hosts == {"h.example": 0}
    assert rows == [
        (0, 0, -5, 200, NULL, NULL, NULL, 0),
        (0, 1, NULL, NULL, NULL, NULL, 1, NULL),
        (1, 0, NULL, NULL, 8, 7, NULL, NULL),
    ]
    assert rest == {
        "0": {k: cx["0"][k] for k in ("2", "3", "4", "5", "01", "9")},
        "2": cx["2"],
    }
    # read back (wire.batch.cx_maps): the values of every entry, in the layout 2 shape
    obj = {"v": 3, "n": 2, "ncx": len(rows), "hosts": list(hosts), "cx": rest}
    ints = b"".join(
        wbatch.pack_ints([i + 1, 10**18, MS, None, None, None, None, None, None, None, 0, k])
        for i, k in enumerate([7, 1])
    )
    agent_rows = wbatch.AGENT_ROW.pack(0, 1, 2, NULL, NULL) * 8
    payload = json.dumps(obj).encode() + b"\0" + ints + agent_rows + wbatch.pack_cx_rows(rows)
    assert wbatch.cx_maps(wbatch.split(payload)) == cx


def test_a_value_past_64_bits_sends_the_batch_s_per_call_values_as_json(tmp_path: Any) -> None:
    # the agent takes any int for a call's response bytes: one past 64 bits cannot be a row,
    # so the batch's entries go as JSON (wire.batch.pack_cx), the others still as rows
    data_dir = str(tmp_path / "data")
    w = SegmentWriter(data_dir)
    w.write_requests(
        [
            {"endpoint": "GET /a", "calls": [call("http", "GET a.example/x", bytes=2**70)]},
            {"endpoint": "GET /b", "calls": [call("http", "GET b.example/y", status=201)]},
        ]
    )
    (payload,) = _payloads(w.close())
    parts = wbatch.split(payload)
    assert parts.obj["cx"]["0"]["0"]["bytes"] == 2**70 and parts.obj["ncx"] == 1
    rep = _ingest(data_dir)
    assert (rep.requests, rep.calls, rep.damaged) == (2, 2, [])
    stored = _stored_calls(data_dir)
    assert [r[:5] for r in stored] == [
        ("GET /a", 0, "http", None, "a.example"),
        ("GET /b", 0, "http", 201, "b.example"),
    ]
    assert stored[0][6] is None  # 2**70 bytes: not an int64, NULL (as in layout 2)


def _record(
    obj: dict[str, Any], ncalls: list[int], cx_rows: list[tuple[int, ...]], t0: int = 50_000
) -> bytes:
    """A hand-made REQUESTS payload of layout 3: a request per ``ncalls`` entry, each call at
    slot 0 of a db site, ``cx_rows`` as given."""
    n = len(ncalls)
    head = {
        "v": 3,
        "n": n,
        "endpoint": [f"GET /{i}" for i in range(n)],
        "sites": [[0]] * n,
        "site_table": [[NULL, 2, 3, 0, 0]],
        "ncx": len(cx_rows),
        **obj,
    }
    ints = b"".join(
        wbatch.pack_ints([i + 1, 10**18, MS, 200, None, None, None, None, None, None, t0, k])
        for i, k in enumerate(ncalls)
    )
    rows = wbatch.AGENT_ROW.pack(0, t0 + 10, t0 + 20, NULL, NULL) * sum(ncalls)
    cx = b"".join(wbatch.CX_ROW.pack(*r) for r in cx_rows)
    return json.dumps(head).encode() + b"\0" + ints + rows + cx


def _write_payload(data_dir: str, payload: bytes) -> None:
    w = SegmentWriter(data_dir)
    w.write(encode_payload(REQUESTS, payload))
    w.close()


def test_odd_cx_rows_are_left_out_alike_by_the_store_and_the_decoder(tmp_path: Any) -> None:
    data_dir = str(tmp_path / "data")
    N = NULL
    payload = _record(
        {"hosts": ["a.example"], "cx": {"0": {"1": {"status": 404}}, "1": {"0": {"hit": False}}}},
        [2, 1],
        [
            (0, 0, N, 201, N, N, N, 0),  # request 0's first call: status and host
            (0, 1, 77, 418, N, N, N, 0),  # its second: the JSON entry's status wins, not its fp
            (1, 0, N, N, N, N, 1, N),  # request 1's call: the JSON entry's hit wins
            (0, 2, N, 500, N, N, N, N),  # request 0 has no call 2: left out
            (1, -1, N, 500, N, N, N, N),  # nor -1
            (2, 0, N, 500, N, N, N, N),  # there is no request 2
            (-1, 0, N, 500, N, N, N, N),  # nor -1
            (0, 0, N, N, 9, N, 7, 5),  # a hit not 0 or 1 and a host index out of range: not given
        ],
    )
    _write_payload(data_dir, payload)
    rep = _ingest(data_dir)
    assert (rep.requests, rep.calls, rep.damaged) == (2, 3, [])
    stored = _stored_calls(data_dir)
    assert stored == _decoded_calls([payload])
    assert [r[:7] for r in stored] == [
        ("GET /0", 0, "db", 201, "a.example", None, 9),
        ("GET /0", 1, "db", 404, "a.example", None, None),
        ("GET /1", 0, "db", None, None, False, None),
    ]
    assert stored[1][9] == 77


def test_cx_rows_of_a_request_whose_rows_are_not_kept_are_left_out(tmp_path: Any) -> None:
    # request 0 has rows but no t0 (the store keeps it without calls): its cx rows name calls
    # that are not kept, request 1's land on its own
    data_dir = str(tmp_path / "data")
    payload = _record(
        {"hosts": ["h"]},
        [1, 1],
        [(0, 0, NULL, 500, NULL, NULL, NULL, 0), (1, 0, NULL, 200, NULL, NULL, NULL, 0)],
    )
    head, _, rest = payload.partition(b"\0")
    ints = bytearray(rest[: 2 * wbatch.INT_ROW.size])
    struct.pack_into("<q", ints, wbatch.INT_COLUMNS.index("t0") * 8, NULL)
    payload = head + b"\0" + bytes(ints) + rest[len(ints) :]
    _write_payload(data_dir, payload)
    rep = _ingest(data_dir)
    assert (rep.requests, rep.calls) == (2, 1)
    assert [r[:5] for r in _stored_calls(data_dir)] == [("GET /1", 0, "db", 200, "h")]


@pytest.mark.parametrize(
    "edit, ok",
    [
        ({}, True),
        ({"ncx": 1}, False),  # two rows' bytes, one said
        ({"ncx": 3}, False),
        ({"ncx": -2}, False),
        ({"ncx": "2"}, False),
        ({"hosts": [1]}, False),  # a host that is no string
        ({"hosts": "h"}, False),
        ({"v": 4}, False),  # a layout not known
        ({"v": 2}, False),  # layout 2 has no cx rows: its rows do not add up
        ({"v": True}, False),
    ],
)
def test_split_checks_the_cx_rows_add_up(edit: dict[str, Any], ok: bool) -> None:
    rows = [(0, 0, NULL, 200, NULL, NULL, NULL, 0), (1, 0, NULL, 201, NULL, NULL, NULL, 0)]
    payload = _record({"hosts": ["h"], **edit}, [1, 1], rows)
    if ok:
        assert wbatch.split(payload).n == 2
    else:
        with pytest.raises(ValueError):
            wbatch.split(payload)


@pytest.mark.parametrize("seed", [20, 21, 22])
def test_random_cx_rows_never_fail_a_batch_and_read_alike(tmp_path: Any, seed: int) -> None:
    # hostile cx rows (any int64 in any field, hosts of any count) among good records: each
    # record is stored whole, the store and the decoder agree call by call
    import random

    rng = random.Random(seed)
    edges = [NULL, -1, 0, 1, 2, 3, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, 5, 7]
    data_dir = str(tmp_path / "data")
    payloads = []
    for r in range(12):
        ncalls = [rng.randint(0, 3) for _ in range(rng.randint(1, 4))]
        rows = [
            tuple(rng.choice(edges) if rng.random() < 0.5 else rng.randint(-3, 4) for _ in range(8))
            for _ in range(rng.randint(0, 12))
        ]
        hosts = [f"h{j}.example" for j in range(rng.randint(0, 3))]
        payload = _record({"hosts": hosts}, ncalls, rows, t0=50_000 + r)
        head, sep, rest = payload.partition(b"\0")
        obj = json.loads(head)
        obj["endpoint"] = [f"GET /{r}/{i}" for i in range(len(ncalls))]
        ints = bytearray(rest[: len(ncalls) * wbatch.INT_ROW.size])
        for i in range(len(ncalls)):  # trace ids unique across records
            struct.pack_into("<q", ints, i * wbatch.INT_ROW.size, 1000 * r + i + 1)
        payload = json.dumps(obj).encode() + sep + bytes(ints) + rest[len(ints) :]
        payloads.append(payload)
    w = SegmentWriter(data_dir, seq=2)
    for payload in payloads:
        w.write(encode_payload(REQUESTS, payload))
    w.close()
    rep = _ingest(data_dir)
    assert rep.damaged == []
    assert rep.requests == sum(len(wbatch.split(p).obj["endpoint"]) for p in payloads)
    stored, decoded = _stored_calls(data_dir), _decoded_calls(payloads)
    # all but the wait alike; the store keeps a wait in whole microseconds
    assert [r[:7] + r[8:] for r in stored] == [r[:7] + r[8:] for r in decoded]
    assert [r[7] for r in stored] == [
        None if r[7] is None else pytest.approx(r[7], rel=1e-9, abs=1e-3) for r in decoded
    ]


@pytest.mark.parametrize("where", ["row", "json"])
def test_a_status_past_32_bits_is_stored_as_none(tmp_path: Any, where: str) -> None:
    # the bulk read made it 0 (the slow path and tables.event_tables: none)
    data_dir = str(tmp_path / "data")
    if where == "row":
        rows = [(0, 0, NULL, 2**31, *[NULL] * 4), (1, 0, NULL, -(2**40), *[NULL] * 4)]
        payload = _record({}, [1, 1], rows)
    else:
        cx = {"0": {"0": {"status": 2**31}}, "1": {"0": {"status": -(2**40)}}}
        payload = _record({"cx": cx}, [1, 1], [])
    _write_payload(data_dir, payload)
    _ingest(data_dir)
    assert [r[3] for r in _stored_calls(data_dir)] == [None, None]
