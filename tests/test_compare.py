"""``perfsleuth compare``: per-endpoint verdicts between two sides (tag values, time ranges).

Synthetic stores are written with the agent's wire encoder (tests/spoolwrite.py) and ingested
by the real store; one real app (Flask under gunicorn on PostgreSQL, tests/apps/compare_app.py)
runs under the agent for the tag comparison and a deploy that fixes an N+1.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import test_ui
from conftest import PG_DSN
from perfsleuth.analysis import compare as cmp
from perfsleuth.analysis import stats
from perfsleuth.cli.main import app
from spoolwrite import MS, SegmentWriter, call
from test_run_servers import Server, gunicorn, launched

ENDPOINTS = {  # base median latency, ms
    "GET /home": 20.0,
    "GET /search": 35.0,
    "GET /checkout": 50.0,
    "GET /cart": 15.0,
    "GET /account": 80.0,
}
PLANTED = "GET /checkout"

# The UI tests' fixtures: Chromium, and a page that fails the test on JavaScript errors.
browser = test_ui.browser
page = test_ui.page


def variant_traffic(seed: int, requests: int = 1500) -> Callable[[SegmentWriter], None]:
    """Random traffic over five endpoints, each request tagged variant a or b at random;
    variant b adds 30 ms to GET /checkout only. Latencies are log-normal around each
    endpoint's median (sigma 0.4), with a DB call or two."""

    def fill(w: SegmentWriter) -> None:
        rng = random.Random(seed)
        names = list(ENDPOINTS)
        for _ in range(requests):
            ep = rng.choice(names)
            variant = rng.choice("ab")
            dur = ENDPOINTS[ep] * rng.lognormvariate(0.0, 0.4)
            if ep == PLANTED and variant == "b":
                dur += 30.0
            calls = [call("db", "SELECT * FROM items WHERE id = ?", dur_ms=dur * 0.2, rows=1)]
            w.request(ep, dur_ms=dur, calls=calls, tags={"variant": variant})

    return fill


def test_planted_30ms_is_slower_and_significant_others_same_over_10_seeds(synth: Any) -> None:
    for seed in range(10):
        store = synth(variant_traffic(seed))
        a, b = cmp.value_sides(store, "tag:variant")
        assert (a.label, b.label) == ("variant=a", "variant=b")
        res = cmp.compare(store, a, b, findings=False)
        by_ep = {r["endpoint"]: r for r in res["endpoints"]}
        assert set(by_ep) == set(ENDPOINTS)  # every endpoint ingested and compared
        assert sum(r["a"]["count"] + r["b"]["count"] for r in by_ep.values()) == 1500
        verdicts = {ep: r["verdict"] for ep, r in by_ep.items()}
        assert verdicts == {ep: "slower" if ep == PLANTED else "same" for ep in ENDPOINTS}, seed
        assert by_ep[PLANTED]["significant"]
        assert by_ep[PLANTED]["p95_change"] > 0.2
        assert re.match(
            r"variant=b is slower on 1 endpoint: GET /checkout p(50|95) \+", res["verdict"]
        )
        assert "unchanged on 4 endpoints" in res["verdict"]


def test_identical_sides_give_no_verdict_and_few_requests_are_too_few(synth: Any) -> None:
    def fill(w: SegmentWriter) -> None:
        rng = random.Random(3)
        for i in range(400):
            w.request("GET /same", dur_ms=rng.lognormvariate(3.0, 0.5), tags={"arm": "xy"[i % 2]})
        for i in range(12):
            w.request("GET /rare", dur_ms=10.0 + i, tags={"arm": "xy"[i % 2]})

    store = synth(fill)
    res = cmp.compare(store, *cmp.value_sides(store, "tag:arm"), findings=False)
    v = {r["endpoint"]: r["verdict"] for r in res["endpoints"]}
    assert v == {"GET /same": "same", "GET /rare": "too_few"}
    assert res["verdict"] == (
        "arm=y: no significant change; unchanged on 1 endpoint, too few requests on 1 endpoint"
    )


