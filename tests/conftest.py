"""Shared fixtures. The in-process agent is started once per test session (it is process-wide,
like any APM agent); each test sees only the requests recorded during it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import store_engines
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolread import read_spool
from spoolwrite import SegmentWriter

PG_DSN = os.environ.get("PERFSLEUTH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL = {"host": "127.0.0.1", "port": 3306, "user": "root", "password": "", "database": "test"}
REDIS_URL = os.environ.get("PERFSLEUTH_TEST_REDIS", "redis://127.0.0.1:6379/0")
MEMCACHED = ("127.0.0.1", 11211)


@pytest.fixture(scope="session")
def agent_data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Data dir of the agent running inside the pytest process."""
    d = str(tmp_path_factory.mktemp("agent-data"))
    import perfsleuth.agent as ps

    # every request's CPU time, whatever the pace of a test's requests (tests of the automatic
    # share set it themselves: test_cpu_sample)
    started = ps.start(d, service="pytest", flush_seconds=0.05, cpu_sample=1.0)
    assert started, "agent failed to start"
    return d


@pytest.fixture
def captured(agent_data_dir: str) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Call it to flush the agent and get the requests recorded since the test began."""
    import perfsleuth.agent as ps

    ps.flush()
    before = {r["id"] for r in read_spool(agent_data_dir)}

    def get() -> list[dict[str, Any]]:
        ps.flush()
        return [r for r in read_spool(agent_data_dir) if r["id"] not in before]

    yield get


@pytest.fixture
def cpu_every_request(agent_data_dir: str) -> Iterator[None]:
    """Every request's CPU time measured while the test runs (PERFSLEUTH_CPU_SAMPLE=1, held
    against a share set outside or by the automatic share), also when the test configures the
    recorder again."""
    from perfsleuth.agent import cpushare, recorder

    before = os.environ.get("PERFSLEUTH_CPU_SAMPLE")
    was_auto = cpushare.auto
    os.environ["PERFSLEUTH_CPU_SAMPLE"] = "1"
    cpushare.auto = False  # the writer thread leaves the share alone
    recorder.set_cpu_sample(None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PERFSLEUTH_CPU_SAMPLE", None)
        else:
            os.environ["PERFSLEUTH_CPU_SAMPLE"] = before
        recorder.set_cpu_sample(None)
        cpushare.auto = was_auto


@pytest.fixture(autouse=True)
def fresh_statement_shapes() -> None:
    """Each test starts with no statement shapes kept: the C accelerator's table of them is
    process-wide, and a test's statement would be recorded as an earlier test's of the same
    tokens (test_handoff's "SELECT 1" as test_speedups_review's "SELECT 12", run in that
    order)."""
    from perfsleuth.agent import recorder

    c = recorder.speedups
    if c is not None and hasattr(c, "statement_shapes") and c.statement_shapes()[0]:
        from perfsleuth.agent.spool import queue

        queue.share_statements()  # configured anew: the shapes go


@pytest.fixture
def statements_as_made(agent_data_dir: str) -> Iterator[None]:
    """Statements recorded as the application made them, not shared by their tokens (the C
    accelerator's shared_statement; its own tests: test_shared_statements): for tests of what
    the recorder or the writer does with distinct statement objects."""
    from perfsleuth.agent import recorder
    from perfsleuth.agent.spool import queue

    if recorder.speedups is not None:
        recorder.speedups.configure(statement_scan=None)
    try:
        yield
    finally:
        queue.share_statements()


@pytest.fixture
def in_request(agent_data_dir: str) -> Callable[..., Any]:
    """A context manager recording a fake web request around a block (for library tests)."""
    from contextlib import contextmanager

    from perfsleuth.agent import recorder

    @contextmanager
    def block(endpoint: str = "GET /test") -> Iterator[Any]:
        method, _, path = endpoint.partition(" ")
        req = recorder.begin("web", method, path)
        assert req is not None
        req.endpoint = endpoint
        try:
            yield req
        finally:
            req.status = 200
            recorder.end(req)

    return block


@dataclass(frozen=True)
class DemoRun:
    """What one run of the real demo left: its data directory and what it printed."""

    data: str
    stdout: str  # the text report: `top`, then "What to look at next" with its commands
    stderr: str


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The real demo (seeding, its apps under the agent, 8 s of traffic, ingest, the report),
    run once per test session for every test that needs it: the detectors, the CLI's smoke
    test, the API and UI tests. A test that writes to the data directory works on a copy."""
    import subprocess

    data = str(tmp_path_factory.mktemp("demo") / "data")
    r = subprocess.run(
        [sys.executable, "-m", "perfsleuth", "demo", "--seconds", "8", "--data", data, "--no-ui"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return DemoRun(data, r.stdout, r.stderr)


@pytest.fixture(scope="session")
def demo_data(demo_run: DemoRun) -> str:
    """The data directory the demo filled (read it only, or copy it first)."""
    return demo_run.data


@pytest.fixture(scope="session", autouse=True)
def _chdb_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """chDB's data, for the tests that run on it, under the session's temporary directory."""
    store_engines.use_dir(str(tmp_path_factory.mktemp("chdb")))


_exit_status = [0]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status[0] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """With chDB loaded, the process ends here, after pytest's report: chDB's background
    threads (merges) keep running into the C++ static destructors of process exit, and one of
    them crashed the test process after a full run (SIGSEGV in chDB's BgSchPool thread while
    the main thread ran pyarrow's destructors: exit status 139, all tests passed or not)."""
    if "chdb" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Store tests run on each engine (tests/store_engines.py)
    if "store_engine" in metafunc.fixturenames:
        module = metafunc.module.__name__.rpartition(".")[2]
        metafunc.parametrize("store_engine", store_engines.engines_for(module), scope="module")


@pytest.fixture
def synth(
    tmp_path: Path, store_engine: str
) -> Iterator[Callable[[Callable[[SegmentWriter], None]], DuckDBStore]]:
    """Write requests with ``fill(writer)``, ingest them, and return the store (on each
    engine: ``store_engine``)."""
    stores: list[DuckDBStore] = []

    def make(fill: Callable[[SegmentWriter], None]) -> DuckDBStore:
        data = str(tmp_path / f"data{len(stores)}")
        w = SegmentWriter(data)
        fill(w)
        w.close()
        s = store_engines.open_engine(store_engine, data)
        s.ingest()
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()
    store_engines.reset()
