"""How sure a finding is: every detector states its evidence floors in the settings table, a
finding under a floor is not raised, and every finding carries ``confidence`` (high, medium,
low) with the counts it rests on, in ``findings --json``, ``explain --json`` and the API.

Stores are written with the real wire encoder and ingested by the real store (as in
tests/test_detectors.py); the CLI and the API server run for real on them.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from perfsleuth.analysis.config import DEFAULTS, EVIDENCE_FLOORS, SOFT_FLOORS, Config
from perfsleuth.analysis.detectors import DETECTORS
from perfsleuth.analysis.finding import Finding, assess
from perfsleuth.analysis.findings import find
from perfsleuth.cli.main import app
from perfsleuth.cli.ui import free_port
from perfsleuth.server import create_app
from perfsleuth.server.app import STATIC_DIR
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import SegmentWriter, call, stored

SERVER = ("/usr/lib/python3/site-packages/server.py", 10, "serve", False)
HOT = ("/srv/app/reports.py", 42, "crunch", True)
SLOW_SQL = "SELECT * FROM ledger WHERE account = ?"


@pytest.fixture
def synth(tmp_path: Path) -> Iterator[Callable[[Callable[[SegmentWriter], None]], str]]:
    """Write requests with ``fill(writer)``, ingest them; returns the data directory."""
    made: list[str] = []

    def make(fill: Callable[[SegmentWriter], None]) -> str:
        data = str(tmp_path / f"data{len(made)}")
        w = SegmentWriter(data)
        fill(w)
        w.close()
        with DuckDBStore(data) as s:
            s.ingest()
        made.append(data)
        return data

    return make


def findings(data: str, *settings: str) -> list[Finding]:
    cfg = Config()
    for s in settings:
        cfg.apply(s)
    with DuckDBStore(data, read_only=True) as store:
        return find(store, config=cfg)


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def slow_ledger(requests: int, calls_each: int = 1) -> Callable[[SegmentWriter], None]:
    """``requests`` requests of GET /ledger, each making ``calls_each`` 400 ms calls of one
    statement; and 20 fast requests of GET /ok, whose data is ingested alongside."""

    def fill(w: SegmentWriter) -> None:
        for _ in range(requests):
            calls = [
                call("db", SLOW_SQL, dur_ms=400.0, off_ms=400.0 * i) for i in range(calls_each)
            ]
            w.request("GET /ledger", dur_ms=410.0 * calls_each, calls=calls)
        for _ in range(20):
            w.request("GET /ok", dur_ms=5.0, calls=[call("db", "SELECT 1", dur_ms=1.0)])

    return fill


def hotspot(requests: int, samples_each: int) -> Callable[[SegmentWriter], None]:
    """Slow requests of GET /hot sampled ``samples_each`` times on one application line."""

    def fill(w: SegmentWriter) -> None:
        stack = w.stack([SERVER, HOT])
        for i in range(requests):
            tid = f"{i + 1:016x}"
            w.request("GET /hot", dur_ms=600.0, trace_id=tid)
            samples = [[(300 + 10 * k) * 1_000_000, "cpu", stack] for k in range(samples_each)]
            w.event(b"P", {"id": tid, "samples": samples})

    return fill


# ------------------------------------------------------------------- the settings table


def test_every_detector_states_its_evidence_floors() -> None:
    for kind in DETECTORS:
        floors = EVIDENCE_FLOORS[kind]
        assert floors, kind
        for setting in floors.values():
            assert isinstance(DEFAULTS[kind][setting], int | float), (kind, setting)
    assert {(k, c) for k, floors in EVIDENCE_FLOORS.items() for c in floors} >= SOFT_FLOORS


# -------------------------------------------------------------------------- the grades


def test_a_finding_under_its_floor_is_not_raised(synth: Any) -> None:
    """Five slow calls made by one request are one slow request: slow_query asks for calls in
    three requests (its min_requests) as well as five calls."""
    one = synth(slow_ledger(requests=1, calls_each=5))
    with DuckDBStore(one, read_only=True) as store:
        assert stored(store) == {"GET /ledger": (1, 5), "GET /ok": (20, 20)}
    assert [f.kind for f in findings(one) if f.endpoint == "GET /ledger"] == []
    [f] = [f for f in findings(one, "slow_query.min_requests=1") if f.endpoint == "GET /ledger"]
    assert f.kind == "slow_query" and f.evidence["calls"] == 5
    with DuckDBStore(one, read_only=True) as store:  # the data was there
        assert store.query("SELECT count(*) AS n FROM calls WHERE duration_ms >= 400")[0]["n"] == 5


@pytest.mark.parametrize(
    ("requests", "level"), [(3, "low"), (5, "low"), (6, "medium"), (11, "medium"), (12, "high")]
)
def test_confidence_grows_with_the_evidence(synth: Any, requests: int, level: str) -> None:
    """slow_query's floors: 3 requests and 5 calls; twice a floor is medium, four times high,
    and the weaker of the two counts decides."""
    [f] = [f for f in findings(synth(slow_ledger(requests, 2))) if f.endpoint == "GET /ledger"]
    assert f.confidence == level
    assert f.confidence_basis == {
        "calls": {"count": 2 * requests, "floor": 5.0},
        "requests": {"count": requests, "floor": 3.0},
    }


def test_a_hotspot_from_two_slow_requests_says_it_is_unsure(synth: Any) -> None:
    """The issue's case: 2 slow requests and 34 samples. At the floors: low."""
    [thin] = findings(synth(hotspot(requests=2, samples_each=17)))
    assert thin.kind == "slow_request_hotspot"
    assert thin.confidence == "low"
    assert thin.confidence_basis["slow_requests"] == {"count": 2, "floor": 2.0}
    assert thin.confidence_basis["samples"] == {"count": 34, "floor": 20.0}
    assert thin.confidence_note() == "low: 2 slow requests (floor 2), 34 samples (floor 20)"
    [thick] = findings(synth(hotspot(requests=10, samples_each=20)))
    assert (thick.kind, thick.confidence) == ("slow_request_hotspot", "high")
    # raising a floor in the settings holds the thin one back
    assert (
        findings(synth(hotspot(requests=2, samples_each=17)), "slow_request_hotspot.min_requests=3")
        == []
    )


