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


def schedstat_of(fd: int) -> str | None:
    """The schedstat file an open descriptor reads, else None."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.endswith("/schedstat") else None


def test_idle_server_threads_hold_no_schedstat_files(agent_data_dir: str) -> None:
    s = sampler.Sampler(Config())
    s.after_ns = 1 << 62  # nothing is sampled: only the scheduler figures are looked at
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
        # each serving thread's counters are read from a file of its own
        opened = {fd: schedstat_of(fd) for fd in s.fds.values() if fd >= 0}
        assert len(opened) >= THREADS and None not in opened.values()
        assert len(s.seen) >= THREADS
        release.set()
        while any(r.path == "/slow" for r in list(recorder.inflight.values())):
            threading.Event().wait(0.01)
        s.tick()  # the threads live on, idle
        assert all(t.is_alive() for t in threads)
        assert not s.fds
        # closed (a number reused since is another file: the agent's own sampler runs too)
        assert all(schedstat_of(fd) != target for fd, target in opened.items())
        # their baselines stay (the next request's figures start from them), bounded
        assert THREADS <= len(s.seen) <= sampler.MAX_BASELINES
    finally:
        release.set()
        done.set()
        for t in threads:
            t.join()
        s._forget(set())
