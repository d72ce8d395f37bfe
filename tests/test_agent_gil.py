"""The agent's threads and the interpreter lock (agent/_speedups.c, "agent threads and the GIL").

An agent thread's wait (the writer's Waker, the evidence thread's sleep, the segment's write)
ends by saying that it wants the lock back, and a request's end (spool.queue.enqueue in C) hands
the lock over to it. Without that, CPython gives the lock back to a thread only when it wins a
race against an application thread that keeps releasing and retaking it (every sqlite3 step),
or after a switch interval that such an application keeps restarting. The hand-over test makes
that interval so long that only the hand-over can give the lock away: it fails without it.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
import zlib
from typing import Any

import pytest

from fakequeue import bare_request, fake_queue
from perfsleuth.agent import accel
from perfsleuth.agent.spool import queue
from perfsleuth.wire.segment import CRC_PIECE, crc32

speedups = accel.module
needs_c = pytest.mark.skipif(
    speedups is None or not hasattr(speedups, "Waker"), reason="the C accelerator is not built"
)


@needs_c
@pytest.mark.parametrize("wait", ["sleep", "waker"])
def test_a_request_s_end_hands_the_lock_to_an_agent_thread_that_wants_it(
    wait: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_queue(monkeypatch, queue_size=1 << 30, queue_limit=1 << 40)
    waker = speedups.Waker()
    done: list[str] = []

    def agent_thread() -> None:
        if wait == "sleep":
            speedups.sleep(0.1)
        else:
            waker.wait(0.1)  # not set: its timeout ends it
        done.append(wait)  # Python code: needs the lock

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # no forced switch within the test: only a hand-over
    t = threading.Thread(target=agent_thread)
    try:
        t.start()
        time.sleep(0.05)  # lets the agent thread into its wait (the lock is let go here)
        # This thread keeps the lock while the agent thread's wait ends and it asks for the
        # lock: half a second at least (other agent threads of this process may be waiting
        # too, so "waiting" alone does not say that this one is).
        start = time.perf_counter()
        for _ in range(100_000_000):
            if speedups.gil_stats()["waiting"] and time.perf_counter() - start > 0.5:
                break
        assert speedups.gil_stats()["waiting"] >= 1
        before = speedups.gil_stats()["hand_overs"]
        # requests end: the agent thread runs to its end (another agent thread of this
        # process, if any, may get a hand-over first)
        for _ in range(1000):
            speedups.enqueue(bare_request())
            if done:
                break
        assert done == [wait]
        assert speedups.gil_stats()["hand_overs"] > before
    finally:
        sys.setswitchinterval(old)
        t.join()


@needs_c
def test_nobody_waiting_means_no_hand_over(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_queue(monkeypatch, queue_size=1 << 30, queue_limit=1 << 40)
    before = speedups.gil_stats()["hand_overs"]
    for _ in range(100):
        speedups.enqueue(bare_request())
    assert speedups.gil_stats() == {"hand_overs": before, "waiting": 0}
    assert len(queue._queue) == 100


@needs_c
def test_the_waker_is_a_threading_event() -> None:
    w = speedups.Waker()
    assert not w.is_set()
    assert w.wait(0.01) is False
    assert w.wait(-1) is False and w.wait(0) is False
    w.set()
    w.set()
    assert w.is_set() and w.wait(0) is True and w.wait(None) is True
    w.clear()
    assert not w.is_set() and w.wait(0) is False
    with pytest.raises(TypeError):
        w.wait("soon")
    with pytest.raises(TypeError):
        w.wait(1, 2)


@needs_c
def test_the_waker_wakes_a_thread_waiting_on_it() -> None:
    w = speedups.Waker()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(w.wait(None)))
    t.start()
    w.set()
    t.join(60)
    assert not t.is_alive() and got == [True]


@needs_c
def test_the_waker_works_in_a_forked_child() -> None:
    w = speedups.Waker()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = w.wait(0) is False
        w.set()
        ok = ok and w.wait(0) is True
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not w.is_set()  # the child's set() was its own


@needs_c
def test_the_agent_s_write_is_os_write() -> None:
    r, w = os.pipe()
    try:
        assert speedups.write(w, b"abc") == 3
        assert speedups.write(w, memoryview(b"xdefx")[1:4]) == 3
        assert os.read(r, 10) == b"abcdef"
    finally:
        os.close(r)
        os.close(w)
    with open("/dev/full", "wb", buffering=0) as full, pytest.raises(OSError) as e:
        speedups.write(full.fileno(), b"x")
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as e:
        speedups.write(w, b"x")  # closed
    assert e.value.errno == errno.EBADF
    with pytest.raises(ValueError):
        speedups.write(-1, b"x")


@needs_c
def test_read_held_is_a_pread_at_zero() -> None:
    fd = os.open("/proc/self/schedstat", os.O_RDONLY)
    try:
        data = speedups.read_held(fd, 128)
        assert len(data.split()) == 3 and all(x.isdigit() for x in data.split())
        assert speedups.read_held(fd, 4) == os.pread(fd, 4, 0)
        with pytest.raises(ValueError):
            speedups.read_held(fd, 513)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        speedups.read_held(fd, 8)
    assert e.value.errno == errno.EBADF


@pytest.mark.parametrize(
    "size", [0, 1, CRC_PIECE - 1, CRC_PIECE, CRC_PIECE + 1, 3 * CRC_PIECE, 100_003]
)
def test_the_record_crc_in_pieces_is_zlib_s(size: int) -> None:
    data = bytes((k * 7 + 3) & 0xFF for k in range(size))
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, 12345) == zlib.crc32(data, 12345)
    assert crc32(memoryview(data)) == zlib.crc32(data)


@needs_c
def test_replace_file_writes_through_a_tmp_file(tmp_path: Any) -> None:
    path = tmp_path / "status.json"
    speedups.replace_file(str(path), b"one")
    speedups.replace_file(path, memoryview(b"two"))
    assert path.read_bytes() == b"two" and sorted(p.name for p in tmp_path.iterdir()) == [
        "status.json"
    ]
    with pytest.raises(FileNotFoundError):
        speedups.replace_file(str(tmp_path / "no" / "status.json"), b"x")
    os.mkdir(tmp_path / "dir")
    with pytest.raises(OSError):  # rename over a directory fails: the .tmp goes
        speedups.replace_file(str(tmp_path / "dir"), b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "status.json"]


@needs_c
def test_file_id_is_os_stat_s(tmp_path: Any) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"")
    st = os.stat(path)
    assert speedups.file_id(str(path)) == (st.st_dev, st.st_ino)
    with pytest.raises(FileNotFoundError):
        speedups.file_id(str(tmp_path / "gone"))
    with pytest.raises(NotADirectoryError):
        speedups.file_id(str(path / "below"))
