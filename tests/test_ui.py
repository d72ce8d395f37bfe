"""The web UI in a real browser (Playwright driving Debian's headless Chromium) against a real
server on the demo's data: real content on every page, numbers equal to the API's, a click
path overview -> endpoint -> trace, and screenshots in test-results/ui/ to look at."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from perfsleuth.analysis import text
from perfsleuth.cli.ui import free_port
from perfsleuth.demo import ENDPOINTS
from perfsleuth.server import create_app
from perfsleuth.server.app import STATIC_DIR
from service_wide import gc_pressure_data

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parent.parent / "test-results" / "ui"
TOKEN = "ui-test-token"
N1 = "GET /customers/{customer_id}/orders"
SINCE = "24h"

pytestmark = pytest.mark.timeout(300)


def fmt_int(v: float) -> str:
    return f"{round(v):,}"


def fmt_ms(v: float | None) -> str:
    """The UI's fmtMs: the one rule of perfsleuth.analysis.text (tests/test_formats.py checks
    that format.ts follows it)."""
    return text.ms_number(v)


@contextmanager
def serving(data: str) -> Iterator[str]:
    """The UI and API of ``data`` under uvicorn, with the token; yields the base URL."""
    if not os.path.isfile(os.path.join(STATIC_DIR, "index.html")):
        pytest.fail("the web UI is not built: run `bash scripts/setup.sh` (npm ci, npm run build)")
    import uvicorn

    port = free_port("127.0.0.1", 0)
    app = create_app(data, token=TOKEN, ingest_every=5)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started, "the UI server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=30)


@pytest.fixture(scope="module")
def server(demo_data: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data = str(tmp_path_factory.mktemp("ui") / "data")
    shutil.copytree(demo_data, data)
    with serving(data) as base:
        yield base


def api(base: str, path: str, **params: Any) -> Any:
    r = httpx.get(f"{base}/api/{path}", params=params, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run `bash scripts/setup.sh` (apt install chromium)")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, f"JavaScript errors: {errors}"


def open_page(page: Any, base: str, route: str) -> None:
    # The token comes in the query string once; the UI keeps it for the session.
    page.goto(f"{base}/?token={TOKEN}#/{route}")
    wait_ready(page, route.split("?")[0])


def wait_ready(page: Any, name: str) -> None:
    """Wait until the page for the current URL is rendered (not the one before a click)."""
    page.wait_for_function(
        "() => document.getElementById('app').dataset.hash === location.hash", timeout=30_000
    )
    page.wait_for_selector(f"#app[data-ready='{name}'] .page[data-page='{name}']", timeout=30_000)
    assert not page.locator("#app .error").count(), page.locator("#app .error").inner_text()


def cell(row: Any, col: str) -> str:
    return str(row.locator(f"td[data-col='{col}']").inner_text()).strip()


def test_overview_endpoint_trace(page: Any, server: str) -> None:
    open_page(page, server, f"overview?since={SINCE}&refresh=0")
    assert "token" not in page.url  # kept for the tab, not in links copied from the bar
    ov = api(server, "overview", since=SINCE)
    rows = page.locator("tr[data-endpoint]")
    assert rows.count() == len(ov["endpoints"])
    shown = {rows.nth(i).get_attribute("data-endpoint") for i in range(rows.count())}
    assert set(ENDPOINTS) <= shown
    want = next(r for r in ov["endpoints"] if r["endpoint"] == N1)
    row = page.locator(f"tr[data-endpoint='{N1}']")
    assert cell(row, "count") == fmt_int(want["count"])
    assert cell(row, "p95_ms") == fmt_ms(want["p95_ms"])
    assert cell(row, "p50_ms") == fmt_ms(want["p50_ms"])
    assert page.locator("#totals-requests .stat-value").inner_text() == fmt_int(
        ov["totals"]["requests"]
    )
    assert page.locator(".uplot").count() == 3  # P95 per endpoint, throughput, slow counts
    page.screenshot(path=str(SHOTS / "overview.png"), full_page=True)

    # sort by p95 (the URL carries it), then filter
    page.locator("th[data-col='p95_ms']").click()
    wait_ready(page, "overview")
    assert "sort=p95_ms" in page.url
    first = page.locator("tr[data-endpoint]").first.get_attribute("data-endpoint")
    assert first == max(ov["endpoints"], key=lambda r: r["p95_ms"] or 0)["endpoint"]

    # overview -> endpoint
    row.locator("a.endpoint-link").click()
    wait_ready(page, "endpoint")
    assert page.locator("#endpoint-name").inner_text() == N1
    d = api(server, "endpoint", name=N1, since=SINCE)
    p95 = page.locator(".stat[data-stat='p95 ms'] .stat-value").inner_text()
    assert p95 == fmt_ms(d["summary"]["p95_ms"])
    page.wait_for_selector("svg.treemap .treemap-node[data-name^='customer_orders']")
    page.screenshot(path=str(SHOTS / "endpoint.png"), full_page=True)
    # a click on a call site zooms the treemap into it
    node = page.locator("svg.treemap .treemap-node[data-name^='customer_orders']").first
    node.click(position={"x": 6, "y": 6})  # its label strip (its children cover the rest)
    assert "› customer_orders" in page.locator(".crumb").inner_text()
    top = page.locator("svg.treemap .treemap-node[data-depth='0']").get_attribute("data-name")
    assert top.startswith("customer_orders")
    mine = api(server, "findings", endpoint=N1, since=SINCE)
    page.wait_for_selector("#endpoint-findings :is(ol.findings, p)")
    shown = page.locator("li.finding").evaluate_all("els => els.map(e => e.dataset.id)")
    assert shown == [f["id"] for f in mine]
    # The flame graph of the endpoint's sampled requests (how many were slow enough to be
    # sampled depends on the machine's load: without samples the page says so).
    if api(server, "profile", endpoint=N1, since=SINCE)["samples"]:
        page.wait_for_selector("svg.flame .flame-frame")
    else:
        page.wait_for_selector(".flame-box p.dim:has-text('No stack samples')")
    slow_links = page.locator("a.trace-link")
    assert slow_links.count() >= len(d["slowest"])

    # endpoint -> its slowest trace
    tid = d["slowest"][0]["trace_id"]
    page.locator(f"a.trace-link:text-is('{tid}')").click()
    wait_ready(page, "trace")
    t = api(server, f"traces/{tid}")
    assert page.locator("#waterfall .wf-row").count() == len(t["calls"]) == t["db_calls"]
    assert page.locator("#waterfall .wf-site", has_text="customer_orders").count() > 0
    assert page.locator(".stat[data-stat='duration ms'] .stat-value").inner_text() == fmt_ms(
        t["duration_ms"]
    )
    assert page.locator("#attributes", has_text=t["tenant"]).count() == 0  # tenant is a card
    assert page.locator(".stat[data-stat='tenant'] .stat-value").inner_text() == t["tenant"]
    # a row opens its stack
    page.locator("#waterfall .wf-row").first.click()
    assert page.locator(".call-detail:not([hidden]) ol.stack li").count() > 0
    page.screenshot(path=str(SHOTS / "trace.png"), full_page=False)


def test_flame_graph_and_samples_of_the_cpu_hotspot(page: Any, server: str) -> None:
    open_page(page, server, f"endpoint?since={SINCE}&refresh=0&name={quote('GET /search')}")
    page.wait_for_selector("svg.flame .flame-frame[data-name^='_edit_distance']")
    # a click on a frame zooms into it: it becomes the top frame
    frames = page.locator("svg.flame .flame-frame")
    before = frames.count()
    page.locator("svg.flame .flame-frame[data-name^='_edit_distance']").first.click()
    assert (
        page.locator("svg.flame .flame-frame")
        .first.get_attribute("data-name")
        .startswith("_edit_distance")
    )
    assert page.locator("svg.flame .flame-frame").count() < before
    page.screenshot(path=str(SHOTS / "endpoint-search.png"), full_page=True)
    # the hotspot's first example: the request with the most samples (the slowest one may have
    # spent its time waiting, for the GIL or the CPU, elsewhere)
    hotspot = next(
        f
        for f in api(server, "findings", since=SINCE)
        if f["kind"] == "slow_request_hotspot" and f["endpoint"] == "GET /search"
    )
    tid = hotspot["example_trace_ids"][0]
    open_page(page, server, f"trace?id={tid}&refresh=0")
    assert page.locator(".sample-strip .sample").count() > 0
    page.wait_for_selector("svg.flame .flame-frame[data-name^='_edit_distance']")
    assert page.get_by_text("_edit_distance").count() > 0
    page.screenshot(path=str(SHOTS / "trace-search.png"), full_page=True)


def test_findings_page(page: Any, server: str) -> None:
    open_page(page, server, f"findings?since={SINCE}&refresh=0")
    found = api(server, "findings", since=SINCE)
    items = page.locator("li.finding")
    assert items.count() == len(found)
    assert items.first.get_attribute("data-id") == found[0]["id"]
    f = next(f for f in found if f["callsite"] and f["example_trace_ids"])
    item = page.locator(f"li.finding[data-id='{f['id']}']")
    assert f["title"] in item.inner_text()
    item.get_by_role("button", name="evidence").click()
    item.locator(".evidence table").wait_for()
    line = api(server, f"findings/{f['id']}", since=SINCE)["source_line"]
    assert line.strip() in item.locator(".evidence pre.code").inner_text()
    page.screenshot(path=str(SHOTS / "findings.png"), full_page=True)
    # an example trace link opens the trace
    item.locator("a.trace-link").first.click()
    wait_ready(page, "trace")
    assert page.locator("h1 .endpoint-link").inner_text() == f["endpoint"]


def test_sql_console(page: Any, server: str) -> None:
    open_page(page, server, "sql?refresh=0")
    page.fill("#sql", "SELECT endpoint, count(*) AS n FROM requests GROUP BY 1 ORDER BY 2 DESC")
    page.click("#run-sql")
    wait_ready(page, "sql")
    page.wait_for_selector("#sql-result table")
    assert "q=SELECT" in page.url
    cells = page.locator("#sql-result tbody tr td:first-child").all_inner_texts()
    assert set(ENDPOINTS) <= set(cells)
    page.screenshot(path=str(SHOTS / "sql.png"), full_page=True)
    page.fill("#sql", "DROP TABLE requests")
    page.click("#run-sql")
    page.wait_for_selector("#sql-result .error")
    assert "read-only" in page.locator("#sql-result .error").inner_text()


def test_without_the_token_the_page_says_so(browser: Any, server: str) -> None:
    ctx = browser.new_context()
    pg = ctx.new_page()
    pg.goto(f"{server}/#/overview")
    pg.wait_for_selector("#app .error")  # the page's place shows the server's message
    assert "needs a token" in pg.locator("#app .error").inner_text()
    ctx.close()


def test_click_through_to_the_replay_command(browser: Any, server: str) -> None:
    """overview -> endpoint -> trace -> replay: the copied curl command is the server's."""
    rows = httpx.post(
        f"{server}/api/sql",
        json={
            "query": "SELECT c.trace_id, r.endpoint FROM captures c JOIN requests r "
            "USING (trace_id) ORDER BY r.duration_ms DESC LIMIT 1"
        },
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()["rows"]
    assert rows, "the demo's slow requests are captured"
    tid, endpoint = rows[0]
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.grant_permissions(["clipboard-read", "clipboard-write"])
    page = ctx.new_page()
    open_page(page, server, f"overview?since={SINCE}&refresh=0")
    page.locator(f"tr[data-endpoint='{endpoint}'] a.endpoint-link").click()
    wait_ready(page, "endpoint")
    page.locator(f"a.trace-link:text-is('{tid}')").first.click()
    wait_ready(page, "trace")
    t = api(server, f"traces/{tid}")
    assert t["replay"] and t["replay"]["curl"].startswith(("curl ", "#", "printf"))
    shown = page.locator("#replay-curl").inner_text()
    assert shown.strip() == t["replay"]["curl"].strip()
    page.click("#copy-curl")
    page.wait_for_selector("#copy-status:has-text('copied')")
    copied = page.evaluate("navigator.clipboard.readText()")
    whole = httpx.get(
        f"{server}/api/traces/{tid}/curl", headers={"Authorization": f"Bearer {TOKEN}"}
    ).text
    assert copied.strip() == whole.strip() and t["path"] in copied
    page.screenshot(path=str(SHOTS / "trace-replay.png"), full_page=False)
    ctx.close()


def test_auto_refresh_redraws_in_place(page: Any, server: str) -> None:
    open_page(page, server, f"overview?since={SINCE}&refresh=5")
    assert page.locator("#refresh").input_value() == "5"
    page.evaluate("window.scrollTo(0, 300)")
    y = page.evaluate("window.scrollY")
    assert y > 100
    page.evaluate("document.querySelector('#app .page').dataset.old = '1'")
    # within one refresh period the page is drawn anew, at the same scroll position
    page.wait_for_selector("#app .page:not([data-old])", state="attached", timeout=15_000)
    page.wait_for_selector("#app tr[data-endpoint]")
    page.wait_for_timeout(300)
    assert abs(page.evaluate("window.scrollY") - y) < 5


def test_a_service_wide_finding_names_the_service(browser: Any, synth: Callable[..., Any]) -> None:
    """A finding of the whole service (gc_pressure's: every endpoint pays about the same share
    to collections of one big heap) says so instead of linking to an endpoint page that has no
    "<service>" endpoint."""
    data = gc_pressure_data(synth)
    with serving(data) as base:
        found = api(base, "findings", since="all")
        service = next(f for f in found if f["endpoint"] == "<service>")
        page = browser.new_page()
        page.goto(f"{base}/?token={TOKEN}#/findings?since=all")
        wait_ready(page, "findings")
        li = page.locator(f"li.finding[data-id='{service['id']}']")
        assert li.locator(".service-wide").inner_text() == "the whole service"
        assert li.locator("a.endpoint-link").count() == 0
        others = [f for f in found if f["endpoint"] != "<service>"]
        for f in others:
            link = page.locator(f"li.finding[data-id='{f['id']}'] a.endpoint-link")
            assert link.inner_text() == f["endpoint"]
        page.close()
