"""Garbage-collection pauses, from ``gc.callbacks``.

Every collection stops every thread that wants the GIL, so its time is added to all requests
in flight (``req.gc_ns``, ``req.gc_count``, stored as ``requests.gc_ms`` / ``gc_count``).
Collections of at least ``gc_event_ms`` that hit a request are also kept as GC pause events
(generation, duration, objects collected, the requests they hit), batched and shipped by the
evidence thread; a pause with no request in flight delayed nobody (and a server's master
process, which serves none, writes nothing). The callback does a clock read and, at "stop",
a walk over the requests in flight; CPython's own callback machinery costs ~1.6 µs a
collection (measured with a no-op callback), a few per request at most.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

from perfsleuth.agent import recorder, shipper
from perfsleuth.wire import GC

_perf = time.perf_counter_ns
MAX_PENDING = 1000  # pause events waiting for the evidence thread; more are counted

recorder.stats.update({"gc_collections": 0, "gc_events_dropped": 0})

_start = [0]
_min_ns = 1_000_000
_pending: deque[tuple[int, int, int, int, list[str]]] = deque()
_installed = False
_fault = False  # test-only: the callback raises (PERFSLEUTH_FAULT=evidence_crash)


def _callback(phase: str, info: dict[str, Any]) -> None:
    try:
        if phase == "start":
            _start[0] = _perf()
            return
        if _fault:
            raise RuntimeError("injected GC callback crash")
        dur = _perf() - _start[0]
        recorder.stats["gc_collections"] += 1
        reqs = list(recorder.inflight.values())
        for r in reqs:
            r.gc_ns += dur
            r.gc_count += 1
        if dur >= _min_ns and reqs:  # a pause with no request in flight delayed nobody
            if len(_pending) >= MAX_PENDING:
                recorder.stats["gc_events_dropped"] += 1
                return
            ids = [f"{r.trace_id:016x}" for r in reqs[:20]]
            gen, collected = info.get("generation", -1), info.get("collected", 0)
            _pending.append((time.time_ns() - dur, dur, gen, collected, ids))
    except Exception:
        recorder.internal_error()


def install(min_ms: float, *, fault: bool = False) -> None:
    global _fault, _installed, _min_ns
    _min_ns = int(min_ms * 1e6)
    _fault = fault
    if not _installed:
        gc.callbacks.append(_callback)
        _installed = True


def ship() -> None:
    """Hand the pending pause events to the writer as one GC record (evidence thread)."""
    if not _pending:
        return
    events = []
    while _pending:
        events.append(_pending.popleft())

    def build(_intern: shipper.Intern) -> dict[str, Any]:
        return {
            "pauses": [
                {"ts": ts, "dur": dur, "gen": gen, "collected": n, "ids": ids}
                for ts, dur, gen, n, ids in events
            ]
        }

    shipper.emit(GC, build)


def after_fork() -> None:
    _pending.clear()
