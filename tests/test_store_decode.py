"""The store's bulk read of the agent's REQUESTS records (store.decode): the per-call values
of ``cx`` land on the call they name and no other, odd records among good ones go the slow
way without costing the others. Segments are written with the agent's encoder
(tests/spoolwrite.py), then edited as a hand-written or broken agent would."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import duckdb

from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.store.spool import read_from
from perfsleuth.wire import REQUESTS
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire.segment import FILE_MAGIC, encode_payload
from spoolwrite import SegmentWriter, call


def _write(data_dir: str, specs: list[dict[str, Any]]) -> str:
    w = SegmentWriter(data_dir)
    w.write_requests(specs)
    return w.close()


def _edit_requests(path: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite each REQUESTS record of the segment in layout 2 (its cx rows as JSON ``cx``
    entries) with its JSON object edited."""
    with open(path, "rb") as fh:
        data = fh.read()
    out = [FILE_MAGIC]
    for rtype, payload, _, _ in read_from(data, 0).raw:
        payload = bytes(payload)
        if rtype == REQUESTS:
            parts = wbatch.split(payload)
            obj = {k: v for k, v in parts.obj.items() if k not in ("ncx", "hosts")}
            obj["v"], obj["cx"] = 2, wbatch.cx_maps(parts)
            edit(obj)
            payload = b"".join(
                (json.dumps(obj).encode(), b"\0", parts.ints.tobytes(), bytes(parts.rows))
            )
        out.append(encode_payload(rtype, payload))
    with open(path, "wb") as fh:
        fh.write(b"".join(out))


def _calls(data_dir: str) -> dict[str, list[tuple[Any, ...]]]:
    """Per endpoint, its calls in order: (seq, kind, status, host)."""
    con = duckdb.connect(os.path.join(data_dir, "perfsleuth.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT endpoint, seq, kind, status, host FROM calls ORDER BY endpoint, seq"
        ).fetchall()
    finally:
        con.close()
    out: dict[str, list[tuple[Any, ...]]] = {}
    for endpoint, *rest in rows:
        out.setdefault(endpoint, []).append(tuple(rest))
    return out


def _ingest(data_dir: str) -> Any:
    store = DuckDBStore(data_dir)
    try:
        return store.ingest()
    finally:
        store.close()


def _two_requests(data_dir: str) -> str:
    return _write(
        data_dir,
        [
            {"endpoint": "GET /a", "calls": [call("db"), call("db", off_ms=2)]},
            {
                "endpoint": "GET /b",
                "calls": [
                    call("http", "GET api.example.com/x", status=200),
                    call("http", "GET api.example.com/y", off_ms=2, status=503),
                ],
            },
        ],
    )


def test_a_cx_entry_names_a_call_of_its_own_request_only(tmp_path: Any) -> None:
    data_dir = str(tmp_path / "data")
    path = _two_requests(data_dir)

    def point_past_own_calls(obj: dict[str, Any]) -> None:
        # GET /a's call 2 and GET /b's call -1 are not theirs: GET /b's first call and GET
        # /a's last one lie there in the batch's rows
        obj["cx"]["0"] = {"2": {"status": 418, "host": "a.example"}}
        obj["cx"]["1"]["-1"] = {"status": 451, "host": "b.example"}

    _edit_requests(path, point_past_own_calls)
    rep = _ingest(data_dir)
    assert (rep.requests, rep.calls) == (2, 4)
    assert _calls(data_dir) == {
        "GET /a": [(0, "db", None, None), (1, "db", None, None)],
        "GET /b": [(0, "http", 200, "api.example.com"), (1, "http", 503, "api.example.com")],
    }


def test_two_keys_naming_one_call_both_apply_in_order(tmp_path: Any) -> None:
    data_dir = str(tmp_path / "data")
    path = _two_requests(data_dir)

    def spell_twice(obj: dict[str, Any]) -> None:
        # "01" is call 1 too; the later entry's values win, the earlier one's others stay
        obj["cx"]["1"]["01"] = {"host": "later.example"}

    _edit_requests(path, spell_twice)
    _ingest(data_dir)
    assert _calls(data_dir)["GET /b"] == [
        (0, "http", 200, "api.example.com"),
        (1, "http", 503, "later.example"),
    ]


def test_an_odd_record_among_good_ones_costs_only_itself(tmp_path: Any) -> None:
    data_dir = str(tmp_path / "data")
    for i in range(3):
        w = SegmentWriter(data_dir, seq=i + 1)
        w.write_requests(
            [{"endpoint": f"GET /r{i}", "calls": [call("http", "GET h.example/z", status=201)]}]
        )
        path = w.close()
        if i == 1:  # a user that is a number, a status that is text: coerced one by one

            def odd(obj: dict[str, Any]) -> None:
                obj["user"] = [7]
                obj["cx"]["0"]["0"]["status"] = "202"

            _edit_requests(path, odd)
    rep = _ingest(data_dir)
    assert (rep.requests, rep.calls, rep.damaged) == (3, 3, [])
    calls = _calls(data_dir)
    assert [calls[f"GET /r{i}"][0][2] for i in range(3)] == [201, 202, 201]
    con = duckdb.connect(os.path.join(data_dir, "perfsleuth.duckdb"), read_only=True)
    try:
        users = dict(con.execute("SELECT endpoint, user FROM requests").fetchall())
    finally:
        con.close()
    assert users == {"GET /r0": None, "GET /r1": "7", "GET /r2": None}