def test_time_ranges_and_the_json_fields(synth: Any, tmp_path: Path) -> None:
    """Two hours of one endpoint, 20 % faster in the second; the CLI's --json has the fields
    the issue lists, and what moved with it (DB calls per request 3 -> 1)."""
    t0 = datetime(2026, 11, 20, 10, 0)
    t0_ns = int(t0.replace(tzinfo=UTC).timestamp() * 1e9)

    def fill(w: SegmentWriter) -> None:
        rng = random.Random(5)
        for i in range(600):
            second_hour = i >= 300
            ts = t0_ns + (i % 300) * 10 * 1000 * MS + (3600 * 1000 * MS if second_hour else 0)
            dur = rng.lognormvariate(4.0, 0.3) * (0.6 if second_hour else 1.0)
            n = 1 if second_hour else 3
            calls = [call("db", "SELECT 1", dur_ms=1.0, off_ms=j) for j in range(n)]
            w.request("GET /report", ts_ns=ts, dur_ms=dur, calls=calls)

    store = synth(fill)
    data = store.data_dir
    store.close()
    result = CliRunner().invoke(
        app,
        ["compare", "--data", data, "--json", "--no-findings",
         "--a", "2026-11-20T10:00/2026-11-20T11:00", "--b", "2026-11-20T11:00/2026-11-20T12:00"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    [row] = doc["endpoints"]
    assert {"endpoint", "a", "b", "p95_change", "significant", "verdict"} <= set(row)
    for side in ("a", "b"):
        assert {"count", "p50_ms", "p95_ms"} <= set(row[side])
        assert row[side]["count"] == 300
    assert row["verdict"] == "faster" and row["significant"] is True
    assert -0.5 < row["p95_change"] < -0.3
    assert row["moved"]["db_calls"]["a"] == pytest.approx(3.0)
    assert row["moved"]["db_calls"]["b"] == pytest.approx(1.0)
    assert doc["verdict"].startswith("2026-11-20T11:00/2026-11-20T12:00 is faster on 1 endpoint")

    human = CliRunner().invoke(
        app,
        ["compare", "--data", data, "--no-findings",
         "--a", "2026-11-20T10:00/2026-11-20T11:00", "--b", "2026-11-20T11:00/2026-11-20T12:00"],
    )  # fmt: skip
    assert human.exit_code == 0, human.output
    assert re.search(r"is faster on 1 endpoint: GET /report p(50|95) -\d+ %", human.output)
    assert "db 3.0→1.0" in human.output


def test_bad_sides_are_usage_errors(synth: Any) -> None:
    store = synth(lambda w: w.request("GET /x", tags={"v": "a"}))
    with pytest.raises(cmp.CompareError, match="need two values of tag 'v'"):
        cmp.value_sides(store, "tag:v")
    with pytest.raises(cmp.CompareError, match="use tag:NAME"):
        cmp.parse_by("colour")
    with pytest.raises(cmp.CompareError, match="ends before it starts"):
        cmp.time_side("2026-11-20T11:00/2026-11-20T10:00")


# ------------------------------------------------------------------------------- statistics


def test_quantile_interval_covers_the_true_quantile() -> None:
    """Exponential(10): the true p95 is 10 ln 20; 95 % intervals over 400 samples of 200 hold
    it about 95 % of the time (binomial spread: 360 to 395 covers it)."""
    rng = np.random.default_rng(11)
    true_p95 = 10 * np.log(20)
    hits = 0
    for _ in range(400):
        q = stats.quantile_ci(np.sort(rng.exponential(10, 200)), 0.95)
        hits += q.low <= true_p95 <= q.high
    assert 360 <= hits <= 395


def test_benjamini_hochberg_matches_the_definition() -> None:
    assert stats.benjamini_hochberg([0.01, 0.04, 0.03, 0.5]) == pytest.approx(
        [0.04, 0.04 * 4 / 3, 0.04 * 4 / 3, 0.5]
    )


def test_two_sided_rank_test_matches_scipy_example() -> None:
    males, females = [19, 22, 16, 29, 24], [20, 11, 17, 12]
    t = stats.mann_whitney(females, males)
    assert t.u == 17 and t.p_value == pytest.approx(0.11134688653314041)
    assert t.delta == pytest.approx(2 * 17 / 20 - 1)


# ------------------------------------------------------------------------------- a real app

VARIANT_ROUTES = ("/home", "/search", "/checkout", "/cart")


def _drive(srv: Server, jobs: list[tuple[str, dict[str, str]]]) -> None:
    def send(job: tuple[str, dict[str, str]]) -> None:
        status, body = srv.get(job[0], headers=job[1])
        assert status == 200, (job, status, body[:300])

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(send, jobs))


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%f")


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """The app before (an N+1 on /orders) and after a deploy that fixed it, into one data
    directory; variant traffic runs before the deploy. Yields (data dir, range a, range b)."""
    tmp = tmp_path_factory.mktemp("compare-app")
    data = tmp / "data"
    rng = random.Random(1)
    t0 = datetime.now(UTC).replace(tzinfo=None)
    with launched(tmp, data, gunicorn("compare_app:app", 2), service="shop", ready="/health",
                  COMPARE_PG_DSN=PG_DSN) as srv:  # fmt: skip
        _drive(srv, [("/orders", {}), ("/search", {})] * 3)  # warm-up: connections
        jobs = [(r, {"X-Variant": rng.choice("ab")}) for r in VARIANT_ROUTES for _ in range(60)]
        jobs += [("/orders", {"X-Variant": rng.choice("ab")}) for _ in range(60)]
        rng.shuffle(jobs)
        _drive(srv, jobs)
        assert srv.stop() == 0
    time.sleep(0.05)
    t1 = datetime.now(UTC).replace(tzinfo=None)
    with launched(tmp, data, gunicorn("compare_app:app", 2), service="shop", ready="/health",
                  COMPARE_PG_DSN=PG_DSN, COMPARE_FIXED="1") as srv:  # fmt: skip
        _drive(srv, [("/orders", {})] * 3)
        _drive(srv, [("/orders", {"X-Variant": "a"})] * 30)
        assert srv.stop() == 0
    t2 = datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=1)
    yield str(data), f"{_iso(t0)}/{_iso(t1)}", f"{_iso(t1)}/{_iso(t2)}"


