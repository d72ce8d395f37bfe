"""The agent's encoder as tests use it (agent.spool.encode.encode_requests): the records it
makes read back as the requests recorded, and they are the bytes the agent's writer puts in
its segments."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.agent import recorder, shipper
from perfsleuth.agent.spool.encode import Encoder, Interned, encode_requests
from perfsleuth.wire import FINGERPRINT, HEADER, LOCATION, REQUESTS, STACK
from perfsleuth.wire.segment import FILE_MAGIC, read_segment


@pytest.fixture
def recorded(agent_data_dir: str) -> Iterator[list[recorder.ActiveRequest]]:
    """Finished requests land in this list instead of the agent's queue."""
    kept: list[recorder.ActiveRequest] = []
    recorder.configure(kept.append, max_calls=20000, stacks_per_site=1)
    try:
        yield kept
    finally:
        recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1)


def order_page(oid: int, items: int) -> None:
    req = recorder.begin("web", "GET", f"/orders/{oid}")
    assert req is not None
    req.endpoint = "GET /orders/{id}"
    req.status = 200
    call = recorder.start_call("db", "postgresql", f"SELECT * FROM orders WHERE id = {oid}")
    assert call is not None
    call.finish()
    for i in range(items):  # an N+1 loop: one site, one stack
        call = recorder.start_call("db", "postgresql", "SELECT * FROM items WHERE id = %s", (i,))
        assert call is not None
        call.finish()
    recorder.end(req)


def records(data: bytes) -> list[tuple[bytes, Any]]:
    res = read_segment(FILE_MAGIC + data)
    assert not res.damaged
    return res.records


def test_encoded_requests_read_back_as_recorded(recorded: list[recorder.ActiveRequest]) -> None:
    order_page(7, 3)
    order_page(8, 0)
    recs = records(encode_requests(recorded))
    fps = {o["id"]: o for t, o in recs if t == FINGERPRINT}
    locs = {o["id"]: o for t, o in recs if t == LOCATION}
    stacks = {o["id"]: o["frames"] for t, o in recs if t == STACK}
    (batch,) = [o for t, o in recs if t == REQUESTS]
    assert [r["path"] for r in batch] == ["/orders/7", "/orders/8"]
    assert {r["endpoint"] for r in batch} == {"GET /orders/{id}"}
    first = batch[0]["calls"]
    assert len(first) == 4 and len(batch[1]["calls"]) == 1
    texts = [fps[c["fp"]]["text"] for c in first]
    assert texts[0] == texts[-1].replace("items", "orders") == "SELECT * FROM orders WHERE id = ?"
    for call in first:
        site = locs[call["site"]]
        assert site["func"] == "order_page" and site["file"] == __file__
        assert call["site"] in stacks[call["stack"]]
    # dictionary records come before the records using them, each once
    kinds = [t for t, _ in recs]
    assert kinds.index(REQUESTS) == len(kinds) - 1
    assert len(fps) == sum(t == FINGERPRINT for t in kinds) == 2


def test_a_segment_gets_each_dictionary_record_once(
    recorded: list[recorder.ActiveRequest],
) -> None:
    for oid in (1, 2):  # from one line: the same stacks
        order_page(oid, 2)
    seen = Interned()
    first = records(encode_requests(recorded[:1], seen))
    again = records(encode_requests(recorded[1:], seen))
    assert {t for t, _ in first} == {LOCATION, STACK, FINGERPRINT, REQUESTS}
    # the second request's statement differs in a literal only: same fingerprints, nothing new
    assert [t for t, _ in again] == [REQUESTS]
    alone = records(encode_requests(recorded[1:]))  # a new segment: all of them again
    assert {t for t, _ in alone} == {LOCATION, STACK, FINGERPRINT, REQUESTS}


