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
from test_ui import (  # noqa: F401
    SHOTS,
    TOKEN,
    api,
    browser,
    open_page,
    page,
    serving,
    wait_ready,
)

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


def wait_fleet(pg: Any) -> None:
    """Wait until the header's host and service pickers are filled for the current URL (from
    /api/fleet, fetched apart from the page's own data)."""
    pg.wait_for_function(
        "() => document.getElementById('top').dataset.fleet === location.hash", timeout=30_000
    )


def open_fleet_page(pg: Any, base: str, route: str) -> None:
    open_page(pg, base, route)
    wait_fleet(pg)


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
    open_fleet_page(page, fleet_server, "overview")
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
    wait_fleet(page)
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
    wait_fleet(page)
    assert page.locator("#host").input_value() == "web2"
    assert "host=web2" in page.url
    assert page.locator("[data-stat='count'] .stat-value").inner_text() == "3"
    assert "host web2" in page.locator("#fleet-note").inner_text()

    # A service, all hosts: the endpoint of the other service is gone.
    open_fleet_page(page, fleet_server, "overview?service=billing")
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
        open_fleet_page(page, base, "overview")
        # filled from the store (its one host and service), and hidden: nothing to choose
        assert page.locator("#host option").count() == 2
        assert page.locator("#service option").all_inner_texts() == ["all services", "shop"]
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


def test_the_overview_fetches_the_fleet_once_and_shows_without_it(
    fleet_server: str,
    page: Any,  # noqa: F811
) -> None:
    """One /api/fleet request per render (the header's pickers and the fleet card share it);
    when it fails, the overview shows all the same, without the fleet."""
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/api/fleet" in r.url else None)
    open_fleet_page(page, fleet_server, "overview?refresh=0")
    assert page.locator("#fleet tbody tr").count() == 3
    assert len(asked) == 1, asked

    page.route("**/api/fleet*", lambda route: route.fulfill(status=500, body="{}"))
    open_fleet_page(page, fleet_server, "overview?refresh=0&since=2h")
    assert page.locator("#totals-requests .stat-value").inner_text() == "15"
    assert not page.locator("#fleet").count()
    assert not page.locator("#host-filter").is_visible()


def test_requests_without_a_host_are_listed_but_not_a_host_link(
    tmp_path: Path,
    page: Any,  # noqa: F811
) -> None:
    """An OTLP service that sends no host.name: its row in the fleet card says (none), as
    text (a link to host "" would show every host)."""
    import httpx

    data = str(tmp_path / "data")
    fleet_data(data)
    t0 = time.time_ns() - 60 * 10**9
    span = {
        "traceId": "ab" * 16,
        "spanId": "cd" * 8,
        "name": "GET /otlp",
        "kind": 2,
        "startTimeUnixNano": str(t0),
        "endTimeUnixNano": str(t0 + 20_000_000),
        "attributes": [
            {"key": "http.request.method", "value": {"stringValue": "GET"}},
            {"key": "http.route", "value": {"stringValue": "/otlp"}},
            {"key": "http.response.status_code", "value": {"intValue": "200"}},
        ],
    }
    payload = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "node-api"}}]
                },
                "scopeSpans": [{"spans": [span]}],
            }
        ]
    }
    with serving(data) as base:
        r = httpx.post(
            f"{base}/v1/traces", json=payload, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert r.status_code == 200, r.text
        open_fleet_page(page, base, "overview")
        row = page.locator("#fleet tbody tr[data-service='node-api']")
        assert row.count() == 1
        assert row.locator("td[data-col='host']").inner_text().strip() == "(none)"
        assert not row.locator("a.host-link").count()
        assert row.locator("a.service-link").count() == 1
        assert page.locator("#fleet a.host-link").count() == 3  # the named hosts are links
    shutil.rmtree(data, ignore_errors=True)
