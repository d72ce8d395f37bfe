"""The evidence thread: stack samples of slow requests, event-loop blockers and GC pauses.

One daemon thread ticks every ``sample_interval_ms`` while a slow request is being sampled or
a request is in flight on a watched event loop (the watchdog pings the loop each tick),
otherwise every 50 ms (IDLE_TICK: a new request is seen within it), or sooner when a request
in flight is one fast tick short of ``sample_after_ms``: that tick reads its thread, the next
takes its first sample at the mark, so a request of D ms gets about
(D - sample_after_ms) / sample_interval_ms + 1 samples. Nothing on the request path wakes the
thread: the wake-up time comes from the start times of the requests in flight. It reads
all threads' frames once per tick, and only when something is slow or blocked, and hands them
to the sampler and the watchdog. Everything it produces goes through
``shipper.emit``; it never touches application objects beyond reading frames and tasks.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable

from perfsleuth.agent import accel, gcwatch, recorder, watchdog
from perfsleuth.agent.config import Config
from perfsleuth.agent.sampler import Sampler

IDLE_TICK = 0.05
IDLE_TICK_NS = int(IDLE_TICK * 1e9)

_cfg: Config | None = None
_sampler: Sampler | None = None
_watchdog: watchdog.Watchdog | None = None
_thread: threading.Thread | None = None
_lock = threading.Lock()
last_error = ""


def start(cfg: Config) -> None:
    global _cfg
    if not cfg.evidence:
        return
    _cfg = cfg
    gcwatch.install(cfg.gc_event_ms, fault=cfg.fault == "evidence_crash")
    watchdog.enable()
    _start_thread()


def _start_thread() -> None:
    global _sampler, _watchdog, _thread
    if _cfg is None:
        return
    _sampler = Sampler(_cfg)
    _watchdog = watchdog.Watchdog(_cfg)
    t = threading.Thread(target=_run, name="perfsleuth-evidence", daemon=True)
    t.start()
    _thread = t


def _run() -> None:
    cfg = _cfg
    if cfg is None:
        return
    interval_ns = int(max(0.001, cfg.sample_interval_ms / 1000) * 1e9)
    _loop(interval_ns, _sampler, tick, accel.pick("sleep", time.sleep))


def _loop(
    interval_ns: int,
    s: Sampler | None,
    tick_once: Callable[[], bool],
    sleep: Callable[[float], None],
) -> None:
    """The evidence thread's loop: ``tick_once`` (tick), then ``sleep`` until the next tick is
    due (next_tick). A tick that raised sleeps IDLE_TICK: the sampler's ``armed`` and
    ``wake_at`` are those of an earlier tick (a wake-up time already past would make every
    following tick due at once, a busy loop for as long as the ticks fail)."""
    global last_error
    last_gc = time.monotonic()
    clock = time.perf_counter_ns if s is None else s.clock
    target = clock()
    while True:
        failed = False
        try:
            busy = tick_once()
            now = time.monotonic()
            if now - last_gc >= 0.5:
                last_gc = now
                gcwatch.ship()
        except Exception as e:  # keep ticking: one bad frame must not end the evidence
            recorder.internal_error()
            last_error = f"{type(e).__name__}: {e}"
            busy, failed = False, True
        at = clock()
        target = at + IDLE_TICK_NS if failed else next_tick(s, busy, interval_ns, target, at)
        sleep(max(0, target - at) / 1e9)


def next_tick(s: Sampler | None, busy: bool, interval_ns: int, target: int, now: int) -> int:
    """When the next tick is due (``s.clock``'s ns), after the tick meant for ``target`` that
    ended at ``now`` (``busy``: what tick() returned). While sampling or arming a request: one
    interval after ``target``, so samples keep their cadence though each tick starts a little
    late (the interpreter lock, a busy CPU); a tick that overran the next mark waits a whole
    interval from its end. While only watching a loop with a request in flight (pings): one
    interval from now, or sooner when a request in flight is to be armed (``wake_at``), so
    that its first sample is at the mark as on a thread. Otherwise: when the next request in
    flight is to be armed, at most IDLE_TICK from now."""
    if s is not None and (s.tracked or s.armed):
        due = target + interval_ns
        return due if due >= now else now + interval_ns
    wake_at = 0 if s is None else s.wake_at
    if busy:
        ping = now + interval_ns
        return max(now, wake_at) if wake_at and wake_at < ping else ping
    idle = now + IDLE_TICK_NS
    return max(now, min(idle, wake_at)) if wake_at else idle


def tick() -> bool:
    """One look at the process; returns whether something needs the fast tick."""
    s, w = _sampler, _watchdog
    if s is None or w is None:
        return False
    if _cfg is not None and _cfg.fault == "evidence_crash":
        raise RuntimeError("injected evidence crash")
    with _lock:
        frames = w.tick()
        s.tick(frames)
        return bool(s.tracked) or s.armed or w.active or w.blocked()


def flush() -> None:
    """Ship what finished requests and past collections left behind (exit, tests)."""
    try:
        with _lock:
            if _sampler is not None:
                _sampler.flush()
        gcwatch.ship()
    except Exception:
        recorder.internal_error()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    recorder.inflight.clear()
    gcwatch.after_fork()
    watchdog.after_fork()
    if _cfg is not None:
        _start_thread()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(flush)
