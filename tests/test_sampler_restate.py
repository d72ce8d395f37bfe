"""A sample's state from scripted scheduler counters (issue 21): the run-queue wait the kernel
adds to a thread's counters only when the wait ends goes back to the intervals it was spent
in, latest first, and the process's CPU time is read beside the threads' counters.

The sampler's ticks run on a real request in a real (blocked) thread; only the readings of
its schedstat file (CPU ns, run-queue ns, times scheduled, when read) and of the process's
CPU clock are scripted, so the states do not depend on the machine's scheduler.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from perfsleuth.agent import recorder, sampler
from perfsleuth.agent.config import Config

MS = 1_000_000
TICK = 20 * MS
W, S, G = sampler.WAIT, sampler.STARVED, sampler.GIL


@pytest.fixture
def request_thread(agent_data_dir: str) -> Iterator[recorder.ActiveRequest]:
    """A request in flight in a thread of its own, blocked until the test ends."""
    got: dict[str, Any] = {}
    started, done = threading.Event(), threading.Event()

    def handler() -> None:
        req = recorder.begin("web", "GET", "/scripted")
        assert req is not None
        got["req"] = req
        started.set()
        done.wait(10)
        recorder.end(req)

    t = threading.Thread(target=handler)
    t.start()
    try:
        assert started.wait(10)
        yield got["req"]
    finally:
        done.set()
        t.join(10)


def scripted(
    req: recorder.ActiveRequest, readings: list[tuple[int, int, int, int]]
) -> sampler.Sampler:
    """A sampler whose reads of the request's thread return ``readings``, one a tick."""
    s = sampler.Sampler(Config())
    s.after_ns = 0  # sampled from its first tick
    far = time.perf_counter_ns() + (1 << 60)
    s.figures_at = s.looked_at = far  # no process figures, no look at threads not sampled
    script = iter(readings)

    def sched(ident: int) -> tuple[int, int, int, int] | None:
        assert ident == req.thread
        s.natives[ident] = req.thread  # one kernel thread all along
        return next(script)

    s._sched = sched  # type: ignore[method-assign]
    return s


def states_of(s: sampler.Sampler, req: recorder.ActiveRequest) -> list[str]:
    t = s.tracked.get(id(req))
    return [] if t is None else [state for _, state, _ in t.samples]


@pytest.mark.parametrize(
    ("last", "want"),
    [
        # blocked all along: no run-queue time comes in later
        ((1 * MS, 0, 1, 3 * TICK), [W, W, W]),
        # queued across the two ticks, then a CPU: 5 ms on it, 15 ms of this interval and the
        # 40 ms before it in the run queue; both earlier intervals were starved
        ((5 * MS, 55 * MS, 1, 3 * TICK), [S, S, S]),
        # 20 ms queued before this interval: the latest earlier interval only
        ((5 * MS, 35 * MS, 1, 3 * TICK), [W, S, S]),
    ],
)
def test_run_queue_wait_taken_in_later_goes_back_to_the_latest_waiting_samples(
    request_thread: recorder.ActiveRequest, last: tuple[int, int, int, int], want: list[str]
) -> None:
    req = request_thread
    s = scripted(req, [(0, 0, 0, 0), (0, 0, 0, TICK), (0, 0, 0, 2 * TICK), last])
    try:
        for _ in range(4):
            s.tick()  # the first only takes the baseline
        assert states_of(s, req) == want
    finally:
        s._forget(set())


def test_an_interval_with_no_sample_takes_its_share_of_later_run_queue_wait(
    request_thread: recorder.ActiveRequest,
) -> None:
    """At its sample limit a request's thread still waits over the third interval: the 19 ms
    of run-queue wait the fourth read takes in beyond its own belong to that interval (the
    latest), not to the older 'wait' sample."""
    req = request_thread
    s = scripted(
        req,
        [
            (0, 0, 0, 0),
            (1 * MS, 0, 1, TICK),  # blocked: a 'wait' sample
            (1 * MS, 0, 1, 2 * TICK),  # blocked, or queued: no sample (the limit)
            (2 * MS, 38 * MS, 2, 3 * TICK),  # 1 ms on the CPU, 19 + 19 ms queued
        ],
    )
    s.limit = 1
    try:
        for _ in range(4):
            s.tick()
        assert states_of(s, req) == [W]
        assert s.tracked[id(req)].taken == 3
    finally:
        s._forget(set())


def test_others_cpu_is_read_beside_the_threads_counters_not_at_the_ticks_start(
    request_thread: recorder.ActiveRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second tick stalls after its start (the evidence thread loses the CPU or the
    interpreter lock while it takes the threads' frames) while other threads of the process
    run 30 ms, then reads the request's thread, woken twice and otherwise blocked: those 30 ms
    fall in the thread's second interval (the interpreter lock: 'gil'), none in its third
    ('wait')."""
    req = request_thread
    process_cpu = [0]
    fake_time = types.SimpleNamespace(
        **{name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    )
    fake_time.process_time_ns = lambda: process_cpu[0]
    monkeypatch.setattr(sampler, "time", fake_time)
    ticks = [0]

    def current_frames() -> dict[int, Any]:
        ticks[0] += 1
        if ticks[0] == 2:  # the app computes while the evidence thread waits
            process_cpu[0] += 30 * MS
        return sys._current_frames()

    fake_sys = types.SimpleNamespace(modules=sys.modules, _current_frames=current_frames)
    monkeypatch.setattr(sampler, "sys", fake_sys)
    s = scripted(req, [(0, 0, 0, 0), (0, 0, 2, TICK), (0, 0, 4, 2 * TICK)])
    try:
        for _ in range(3):
            s.tick()
        assert states_of(s, req) == [G, W]
    finally:
        s._forget(set())
