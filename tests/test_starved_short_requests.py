"""cpu_starved for a service whose requests are all short (issue 21 item 1, seen on the zoo's
FastAPI app on an oversubscribed machine): none runs long enough to be stack-sampled, yet its
event loop waits for a CPU most of the time it has work. The scheduler figures cover every
thread serving a request, not only those of sampled requests.

App: tests/apps/short_requests_app.py (a few milliseconds of CPU a request, on a sync and an
async endpoint), under uvicorn, with the default sampling threshold; the busy loops are
test_sampler_classes.oversubscribed's. What it asserts depends on the machine's load (the run
queue share, the runnable time, how few requests get sampled), so `make test` leaves it out:
``make test-busy`` runs it (BUSY_ACCEPTANCE=1), as tests/test_busy_acceptance.py.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from perfsleuth.analysis.config import Config
from perfsleuth.analysis.findings import find
from perfsleuth.store.duckdb_store import DuckDBStore
from test_run_servers import launched, uvicorn
from test_sampler_classes import oversubscribed

pytestmark = pytest.mark.skipif(
    os.environ.get("BUSY_ACCEPTANCE") != "1", reason="load-dependent: `make test-busy` runs it"
)

REQUESTS = 600  # half to each endpoint
CLIENTS = 4  # concurrent: the server has a request in flight nearly all the time


def test_cpu_starved_is_raised_for_a_service_of_short_requests(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with launched(
        tmp_path, data, uvicorn("short_requests_app:app"), service="short", ready="/health"
    ) as srv:
        paths = ["/sync", "/async"] * (REQUESTS // 2)
        with oversubscribed(), ThreadPoolExecutor(CLIENTS) as pool:
            statuses = list(pool.map(lambda path: srv.get(path)[0], paths))
        assert statuses == [200] * REQUESTS
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
        assert store.query("SELECT count(*) AS n FROM requests")[0]["n"] >= REQUESTS
        with_samples = store.query("SELECT count(DISTINCT trace_id) AS n FROM samples")[0]["n"]
        found = [f for f in find(store, config=Config()) if f.kind == "cpu_starved"]
    # Hardly any request was slow enough to be sampled ...
    assert with_samples <= REQUESTS // 20
    # ... and the service is found starved: its loop waited for a CPU more than it ran.
    (f,) = found
    assert f.evidence["service"] == "short"
    assert f.evidence["run_queue_share"] >= 0.5, f.evidence
    assert f.evidence["runnable_ms"] >= 1000, f.evidence
    assert f.confidence is not None