def test_a_soft_floor_grades_without_holding_back() -> None:
    """One event-loop block of a second or more is reported (event_loop_blocker's single_ms),
    under its two-block floor: as low."""
    f = Finding(id="x", kind="event_loop_blocker", endpoint="GET /x", title="t",
                impact_ms_per_min=1.0, evidence={"blocks": 1, "blocked_ms": 1500.0})  # fmt: skip
    assert assess(f, Config()) and f.confidence == "low"
    f.evidence["blocks"] = 9
    assert assess(f, Config()) and f.confidence == "high"
    # a count a detector does not carry is left out; with none, the finding is unrated
    g = Finding(id="y", kind="gc_pressure", endpoint="GET /x", title="t", impact_ms_per_min=1.0)
    assert assess(g, Config()) and g.confidence is None and g.confidence_note() == "unrated"


# ------------------------------------------------------------------- where it is shown


def test_confidence_in_findings_explain_and_the_api(synth: Any) -> None:
    data = synth(slow_ledger(requests=12, calls_each=2))
    r = cli("findings", "--data", data, "--no-ingest", "--json")
    assert r.exit_code == 0, r.stderr
    [f] = [f for f in json.loads(r.stdout) if f["endpoint"] == "GET /ledger"]
    assert f["confidence"] == "high"
    assert f["confidence_basis"]["requests"] == {"count": 12, "floor": 3.0}
    r = cli("explain", f["id"], "--data", data, "--no-ingest", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["confidence"] == "high"
    with TestClient(create_app(data, ingest_every=0, sql_time_limit=2.0)) as client:
        listed = client.get("/api/findings", params={"since": "7d"}).json()
        assert [x["confidence"] for x in listed if x["id"] == f["id"]] == ["high"]
        one = client.get(f"/api/findings/{f['id']}", params={"since": "7d"}).json()
        assert one["confidence_basis"] == f["confidence_basis"]


def test_the_findings_page_shows_how_sure(demo_data: str, tmp_path: Path) -> None:
    """The web UI (built by setup) in headless Chromium on the demo's data: each finding's
    grade in its head, and the counts behind it in its evidence."""
    import test_ui

    if not os.path.isfile(os.path.join(STATIC_DIR, "index.html")):
        pytest.fail("the web UI is not built: run `make setup` (npm ci, npm run build)")
    if not os.path.exists(test_ui.CHROMIUM):
        pytest.fail(f"{test_ui.CHROMIUM} is missing: run `make setup`")
    import uvicorn
    from playwright.sync_api import sync_playwright

    data = str(tmp_path / "data")
    shutil.copytree(demo_data, data)
    port = free_port("127.0.0.1", 0)
    srv = uvicorn.Server(
        uvicorn.Config(
            create_app(data, token=test_ui.TOKEN, ingest_every=0),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.started
        base = f"http://127.0.0.1:{port}"
        found = test_ui.api(base, "findings", since="24h")
        assert found and all(f["confidence"] in ("high", "medium", "low") for f in found)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=test_ui.CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page()
                test_ui.open_page(page, base, "findings?since=24h&refresh=0")
                for f in found:
                    item = page.locator(f"li.finding[data-id='{f['id']}']")
                    badge = item.locator(".finding-head .confidence")
                    assert badge.inner_text() == f"{f['confidence']} confidence"
                f = found[0]
                item = page.locator(f"li.finding[data-id='{f['id']}']")
                item.get_by_role("button", name="evidence").click()
                note = item.locator(".evidence .confidence-note")
                note.wait_for()
                name, b = next(iter(f["confidence_basis"].items()))
                assert note.inner_text().startswith(f"How sure: {f['confidence']}: ")
                assert f"{b['count']:,.0f} {name.replace('_', ' ')}" in note.inner_text()
            finally:
                browser.close()
    finally:
        srv.should_exit = True
        t.join(timeout=30)


def test_a_hotspot_is_not_made_of_imports(synth: Any) -> None:
    """The first requests of a process import the project's modules (a URL module, a view
    module imported lazily): samples in the import system are start-up, not the endpoint's."""
    importing = [
        ("<frozen importlib._bootstrap>", 1176, "_find_and_load", False),
        ("/srv/proj/urls.py", 3, "<module>", True),
    ]

    def fill(w: SegmentWriter) -> None:
        stack = w.stack([SERVER, *importing])
        for i in range(3):
            tid = f"{i + 1:016x}"
            w.request("GET /login", dur_ms=900.0, trace_id=tid)
            samples = [[(300 + 10 * k) * 1_000_000, "cpu", stack] for k in range(30)]
            w.event(b"P", {"id": tid, "samples": samples})

    data = synth(fill)
    with DuckDBStore(data, read_only=True) as store:
        assert store.query("SELECT count(*) AS n FROM samples")[0]["n"] == 90
    assert not [f for f in findings(data) if f.kind == "slow_request_hotspot"]
    # the same samples outside the import system are a hotspot
    [f] = findings(synth(hotspot(3, 30)))
    assert f.kind == "slow_request_hotspot"
