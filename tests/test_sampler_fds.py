"""The sampler's scheduler counters on a server with many threads (issue 22 item 8): a
thread's schedstat file is open while it serves a request in flight; idle threads hold at most
``MAX_IDLE_FILES`` of them (a pool's threads take turns at requests), and their baselines stay
bounded. Real threads, real /proc files, the agent's recorder."""

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


def test_idle_server_threads_hold_few_schedstat_files(agent_data_dir: str) -> None:
    s = sampler.Sampler(Config())
    s.after_ns = 1 << 62  # nothing is sampled: only the scheduler figures are looked at
    serving = threading.Barrier(THREADS + 1)
    release, again, done = threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:  # a server thread: a request, idle in its pool, another request
        req = recorder.begin("web", "GET", "/slow")
        assert req is not None
        serving.wait(10)
        release.wait(10)
        recorder.end(req)
        again.wait(10)
        req = recorder.begin("web", "GET", "/slow")
        assert req is not None
        serving.wait(10)
        done.wait(10)
        recorder.end(req)

    def look() -> None:
        s.looked_at = 0  # a look is due
        s.tick()

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    try:
        serving.wait(10)
        look()
        look()
        # each serving thread's counters are read from a file of its own
        opened = {fd: schedstat_of(fd) for fd in s.fds.values() if fd >= 0}
        assert len(opened) >= THREADS and None not in opened.values()
        assert len(s.seen) >= THREADS
        release.set()
        while any(r.path == "/slow" for r in list(recorder.inflight.values())):
            threading.Event().wait(0.01)
        s.tick()  # the threads live on, idle
        assert all(t.is_alive() for t in threads)
        assert len(s.fds) == sampler.MAX_IDLE_FILES < THREADS
        # the others closed (a number reused since is another file: the agent's own sampler
        # runs too)
        still = [fd for fd, target in opened.items() if schedstat_of(fd) == target]
        assert sorted(still) == sorted(s.fds.values())
        # their baselines stay, bounded
        assert THREADS <= len(s.seen) <= sampler.MAX_BASELINES
        # the next request's first look takes its figures from them (the file opened again)
        wall = s.figures["sched_wall_ns"]
        again.set()
        serving.wait(10)
        look()
        assert len([fd for fd in s.fds.values() if fd >= 0]) >= THREADS
        assert s.figures["sched_wall_ns"] - wall >= THREADS * 1000
    finally:
        release.set()
        again.set()
        done.set()
        for t in threads:
            t.join()
        s._forget(set())


CRASH = """
import sys, tempfile, threading
import perfsleuth.agent as ps
from perfsleuth.agent import recorder, sampler
from perfsleuth.agent.config import Config

assert ps.start(tempfile.mkdtemp(), service="dead-thread")
s = sampler.Sampler(Config())
s.after_ns = 1 << 62  # the scheduler figures' look at each thread serving a request

def served_and_died():
    recorder.begin("web", "GET", "/left-open")  # the thread ends with its request in flight

# large stacks: past glibc's cache of thread stacks (40 MB) an ended thread's is unmapped,
# with the pthread structure its id points to
threading.stack_size(64 << 20)
for _ in range(4):
    threads = [threading.Thread(target=served_and_died) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.looked_at = 0
    s.tick()
print("alive")
"""


def test_a_thread_that_died_in_a_request_is_not_read(tmp_path: str) -> None:
    """A request left in flight by a thread that ended: the sampler does not ask for the
    CPU clock of its stale pthread id (which can crash the process)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "alive" in r.stdout, (r.returncode, r.stderr[-2000:])
