"""Sample states in a forked worker (issue 21 item 1, seen on the demo's gunicorn sync workers
on an oversubscribed machine): the thread that forked is the child's main thread, but Python
3.11 leaves its ``native_id`` at the parent's, so its schedstat file was not found and the
sampler fell back to the CPU clock alone, which calls CPU-bound code that waits for a CPU
"waiting".

App: tests/apps/evidence_wsgi.py (``GET /checksum``: half a second of pure-Python hashing)
under gunicorn sync workers; the busy loops are test_sampler_classes.oversubscribed's.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from perfsleuth.agent import sampler
from perfsleuth.agent.config import Config as AgentConfig
from perfsleuth.analysis import profile
from perfsleuth.store.duckdb_store import DuckDBStore
from test_run_servers import gunicorn, launched
from test_sampler_classes import CPU_CLASSES, FAST_SAMPLING, oversubscribed


def test_a_forked_child_reads_the_schedstat_of_the_thread_that_forked() -> None:
    pid = os.fork()
    if pid == 0:
        try:
            s = sampler.Sampler(AgentConfig())
            ok = s._sched(threading.get_ident()) is not None
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_cpu_bound_code_in_a_gunicorn_sync_worker_is_classed_cpu_when_starved(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    with launched(
        tmp_path, data, gunicorn("evidence_wsgi:app", 2), service="sync", ready="/health",
        **FAST_SAMPLING,
    ) as srv:  # fmt: skip
        with oversubscribed():
            for _ in range(3):
                assert srv.get("/checksum")[0] == 200
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
        p = profile.load(store, "GET /checksum")
    assert p.requests == 3 and p.samples >= 20, p.states
    assert sum(p.states.get(s, 0) for s in CPU_CLASSES) / p.samples >= 0.8, p.states
    assert p.verdict().kind == "cpu", p.states
