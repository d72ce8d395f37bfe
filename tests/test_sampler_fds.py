"""The sampler's scheduler counters on a server with many threads (issue 22 item 8): a
thread's schedstat file is open only while it serves a request in flight; idle threads hold
none, and their baselines stay bounded. Real threads, real /proc files, the agent's recorder."""

from __future__ import annotations

import os
import threading

import pytest

from perfsleuth.agent import recorder, sampler
from perfsleuth.agent.config import Config

THREADS = 40

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="schedstat is Linux's")


def schedstat_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").endswith("/schedstat"):
                n += 1
        except OSError:
            pass
    return n


def test_idle_server_threads_hold_no_schedstat_files(agent_data_dir: str) -> None:
    s = sampler.Sampler(Config())
    s.after_ns = 1 << 62  # nothing is sampled: only the scheduler figures are looked at
    base = schedstat_fds()
    serving, release, done = threading.Barrier(THREADS + 1), threading.Event(), threading.Event()

    def worker() -> None:  # a server thread: one request, then idle in its pool
        req = recorder.begin("web", "GET", "/slow")
        assert req is not None
        serving.wait(10)
        release.wait(10)
        recorder.end(req)
        done.wait(10)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    try:
        serving.wait(10)
        for _ in range(2):
            s.looked_at = 0  # a look is due
            s.tick()
        assert schedstat_fds() - base >= THREADS  # each serving thread's counters are read
        assert len(s.seen) >= THREADS
        release.set()
        while any(r.path == "/slow" for r in list(recorder.inflight.values())):
            threading.Event().wait(0.01)
        s.tick()  # the threads live on, idle
        assert all(t.is_alive() for t in threads)
        assert schedstat_fds() == base
        assert not s.fds
        # their baselines stay (the next request's figures start from them), bounded
        assert THREADS <= len(s.seen) <= sampler.MAX_BASELINES
    finally:
        release.set()
        done.set()
        for t in threads:
            t.join()
        s._forget(set())
