"""Event-loop blockers: pings posted into each asyncio loop the agent sees, checked from the
evidence thread.

While a request is in flight on a loop, each evidence tick posts a ping into it
(``call_soon_threadsafe``) unless one is still waiting; the loop answers when it next runs its
callbacks, noting how long the ping waited. A ping waiting longer than ``loop_block_ms`` means
the loop is blocked: while it stays blocked, each tick records the loop thread's stack and
the request whose code runs: the request recorded in the running task's context
(``asyncio.current_task(loop)``; a child task inherits its parent's context, so a route run in
a task of its own, as behind Starlette's ``BaseHTTPMiddleware``, is still found). The answer
measures how long
it lasted; the blocker is then shipped with its most common stacks, the request that caused
it, the other requests that were in flight on that loop (delayed by it), and the last call that
request had finished by the end of the block (a large result parsed on the loop shows up as its
rows and bytes). Works for plain asyncio and uvloop loops alike.

Why pings and not a ``call_later`` heartbeat: a pending timer makes every wait of the loop in
``select`` arm a kernel timer, which measured +4-6 % CPU per request on a loop handing work to a
thread pool; a ping costs one self-pipe write per tick, and nothing at all while the loop has no
request in flight. A block is timed from when its ping was posted, so a block that began before
reads up to one tick short: durations are lower bounds.
"""

from __future__ import annotations

import contextvars
import gc
import sys
import threading
import time
from collections import Counter
from types import FrameType
from typing import TYPE_CHECKING, Any

from perfsleuth.agent import recorder, shipper
from perfsleuth.agent.config import Config
from perfsleuth.agent.sampler import frames_flat
from perfsleuth.wire import BLOCKER

if TYPE_CHECKING:
    import asyncio  # imported by the app itself before any loop can run: never here

_perf = time.perf_counter_ns
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


def _context_of(task: Any) -> contextvars.Context | None:
    """The context a task's steps run in (read from another thread: only a reference)."""
    get_context = getattr(task, "get_context", None)  # 3.12+
    if get_context is not None:
        return get_context()  # type: ignore[no-any-return]
    # 3.11's C task has no accessor; its context is one of the objects it references.
    for obj in gc.get_referents(task):
        if type(obj) is contextvars.Context:
            return obj
    return None


def task_request(task: Any) -> recorder.ActiveRequest | None:
    """The request being recorded in ``task``'s context (its own, or the parent's that
    created it), or None."""
    if task is None:
        return None
    ctx = _context_of(task)
    if ctx is None:
        return None
    req = ctx.get(recorder._current)
    return req if isinstance(req, recorder.ActiveRequest) else None


class _Block:
    __slots__ = ("delayed", "reqs", "stacks", "start", "start_wall", "votes")

    def __init__(self, start: int) -> None:
        self.start = start
        self.start_wall = time.time_ns() - (_perf() - start)
        self.stacks: Counter[tuple[Any, ...]] = Counter()
        # The request found running, tick by tick: the one seen most often is the block's.
        # A tick can fall after the blocking step ended and before the ping is answered (the
        # loop first runs the callbacks queued ahead of it): it sees another task.
        self.votes: Counter[int] = Counter()
        self.reqs: dict[int, recorder.ActiveRequest] = {}
        self.delayed: set[int] = set()

    @property
    def req(self) -> recorder.ActiveRequest | None:
        top = self.votes.most_common(1)
        return self.reqs[top[0][0]] if top else None


class _Loop:
    __slots__ = ("block", "lag", "last", "loop", "sent", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.get_ident()
        self.sent = 0  # when the waiting ping was posted (0: none waiting)
        self.last = 0  # when the loop last answered one
        self.lag = 0  # how long that ping waited
        self.block: _Block | None = None


_loops: dict[int, _Loop] = {}
_lock = threading.Lock()
_enabled = False


def enable() -> None:
    global _enabled
    _enabled = True


def watch_current_loop() -> None:
    """Called from the ASGI wrapper on the loop thread: start watching a new loop."""
    if not _enabled:
        return
    aio = sys.modules.get("asyncio")
    if aio is None:
        return
    try:
        loop = aio.get_running_loop()
    except RuntimeError:
        return
    if id(loop) in _loops:
        return
    with _lock:
        if id(loop) not in _loops:
            _loops[id(loop)] = _Loop(loop)


def _pong(entry: _Loop, sent: int) -> None:
    """Runs on the loop: the answer to a ping posted at ``sent``."""
    now = _perf()
    entry.lag = now - sent
    entry.last = now
    entry.sent = 0


class Watchdog:
    def __init__(self, cfg: Config) -> None:
        self.threshold = int(cfg.loop_block_ms * 1e6)
        self.active = False  # a request is in flight on a watched loop: tick fast

    def tick(self, frames: dict[int, FrameType] | None = None) -> dict[int, FrameType] | None:
        """Check every watched loop; returns the frames it read (shared with the sampler)."""
        if not _loops:
            self.active = False
            return frames
        now = _perf()
        busy = {r.thread for r in list(recorder.inflight.values())}
        self.active = False
        for key, e in list(_loops.items()):
            if e.loop.is_closed():
                _loops.pop(key, None)
                continue
            b = e.block
            if b is not None and e.last > b.start:
                e.block = None
                self._finish(e, b)
                b = None
            if e.thread in busy:
                self.active = True
            if e.sent == 0:
                if e.thread in busy and e.loop.is_running():
                    e.sent = now
                    try:
                        e.loop.call_soon_threadsafe(_pong, e, now)
                    except RuntimeError:  # closed between the check and the post
                        _loops.pop(key, None)
                continue
            if b is None and now - e.sent > self.threshold:
                b = e.block = _Block(e.sent)
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
        req = None
        try:
            req = task_request(sys.modules["asyncio"].current_task(e.loop))
        except Exception:
            pass
        for r in list(recorder.inflight.values()):
            if r.thread != e.thread:
                continue
            b.delayed.add(id(r))
            if r is req:
                b.votes[id(r)] += 1
                b.reqs[id(r)] = r
                # keep a replayable capture of the blocking request (the leading one)
                if r.keep is None and b.req is r:
                    r.keep = "blocker"

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
        # The request's last call finished by the end of the block: a sync driver's query run
        # on the loop is part of the block (the ping may have gone out before it started), an
        # awaited one that outlasted the block is not.
        last = req.last_finished_call(e.last) if req is not None else None

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
                    "kind": last["kind"],
                    "text": shipper.call_text(last["kind"], last["target"]),
                    "rows": last["rows"],
                    "bytes": last["bytes"],
                    "ms": (last["end"] - last["start"]) / 1e6,
                }
            return body

        shipper.emit(BLOCKER, build)


def after_fork() -> None:
    """A forked child has no running loop yet; the parent's entries are not its own."""
    global _lock
    _loops.clear()
    _lock = threading.Lock()
