"""Stack samples of slow requests, taken from the evidence thread (FusionReactor-style).

Once a request has been in flight for ``sample_after_ms``, each tick takes one sample of where
its code is:

- a sync request (WSGI, or a sync endpoint running in a thread pool: ``req.worker``): the
  stack of its thread;
- an async request whose task is running on the loop right now: the loop thread's stack;
- an async request that is awaiting: its coroutine chain (``cr_await``), outermost first.

Each sample says ``cpu``, ``wait`` or ``call``: ``call`` while the request is inside a recorded
DB / HTTP / cache call (the call's own timing explains that time); otherwise, for a thread,
``cpu`` when it used at least half of the wall time since the previous tick on the CPU (its
own CPU clock, ``pthread_getcpuclockid``; waiting for the GIL counts as ``wait``), and an
awaiting coroutine is ``wait``. Samples are kept per request up to ``samples_per_request``
(more are counted in ``samples_dropped``) and shipped as one SAMPLES record when the request
ends, or in chunks while a very long request is still running, so a request stuck for minutes
is visible before it finishes.
"""

from __future__ import annotations

import sys
import time
from types import FrameType
from typing import Any

from perfsleuth.agent import recorder, shipper, stacks
from perfsleuth.agent.config import Config
from perfsleuth.wire import SAMPLES

_perf = time.perf_counter_ns
CHUNK = 100  # samples per record while a request is still in flight
MAX_TRACKED = 64  # requests sampled at once; more slow requests in flight are skipped

recorder.stats.update({"samples_taken": 0, "samples_dropped": 0})


def frames_flat(frame: FrameType | None, limit: int = stacks.MAX_DEPTH) -> tuple[Any, ...]:
    """(code, line, ...) innermost first, skipping the agent's own frames anywhere (its ASGI
    and WSGI wrappers sit in the middle of a request's stack)."""
    out: list[Any] = []
    f = frame
    classify = stacks.classify
    while f is not None and len(out) < 2 * limit:
        code = f.f_code
        if classify(code) is not None:
            out.append(code)
            out.append(f.f_lineno)
        f = f.f_back
    return tuple(out)


def coroutine_flat(task: Any) -> tuple[Any, ...]:
    """The await chain of an asyncio task, as frames_flat would give it (innermost first)."""
    chain: list[FrameType] = []
    coro = task.get_coro()
    for _ in range(stacks.MAX_DEPTH):
        if coro is None:
            break
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        chain.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    out: list[Any] = []
    for frame in reversed(chain):
        if stacks.classify(frame.f_code) is not None:
            out.append(frame.f_code)
            out.append(frame.f_lineno)
    return tuple(out)


def _task_frame(task: Any) -> FrameType | None:
    try:
        coro = task.get_coro()
        return getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
    except Exception:
        return None


def _on_stack(frame: FrameType | None, target: FrameType) -> bool:
    f = frame
    while f is not None:
        if f is target:
            return True
        f = f.f_back
    return False


class _Tracked:
    __slots__ = ("req", "samples", "sent", "taken")

    def __init__(self, req: recorder.ActiveRequest) -> None:
        self.req = req
        self.samples: list[tuple[int, str, tuple[Any, ...]]] = []  # (offset ns, state, flat)
        self.taken = 0
        self.sent = 0


class Sampler:
    def __init__(self, cfg: Config) -> None:
        self.after_ns = int(cfg.sample_after_ms * 1e6)
        self.limit = max(1, cfg.samples_per_request)
        self.tracked: dict[int, _Tracked] = {}
        # thread ident -> (wall ns, thread CPU ns) at the previous look
        self.cpu_seen: dict[int, tuple[int, int]] = {}

    def tick(self, frames: dict[int, FrameType] | None = None) -> None:
        now = _perf()
        due = [r for r in list(recorder.inflight.values()) if now - r.start >= self.after_ns]
        for key in [k for k, t in self.tracked.items() if k not in recorder.inflight]:
            self._ship(self.tracked.pop(key), final=True)
        if not due:
            self.cpu_seen.clear()
            return
        if frames is None:
            frames = sys._current_frames()
        seen_threads: set[int] = set()
        for req in due:
            t = self.tracked.get(id(req))
            if t is None:
                if len(self.tracked) >= MAX_TRACKED:
                    recorder.stats["samples_dropped"] += 1
                    continue
                t = self.tracked[id(req)] = _Tracked(req)
            self._sample(t, frames, now, seen_threads)
        for ident in [i for i in self.cpu_seen if i not in seen_threads]:
            del self.cpu_seen[ident]

    def _state(self, ident: int, now: int, seen: set[int]) -> str | None:
        """'cpu' / 'wait' from the thread's CPU clock since the last look (None at the first)."""
        seen.add(ident)
        try:
            cpu = time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
        except (OSError, AttributeError, OverflowError):
            return "cpu"  # no per-thread clock here: a running thread is the best guess
        prev = self.cpu_seen.get(ident)
        self.cpu_seen[ident] = (now, cpu)
        if prev is None or now <= prev[0]:
            return None
        return "cpu" if (cpu - prev[1]) * 2 >= now - prev[0] else "wait"

    def _sample(self, t: _Tracked, frames: dict[int, FrameType], now: int, seen: set[int]) -> None:
        req = t.req
        worker = req.worker
        flat: tuple[Any, ...] = ()
        state: str | None
        if worker is not None and worker in frames:
            state = self._state(worker, now, seen)
            flat = frames_flat(frames[worker])
        elif req.task is not None:
            loop_frame = frames.get(req.thread)
            coro_frame = _task_frame(req.task)
            if coro_frame is not None and _on_stack(loop_frame, coro_frame):
                state = self._state(req.thread, now, seen)
                flat = frames_flat(loop_frame)
            else:
                state = "wait"
                flat = coroutine_flat(req.task)
        elif req.thread in frames:
            state = self._state(req.thread, now, seen)
            flat = frames_flat(frames[req.thread])
        else:
            return
        if state is None or not flat:
            return  # the first look at a thread only sets its CPU baseline
        if req.open_call():
            state = "call"  # inside a recorded DB / HTTP / cache call: the call explains it
        t.taken += 1
        if len(t.samples) + t.sent >= self.limit:
            recorder.stats["samples_dropped"] += 1
            return
        recorder.stats["samples_taken"] += 1
        t.samples.append((now - req.start, state, flat))
        if len(t.samples) >= CHUNK:
            self._ship(t, final=False)

    def _ship(self, t: _Tracked, *, final: bool) -> None:
        samples, t.samples = t.samples, []
        if not samples and not (final and t.sent):
            return
        t.sent += len(samples)
        req = t.req
        dropped = t.taken - t.sent if final else 0

        def build(intern: shipper.Intern) -> dict[str, Any]:
            return {
                "id": f"{req.trace_id:016x}",
                "ts": req.start_wall,
                "endpoint": req.endpoint if final else "",
                "method": req.method,
                "path": req.path,
                "final": final,
                "dropped": dropped,
                "samples": [[off, st, intern(flat)] for off, st, flat in samples],
            }

        shipper.emit(SAMPLES, build)

    def flush(self) -> None:
        for key in list(self.tracked):
            t = self.tracked[key]
            if key not in recorder.inflight:
                del self.tracked[key]
                self._ship(t, final=True)
