"""Event-loop blockers: a heartbeat on each asyncio loop the agent sees, checked from the
evidence thread.

The heartbeat is a ``call_later`` callback every ``BEAT`` seconds that notes when it ran and
how late it was. When the evidence thread sees a loop whose next beat is overdue by more than
``loop_block_ms``, the loop is blocked: while it stays blocked, each tick records the loop
thread's stack and which request's task is running (``asyncio.current_task(loop)``). The first
beat after the block measures how long it lasted; the blocker is then shipped with its most
common stacks, the request that caused it, the other requests that were in flight on that loop
(delayed by it), and the last call that request had finished (a large result parsed on the
loop shows up as rows and bytes right before the block). Works for plain asyncio and uvloop
loops alike: it only uses ``call_later`` and ``current_task``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import Counter
from types import FrameType
from typing import Any

from perfsleuth.agent import recorder, shipper
from perfsleuth.agent.config import Config
from perfsleuth.agent.sampler import frames_flat
from perfsleuth.wire import BLOCKER

_perf = time.perf_counter_ns
BEAT = 0.02  # seconds between heartbeats while a request is in flight on the loop
IDLE_BEAT = 0.5  # ... and while none is
MAX_STACKS = 16  # distinct stacks kept per blocker

recorder.stats.update({"loop_blockers": 0, "loop_starved": 0})

# Innermost frames of a loop that is not running a callback: waiting in select, or between
# callbacks (asyncio; uvloop's loop is C, so only the frame that started it is left).
_IDLE = {
    ("selectors.py", None),
    ("base_events.py", "_run_once"),
    ("base_events.py", "run_forever"),
    ("base_events.py", "run_until_complete"),
    ("selector_events.py", "_read_from_self"),
    ("runners.py", "run"),
}


def _idle(flat: tuple[Any, ...]) -> bool:
    if not flat:
        return True
    code = flat[0]
    base = code.co_filename.rsplit("/", 1)[-1]
    return (base, None) in _IDLE or (base, code.co_name) in _IDLE


class _Block:
    __slots__ = ("delayed", "req", "stacks", "start", "start_wall")

    def __init__(self, start: int) -> None:
        self.start = start
        self.start_wall = time.time_ns() - (_perf() - start)
        self.stacks: Counter[tuple[Any, ...]] = Counter()
        self.req: recorder.ActiveRequest | None = None
        self.delayed: set[int] = set()


class _Loop:
    __slots__ = ("block", "due", "fast", "gen", "lag", "last", "loop", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.get_ident()
        self.last = _perf()  # when the last beat ran
        self.due = self.last + int(BEAT * 1e9)  # when the next one should run
        self.lag = 0
        self.block: _Block | None = None
        self.fast = True  # beating every BEAT (a request is in flight) or every IDLE_BEAT
        self.gen = 0  # the current beat chain: a beat of an older chain stops there


_loops: dict[int, _Loop] = {}
_lock = threading.Lock()
_enabled = False


def enable() -> None:
    global _enabled
    _enabled = True


def watch_current_loop() -> None:
    """Called from the ASGI wrapper on the loop thread: start the heartbeat on a new loop."""
    if not _enabled:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    entry = _loops.get(id(loop))
    if entry is not None:
        if not entry.fast:  # a request starts on an idle loop: back to the fast beat
            entry.fast = True
            entry.gen += 1
            entry.due = _perf() + int(BEAT * 1e9)
            loop.call_later(BEAT, _beat, entry, entry.gen)
        return
    with _lock:
        if id(loop) in _loops:
            return
        entry = _Loop(loop)
        _loops[id(loop)] = entry
    loop.call_later(BEAT, _beat, entry, entry.gen)


def _beat(entry: _Loop, gen: int) -> None:
    if gen != entry.gen:
        return  # a newer chain beats for this loop
    now = _perf()
    entry.lag = now - entry.due
    entry.last = now
    # Beat fast only while a request is in flight on this loop: a loop with nothing to serve
    # costs a wake-up per beat (~0.8 % of a core at 50 a second) and has nobody to delay.
    thread = entry.thread
    entry.fast = any(r.thread == thread for r in list(recorder.inflight.values()))
    interval = BEAT if entry.fast else IDLE_BEAT
    entry.due = now + int(interval * 1e9)
    try:
        entry.loop.call_later(interval, _beat, entry, gen)
    except Exception:  # loop closing: forget it
        _loops.pop(id(entry.loop), None)


class Watchdog:
    def __init__(self, cfg: Config) -> None:
        self.threshold = int(cfg.loop_block_ms * 1e6)

    def tick(self, frames: dict[int, FrameType] | None = None) -> dict[int, FrameType] | None:
        """Check every watched loop; returns the frames it read (shared with the sampler)."""
        if not _loops:
            return frames
        now = _perf()
        for key, e in list(_loops.items()):
            if e.loop.is_closed():
                _loops.pop(key, None)
                continue
            b = e.block
            if b is not None and e.last > b.start:
                e.block = None
                self._finish(e, b)
                continue
            if b is None and now - e.due > self.threshold:
                if not e.loop.is_running():
                    continue  # a stopped loop is not a blocked one
                b = e.block = _Block(e.due)
            if b is not None:
                if frames is None:
                    frames = sys._current_frames()
                self._observe(e, b, frames)
        return frames

    def blocked(self) -> bool:
        return any(e.block is not None for e in list(_loops.values()))

    def _observe(self, e: _Loop, b: _Block, frames: dict[int, FrameType]) -> None:
        frame = frames.get(e.thread)
        if frame is not None:
            flat = frames_flat(frame)
            if len(b.stacks) < MAX_STACKS or flat in b.stacks:
                b.stacks[flat] += 1
        running: Any = None
        try:
            running = asyncio.current_task(e.loop)
        except Exception:
            pass
        for r in list(recorder.inflight.values()):
            if r.thread != e.thread:
                continue
            if running is not None and r.task is running:
                b.req = r
                if r.keep is None:  # keep a replayable capture of the blocking request
                    r.keep = "blocker"
            else:
                b.delayed.add(id(r))

    def _finish(self, e: _Loop, b: _Block) -> None:
        duration = max(e.lag, e.last - b.start)
        if duration < self.threshold:
            return
        stacks = b.stacks.most_common(MAX_STACKS)
        if stacks and _idle(stacks[0][0]):
            # The loop sat in its own select/run machinery: no callback ran long, the loop
            # thread could not get the GIL or the CPU back (other threads, a busy machine).
            recorder.stats["loop_starved"] += 1
            return
        recorder.stats["loop_blockers"] += 1
        req = b.req
        delayed = len(b.delayed - {id(req)}) if req is not None else len(b.delayed)
        last = None
        if req is not None:
            for c in reversed(req.calls[-50:]):
                if c.end and c.end <= b.start:
                    last = c
                    break

        def build(intern: shipper.Intern) -> dict[str, Any]:
            body: dict[str, Any] = {
                "ts": b.start_wall,
                "dur": duration,
                "delayed": delayed,
                "stacks": [[intern(flat), n] for flat, n in stacks],
            }
            if req is not None:
                body["id"] = f"{req.trace_id:016x}"
                body["endpoint"] = req.endpoint or ""
                body["method"] = req.method
                body["path"] = req.path
            if last is not None:
                body["last_call"] = {
                    "kind": last.kind,
                    "text": shipper.call_text(last),
                    "rows": last.rows,
                    "bytes": last.bytes,
                    "ms": (last.end - last.start) / 1e6,
                }
            return body

        shipper.emit(BLOCKER, build)


def after_fork() -> None:
    """A forked child has no running loop yet; the parent's entries are not its own."""
    global _lock
    _loops.clear()
    _lock = threading.Lock()