def test_one_encoder_writes_a_known_stack_into_each_new_segment(
    recorded: list[recorder.ActiveRequest],
) -> None:
    # The writer's encoder outlives its segments and remembers the stack of new sites by the
    # stack object: statements never seen before (a literal each) made from one line share it.
    for oid in (1, 2, 3):
        order_page(oid, 0)
    enc = Encoder(fingerprint_cpu_pct=None)
    first = records(encode_requests(recorded[:2], Interned(), encoder=enc))
    second = records(encode_requests(recorded[2:], Interned(), encoder=enc))
    stacks = [{o["id"] for t, o in recs if t == STACK} for recs in (first, second)]
    assert stacks[0] and stacks[1] == stacks[0]
    locations = [{o["id"] for t, o in recs if t == LOCATION} for recs in (first, second)]
    assert locations[0] and locations[1] == locations[0]


AGENT = r"""
import json, sys
import perfsleuth.agent as ps
from perfsleuth.agent import recorder
from perfsleuth.agent.spool import queue, writer
from perfsleuth.agent.spool.encode import encode_requests

sys.path.insert(0, sys.argv[2])
from test_spool_encode import order_page

assert ps.start(sys.argv[1], service="enc")
kept = []

def sink(req):
    kept.append(req)
    queue.enqueue(req)

recorder.configure(sink, max_calls=20000, stacks_per_site=1)
with writer.lock:  # one drain writes them all, as encode_requests does
    for k in range(150):
        order_page(k, k % 4)
ps.flush()
print(json.dumps({"n": len(kept), "encoded": encode_requests(kept).hex()}))
"""


