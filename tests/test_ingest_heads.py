"""The spool ingest's reading of REQUESTS records' JSON heads (issue 20, ingest speed): parsed
by msgspec where it gives what ``json.loads`` gives, by ``json.loads`` otherwise
(store.spool.loads_json); the head checks of wire.batch.split, now a column at a time, still
refuse what they refused; and the objects a batch's heads become are made with the cyclic
collector off (store.ingest), as the segment's reading already was."""

from __future__ import annotations

import gc
import json
from typing import Any

import numpy as np
import pytest

from perfsleuth.store import records
from perfsleuth.store.decode import hex_ids
from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.store.spool import loads_json
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire.calls import NULL, SEPARATOR
from spoolwrite import SegmentWriter, call

# JSON texts where a fast parser could differ from json.loads: integers past 64 bits (orjson
# makes floats of them), NaN and Infinity, a float past the double range, lone surrogates
# (escaped and raw), a BOM, UTF-16, nesting too deep, trailing garbage, duplicate keys.
ODD = [
    b'{"n": 18446744073709551616, "m": -9223372036854775809, "k": 123456789012345678901234567}',
    b'{"a": NaN, "b": Infinity, "c": -Infinity}',
    b"[1e400, -1e400, 1e-400, 0.30000000000000004, -0.0]",
    b'["\\ud800", "\\udfff\\ud800"]',
    b'"\xed\xa0\x80"',
    b"\xef\xbb\xbf[1]",
    '{"a": [1, 2]}'.encode("utf-16"),
    b"[" * 5000 + b"]" * 5000,
    b"[1] x",
    b'{"a": 1, "a": 2}',
    b"",
    b"\xff\xfe\x00",
    b'{"s": "\\u0000\\t\\"", "t": true, "f": false, "z": null}',
]


def _outcome(fn: Any, payload: bytes) -> Any:
    try:
        return ("ok", repr(fn(payload)))
    except RecursionError:
        return ("raises", RecursionError)
    except ValueError:
        return ("raises", ValueError)


@pytest.mark.parametrize("payload", ODD)
def test_loads_json_returns_or_raises_what_json_loads_does(payload: bytes) -> None:
    assert _outcome(loads_json, payload) == _outcome(json.loads, payload)


def test_loads_json_keeps_integers_past_64_bits_as_integers() -> None:
    obj = loads_json(b'{"fp": 36893488147419103232}')
    assert obj == {"fp": 36893488147419103232} and type(obj["fp"]) is int


def _head(obj: dict[str, Any]) -> bytes:
    """A REQUESTS payload of one request without calls, its JSON head ``obj``."""
    ints = [NULL if c != "ncalls" else 0 for c in wbatch.INT_COLUMNS]
    ints[wbatch.INT_COLUMNS.index("id")] = 7
    return json.dumps(obj).encode() + SEPARATOR + wbatch.INT_ROW.pack(*ints)


GOOD_SITE = [1, 2, 3, 0, 1]


@pytest.mark.parametrize(
    "table, sites, ok",
    [
        ([GOOD_SITE], [[0]], True),
        ([], [None], True),
        ([GOOD_SITE], [[]], True),
        ([GOOD_SITE], [None], True),
        ([[1, 2, 3, 0]], [[0]], False),  # a site of four fields
        ([GOOD_SITE, "x"], [[0]], False),  # a site that is no list
        ({"all": GOOD_SITE}, [[0]], False),  # a table that is no list
        ([GOOD_SITE], [[1]], False),  # past the table
        ([GOOD_SITE], [[-1]], False),
        ([GOOD_SITE], [[True]], False),  # a bool is no index
        ([GOOD_SITE], [[0.0]], False),
        ([GOOD_SITE], [0], False),  # an entry that is no list
        ([GOOD_SITE], [[[0]]], False),
    ],
)
def test_split_checks_site_tables_and_sites_as_before(table: Any, sites: Any, ok: bool) -> None:
    payload = _head({"v": wbatch.VERSION, "n": 1, "site_table": table, "sites": sites})
    for loads in (json.loads, loads_json):
        if ok:
            assert wbatch.split(payload, loads).n == 1
        else:
            with pytest.raises(ValueError):
                wbatch.split(payload, loads)


def test_heads_are_read_with_the_collector_off_and_by_loads_json(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The objects of a batch's heads are frozen with the rest of the batch (a collection
    walked them again and again: 0.1 s per 100k requests), and parsed by loads_json."""
    data_dir = str(tmp_path / "data")
    w = SegmentWriter(data_dir)
    for i in range(3):
        w.write_requests([{"endpoint": f"GET /{i}", "calls": [call("db", "SELECT 1", rows=1)]}] * 4)
    w.close()
    seen: list[tuple[bool, bool]] = []
    parsed: list[bytes] = []
    real_add, real_split = records.Batch.add_raw, wbatch.split

    def add_raw(self: records.Batch, seg: Any, rtype: bytes, *a: Any) -> None:
        seen.append((rtype == records.REQUESTS, gc.isenabled()))
        real_add(self, seg, rtype, *a)

    def split(payload: Any, loads: Any = json.loads) -> Any:
        def counted(head: bytes) -> Any:
            parsed.append(head)
            return loads(head)

        assert loads is loads_json
        return real_split(payload, counted)

    monkeypatch.setattr(records.Batch, "add_raw", add_raw)
    monkeypatch.setattr(records.wbatch, "split", split)
    store = DuckDBStore(data_dir)
    try:
        assert gc.isenabled()
        assert store.ingest().requests == 12
        assert gc.isenabled()
    finally:
        store.close()
    assert [s for s in seen if s[0]] == [(True, False)] * 3
    assert len(parsed) == 3


def test_hex_ids_are_the_16_hex_digits_of_the_64_bits() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(-(2**63), 2**63 - 1, 1000, dtype=np.int64, endpoint=True)
    ids[:6] = [0, 1, -1, -(2**63), 2**63 - 1, 0x0123456789ABCDEF]
    got = hex_ids(ids)
    got.validate(full=True)
    assert got.to_pylist() == [f"{v & (2**64 - 1):016x}" for v in ids.tolist()]
    assert hex_ids(ids[::7]).to_pylist() == [f"{v & (2**64 - 1):016x}" for v in ids[::7].tolist()]
    assert hex_ids(np.empty(0, np.int64)).to_pylist() == []
