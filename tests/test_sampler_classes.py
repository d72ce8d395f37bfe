"""What a stack sample says about its thread (issue 21, items 1 and 5), with real servers.

- On a machine with more busy processes than cores, CPU-bound code is classed as on the CPU or
  starved (runnable, waiting for a CPU), never as waiting; a sleep or an await stays waiting;
  ``cpu_starved`` reports the run-queue share. The busy processes are started by the test
  (4 per core, each ending by itself after BUSY_SECONDS, killed when the test ends).
- Behind a BaseHTTPMiddleware, samples of a request parked at ``await call_next(request)``
  point at the endpoint's own lines (its child task), not at the middleware's await.

Apps: tests/apps/sampler_classes_app.py and middleware_app.py (planted lines carry markers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.agent import sampler
from perfsleuth.analysis import profile
from perfsleuth.analysis.config import Config
from perfsleuth.analysis.findings import find
from perfsleuth.store.duckdb_store import DuckDBStore
from test_run_servers import APPS, launched, uvicorn

CLASSES_APP = os.path.join(APPS, "sampler_classes_app.py")
MIDDLEWARE_APP = os.path.join(APPS, "middleware_app.py")
FAST_SAMPLING = {"PERFSLEUTH_SAMPLE_AFTER_MS": "100"}
BUSY_PER_CORE = 4
# A bound only, for loops whose test could not kill them: each loop also ends as soon as the
# process that started it is gone. The test kills them when its traffic is done, however long
# that took (a busy machine slows the traffic: loops that end by themselves before it would
# leave the rest of the traffic unstarved).
BUSY_SECONDS = 900
CPU_CLASSES = ("cpu", "starved")


def line_of(path: str, marker: str) -> int:
    with open(path, encoding="utf-8") as fh:
        hits = [i for i, s in enumerate(fh.read().splitlines(), 1) if marker in s]
    assert len(hits) == 1, (path, marker, hits)
    return hits[0]


@contextmanager
def oversubscribed(seconds: float = BUSY_SECONDS, per_core: int = BUSY_PER_CORE) -> Iterator[None]:
    """``per_core`` pure-Python busy loops per core, for as long as the block runs (each
    ends by itself after ``seconds`` on the monotonic clock, or when the process that started
    it is gone)."""
    n = per_core * (os.cpu_count() or 1)
    code = (
        "import os, time\n"
        f"parent, end = os.getppid(), time.monotonic() + {seconds}\n"
        "while os.getppid() == parent and time.monotonic() < end:\n"
        "    for _ in range(100_000): pass\n"
    )
    # Each in a session of its own, like the other services of a busy box: with the kernel's
    # autogroup scheduling (sched_autogroup_enabled) a session shares the CPUs fairly with the
    # others, so busy loops in one session would leave a server in its own session a core.
    procs = [
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(n)
    ]
    try:
        time.sleep(1.0)  # until they all loop: interpreters starting up are not yet the load
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


def _leaf(st: list[Any]) -> Any:
    app = [f for f in st if f.app]
    return app[-1] if app else None


def _findings(data: Path, **overrides: Any) -> list[Any]:
    cfg = Config()
    for key, value in overrides.items():
        kind, name = key.split("__")
        cfg.set(kind, name, value)
    with DuckDBStore(str(data), read_only=True) as store:
        return find(store, config=cfg)


@pytest.fixture(scope="module")
def busy_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sampler-busy")
    data = tmp / "data"
    with launched(
        tmp, data, uvicorn("sampler_classes_app:app"), service="busy", ready="/fast",
        **FAST_SAMPLING,
    ) as srv:  # fmt: skip
        with oversubscribed():
            for path in ("/cpu", "/sleep", "/await") * 3:
                assert srv.get(path)[0] == 200
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
    return data


def test_cpu_bound_code_on_an_oversubscribed_machine_is_classed_cpu(busy_store: Path) -> None:
    planted = line_of(CLASSES_APP, "PLANTED-CPU")
    with DuckDBStore(str(busy_store), read_only=True) as store:
        p = profile.load(store, "GET /cpu")
        sleep = profile.load(store, "GET /sleep")
        awaiting = profile.load(store, "GET /await")
    assert p.requests == 3 and p.samples >= 30
    at_line = sum(
        n for st, n in p.stacks if (leaf := _leaf(st)) and leaf.line in (planted, planted - 1)
    )
    assert at_line / p.samples >= 0.5
    on_cpu = sum(p.states.get(s, 0) for s in CPU_CLASSES)
    assert on_cpu / p.samples >= 0.8, p.states
    for w in (sleep, awaiting):
        assert w.requests == 3 and w.samples >= 30
        assert w.states.get("wait", 0) / w.samples >= 0.8, w.states


def test_hotspot_advice_and_cpu_starved_on_an_oversubscribed_machine(busy_store: Path) -> None:
    found = _findings(busy_store)
    hot = {f.endpoint: f for f in found if f.kind == "slow_request_hotspot"}
    cpu = hot["GET /cpu"]
    assert cpu.callsite is not None and cpu.callsite["function"] == "crunch"
    assert cpu.evidence["class"] == "cpu"
    assert "CPU-bound" in cpu.suggestion and "waits on" not in cpu.suggestion
    for ep in ("GET /sleep", "GET /await"):
        assert hot[ep].evidence["class"] == "wait", hot[ep].title
        assert "waiting" in hot[ep].suggestion
    (starved,) = [f for f in found if f.kind == "cpu_starved"]
    assert starved.evidence["service"] == "busy"
    assert starved.evidence["run_queue_share"] >= 0.5
    assert "waited for a CPU" in starved.title


def test_a_request_that_only_waits_for_the_gil_is_no_hotspot(tmp_path: Path) -> None:
    """A request with next to nothing to do, slow only because another thread of the process
    computes, waits for the GIL at whatever line it stands on: that line is not where its time
    went (the demo's clean GET /orders/{order_id} got a hotspot this way on a busy machine).
    The computing endpoint keeps its hotspot."""
    data = tmp_path / "data"
    with launched(
        tmp_path, data, uvicorn("sampler_classes_app:app"), service="gil", ready="/fast",
        **FAST_SAMPLING,
    ) as srv:  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            for _ in range(3):
                computing = pool.submit(srv.get, "/cpu")
                time.sleep(0.02)
                assert srv.get("/bystander")[0] == 200
                assert computing.result()[0] == 200
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
        p = profile.load(store, "GET /bystander")
    # the premise: its slow requests waited for the GIL at the planted line
    planted = line_of(CLASSES_APP, "PLANTED-GIL")
    assert p.requests >= 2 and p.samples >= 20, (p.requests, p.samples)
    assert p.states.get("gil", 0) >= 0.5 * p.samples, p.states
    hot, _ = p.hotspot()
    assert hot is not None and hot.line == planted
    found = {f.endpoint: f for f in _findings(data) if f.kind == "slow_request_hotspot"}
    assert "GET /bystander" not in found, found["GET /bystander"].title
    assert found["GET /cpu"].evidence["class"] == "cpu", found["GET /cpu"].title


@pytest.fixture(scope="module")
def middleware_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sampler-middleware")
    data = tmp / "data"
    with launched(
        tmp, data, uvicorn("middleware_app:app", "--loop", "asyncio"), service="mw",
        ready="/health", **FAST_SAMPLING,
    ) as srv:  # fmt: skip
        for path in ("/io", "/crunch") * 3:
            assert srv.get(path)[0] == 200
        for _ in range(5):
            assert srv.get("/health")[0] == 200
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
    return data


def test_samples_behind_a_base_http_middleware_point_below_call_next(
    middleware_store: Path,
) -> None:
    call_next = {
        line_of(MIDDLEWARE_APP, "PLANTED-CALL-NEXT-OUTER"),
        line_of(MIDDLEWARE_APP, "PLANTED-CALL-NEXT-INNER"),
    }
    io_line = line_of(MIDDLEWARE_APP, "PLANTED-IO")
    crunch = line_of(MIDDLEWARE_APP, "PLANTED-CRUNCH")
    with DuckDBStore(str(middleware_store), read_only=True) as store:
        io = profile.load(store, "GET /io")
        busy = profile.load(store, "GET /crunch")
    for p in (io, busy):
        assert p.requests == 3 and p.samples >= 20
        leaves = [(_leaf(st), n) for st, n in p.stacks]
        at_call_next = sum(n for leaf, n in leaves if leaf is not None and leaf.line in call_next)
        # A sample may catch the middleware's own code running in call_next (building the
        # response): a few, never the time spent below it.
        assert at_call_next <= 0.1 * p.samples, (p.endpoint, p.states, leaves)
    # The awaiting endpoint is found at its own await, as waiting (most samples; on a busy
    # machine the chain's teardown after the handler returned takes up to half of them).
    hot, n = io.hotspot()
    assert hot is not None and hot.line == io_line and n / io.samples >= 0.5
    assert io.hotspot_verdict(hot).kind == "wait"
    # The endpoint computing on the loop (in the middleware's child task) is on the CPU.
    hot, n = busy.hotspot()
    assert hot is not None and hot.line in (crunch - 1, crunch) and n / busy.samples >= 0.5
    assert busy.hotspot_verdict(hot).kind == "cpu"

    found = [f for f in _findings(middleware_store) if f.kind == "slow_request_hotspot"]
    assert [f.endpoint for f in found] == ["GET /io"]  # /crunch blocked the loop: a blocker
    assert found[0].callsite is not None and found[0].callsite["line"] == io_line


def test_cpu_starved_is_silent_when_request_threads_wait_rather_than_compute(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    with launched(
        tmp_path, data, uvicorn("sampler_classes_app:app"), service="idle", ready="/fast",
        **FAST_SAMPLING,
    ) as srv:  # fmt: skip
        for path in ("/sleep", "/await") * 3:
            assert srv.get(path)[0] == 200
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
        figures = {
            r["name"]: r["v"]
            for r in store.query(
                "SELECT name, max(value) AS v FROM agent_stats WHERE service = 'idle' GROUP BY 1"
            )
        }
    # The sleeping request threads were sampled and their figures ingested ...
    assert figures.get("sched_wall_ns", 0) >= 500_000_000, figures
    assert figures.get("cpus_milli", 0) >= 1000
    # ... and a thread that sleeps is not starved, however busy the machine is.
    assert [f for f in _findings(data) if f.kind == "cpu_starved"] == []


def _stats(w: Any, ts_ns: int, pid: int = 4242, **counters: int) -> None:
    from perfsleuth.wire import STATS

    w.event(STATS, {"ts": ts_ns, "pid": pid, "counters": counters})


def test_cpu_starved_reports_cgroup_throttling_and_stays_silent_on_a_clean_service(
    tmp_path: Path,
) -> None:
    """Figures as the agent ships them from a cgroup's cpu.stat (a quota the machine running
    the tests may not allow setting up): cumulative counters, read over the window."""
    import time

    from spoolwrite import SegmentWriter

    now = time.time_ns()
    data = str(tmp_path / "data")
    quota = SegmentWriter(data, service="quota", pid=4242)
    clean = SegmentWriter(data, service="clean", pid=4343, seq=2)
    for w in (quota, clean):
        for _ in range(5):
            w.request("GET /report", dur_ms=400.0)
    # 60 s: 600 periods of 100 ms, 300 of them throttled for 12 s in all; request threads ran
    # 30 s and waited 1 s in the run queue (a quota, not a crowded machine).
    _stats(quota, now - 60 * 10**9, cpus_milli=500, load1_milli=300)
    _stats(
        quota, now, sched_run_ns=30 * 10**9, sched_queue_ns=10**9, sched_wall_ns=62 * 10**9,
        cgroup_periods=600, cgroup_throttled=300, cgroup_throttled_us=12 * 10**6,
        cpus_milli=500, load1_milli=400,
    )  # fmt: skip
    _stats(
        clean, now, pid=4343, sched_run_ns=30 * 10**9, sched_queue_ns=10**9,
        sched_wall_ns=62 * 10**9,
        cgroup_periods=600, cgroup_throttled=3, cgroup_throttled_us=50_000, cpus_milli=4000,
        load1_milli=1200,
    )  # fmt: skip
    quota.close()
    clean.close()
    with DuckDBStore(data) as store:
        store.ingest()
        assert store.query("SELECT count(DISTINCT service) AS n FROM agent_stats")[0]["n"] == 2
    found = [f for f in _findings(Path(data)) if f.kind == "cpu_starved"]
    assert [f.evidence["service"] for f in found] == ["quota"]
    (f,) = found
    assert f.evidence["cgroup_throttled_share"] == 0.5
    assert f.evidence["cgroup_throttled_ms"] == 12_000
    assert f.evidence["cpus"] == 0.5
    assert "throttled it in 50% of the periods" in f.title and "0.5 CPUs" in f.title
    assert "waited for a CPU" not in f.title  # 1 s queued against 30 s running


def test_classify_from_scheduler_counters() -> None:
    ms = 1_000_000
    # Runnable most of the interval: on the CPU, or starved when queued longer than it ran.
    assert sampler.classify(20 * ms, 18 * ms, 1 * ms, 1, 0) == "cpu"
    assert sampler.classify(20 * ms, 4 * ms, 15 * ms, 6, 0) == "starved"
    # Neither running nor queued: blocked, or waking again and again while another thread
    # of the process computes (the interpreter lock's 5 ms switch interval).
    assert sampler.classify(20 * ms, 0, 0, 0, 20 * ms) == "wait"
    assert sampler.classify(20 * ms, 1 * ms, 0, 4, 18 * ms) == "gil"
    assert sampler.classify(20 * ms, 1 * ms, 0, 4, 1 * ms) == "wait"
    # No scheduler counters (not Linux): the CPU clock alone.
    assert sampler.classify(20 * ms, 2 * ms, 0, None, 18 * ms) == "wait"


def test_cgroup_cpu_stat_v1_and_v2(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "svc").mkdir(parents=True)
    (v2 / "svc" / "cpu.stat").write_text(
        "usage_usec 100\nnr_periods 40\nnr_throttled 10\nthrottled_usec 2500\n"
    )
    (v2 / "svc" / "cpu.max").write_text("150000 100000\n")
    cg = tmp_path / "cgroup"
    cg.write_text("0::/svc\n")
    d = sampler.cgroup_cpu_dir(str(cg), str(v2))
    assert d == str(v2 / "svc")
    assert sampler.read_cpu_stat(d) == {"periods": 40, "throttled": 10, "throttled_us": 2500}
    assert sampler.cpu_limit(d) == 1.5

    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    base = v1 / "cpu,cpuacct" / "docker" / "abc"
    (base / "cpu.stat").write_text("nr_periods 7\nnr_throttled 2\nthrottled_time 3000000\n")
    (base / "cpu.cfs_quota_us").write_text("-1\n")
    (base / "cpu.cfs_period_us").write_text("100000\n")
    cg.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/x\n")
    d = sampler.cgroup_cpu_dir(str(cg), str(v1))
    assert d == str(base)
    assert sampler.read_cpu_stat(d) == {"periods": 7, "throttled": 2, "throttled_us": 3000}
    assert sampler.cpu_limit(d) is None
    cg.write_text("0::/gone\n")
    assert sampler.cgroup_cpu_dir(str(cg), str(tmp_path / "none")) == ""


def test_the_demo_shops_cpu_work_is_classed_cpu_on_an_oversubscribed_machine(
    tmp_path: Path,
) -> None:
    """The demo's planted CPU problems: the fuzzy search (thread pool) and the catalog import
    parsed on the event loop; both compute, however long they wait for a CPU."""
    from perfsleuth.demo import db

    db_path = str(tmp_path / "demo.sqlite3")
    db.seed(db_path)
    data = tmp_path / "data"
    with launched(
        tmp_path, data, uvicorn("perfsleuth.demo.shop:app"), service="shop", ready="/health",
        PERFSLEUTH_DEMO_DB=db_path, **FAST_SAMPLING,
    ) as srv:  # fmt: skip
        with oversubscribed():
            for _ in range(3):
                assert srv.get("/search?q=backpak")[0] == 200
            for _ in range(2):
                assert srv.request("POST", "/catalog/import", body=b"{}")[0] == 200
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
        for ep, least in (("GET /search", 20), ("POST /catalog/import", 5)):
            p = profile.load(store, ep)
            v = p.verdict()
            assert p.samples >= least, (ep, p.states)
            assert v.kind == "cpu", (ep, p.states)
            assert sum(v.shares.get(s, 0) for s in CPU_CLASSES) >= 0.8, (ep, p.states)
    (hot,) = [
        f
        for f in _findings(data)
        if f.kind == "slow_request_hotspot" and f.endpoint == "GET /search"
    ]
    assert hot.evidence["class"] == "cpu" and "CPU-bound" in hot.suggestion


@contextmanager
def cpu_quota_cgroup(name: str, cpus: float) -> Iterator[str]:
    """A cgroup v1 ``cpu`` group limited to ``cpus`` CPUs (skips the test where the machine
    does not allow creating one); removed afterwards."""
    path = os.path.join("/sys/fs/cgroup/cpu", name)
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"cannot create a cpu cgroup here: {e}")
    try:
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as fh:
            fh.write("100000")
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as fh:
            fh.write(str(int(cpus * 100000)))
        yield path
    finally:
        for _ in range(100):  # the killed server leaves it within moments
            try:
                os.rmdir(path)
                break
            except OSError:
                import time

                time.sleep(0.1)


def test_cpu_starved_reports_a_real_cgroup_quota(tmp_path: Path) -> None:
    """The server runs in a cgroup allowed a fifth of a CPU: its CPU-bound requests are
    throttled; samples are starved (throttled time counts as run-queue wait) and cpu_starved
    names the quota with the throttled share."""
    data = tmp_path / "data"
    with cpu_quota_cgroup(f"perfsleuth-test-{os.getpid()}", 0.2) as cg:
        cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh",
               *uvicorn("sampler_classes_app:app")]  # fmt: skip
        with launched(tmp_path, data, cmd, service="quota", ready="/fast", **FAST_SAMPLING) as srv:
            for _ in range(2):
                assert srv.get("/cpu")[0] == 200
            assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
        p = profile.load(store, "GET /cpu")
    assert p.requests == 2 and p.verdict().kind == "cpu", p.states
    assert p.states.get("starved", 0) > p.states.get("cpu", 0), p.states
    (f,) = [f for f in _findings(data) if f.kind == "cpu_starved"]
    assert f.evidence["cgroup_throttled_share"] >= 0.5, f.evidence
    assert f.evidence["cpus"] == 0.2
    assert "CPU quota throttled it" in f.title


def test_a_forked_child_closes_the_schedstat_files_it_inherited() -> None:
    import threading

    from perfsleuth.agent.config import Config as AgentConfig

    s = sampler.Sampler(AgentConfig())
    me = threading.get_ident()
    assert s._sched(me) is not None  # a thread's counters, from its open schedstat file
    fd = s.fds[me]
    inherited = os.fstat(fd)
    pid = os.fork()
    if pid == 0:  # the child: the parent's file must be closed
        try:
            now = os.fstat(fd)  # the number may since be another file's (an at-fork hook's)
            same = (now.st_dev, now.st_ino) == (inherited.st_dev, inherited.st_ino)
            os._exit(1 if same else 0)
        except OSError:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.fstat(fd)  # still open in the parent
    s._forget(set())
