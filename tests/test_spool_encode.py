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