def test_the_agent_writes_what_encode_requests_makes(tmp_path: Path) -> None:
    env = {**os.environ, "PERFSLEUTH_EVIDENCE": "0"}  # its records would come between
    out = subprocess.run(
        [sys.executable, "-c", AGENT, str(tmp_path), os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    got = json.loads(out.stdout)
    assert got["n"] == 150
    (seg,) = glob.glob(str(tmp_path / "spool" / "*"))
    with open(seg, "rb") as fh:
        data = fh.read()
    encoded = bytes.fromhex(got["encoded"])
    assert data.endswith(encoded)
    assert [t for t, _ in records(data[len(FILE_MAGIC) : -len(encoded)])] == [HEADER]
    assert sum(len(o) for t, o in records(encoded) if t == REQUESTS) == 150


def statements_page(oid: int) -> None:
    """Twenty statements never seen before (literals inline), one shape."""
    req = recorder.begin("web", "GET", f"/report/{oid}")
    assert req is not None
    for j in range(20):
        ids = ", ".join(str(oid * 31 + k) for k in range(j % 5 + 1))
        sql = (
            f"/* trace={oid:x}-{j} */ SELECT id FROM orders WHERE id IN ({ids}) AND note <> 'n{j}'"
        )
        call = recorder.start_call("db", "postgresql", sql)
        assert call is not None
        call.finish()
    recorder.end(req)


@pytest.mark.usefixtures("statements_as_made")  # the writer meets each text
def test_statements_with_literals_inline_share_one_fingerprint_and_fill_no_cache(
    recorded: list[recorder.ActiveRequest],
) -> None:
    # Each statement comes once: it is fingerprinted (one FINGERPRINT record for the shape,
    # found by its tokens), but neither it nor its site is kept in the writer's caches.
    # Before: every such site and statement was kept (60 entries each), the caches reset and
    # the segment rotated every few thousand statements.
    for oid in (1, 2, 3):
        statements_page(oid)
    enc = Encoder(fingerprint_cpu_pct=None)
    data = encode_requests(recorded, Interned(), encoder=enc)
    recs = records(data)
    fps = [o for t, o in recs if t == FINGERPRINT]
    assert [o["text"] for o in fps] == ["SELECT id FROM orders WHERE id IN (...) AND note <> ?"]
    assert len(enc.sites) == 0 and len(enc.fps) == 0
    assert len(enc.fp_tokens) == 5  # one a length of the IN list
    # statements of one shape made at one place share a site: 5 in the batch's site table
    # (one a length of the IN list; 60 before), every call read back with its fingerprint
    at = data.index(b'"site_table":') + len(b'"site_table":')
    table, _ = json.JSONDecoder().raw_decode(data[at:].decode("utf-8", "replace"))
    assert len(table) == 5 and len(enc.shapes) == 5
    (batch,) = [o for t, o in recs if t == REQUESTS]
    assert [c["fp"] for r in batch for c in r["calls"]] == [fps[0]["id"]] * 60
    # a site seen again is kept from then on
    recorded.clear()
    for oid in (1, 1):
        statements_page(oid)
    encode_requests(recorded, Interned(), encoder=enc)
    assert len(enc.sites) == 20 and len(enc.fps) == 20


def test_the_stacks_memos_go_when_the_recorder_forgets_its_stacks(
    recorded: list[recorder.ActiveRequest],
) -> None:
    # Under distinct SQL the recorder's site budget empties its caches every second or two,
    # and the same place's stack is captured anew: a new object each time. The writer's memos
    # by stack object (flats, shapes) grew by a stack and its shapes at each forget and held
    # them until the whole cache budget was spent: the steady benchmark's +2.3 MB in 9 minutes.
    enc = Encoder(fingerprint_cpu_pct=None)
    seg = Interned()
    shapes = []
    for oid in range(1, 7):
        statements_page(oid)
        encode_requests(recorded, seg, encoder=enc)
        recorded.clear()
        shapes.append((len(enc.flats), len(enc.shapes)))
        recorder.forget_sites()  # the stack of the next page is a new object
    assert shapes == [(1, 5)] * 6  # before: (1, 5), (2, 10), ... (6, 30)
    # and what it writes still resolves every call to the statement's fingerprint
    statements_page(7)
    data = encode_requests(recorded, seg, encoder=enc)
    (batch,) = [o for t, o in records(data) if t == REQUESTS]
    assert len({c["fp"] for r in batch for c in r["calls"]}) == 1
    assert all(c["stack"] and c["fp"] for r in batch for c in r["calls"])


@pytest.mark.usefixtures("statements_as_made")  # the writer meets each text
def test_a_batchs_new_statements_are_scanned_together_within_the_budget(
    recorded: list[recorder.ActiveRequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    from perfsleuth.wire import fingerprint as fpr

    if fpr._c_tokens is None:
        pytest.skip("C tokenizer not built")
    calls: list[int] = []
    many = fpr.sql_tokens_many

    def counted(statements: list[Any]) -> Any:
        calls.append(len(statements))
        return many(statements)

    monkeypatch.setattr(fpr, "sql_tokens_many", counted)
    for oid in range(4):
        statements_page(oid)
    enc = Encoder(fingerprint_cpu_pct=5.0)
    encode_requests(recorded, Interned(), encoder=enc)
    assert calls == [80]  # one call for the batch's 80 new statements
    # with no budget left, nothing is scanned and the statements are written as hashes
    calls.clear()
    recorded.clear()
    statements_page(9)
    enc = Encoder(fingerprint_cpu_pct=0.0)
    recs = records(encode_requests(recorded, Interned(), encoder=enc))
    assert calls == []
    texts = {o["text"].split(":")[0] for t, o in recs if t == FINGERPRINT}
    assert texts == {"[not fingerprinted"}


def test_a_scan_that_spent_the_budget_still_fingerprints_what_it_scanned(
    recorded: list[recorder.ActiveRequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The batch's scan is the costly part of fingerprinting, and it is spent when it returns:
    # a scan that takes the writer past its budget leaves no statement it scanned hash-only.
    # Before: the 20 statements scanned were all written "[not fingerprinted ...]".
    from perfsleuth.wire import fingerprint as fpr

    if fpr._c_tokens is None:
        pytest.skip("C tokenizer not built")
    many = fpr.sql_tokens_many

    def long_scan(statements: list[Any]) -> Any:
        res = many(statements)
        return None if res is None else (res[0], 10**12)  # as if it took 1,000 s

    monkeypatch.setattr(fpr, "sql_tokens_many", long_scan)
    statements_page(7)
    enc = Encoder(fingerprint_cpu_pct=5.0)
    recs = records(encode_requests(recorded, Interned(), encoder=enc))
    texts = {o["text"] for t, o in recs if t == FINGERPRINT}
    assert texts == {"SELECT id FROM orders WHERE id IN (...) AND note <> ?"}
    # the next batch's new statements find the budget spent: hashes, counted
    recorded.clear()
    statements_page(8)
    recs = records(encode_requests(recorded, Interned(), encoder=enc))
    assert {o["text"].split(":")[0] for t, o in recs if t == FINGERPRINT} == {"[not fingerprinted"}


def test_one_off_urls_and_cache_keys_are_kept_from_their_second_sighting(
    recorded: list[recorder.ActiveRequest],
) -> None:
    # A call's own target (an HTTP call's URL, a cache key) mostly carries an id and comes
    # once; like a site, it is kept in the writer's caches only when it comes again. Before:
    # every distinct URL and key was kept (100 entries here), filling the 4 MB of caches
    # after ~10k such calls (then everything was cleared and the segment rotated).
    def page(oid: int) -> None:
        req = recorder.begin("web", "GET", f"/users/{oid}")
        assert req is not None
        for j in range(5):  # as agent.instrument.http and .cache record them
            for kind, system, target in (
                ("http", "http", ("GET", f"http://api.internal/users/{oid * 10 + j}")),
                ("cache", "redis", ("GET", f"user:{oid * 10 + j}")),
            ):
                call = recorder.start_call(kind, system, None)
                assert call is not None
                call.target = target
                call.finish()
        recorder.end(req)

    for oid in range(20):
        page(oid)
    enc = Encoder(fingerprint_cpu_pct=None)
    recs = records(encode_requests(recorded, Interned(), encoder=enc))
    (batch,) = [o for t, o in recs if t == REQUESTS]
    assert all(c.get("fp") is not None for r in batch for c in r["calls"])
    assert len(enc.fps) == 0  # none kept: 200 before
    recorded.clear()
    for oid in (3, 3):
        page(oid)
    encode_requests(recorded, Interned(), encoder=enc)
    assert len(enc.fps) == 10  # the targets seen again: kept


def test_requests_with_equal_or_uncomparable_site_entries_read_back_as_recorded(
    recorded: list[recorder.ActiveRequest],
) -> None:
    """The encoder shares the site indexes of a request whose site list equals the previous
    one's: entries equal but made apart are the same sites, and an entry whose comparison
    raises is resolved on its own (its request is not lost)."""

    class Uncomparable(str):
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("not comparable")

        __hash__ = str.__hash__

    for oid in (1, 2, 3):
        order_page(oid, 2)
    _, equal, odd = recorded
    assert equal.site_list is not None and odd.site_list is not None
    equal.site_list = [tuple(list(e)) for e in equal.site_list]
    odd.site_list = [(*e[:2], Uncomparable(e[2]), *e[3:]) for e in odd.site_list]
    recs = records(encode_requests(recorded))
    fps = {o["id"]: o["text"] for t, o in recs if t == FINGERPRINT}
    (batch,) = [o for t, o in recs if t == REQUESTS]
    assert [r["path"] for r in batch] == ["/orders/1", "/orders/2", "/orders/3"]
    for r in batch:
        assert [fps[c["fp"]] for c in r["calls"]] == [
            "SELECT * FROM orders WHERE id = ?",
            "SELECT * FROM items WHERE id = ?",
            "SELECT * FROM items WHERE id = ?",
        ]
