"""A sample's state at the edges of its tick (issue 21): the state is about the interval since
the previous tick, so it must describe what the request did over that interval.

- A request whose sync code returned from its thread-pool worker since the last tick and that
  now awaits (the response on its way out) computed over the interval: it is not sampled as
  waiting. Else, on a quiet machine, about one /cpu-sync request in three gets such a sample
  (the evidence thread often takes the interpreter lock the moment the worker lets it go,
  before the loop resumes the request).
- A tick that stalls between its start and its reads (the evidence thread lost the CPU or the
  interpreter lock) measures each thread's interval between the reads, not from the tick's
  start: a thread on the CPU all along is not called waiting.

Real threads, a real event loop, the thread pool hand-off's own marking, real /proc counters;
the test drives the sampler's ticks itself.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from perfsleuth.agent import recorder, sampler
from perfsleuth.agent.config import Config
from perfsleuth.agent.instrument import threads

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="schedstat is Linux's")

CPU_CLASSES = (sampler.CPU, sampler.STARVED)
INTERVAL = 0.06  # between the test's ticks: long enough for a thread to show it computes


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def new_sampler() -> sampler.Sampler:
    s = sampler.Sampler(Config())
    s.after_ns = 0  # every request in flight is sampled at each tick
    return s


def states_of(s: sampler.Sampler, req: recorder.ActiveRequest) -> list[str]:
    t = s.tracked.get(id(req))
    return [] if t is None else [state for _, state, _ in t.samples]


def burn(stop: threading.Event) -> int:
    n = 0
    while not stop.is_set():
        n += sum(i * i for i in range(200))
    return n


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    try:
        yield lp
    finally:
        lp.call_soon_threadsafe(lp.stop)
        t.join(10)
        lp.close()


def test_a_request_back_from_its_worker_is_not_sampled_waiting_for_the_interval_it_computed(
    agent_data_dir: str, loop: asyncio.AbstractEventLoop
) -> None:
    s = new_sampler()
    stop, returned = threading.Event(), threading.Event()
    got: dict[str, Any] = {}
    pool = ThreadPoolExecutor(1)

    async def endpoint() -> None:  # an async server running a sync endpoint in its pool
        req = recorder.begin("web", "GET", "/cpu-sync")
        assert req is not None
        req.task = asyncio.current_task()
        got["req"] = req
        sent = asyncio.Event()
        got["sent"] = sent
        work = functools.partial(threads._run_marked, req, burn, stop)
        await asyncio.get_running_loop().run_in_executor(pool, work)
        returned.set()
        await sent.wait()  # the response on its way out: the request awaits
        recorder.end(req)

    done = asyncio.run_coroutine_threadsafe(endpoint(), loop)
    try:
        wait_until(lambda: "req" in got and got["req"].worker is not None)
        req = got["req"]
        s.tick()  # the worker's first look: a baseline, no sample
        for _ in range(2):
            time.sleep(INTERVAL)
            s.tick()
        computed = states_of(s, req)
        assert len(computed) == 2 and set(computed) <= set(CPU_CLASSES), computed
        # The worker computes most of the next interval, then returns; the request awaits.
        time.sleep(INTERVAL)
        stop.set()
        assert returned.wait(10) and req.worker is None
        s.tick()
        assert states_of(s, req) == computed  # not a 'wait' for the interval it computed
        # From now on it awaits all along: waiting.
        time.sleep(INTERVAL)
        s.tick()
        assert states_of(s, req) == [*computed, sampler.WAIT]
    finally:
        stop.set()
        if "sent" in got:
            loop.call_soon_threadsafe(got["sent"].set)
        done.result(10)
        pool.shutdown()
        s._forget(set())


def test_a_tick_that_stalls_before_its_reads_measures_the_interval_between_the_reads(
    agent_data_dir: str,
) -> None:
    s = new_sampler()
    stop = threading.Event()
    got: dict[str, Any] = {}

    def handler() -> None:  # a WSGI request computing in its own thread
        req = recorder.begin("web", "GET", "/cpu")
        assert req is not None
        got["req"] = req
        burn(stop)
        recorder.end(req)

    t = threading.Thread(target=handler)
    t.start()
    shipped = s.ship_figures

    def stalled() -> None:  # the evidence thread loses the CPU after the tick's start
        time.sleep(0.5)
        shipped()

    try:
        wait_until(lambda: "req" in got)
        req = got["req"]
        s.ship_figures = stalled  # type: ignore[method-assign]
        s.figures_at = 0  # due at this tick, which reads the thread's counters after it
        s.tick()
        s.ship_figures = shipped  # type: ignore[method-assign]
        for _ in range(2):  # the second look takes in any run-queue wait still open at the first
            time.sleep(INTERVAL * 2)
            s.tick()
        state = states_of(s, req)[0]
        assert state in CPU_CLASSES, states_of(s, req)
    finally:
        stop.set()
        t.join(10)
        s._forget(set())


def test_a_thread_that_waited_for_a_cpu_across_ticks_is_starved_not_waiting(
    agent_data_dir: str,
) -> None:
    """The kernel adds a run-queue wait to a thread's counters when the wait ends (the thread
    gets a CPU): a thread queued across whole ticks shows no change at all over them, as a
    blocked one does, then more queue time than the interval. Here the request's thread
    computes (hashing, without the interpreter lock) at the lowest priority on one CPU that a
    busy process of normal priority also wants: it runs a few ms now and then."""
    if not hasattr(os, "sched_setaffinity") or not hasattr(os, "setpriority"):
        pytest.skip("needs Linux CPU affinity and thread priorities")
    import hashlib
    import subprocess
    import sys

    cpu = min(os.sched_getaffinity(0))
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile 1: pass"]
    )
    s = new_sampler()
    stop = threading.Event()
    got: dict[str, Any] = {}
    data = b"x" * (1 << 20)

    def handler() -> None:
        os.sched_setaffinity(threading.get_native_id(), {cpu})
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        req = recorder.begin("web", "GET", "/hash")
        assert req is not None
        got["req"] = req
        while not stop.is_set():
            hashlib.sha256(data).digest()
        recorder.end(req)

    t = threading.Thread(target=handler)
    try:
        time.sleep(0.3)  # the busy process loops
        t.start()
        wait_until(lambda: "req" in got)
        for _ in range(40):
            s.tick()
            time.sleep(0.02)
        busy.kill()  # the thread gets a CPU: its counters take in the wait
        busy.wait()
        time.sleep(0.05)
        s.tick()
        states = states_of(s, got["req"])
        assert len(states) >= 30, states
        waits = states.count(sampler.WAIT) + states.count(sampler.GIL)
        assert waits <= 0.1 * len(states), states
    finally:
        stop.set()
        busy.kill()
        busy.wait()
        t.join(10)
        s._forget(set())