def test_real_app_tag_variant_finds_the_planted_endpoint(shop: tuple[str, str, str]) -> None:
    """Before the deploy (--window): the deploy changed /orders for every variant."""
    data, before, _ = shop
    result = CliRunner().invoke(
        app,
        ["compare", "--data", data, "--by", "tag:variant", "--window", before, "--json",
         "--no-findings"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    v = {r["endpoint"]: r["verdict"] for r in doc["endpoints"]}
    counts = {r["endpoint"]: r["a"]["count"] + r["b"]["count"] for r in doc["endpoints"]}
    assert counts["GET /checkout"] >= 60 and counts["GET /home"] >= 60  # tagged and ingested
    assert v["GET /checkout"] == "slower", doc["verdict"]
    for ep in ("GET /home", "GET /search", "GET /cart", "GET /orders"):
        assert v[ep] == "same", (ep, doc["verdict"])


def test_real_app_deploy_fixing_an_n_plus_one_is_faster_and_the_finding_gone(
    shop: tuple[str, str, str],
) -> None:
    data, before, after = shop
    result = CliRunner().invoke(
        app, ["compare", "--data", data, "--a", before, "--b", after, "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    row = next(r for r in doc["endpoints"] if r["endpoint"] == "GET /orders")
    assert row["verdict"] == "faster", doc["verdict"]
    assert row["moved"]["db_calls"]["a"] > 20 and row["moved"]["db_calls"]["b"] == 1
    gone = [f for f in doc["findings"]["gone"] if f["endpoint"] == "GET /orders"]
    assert "n_plus_one" in {f["kind"] for f in gone}, doc["findings"]
    assert not [f for f in doc["findings"]["appeared"] if f["kind"] == "n_plus_one"]
    assert [f["kind"] for f in row["findings_gone"]].count("n_plus_one") == 1


# ------------------------------------------------------------------------------------ the API


def test_compare_api_gives_the_table_and_both_distributions(synth: Any) -> None:
    from fastapi.testclient import TestClient

    from perfsleuth.server.app import create_app

    store = synth(variant_traffic(0, requests=600))
    data = store.data_dir
    store.close()
    with TestClient(create_app(data, ingest_every=0)) as c:
        vals = c.get("/api/compare/values", params={"by": "tag:variant"})
        assert vals.status_code == 200, vals.text
        assert sorted(v["value"] for v in vals.json()) == ["a", "b"]
        assert sum(v["requests"] for v in vals.json()) == 600
        r = c.get("/api/compare", params={"by": "tag:variant", "findings": "false"})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert (doc["a"], doc["b"]) == ("variant=a", "variant=b")
        v = {row["endpoint"]: row["verdict"] for row in doc["endpoints"]}
        assert v[PLANTED] == "slower" and list(v.values()).count("same") == 4
        h = doc["histograms"][PLANTED]
        assert len(h["edges"]) == len(h["a"]) + 1 == len(h["b"]) + 1
        assert sum(h["a"]) == pytest.approx(1.0) and sum(h["b"]) == pytest.approx(1.0)
        bad = c.get("/api/compare", params={"by": "colour"})
        assert bad.status_code == 400 and "use tag:NAME" in bad.json()["error"]
        one = c.get("/api/compare", params={"a": "last-1h"})
        assert one.status_code == 400 and "give two sides" in one.json()["error"]


# ------------------------------------------------------------------------- the page (Chromium)


@pytest.fixture
def compare_server(synth: Any) -> Iterator[str]:
    import threading

    import uvicorn

    from perfsleuth.server.app import STATIC_DIR, create_app
    from test_run_servers import free_port
    from test_ui import TOKEN

    if not Path(STATIC_DIR, "index.html").is_file():
        pytest.fail("the web UI is not built: run `bash scripts/setup.sh` (npm ci, npm run build)")
    store = synth(variant_traffic(1, requests=600))
    data = store.data_dir
    store.close()
    app_ = create_app(data, token=TOKEN, ingest_every=0)
    srv = uvicorn.Server(
        uvicorn.Config(app_, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{srv.config.port}"
    srv.should_exit = True
    t.join(timeout=30)


def test_compare_page_shows_the_verdict_table_and_overlaid_distributions(
    page: Any, compare_server: str
) -> None:
    from test_ui import SHOTS, TOKEN, wait_ready

    page.goto(f"{compare_server}/?token={TOKEN}#/compare?by=tag:variant&refresh=0")
    wait_ready(page, "compare")
    verdict = page.locator("#compare-verdict").inner_text()
    assert verdict.startswith("variant=b is slower on 1 endpoint: GET /checkout")
    rows = page.locator("table.compare-table tbody tr")
    assert rows.count() == 5
    assert rows.first.get_attribute("data-endpoint") == PLANTED
    assert rows.first.get_attribute("data-verdict") == "slower"
    same = page.locator("table.compare-table tbody tr[data-verdict='same']")
    assert same.count() == 4
    chart = page.locator("#compare-chart")
    assert chart.get_attribute("data-endpoint") == PLANTED
    assert chart.locator("path[data-side='a']").count() == 1
    assert chart.locator("path[data-side='b']").count() == 1
    page.screenshot(path=str(SHOTS / "compare.png"), full_page=True)
    # Another endpoint's distributions on a click; the form keeps the sides.
    page.locator("table.compare-table tbody tr[data-endpoint='GET /cart'] td a").click()
    wait_ready(page, "compare")
    assert page.locator("#compare-chart").get_attribute("data-endpoint") == "GET /cart"
    assert page.locator("#cmp-by").input_value() == "tag:variant"
    assert page.locator("nav a, #nav a", has_text="Compare").count() >= 1


def test_by_attribute_compares_its_values_not_a_tag_of_the_same_name(synth: Any) -> None:
    """attr:plan compares the attribute's values; a tag named plan (set the other way round)
    is not mixed in."""

    def fill(w: SegmentWriter) -> None:
        rng = random.Random(8)
        for i in range(400):
            plan = "pro" if i % 2 else "free"
            dur = rng.lognormvariate(3.0, 0.3) * (2.0 if plan == "pro" else 1.0)
            w.request("GET /export", dur_ms=dur, attrs={"plan": plan},
                      tags={"plan": "free" if plan == "pro" else "pro"})  # fmt: skip

    store = synth(fill)
    a, b = cmp.value_sides(store, "attr:plan")
    assert (a.label, b.label) == ("plan=free", "plan=pro")
    [row] = cmp.compare(store, a, b, findings=False)["endpoints"]
    assert row["verdict"] == "slower" and row["a"]["count"] == row["b"]["count"] == 200
    [tag_row] = cmp.compare(store, *cmp.value_sides(store, "tag:plan"), findings=False)["endpoints"]
    assert tag_row["verdict"] == "faster"


# ----------------------------------------------------------------------------- by release


def release_writer(data: str, version: str, pid: int) -> SegmentWriter:
    """A segment whose header names the release, as the agent's (PERFSLEUTH_VERSION)."""
    from perfsleuth.wire import HEADER
    from perfsleuth.wire.segment import encode_record

    w = SegmentWriter(data, pid=pid, seq=pid, header=False)
    w.write(encode_record(HEADER, {"v": 1, "host": "testbox", "pid": pid, "service": "shop",
                                   "version": version, "agent": "test"}))  # fmt: skip
    return w


def test_by_release_compares_the_older_release_with_the_newer(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    rng = random.Random(4)
    t0 = time.time_ns() - 3600 * 10**9
    for k, (version, slow) in enumerate((("1.4.1", 1.0), ("1.4.2", 1.5))):
        w = release_writer(data, version, pid=100 + k)
        for i in range(300):
            ts = t0 + k * 1800 * 10**9 + i * 10**9
            w.request("GET /cart", ts_ns=ts, dur_ms=20 * rng.lognormvariate(0, 0.3) * slow)
            w.request("GET /home", ts_ns=ts + 1, dur_ms=10 * rng.lognormvariate(0, 0.3))
        w.close()
    result = CliRunner().invoke(
        app, ["compare", "--data", data, "--by", "release", "--json", "--no-findings"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert (doc["a"], doc["b"]) == ("1.4.1", "1.4.2")
    v = {r["endpoint"]: (r["verdict"], r["a"]["count"], r["b"]["count"]) for r in doc["endpoints"]}
    assert v == {"GET /cart": ("slower", 300, 300), "GET /home": ("same", 300, 300)}
    assert doc["verdict"].startswith("1.4.2 is slower on 1 endpoint: GET /cart")
