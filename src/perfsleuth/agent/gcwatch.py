"""Garbage-collection pauses, from ``gc.callbacks``.

A collection runs in the thread whose allocation triggered it, in that thread's current
context, so the request recorded there (``recorder.current_get()``) is the one whose code ran
when it started: on an event loop, the request whose task was stepping (a child task inherits
the request's context); in a thread, the thread's request. The pause is charged to that request
alone (``req.gc_ns``, ``req.gc_count``, stored as ``requests.gc_ms`` / ``gc_count``); the other
requests in flight only waited for it, as for an event-loop blocker, and are counted as
delayed on the pause event. A collection started outside any request (the loop's own code,
the agent's threads) is charged to nobody.

A collection's duration is the CPU time of the thread that ran it (``time.thread_time_ns``,
two system calls a collection), not its wall time: on a busy machine the wall time also holds
the time the thread waited for a CPU, which is the machine's, not the collection's (a young
collection of 522 objects measured 35 ms of wall beside 16 busy loops a core, and was charged
to a request that only slept).

Collections of at least ``gc_event_ms`` that hit a request are also kept as GC pause events
(generation, duration, objects collected, the request charged, the requests in flight with it
first, how many were delayed), batched and shipped by the evidence thread; a pause with no
request in flight delayed nobody (and a server's master process, which serves none, writes
nothing). The callback reads the thread's CPU clock (~0.6 µs) and, at "stop", does a context
lookup and a walk over the requests in flight; CPython's own callback machinery costs ~1.6 µs
a collection (measured with a no-op callback), a few per request at most.

The size of the heap a full collection scans is sampled by the evidence thread, after a full
collection that hit a request, at most every ``HEAP_EVERY_S``: the memory blocks the
interpreter has allocated (``sys.getallocatedblocks()``, about one per live object), in
``stats["gc_heap_objects"]``, shipped as a STATS record (agent_stats). Not
``len(gc.get_objects())``: the list it builds holds a reference to every tracked object, a
tuple another thread is still filling in included, and that thread's tuple() then fails with
SystemError (seen in CI).
"""

from __future__ import annotations

import contextvars
import gc
import os
import sys
import time
from collections import deque
from typing import Any

from perfsleuth.agent import recorder, shipper
from perfsleuth.wire import GC, STATS

_cpu = time.thread_time_ns
MAX_PENDING = 1000  # pause events waiting for the evidence thread; more are counted
HEAP_EVERY_S = 300.0

recorder.stats.update(
    {"gc_collections": 0, "gc_events_dropped": 0, "gc_full_collections": 0, "gc_heap_objects": 0}
)

# The request in whose context a collection ran, read from a copy of the context: not by the
# variable's get(), whose cache CPython 3.11 leaves stale when a collection runs inside a
# reset that removes the variable (the reset's allocation) and reads it meanwhile; the ended
# request then stayed "current" and the thread's next requests went unrecorded.
_copy_context = contextvars.copy_context
_current_var = recorder._current
_start = [0]  # the collecting thread's CPU clock when the collection started
_min_ns = 1_000_000
# (ts, dur, generation, collected, charged trace id or None, ids in flight, delayed)
_pending: deque[tuple[int, int, int, int, str | None, list[str], int]] = deque()
_heap_due = [False, 0.0]  # a full collection ran since the last heap sample; when it was taken
_installed = False
_fault = False  # test-only: the callback raises (PERFSLEUTH_FAULT=evidence_crash)


def _callback(phase: str, info: dict[str, Any]) -> None:
    try:
        if phase == "start":
            _start[0] = _cpu()
            return
        if _fault:
            raise RuntimeError("injected GC callback crash")
        dur = max(0, _cpu() - _start[0])
        stats = recorder.stats
        stats["gc_collections"] += 1
        gen = info.get("generation", -1)
        if gen == 2:
            stats["gc_full_collections"] += 1
            if recorder.inflight:  # a process serving nothing (a server's master) ships none
                _heap_due[0] = True
        charged = _copy_context().get(_current_var)
        if charged is not None and not charged.end:  # (end set: a context that outlived it)
            charged.gc_ns += dur
            charged.gc_count += 1
        else:
            charged = None
        if dur < _min_ns or not recorder.inflight:
            return  # a pause with no request in flight delayed nobody
        reqs = list(recorder.inflight.values())
        if len(_pending) >= MAX_PENDING:
            stats["gc_events_dropped"] += 1
            return
        others = [r for r in reqs if r is not charged]
        first = [charged] if charged is not None else []
        ids = [f"{r.trace_id:016x}" for r in (first + others)[:20]]
        by = ids[0] if charged is not None else None
        _pending.append(
            (time.time_ns() - dur, dur, gen, info.get("collected", 0), by, ids, len(others))
        )
    except Exception:
        recorder.internal_error()


def install(min_ms: float, *, fault: bool = False) -> None:
    global _fault, _installed, _min_ns
    _min_ns = int(min_ms * 1e6)
    _fault = fault
    if not _installed:
        gc.callbacks.append(_callback)
        _installed = True


def sample_heap(now: float) -> None:
    """After a full collection, at most every HEAP_EVERY_S: about how many objects are live
    (what each full collection scans), in ``stats["gc_heap_objects"]``."""
    if not _heap_due[0] or (_heap_due[1] and now - _heap_due[1] < HEAP_EVERY_S):
        return
    _heap_due[0] = False
    _heap_due[1] = now
    stats = recorder.stats
    stats["gc_heap_objects"] = objects = sys.getallocatedblocks()
    counters = {"gc_heap_objects": objects, "gc_full_collections": stats["gc_full_collections"]}
    ts, pid = time.time_ns(), os.getpid()
    shipper.emit(STATS, lambda _intern: {"ts": ts, "pid": pid, "counters": counters})


def ship() -> None:
    """Hand the pending pause events to the writer as one GC record (evidence thread)."""
    try:
        sample_heap(time.monotonic())
    except Exception:
        recorder.internal_error()
    if not _pending:
        return
    events = []
    while _pending:
        events.append(_pending.popleft())

    def build(_intern: shipper.Intern) -> dict[str, Any]:
        return {
            "pauses": [
                {"ts": ts, "dur": dur, "gen": gen, "collected": n, "ids": ids, "delayed": d}
                | ({"by": by} if by is not None else {})
                for ts, dur, gen, n, by, ids, d in events
            ]
        }

    shipper.emit(GC, build)


def after_fork() -> None:
    _pending.clear()
    _heap_due[:] = [False, 0.0]
