"""spool.queue.enqueue: the C accelerator's (its common case; the rest handed to Python's) and
the Python one keep the same books: bytes, sizes, wake-ups and drops."""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest

from fakequeue import bare_request, fake_queue
from perfsleuth.agent import recorder
from perfsleuth.agent.spool import queue

IMPLEMENTATIONS = ["python"] + (["c"] if hasattr(recorder.speedups, "enqueue") else [])


def run(impl: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Enqueue a fixed sequence of requests through one implementation: what it left."""
    enqueue = queue.python_enqueue if impl == "python" else recorder.speedups.enqueue
    site_cache: dict[Any, Any] = {}
    full: list[int] = []
    wake = threading.Event()
    stats = fake_queue(
        monkeypatch,
        queue_size=6,
        queue_limit=6000,
        cache_limit=10_000,
        WAKE_AT=3,
        _site_cache=site_cache,
        wake=wake,
        on_full=lambda: full.append(1),
    )
    woke = []
    enqueue(bare_request())  # no calls
    enqueue(bare_request(calls=3))
    woke.append(wake.is_set())
    enqueue(bare_request(calls=2, attrs=2))  # the third: wakes the writer
    woke.append(wake.is_set())
    site_cache["k"] = 1  # the site cache grew: this request's statements are counted
    enqueue(bare_request(calls=1, sites=2))
    enqueue(bare_request(calls=1))  # seen since: not counted again
    enqueue(bare_request(calls=40))  # over queue_limit: dropped
    enqueue(bare_request())
    enqueue(bare_request())  # the queue holds 6: dropped
    return {
        "queued": len(queue._queue),
        "sizes": list(queue._sizes),
        "bytes": queue._queue_bytes,
        "sites_seen": queue._sites_seen,
        "site_cache_bytes": queue._site_cache_bytes,
        "woke": woke,
        "full": len(full),
        "stats": stats,
    }


def test_the_c_enqueue_keeps_the_python_one_s_books(monkeypatch: pytest.MonkeyPatch) -> None:
    if "c" not in IMPLEMENTATIONS:
        pytest.skip("the C accelerator is not built")
    with monkeypatch.context() as m:
        python = run("python", m)
    with monkeypatch.context() as m:
        c = run("c", m)
    assert c == python
    r = queue.REQUEST_BYTES
    # a bytearray's allocation: its length and a NUL
    assert python["sizes"] == [
        r,
        r + 3 * recorder.ROW + 1,
        r + 2 * recorder.ROW + 1 + 256,
        r + recorder.ROW + 1 + 2 * queue.SITE_ENTRY_BYTES + len("SELECT ") * 2 + 1,
        r + recorder.ROW + 1,
        r,
    ]
    assert python["bytes"] == sum(python["sizes"])
    assert python["woke"] == [False, True]
    assert python["stats"] == {"dropped_queue_full": 1, "dropped_memory": 1, "cache_resets": 0}
    assert python["full"] == 2


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_enqueue_is_the_queue_s_enqueue(impl: str) -> None:
    if impl == "c":
        assert queue.enqueue is recorder.speedups.enqueue
    else:
        assert queue.python_enqueue.__module__ == queue.__name__


def test_take_pops_the_queue_in_order_within_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """take: all that is queued when it fits the slice, else requests up to the slice's bytes
    (at least one); the sizes of what is left stay the queue's, in order."""
    reqs = [bare_request(calls=k) for k in range(10)]
    monkeypatch.setattr(queue, "_queue", collections.deque(reqs))
    sizes = [1000 + k for k in range(10)]
    # the Python enqueue appends a size before its request: one size more than requests
    monkeypatch.setattr(queue, "_sizes", collections.deque([*sizes, 5000]))
    monkeypatch.setattr(queue, "_queue_bytes", sum(sizes) + 5000)
    first = queue.take(2500)  # over the queue's bytes: up to 2,500 of them
    assert first == reqs[:3]
    assert list(queue._sizes) == [*sizes[3:], 5000]
    assert queue._queue_bytes == sum(sizes[3:]) + 5000
    one = queue.take(1)  # at least one
    assert one == reqs[3:4]
    monkeypatch.setattr(queue, "_queue_bytes", sum(sizes[4:]))  # as enqueue left them
    rest = queue.take(1 << 20)  # all of it
    assert rest == reqs[4:]
    assert list(queue._queue) == [] and list(queue._sizes) == [5000]
    assert queue._queue_bytes == 5000
    assert queue.take(1 << 20) == []


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_request_s_rows_count_as_allocated(
    impl: str, agent_data_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1-call request made by the C wrappers has its rows' buffer allocated for 4 rows
    (grow_calls grows it ahead): the memory budget counts the allocation, not the length."""
    import sqlite3

    from perfsleuth.agent import shipper

    if recorder.speedups is None:
        pytest.skip("the C accelerator is not built")
    got: list[recorder.ActiveRequest] = []
    recorder.configure(got.append, max_calls=20000, stacks_per_site=1)
    try:
        conn = sqlite3.connect(":memory:")
        req = recorder.speedups.begin("web", "GET", "/one")
        conn.execute("SELECT 1").fetchall()
        recorder.speedups.end(req)
        conn.close()
    finally:
        recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1)
    calls = got[0].calls
    assert calls is not None and len(calls) == recorder.ROW < calls.__alloc__()
    enqueue = queue.python_enqueue if impl == "python" else recorder.speedups.enqueue
    for name, value in {
        "queue_size": 6,
        "queue_limit": 60_000,
        "_queue": collections.deque(),
        "_sizes": collections.deque(),
        "_queue_bytes": 0,
        "_site_cache": {},
        "_sites_seen": 0,
        "wake": threading.Event(),
    }.items():
        monkeypatch.setattr(queue, name, value)
    got[0].site_list = []
    got[0].attrs = None
    enqueue(got[0])
    assert list(queue._sizes) == [queue.REQUEST_BYTES + calls.__alloc__()]
