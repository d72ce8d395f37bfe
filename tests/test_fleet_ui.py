"""The fleet in the web UI (issue 19): the host and service filters and the fleet table, in a
real browser (Playwright, Debian's Chromium) against a real server on a store holding three
hosts of two services; the API's ``host`` / ``service`` filters against the same data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.wire import HEADER
from perfsleuth.wire.segment import encode_record
from spoolwrite import SegmentWriter, call
from test_ui import SHOTS, api, browser, open_page, page, serving, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(300)

# host -> service, and the requests each sends: (endpoint, count, ms)
FLEET = {
    "web1": ("shop", [("GET /a", 6, 100.0)]),
    "web2": ("shop", [("GET /a", 3, 200.0), ("GET /b", 2, 50.0)]),
    "worker1": ("billing", [("GET /c", 4, 30.0)]),
}


def fleet_data(data: str) -> None:
    """Segments as three agents on three hosts would write them (their header names the host
    and service), ingested into ``data``'s store."""
    now = time.time_ns() - 120 * 10**9
    for pid, (host, (service, requests)) in enumerate(FLEET.items(), 100):
        w = SegmentWriter(data, service=service, pid=pid, host=host, header=False)
        w.write(
            encode_record(
                HEADER, {"v": 1, "host": host, "pid": pid, "service": service, "agent": "test"}
            )
        )
        for endpoint, n, ms in requests:
            for i in range(n):
                w.request(endpoint, ts_ns=now + i * 10**6, dur_ms=ms, calls=[call()])
        w.close()
    with DuckDBStore(data) as store:
        store.ingest()


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data = str(tmp_path_factory.mktemp("fleet-ui") / "data")
    fleet_data(data)
    with serving(data) as base:
        yield base


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {r["endpoint"]: r["count"] for r in rows}


def test_the_api_filters_by_host_and_service(fleet_server: str) -> None:
    f = api(fleet_server, "fleet", since="1h")
    assert f["hosts"] == ["web1", "web2", "worker1"] and f["services"] == ["billing", "shop"]
    assert counts(api(fleet_server, "endpoints", since="1h")) == {
        "GET /a": 9,
        "GET /b": 2,
        "GET /c": 4,
    }
    assert counts(api(fleet_server, "endpoints", since="1h", host="web2")) == {
        "GET /a": 3,
        "GET /b": 2,
    }
    assert counts(api(fleet_server, "endpoints", since="1h", service="shop")) == {
        "GET /a": 9,
        "GET /b": 2,
    }
    assert api(fleet_server, "endpoints", since="1h", host="web1", service="billing") == []
    ov = api(fleet_server, "overview", since="1h", host="web1")
    assert ov["totals"]["requests"] == 6
    assert sum(ov["throughput"]["requests"]) == 6
    d = api(fleet_server, "endpoint", name="GET /a", since="1h", host="web2")
    assert d["summary"]["count"] == 3 and d["summary"]["p50_ms"] == pytest.approx(200, rel=0.05)
    assert sum(c for c in d["percentiles"]["count"] if c) == 3
    assert sum(b["count"] for b in d["histogram"]) == 3
    assert len(d["slowest"]) == 3
    assert d["fingerprints"][0]["calls"] == 3  # the calls of web2's requests only
    everyone = api(fleet_server, "endpoint", name="GET /a", since="1h")
    assert everyone["summary"]["count"] == 9 and everyone["fingerprints"][0]["calls"] == 9


def test_the_ui_filters_the_overview_and_endpoint_by_host_and_service(
    fleet_server: str,
    page: Any,  # noqa: F811
) -> None:
    open_page(page, fleet_server, "overview")
    # The pickers list the hosts and services; the fleet table names each pair.
    assert page.locator("#host-filter").is_visible()
    hosts = page.locator("#host option").all_inner_texts()
    assert hosts == ["all hosts", "web1", "web2", "worker1"]
    assert page.locator("#service option").all_inner_texts() == ["all services", "billing", "shop"]
    rows = page.locator("#fleet tbody tr")
    assert rows.count() == 3
    assert page.locator("#totals-requests .stat-value").inner_text() == "15"

    page.select_option("#host", "web2")
    wait_ready(page, "overview")
    assert "host=web2" in page.url
    assert page.locator("#totals-requests .stat-value").inner_text() == "5"
    shown = page.locator("#app tr[data-endpoint]").evaluate_all(
        "rs => rs.map(r => r.dataset.endpoint)"
    )
    assert sorted(shown) == ["GET /a", "GET /b"]
    assert page.locator("#fleet tbody tr").count() == 1
    page.screenshot(path=str(SHOTS / "fleet-host-filter.png"), full_page=True)

    # The filter follows the link to the endpoint page.
    page.locator("#app tr[data-endpoint='GET /a'] a.endpoint-link").click()
    wait_ready(page, "endpoint")
    assert "host=web2" in page.url
    assert page.locator("[data-stat='count'] .stat-value").inner_text() == "3"
    assert "host web2" in page.locator("#fleet-note").inner_text()

    # A service, all hosts: the endpoint of the other service is gone.
    open_page(page, fleet_server, "overview?service=billing")
    assert page.locator("#service").input_value() == "billing"
    assert page.locator("#totals-requests .stat-value").inner_text() == "4"
    shown = page.locator("#app tr[data-endpoint]").evaluate_all(
        "rs => rs.map(r => r.dataset.endpoint)"
    )
    assert shown == ["GET /c"]
    page.locator("#fleet-clear").click()
    wait_ready(page, "overview")
    assert page.locator("#totals-requests .stat-value").inner_text() == "15"


def test_one_host_and_service_show_no_pickers(tmp_path: Path, page: Any) -> None:  # noqa: F811
    data = str(tmp_path / "data")
    w = SegmentWriter(data)
    w.request("GET /only", calls=[call()])
    w.close()
    with DuckDBStore(data) as store:
        store.ingest()
    with serving(data) as base:
        open_page(page, base, "overview")
        assert not page.locator("#host-filter").is_visible()
        assert not page.locator("#service-filter").is_visible()
        assert not page.locator("#fleet").count()
    shutil.rmtree(data, ignore_errors=True)


def test_top_takes_the_same_filters(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    fleet_data(data)

    def top(*args: str) -> Any:
        out = subprocess.run(
            [sys.executable, "-m", "perfsleuth", "top", "--data", data, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert counts(json.loads(top("--host", "web2", "--json"))["rows"]) == {"GET /a": 3, "GET /b": 2}
    got = json.loads(top("--service", "billing", "--by", "host", "--json"))["rows"]
    assert [(r["host"], r["count"]) for r in got] == [("worker1", 4)]
    assert "5 requests of host 'web2'" in top("--host", "web2")
    assert "No requests of host 'nowhere'" in top("--host", "nowhere")
