"""The agent never hurts the app: full queues, full disks and a dead writer only cost data,
and every lost request is counted where `perfsleuth top` can see it.

Each case runs in a fresh interpreter: the agent's state is process-wide, like any APM agent's.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spoolread import read_spool
from tinyfs import tmpfs

APP = """
import json, os, sys, time
import perfsleuth.agent as ps
from perfsleuth.agent import recorder

ok = ps.start(sys.argv[1], service="faults", **json.loads(sys.argv[2]))
answered = 0
for i in range(int(sys.argv[3])):
    req = recorder.begin("web", "GET", f"/items/{i}")
    # the "application": must run and answer whatever the agent does
    if req is not None:
        req.endpoint = "GET /items/{id}"
        for j in range(int(sys.argv[4])):
            c = recorder.start_call("db", "sqlite", "select * from items where id = ?", (j,))
            if c is not None:
                c.rows = 1
                c.finish()
        ps.attr("payload", "x" * int(sys.argv[5]))
        req.status = 200
        recorder.end(req)
    answered += 1
ps.flush()
print(json.dumps({"started": ok, "answered": answered, "stats": ps.stats()}))
"""


def run_app(data: Path, n: int, *, calls: int = 3, attr_len: int = 10, **cfg: object) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", APP, str(data), json.dumps(cfg), str(n), str(calls), str(attr_len)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def status_files(data: Path) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in glob.glob(str(data / "agents" / "*.json"))]


def test_everything_recorded_is_written_exactly_once(tmp_path: Path) -> None:
    res = run_app(tmp_path, 500, calls=5)
    assert res["answered"] == 500 and res["stats"]["requests_written"] == 500
    reqs = read_spool(str(tmp_path))
    assert len(reqs) == 500 and len({r["id"] for r in reqs}) == 500
    assert all(len(r["calls"]) == 5 for r in reqs)
    # at exit the open segment is closed and renamed: nothing is left half-written
    assert not glob.glob(str(tmp_path / "spool" / "*.open"))


def test_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    # The writer wakes up only every 60 s, so the queue (10) fills at once; exit still flushes.
    res = run_app(tmp_path, 200, queue_size=10, flush_seconds=60)
    assert res["answered"] == 200
    assert res["stats"]["dropped_queue_full"] == 190
    assert len(read_spool(str(tmp_path))) == 10
    (status,) = status_files(tmp_path)
    assert status["dropped_queue_full"] == 190 and status["requests_written"] == 10


def test_calls_per_request_are_bounded(tmp_path: Path) -> None:
    res = run_app(tmp_path, 3, calls=120, max_calls=100)
    assert res["stats"]["calls_dropped"] == 60
    reqs = read_spool(str(tmp_path))
    assert [len(r["calls"]) for r in reqs] == [100] * 3
    assert [r["calls_dropped"] for r in reqs] == [20] * 3


def test_dead_writer_costs_data_not_requests(tmp_path: Path) -> None:
    res = run_app(tmp_path, 300, fault="writer_crash", queue_size=50)
    assert res["answered"] == 300 and res["started"] is True
    (status,) = status_files(tmp_path)
    lost = status["dropped_queue_full"] + status["dropped_writer_dead"]
    assert lost == 300 and status["requests_written"] == 0
    assert status["writer_restarts"] <= 3  # restarts are bounded: a crash loop stays cheap


def test_unwritable_spool_costs_data_not_requests(tmp_path: Path) -> None:
    (tmp_path / "spool").write_text("a file where the spool directory should be")
    res = run_app(tmp_path, 100)
    assert res["answered"] == 100
    (status,) = status_files(tmp_path)
    assert status["dropped_write_error"] == 100 and status["write_errors"] >= 1
    assert "spool" in status["last_error"]


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 256 KiB filesystem for the spool, so writes fail with ENOSPC."""
    with tmpfs(tmp_path / "spool", "256k"):
        yield tmp_path


def test_full_disk_costs_data_not_requests(tiny_disk: Path) -> None:
    # 400 requests x ~4 KB attribute = ~1.6 MB into a 256 KiB filesystem.
    res = run_app(tiny_disk, 400, attr_len=4000, segment_bytes=64_000)
    assert res["answered"] == 400
    (status,) = status_files(tiny_disk)
    assert status["dropped_write_error"] > 0 and "No space left" in status["last_error"]
    written = status["requests_written"]
    assert written + status["dropped_write_error"] == 400
    # what was written is readable: segments cut short by ENOSPC only lose their torn tail
    assert len(read_spool_tolerant(tiny_disk)) == written


def read_spool_tolerant(data: Path) -> list[dict]:
    from perfsleuth.wire import REQUESTS
    from perfsleuth.wire.segment import read_segment

    out = []
    for p in glob.glob(str(data / "spool" / "*")):
        for t, o in read_segment(Path(p).read_bytes()).records:
            out += o if t == REQUESTS else []
    return out


def test_forked_child_writes_its_own_requests_once(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, sys
        import perfsleuth.agent as ps
        from perfsleuth.agent import recorder
        ps.start(sys.argv[1], flush_seconds=60)
        def one(name):
            req = recorder.begin("web", "GET", "/")
            req.endpoint = name
            req.status = 200
            recorder.end(req)
        one("GET /before-fork")          # still queued in the parent when it forks
        pid = os.fork()
        if pid == 0:
            one("GET /child")
            sys.exit(0)                   # atexit flushes the child's own queue
        os.waitpid(pid, 0)
        one("GET /parent")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    names = sorted(q["endpoint"] for q in read_spool(str(tmp_path)))
    assert names == ["GET /before-fork", "GET /child", "GET /parent"]
    pids = {os.path.basename(p).split("-")[1] for p in glob.glob(str(tmp_path / "spool" / "*"))}
    assert len(pids) == 2


def test_multiprocessing_children_flush_although_they_skip_atexit(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import multiprocessing as mp, sys
        import perfsleuth.agent as ps
        ps.start(sys.argv[1], instrument=False, flush_seconds=60)
        def work(i):
            with ps.task("job"):
                pass
        if __name__ == "__main__":
            ctx = mp.get_context("fork")
            procs = [ctx.Process(target=work, args=(i,)) for i in range(3)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            pool = ctx.Pool(2)
            pool.map(work, range(5))
            pool.close()
            pool.join()
        """
    )
    script = tmp_path / "mp_app.py"
    script.write_text(code)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    reqs = read_spool(str(tmp_path / "data"))
    assert [q["endpoint"] for q in reqs] == ["job"] * 8
    assert all(q["kind"] == "background" for q in reqs)
