"""Findings: the detectors on the real demo (every planted problem found, with the looping line
of code; nothing on the clean endpoints), on small synthetic stores written with the real wire
encoder and ingested by the real store (thresholds and the false alarms peers are criticised
for), and the loop finder on real source files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import perfsleuth.demo
import perfsleuth.demo.legacy
import perfsleuth.demo.shop
from perfsleuth.analysis import Config, ConfigError, find, load_config, loops, stable_id
from perfsleuth.analysis.detectors import DETECTORS
from perfsleuth.analysis.finding import Finding
from perfsleuth.cli.main import app
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import SegmentWriter, call, stored

CONTRACT = {
    "id",
    "kind",
    "endpoint",
    "title",
    "impact_ms_per_min",
    "callsite",
    "fingerprint",
    "count_per_request",
    "example_trace_ids",
    "first_seen",
    "last_seen",
    "suggestion",
}


def line_of(path: str, needle: str, after: str | None = None) -> int:
    """The line number of the only line containing ``needle`` (after the line containing
    ``after``, when given)."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    start = 0 if after is None else line_of(path, after)
    hits = [i for i, s in enumerate(lines, 1) if needle in s and i > start]
    assert len(hits) == 1, (path, needle, hits)
    return hits[0]


def cli(*args: str) -> Any:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def assert_one_line_error(stderr: str, contains: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("perfsleuth: "), stderr
    assert contains in lines[0], stderr


# ---------------------------------------------------------------------------------- the demo


@pytest.fixture(scope="module")
def demo(demo_data: str) -> str:
    """The session's demo run (conftest.demo_run); these tests only read it."""
    return demo_data


@pytest.fixture(scope="module")
def demo_findings(demo: str) -> list[Finding]:
    with DuckDBStore(demo, read_only=True) as store:
        return find(store, config=Config())


def test_every_planted_problem_is_found(demo_findings: list[Finding]) -> None:
    found = {(f.endpoint, f.kind) for f in demo_findings}
    planted = {(e, k) for e, k in perfsleuth.demo.PLANTED.items() if k in DETECTORS}
    assert len(planted) == len(perfsleuth.demo.PLANTED)
    missing = planted - found
    assert not missing, f"not found: {missing}; found: {sorted(found)}"


def test_clean_endpoints_have_no_findings(demo_findings: list[Finding]) -> None:
    noisy = [
        (f.kind, f.endpoint, f.title) for f in demo_findings if f.endpoint in perfsleuth.demo.CLEAN
    ]
    assert noisy == []


def test_n_plus_one_points_at_the_line_inside_the_loop(demo_findings: list[Finding]) -> None:
    shop = perfsleuth.demo.shop.__file__
    n1 = [
        f
        for f in demo_findings
        if f.kind == "n_plus_one" and f.endpoint == "GET /customers/{customer_id}/orders"
    ]
    assert len(n1) == 1
    f = n1[0]
    assert f.callsite is not None
    assert f.callsite["file"].endswith(os.path.join("demo", "shop.py"))
    assert f.callsite["line"] == line_of(shop, "items = _items_of(con, o[0])")
    assert f.callsite["function"] == "customer_orders"
    # The agent's call site is the helper; the finding keeps it as evidence.
    assert f.evidence["call_site"]["function"] == "_items_of"
    assert f.evidence["loop_found_in_source"] is True
    assert f.fingerprint is not None and "FROM order_items" in f.fingerprint
    assert f.count_per_request is not None and f.count_per_request >= 5

    legacy = perfsleuth.demo.legacy.__file__
    export = next(
        f for f in demo_findings if f.kind == "n_plus_one" and f.endpoint == "GET /admin/export.csv"
    )
    assert export.callsite is not None
    assert export.callsite["file"].endswith(os.path.join("demo", "legacy.py"))
    assert export.callsite["line"] == line_of(
        legacy, "n, total = con.execute(", after="for cid, name, email in customers:"
    )
    assert export.count_per_request == 300  # one per exported customer (EXPORT_PAGE)


def test_repeated_query_needs_the_same_parameters(demo_findings: list[Finding]) -> None:
    rq = [f for f in demo_findings if f.kind == "repeated_query"]
    assert [f.endpoint for f in rq] == ["GET /products/{product_id}"]
    assert rq[0].count_per_request == 3
    assert rq[0].fingerprint is not None and "FROM products p WHERE p.id = ?" in rq[0].fingerprint


def test_findings_are_ranked_by_impact_with_stable_unique_ids(
    demo: str, demo_findings: list[Finding]
) -> None:
    impacts = [f.impact_ms_per_min for f in demo_findings]
    assert impacts == sorted(impacts, reverse=True)
    assert all(i > 0 for i in impacts)
    ids = [f.id for f in demo_findings]
    assert len(set(ids)) == len(ids)
    with DuckDBStore(demo, read_only=True) as store:
        again = find(store, config=Config())
    assert [f.id for f in again] == ids


def test_every_finding_is_complete_and_its_examples_exist(
    demo: str, demo_findings: list[Finding]
) -> None:
    with DuckDBStore(demo, read_only=True) as store:
        for f in demo_findings:
            assert f.title and f.suggestion and f.first_seen and f.last_seen
            assert f.first_seen <= f.last_seen
            service_wide = f.endpoint == "<service>"  # cpu_starved: the service's requests
            assert (0 if service_wide else 1) <= len(f.example_trace_ids) <= 3
            for tid in f.example_trace_ids:
                trace = store.trace(tid)
                assert service_wide or trace["endpoint"] == f.endpoint


def test_upstream_latency_separates_their_time_from_ours(demo_findings: list[Finding]) -> None:
    up = next(f for f in demo_findings if f.kind == "upstream_latency")
    ev = up.evidence
    assert ev["share_of_endpoint_time"] >= 0.5
    assert ev["endpoint_p95_ms_without_upstream"] < ev["endpoint_p95_ms"]
    assert ev["site_p95_ms_without_upstream"] <= ev["site_p95_ms"]
    assert up.callsite is not None and up.callsite["function"] == "shipping_quote"


def test_findings_json_contract(demo: str) -> None:
    r = cli("findings", "--data", demo, "--no-ingest", "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert isinstance(out, list) and out
    for f in out:
        assert set(f) >= CONTRACT
        assert isinstance(f["impact_ms_per_min"], float)
        assert f["callsite"] is None or set(f["callsite"]) == {"file", "line", "function"}
        assert isinstance(f["example_trace_ids"], list)
    assert [f["impact_ms_per_min"] for f in out] == sorted(
        (f["impact_ms_per_min"] for f in out), reverse=True
    )
    only = json.loads(
        cli(
            "findings", "--data", demo, "--no-ingest", "--json", "-e", "GET /admin/export.csv"
        ).stdout
    )
    assert {(f["kind"], f["endpoint"]) for f in only} == {("n_plus_one", "GET /admin/export.csv")}


def test_findings_table_and_explain(demo: str, demo_findings: list[Finding]) -> None:
    r = cli("findings", "--data", demo, "--no-ingest")
    assert r.exit_code == 0, r.stderr
    for f in demo_findings:
        assert f.id in r.stdout
    n1 = next(f for f in demo_findings if f.kind == "n_plus_one" and "customers" in f.endpoint)
    r = cli("explain", n1.id[:8], "--data", demo, "--no-ingest")
    assert r.exit_code == 0, r.stderr
    assert "items = _items_of(con, o[0])" in r.stdout  # the line of code itself
    assert f"perfsleuth trace {n1.example_trace_ids[0]}" in r.stdout
    assert "perfsleuth calltree" in r.stdout
    j = json.loads(cli("explain", n1.id, "--data", demo, "--no-ingest", "--json").stdout)
    assert j["id"] == n1.id and j["source_line"].startswith("items = _items_of(")


def test_unknown_finding_endpoint_and_setting_are_one_line_errors(demo: str) -> None:
    r = cli("explain", "0000nope", "--data", demo, "--no-ingest")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "no finding with id '0000nope'")
    r = cli("findings", "-e", "GET /nope", "--data", demo, "--no-ingest")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "unknown endpoint 'GET /nope'")
    r = cli("findings", "--set", "n_plus_one.nope=1", "--data", demo, "--no-ingest")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "unknown setting n_plus_one.nope")
    r = cli("findings", "--set", "n_plus_one.min_repeats=many", "--data", demo, "--no-ingest")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "invalid value 'many' for n_plus_one.min_repeats")


def test_detectors_can_be_switched_off_and_tuned(demo: str, tmp_path: Path) -> None:
    def kinds(*args: str) -> set[tuple[str, str]]:
        r = cli("findings", "--data", demo, "--no-ingest", "--json", *args)
        assert r.exit_code == 0, r.stderr
        return {(f["kind"], f["endpoint"]) for f in json.loads(r.stdout)}

    off = kinds("--set", "n_plus_one.enabled=false")
    assert not any(k == "n_plus_one" for k, _ in off)
    assert ("repeated_query", "GET /products/{product_id}") in off
    # 300 per request in the export; megacorp's customers have ~400 orders, the others 20.
    tuned = kinds("--set", "n_plus_one.min_repeats=1000")
    assert not any(k == "n_plus_one" for k, _ in tuned)
    cfg = tmp_path / "perfsleuth.toml"
    cfg.write_text("[findings]\n[findings.repeated_query]\nenabled = false\n")
    assert not any(k == "repeated_query" for k, _ in kinds("--config", str(cfg)))


def test_calltree_of_the_n_plus_one_endpoint(demo: str) -> None:
    r = cli(
        "calltree", "GET /customers/{customer_id}/orders", "--data", demo, "--no-ingest", "--json"
    )
    assert r.exit_code == 0, r.stderr
    tree = json.loads(r.stdout)
    loop = next(c for c in tree["children"] if c["function"] == "customer_orders" and c["children"])
    assert loop["line"] == line_of(perfsleuth.demo.shop.__file__, "items = _items_of(con, o[0])")
    assert [c["function"] for c in loop["children"]] == ["_items_of"]
    assert loop["calls"] > tree["calls"] / 2


# ---------------------------------------------------------------------------------- synthetic

APP = textwrap.dedent(
    """\
    def load_items(db, order_id):
        return db.query("items", order_id)  # SITE


    def orders_page(db, orders):
        first = db.query("orders")  # ORDERS
        out = []
        for o in orders:
            out.append(load_items(db, o))  # LOOP
        return out


    def avatars(cache, users):
        return [cache.get(u) for u in users]  # COMPREHENSION


    def settings(cache):
        a = cache.get("s")  # STRAIGHT
        b = cache.get("s")
        return a, b
    """
)
ITEMS = "SELECT * FROM items WHERE order_id = ?"
ORDERS = "SELECT * FROM orders WHERE customer_id = ?"


@pytest.fixture
def src(tmp_path: Path) -> dict[str, Any]:
    """A real source file for the loop finder, and the lines of its markers."""
    path = tmp_path / "src" / "app.py"
    path.parent.mkdir()
    path.write_text(APP)
    marks = ("SITE", "ORDERS", "LOOP", "COMPREHENSION", "STRAIGHT")
    return {"file": str(path), **{m: line_of(str(path), f"# {m}") for m in marks}}


SERVER = ("/usr/lib/python3/site-packages/server.py", 10, "serve", False)


def orders_request(
    w: SegmentWriter,
    src: dict[str, Any],
    n: int,
    *,
    endpoint: str = "GET /orders",
    kind: str = "db",
    text: str = ITEMS,
    same_params: bool = False,
    dur_ms: float = 2.0,
) -> None:
    """One parent query, then ``n`` calls from load_items() called in the loop."""
    f = src["file"]
    outer = [SERVER, (f, src["ORDERS"], "orders_page", True)]
    inner = [SERVER, (f, src["LOOP"], "orders_page", True), (f, src["SITE"], "load_items", True)]
    calls = [call("db", ORDERS, dur_ms=1.0, site=outer[-1][:3], stack=outer, ph=1)]
    for i in range(n):
        calls.append(
            call(
                kind,
                text,
                dur_ms=dur_ms,
                off_ms=1.0 + i * dur_ms,
                site=inner[-1][:3],
                stack=inner if i == 0 else None,  # later calls of a site may have no stack
                ph=7 if same_params else 100 + i,
            )
        )
    w.request(endpoint, dur_ms=2.0 + n * dur_ms, calls=calls, user="u1", tenant="t1")


def kinds_of(findings: list[Finding]) -> list[tuple[str, str]]:
    return sorted((f.kind, f.endpoint) for f in findings)


def test_n_plus_one_needs_five_repeats_and_reports_the_loop(synth: Any, src: dict) -> None:
    def fill(w: SegmentWriter) -> None:
        for _ in range(10):
            orders_request(w, src, 4, endpoint="GET /four")  # below the default threshold
            orders_request(w, src, 1, endpoint="GET /one-plus-one")  # a 1+1 load
            orders_request(w, src, 5, endpoint="GET /five")
            orders_request(w, src, 12, endpoint="GET /twelve")

    store = synth(fill)
    found = find(store, config=Config())
    assert kinds_of(found) == [("n_plus_one", "GET /five"), ("n_plus_one", "GET /twelve")]
    f = next(f for f in found if f.endpoint == "GET /twelve")
    assert f.callsite == {"file": src["file"], "line": src["LOOP"], "function": "orders_page"}
    assert f.count_per_request == 12
    assert f.evidence["requests_with_pattern"] == 10
    assert f.evidence["ms_beyond_first"] == pytest.approx(10 * 11 * 2.0, rel=1e-3)
    # impact: the calls beyond the first, per minute (the data spans under a minute)
    assert f.impact_ms_per_min == pytest.approx(220.0, rel=1e-3)
    assert f.fingerprint == ITEMS
    # the threshold is a setting
    cfg = load_config(assignments=["n_plus_one.min_repeats=4"])
    assert ("n_plus_one", "GET /four") in kinds_of(find(store, config=cfg))


def test_n_plus_one_falls_back_to_the_call_site_without_source(
    synth: Any, src: dict, tmp_path: Path
) -> None:
    gone = {**src, "file": str(tmp_path / "deleted" / "app.py")}

    def fill(w: SegmentWriter) -> None:
        for _ in range(5):
            orders_request(w, gone, 8)

    [f] = find(synth(fill), config=Config())
    assert f.callsite == {"file": gone["file"], "line": src["SITE"], "function": "load_items"}
    assert f.evidence["loop_found_in_source"] is False


def test_n_plus_one_ignores_a_rare_or_cheap_pattern(synth: Any, src: dict) -> None:
    def fill(w: SegmentWriter) -> None:
        for i in range(100):
            # 2 of 100 requests loop (under 5 % of the endpoint's traffic)
            orders_request(w, src, 10 if i < 2 else 1, endpoint="GET /rare")
            # a loop costing 0.1 % of the request's time and under 50 ms
            w.request(
                "GET /cheap",
                dur_ms=5000.0,
                calls=[call("db", ITEMS, dur_ms=0.05, site=(src["file"], src["SITE"], "f"))] * 6,
            )

    store = synth(fill)
    # the rare loop: 2 requests of 1 + 10 calls, 98 of 1 + 1
    assert stored(store) == {"GET /rare": (100, 2 * 11 + 98 * 2), "GET /cheap": (100, 600)}
    assert find(store, config=Config()) == []


def test_cache_n_plus_one_only_with_a_loop_in_the_source(synth: Any, src: dict) -> None:
    f = src["file"]

    def fill(w: SegmentWriter) -> None:
        for _ in range(5):
            looped = (f, src["COMPREHENSION"], "avatars")
            straight = (f, src["STRAIGHT"], "settings")
            w.request(
                "GET /avatars",
                dur_ms=20.0,
                calls=[
                    call(
                        "cache",
                        "GET avatar:{id}",
                        dur_ms=2.0,
                        site=looped,
                        stack=[(*looped, True)],
                        ph=i,
                    )
                    for i in range(8)
                ],
            )
            w.request(
                "GET /settings",
                dur_ms=20.0,
                calls=[
                    call(
                        "cache", "GET s", dur_ms=2.0, site=straight, stack=[(*straight, True)], ph=i
                    )
                    for i in range(8)
                ],
            )

    found = find(synth(fill), config=Config())
    assert kinds_of(found) == [("n_plus_one", "GET /avatars")]
    assert found[0].callsite is not None and found[0].callsite["line"] == src["COMPREHENSION"]
    assert "MGET" in found[0].suggestion


def test_repeated_query_needs_identical_parameters(synth: Any, src: dict) -> None:
    site = (src["file"], src["STRAIGHT"], "settings")

    def fill(w: SegmentWriter) -> None:
        for _ in range(5):
            # the same statement twice with different parameters: not a repeat
            w.request(
                "GET /different",
                calls=[call(text=ORDERS, site=site, ph=1), call(text=ORDERS, site=site, ph=2)],
            )
            # twice with the same parameters: a repeat
            w.request(
                "GET /same",
                calls=[call(text=ORDERS, site=site, ph=3), call(text=ORDERS, site=site, ph=3)],
            )
            # no parameters: literals may differ behind the fingerprint
            w.request(
                "GET /literal", calls=[call(text=ORDERS, site=site), call(text=ORDERS, site=site)]
            )
            # the same write twice: a cache cannot remove it
            upd = "UPDATE orders SET total = ? WHERE id = ?"
            w.request(
                "POST /write",
                calls=[call(text=upd, site=site, ph=4), call(text=upd, site=site, ph=4)],
            )

    found = find(synth(fill), config=Config())
    assert kinds_of(found) == [("repeated_query", "GET /same")]
    f = found[0]
    assert f.count_per_request == 2
    assert f.callsite == {"file": src["file"], "line": src["STRAIGHT"], "function": "settings"}
    assert f.evidence["ms_beyond_first"] == pytest.approx(5.0)


def test_oversized_result(synth: Any) -> None:
    def fill(w: SegmentWriter) -> None:
        w.request(
            "GET /report",
            dur_ms=300.0,
            resp_bytes=900,
            attrs={"rows_returned": 20},
            calls=[call(text="SELECT * FROM orders", dur_ms=20.0, rows=59_000)],
        )
        w.request(
            "GET /blob",
            dur_ms=50.0,
            calls=[call(text="SELECT body FROM blobs WHERE id = ?", rows=1, bytes=3_000_000)],
        )
        w.request(
            "GET /page", dur_ms=50.0, calls=[call(text="SELECT * FROM t LIMIT ?", rows=9_999)]
        )

    found = find(synth(fill), config=Config())
    assert kinds_of(found) == [
        ("oversized_result", "GET /blob"),
        ("oversized_result", "GET /report"),
    ]
    rep = next(f for f in found if f.endpoint == "GET /report")
    assert rep.evidence["rows_median"] == 59_000
    assert rep.evidence["rows_returned_median"] == 20
    assert "to return 20 rows" in rep.title
    assert rep.impact_ms_per_min == pytest.approx(300.0)  # the query + the app time around it


def test_slow_query(synth: Any) -> None:
    def fill(w: SegmentWriter) -> None:
        for i in range(20):
            slow = 400.0 if i % 4 == 0 else 5.0
            w.request(
                "GET /slow", dur_ms=slow + 10, calls=[call(text="SELECT slow()", dur_ms=slow)]
            )
            w.request("GET /fast", dur_ms=15.0, calls=[call(text="SELECT fast()", dur_ms=5.0)])

    [f] = find(synth(fill), config=Config())
    assert (f.kind, f.endpoint, f.fingerprint) == ("slow_query", "GET /slow", "SELECT slow()")
    assert f.evidence["p95_ms"] == pytest.approx(400.0)
    assert f.evidence["share_of_endpoint_time"] > 0.8


def test_slow_query_ignores_a_fast_statement_with_a_few_slow_waits(synth: Any) -> None:
    # What a starved machine did to a primary-key lookup in the demo: median ~10 ms, a few
    # calls held up ~150 ms (waiting for the interpreter lock and the CPU, not the database).
    def fill(w: SegmentWriter) -> None:
        for i in range(20):
            d = 150.0 if i in (3, 11) else 10.0
            w.request("GET /order", dur_ms=d + 5, calls=[call(text="SELECT pk()", dur_ms=d)])

    store = synth(fill)
    assert stored(store) == {"GET /order": (20, 20)}
    assert find(store, config=Config()) == []


def test_upstream_latency(synth: Any) -> None:
    def fill(w: SegmentWriter) -> None:
        for i in range(20):
            wait = 400.0 if i % 2 else 100.0
            w.request(
                "GET /quote",
                dur_ms=wait + 10,
                tenant=f"t{i % 2}",
                calls=[
                    call(
                        "http",
                        "GET carrier.example:443/v1/quotes/{id}",
                        dur_ms=wait,
                        host="carrier.example:443",
                        status=200,
                    )
                ],
            )
            w.request(
                "GET /mostly-ours",
                dur_ms=200.0,
                calls=[
                    call("http", "GET api.example/x", dur_ms=30.0, host="api.example", status=200)
                ],
            )

    [f] = find(synth(fill), config=Config())
    assert (f.kind, f.endpoint) == ("upstream_latency", "GET /quote")
    ev = f.evidence
    assert ev["host"] == "carrier.example:443"
    assert ev["endpoint_p95_ms_without_upstream"] == pytest.approx(10.0)
    assert ev["top_tenants"][0]["tenant"] == "t1"  # the tenant with the slow route
    assert ev["top_tenants"][0]["share"] == pytest.approx(0.8)
    assert f.impact_ms_per_min == pytest.approx(10 * 400 + 10 * 100)


def test_upstream_latency_survives_requests_slowed_by_something_else(synth: Any) -> None:
    """Eight quotes wait 250 ms of their 260 on the carrier; two more wait as long but spent
    2 s in all (a blocked event loop, a starved CPU: the busy-machine demo). The total share
    is 40 %, the typical request's 96 %: still the carrier's slowness. An endpoint where only
    a few requests call a slow host is not dominated by it."""

    def fill(w: SegmentWriter) -> None:
        for i in range(10):
            w.request(
                "GET /quote",
                dur_ms=2000.0 if i < 2 else 260.0,
                calls=[call("http", "GET carrier.example/q", dur_ms=250.0,
                            host="carrier.example", status=200)],
            )  # fmt: skip
        for i in range(30):
            calls = [call("http", "GET slow.example/x", dur_ms=250.0, host="slow.example",
                          status=200)] if i < 6 else []  # fmt: skip
            w.request("GET /rarely-calls", dur_ms=260.0 if i < 6 else 200.0, calls=calls)

    store = synth(fill)
    assert stored(store) == {"GET /quote": (10, 10), "GET /rarely-calls": (30, 6)}
    [f] = [f for f in find(store, config=Config()) if f.kind == "upstream_latency"]
    assert f.endpoint == "GET /quote"
    assert f.evidence["share_of_endpoint_time"] == pytest.approx(2500 / 6080)
    assert f.evidence["median_share_of_request_time"] == pytest.approx(250 / 260)
    assert "typical request" in f.title


def test_many_fast_calls_to_a_host_are_not_upstream_latency(synth: Any) -> None:
    """25 avatar fetches of 2 ms each: most of the endpoint's time, but an N+1 of a fast
    upstream (n_plus_one's business), not a slow one."""

    def fill(w: SegmentWriter) -> None:
        for _ in range(20):
            calls = [
                call("http", "GET avatars.example/avatars/{id}", dur_ms=2.0, off_ms=2.0 * j,
                     host="avatars.example", status=200, site=None)
                for j in range(25)
            ]  # fmt: skip
            w.request("GET /team", dur_ms=55.0, calls=calls)

    store = synth(fill)
    assert stored(store) == {"GET /team": (20, 500)}
    assert [f for f in find(store, config=Config()) if f.kind == "upstream_latency"] == []
    # with the per-call floor lowered, the same traffic is reported
    tuned = Config()
    tuned.apply("upstream_latency.min_ms_per_call=1")
    [f] = [f for f in find(synth(fill), config=tuned) if f.kind == "upstream_latency"]
    assert f.endpoint == "GET /team" and f.count_per_request == 25


def test_outlier_tenant(synth: Any) -> None:
    def fill(w: SegmentWriter) -> None:
        for i in range(100):
            big = i % 10 == 0  # megacorp: 10 % of the requests
            w.request(
                "GET /orders",
                dur_ms=500.0 if big else 20.0,
                tenant="megacorp" if big else f"t{i % 3}",
                user=f"u{i % 30}",
            )
            # a balanced endpoint: no outlier
            w.request("GET /even", dur_ms=20.0 + (i % 7), tenant=f"t{i % 3}", user=f"u{i % 30}")

    found = find(synth(fill), config=Config())
    assert kinds_of(found) == [("outlier_tenant", "GET /orders")]  # and not its users again
    ev = found[0].evidence
    assert ev["tenant"] == "megacorp" and ev["dimension"] == "tenant"
    assert ev["request_share"] == pytest.approx(0.1)
    assert ev["endpoint_p95_ms_without_them"] == pytest.approx(20.0)
    assert ev["endpoint_p95_ms"] == pytest.approx(500.0)
    # the time beyond everyone else's average: 10 x (500 - 20)
    assert found[0].impact_ms_per_min == pytest.approx(4800.0)


def test_chatty_endpoint_but_not_for_an_n_plus_one(synth: Any, src: dict) -> None:
    def fill(w: SegmentWriter) -> None:
        for _ in range(5):
            many = [
                call(text=f"SELECT * FROM t{j} WHERE id = ?", dur_ms=1.0, ph=j) for j in range(40)
            ]
            w.request("GET /dashboard", dur_ms=50.0, calls=many)
            orders_request(w, src, 40, endpoint="GET /loop", dur_ms=1.0)

    found = find(synth(fill), config=Config())
    assert kinds_of(found) == [("chatty_endpoint", "GET /dashboard"), ("n_plus_one", "GET /loop")]
    chatty = next(f for f in found if f.kind == "chatty_endpoint")
    assert chatty.count_per_request == 40
    assert chatty.evidence["statements_per_request_median"] == 40


def test_large_request_body_only_when_size_drives_latency(synth: Any) -> None:
    def fill(w: SegmentWriter) -> None:
        for i in range(10):
            size = 400_000 + i * 100_000
            w.request("POST /notes", dur_ms=10 + size / 20_000, req_bytes=size)
            # large but flat: the time does not depend on the size
            w.request("POST /upload", dur_ms=30.0 + (i % 2), req_bytes=size)
            w.request("POST /small", dur_ms=10 + i, req_bytes=1000 + i * 100)

    [f] = find(synth(fill), config=Config())
    assert (f.kind, f.endpoint) == ("large_request_body", "POST /notes")
    assert f.evidence["correlation"] == pytest.approx(1.0)
    assert f.evidence["ms_per_mb"] == pytest.approx(50.0)


def test_endpoint_and_window_scope(synth: Any, src: dict) -> None:
    import time
    from datetime import timedelta

    old = time.time_ns() - 3 * 3600 * 10**9

    def fill(w: SegmentWriter) -> None:
        for _ in range(5):
            orders_request(w, src, 8, endpoint="GET /a")
            orders_request(w, src, 8, endpoint="GET /b")
        for _ in range(5):
            w.request(
                "GET /old",
                ts_ns=old,
                dur_ms=2000.0,
                calls=[call(text="SELECT slow()", dur_ms=1900.0)],
            )

    store = synth(fill)
    assert kinds_of(find(store, endpoint="GET /a", config=Config())) == [("n_plus_one", "GET /a")]
    assert ("slow_query", "GET /old") in kinds_of(find(store, config=Config()))
    recent = kinds_of(find(store, since=timedelta(hours=1), config=Config()))
    assert recent == [("n_plus_one", "GET /a"), ("n_plus_one", "GET /b")]


def test_ignore_a_finding_by_id(synth: Any, src: dict, tmp_path: Path) -> None:
    def fill(w: SegmentWriter) -> None:
        for _ in range(5):
            orders_request(w, src, 8, endpoint="GET /a")
            orders_request(w, src, 8, endpoint="GET /b")

    store = synth(fill)
    a, b = sorted(find(store, config=Config()), key=lambda f: f.endpoint)
    toml = tmp_path / "ps.toml"
    toml.write_text(f'[findings]\nignore = ["{a.id}"]\n')
    assert [f.id for f in find(store, config=load_config(str(toml)))] == [b.id]


# ---------------------------------------------------------------------------------- ids, config


def test_stable_id_is_deterministic_and_distinguishes_problems() -> None:
    a = stable_id("n_plus_one", "GET /x", ("db", "SELECT 1", "app/views.py", "f"))
    assert a == stable_id("n_plus_one", "GET /x", ("db", "SELECT 1", "app/views.py", "f"))
    assert len(a) == 12 and int(a, 16) >= 0
    assert a != stable_id("n_plus_one", "GET /y", ("db", "SELECT 1", "app/views.py", "f"))
    assert a != stable_id("repeated_query", "GET /x", ("db", "SELECT 1", "app/views.py", "f"))
    # in another process (another run), the same id
    code = (
        "from perfsleuth.analysis import stable_id; "
        "print(stable_id('n_plus_one', 'GET /x', ('db', 'SELECT 1', 'app/views.py', 'f')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a


def test_config_layers_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "x.toml"
    toml.write_text(
        "[findings]\nignore = ['abc']\n[findings.n_plus_one]\nmin_repeats = 8\n"
        "kinds = ['db']\n[findings.slow_query]\nenabled = false\n"
    )
    monkeypatch.setenv("PERFSLEUTH_CONFIG", str(toml))
    cfg = load_config(assignments=["n_plus_one.min_repeats=9", "outlier_tenant.min_ratio=3"])
    assert cfg.get("n_plus_one", "min_repeats") == 9  # --set beats the file
    assert cfg.get("n_plus_one", "kinds") == ["db"]
    assert cfg.get("outlier_tenant", "min_ratio") == 3.0
    assert cfg.enabled["slow_query"] is False and cfg.enabled["n_plus_one"] is True
    assert cfg.ignore == {"abc"}
    assert load_config(assignments=["n_plus_one.kinds=db,http"]).get("n_plus_one", "kinds") == [
        "db",
        "http",
    ]
    for bad, msg in [
        ("nope.x=1", "unknown detector 'nope'"),
        ("n_plus_one.x=1", "unknown setting n_plus_one.x"),
        ("n_plus_one.min_repeats=x", "invalid value 'x'"),
        ("slow_query.enabled=maybe", "invalid value 'maybe'"),
        ("n_plus_one", "use detector.name=value"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            load_config(assignments=[bad])
    toml.write_text("[findings\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config()


def test_every_detector_has_documented_defaults() -> None:
    from perfsleuth.analysis.config import DEFAULTS

    assert set(DETECTORS) == set(DEFAULTS)
    assert set(DETECTORS) >= {
        "n_plus_one",
        "repeated_query",
        "oversized_result",
        "slow_query",
        "upstream_latency",
        "outlier_tenant",
        "chatty_endpoint",
        "large_request_body",
    }


# ---------------------------------------------------------------------------------- loops

LOOPS_SRC = textwrap.dedent(
    """\
    import asyncio


    def plain(db):
        db.q()  # plain
        for x in db.q():  # for-header
            db.q(x)  # for-body
        else:
            db.q()  # for-else
        while db.q():  # while-test
            db.q()  # while-body
        ys = [db.q(y)  # comp-elt
              for y in db.q()]  # comp-iter
        d = {k: db.q(k) for k in ys}  # dict-comp
        return ys, d


    def outer(db):
        for x in range(3):
            def inner():
                return db.q()  # nested-def
            inner()  # calls-nested
        return lambda: db.q()  # lambda


    async def aloop(db):
        async for x in db.stream():
            await db.q(x)  # async-for


    for i in range(2):
        print(i)  # module-loop
    """
)


@pytest.fixture
def loop_src(tmp_path: Path) -> tuple[str, Callable[[str], int]]:
    path = tmp_path / "loops_src.py"
    path.write_text(LOOPS_SRC)
    return str(path), lambda mark: line_of(str(path), f"# {mark}")


@pytest.mark.parametrize(
    ("mark", "expected"),
    [
        ("plain", False),
        ("for-header", False),  # the iterable is evaluated once
        ("for-body", True),
        ("for-else", False),
        ("while-test", True),
        ("while-body", True),
        ("comp-elt", True),
        ("comp-iter", False),  # the first iterable of a comprehension runs once
        ("dict-comp", True),
        ("nested-def", False),  # its own function: no loop inside it
        ("calls-nested", True),
        ("lambda", False),
        ("async-for", True),
        ("module-loop", True),
    ],
)
def test_in_loop(loop_src: tuple[str, Callable[[str], int]], mark: str, expected: bool) -> None:
    path, line = loop_src
    assert loops.in_loop(path, line(mark)) is expected


def test_in_loop_unreadable_sources(tmp_path: Path) -> None:
    assert loops.in_loop(str(tmp_path / "missing.py"), 3) is None
    assert loops.in_loop("<frozen runpy>", 3) is None
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    assert loops.in_loop(str(bad), 1) is None
    ok = tmp_path / "ok.py"
    ok.write_text("x = 1\n")
    assert loops.in_loop(str(ok), 99) is None  # past the end: not this file's version


def test_relative_paths_and_edits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app_dir = tmp_path / "proj" / "app"
    app_dir.mkdir(parents=True)
    f = app_dir / "views.py"
    f.write_text("def v(db):\n    for x in db:\n        db.q(x)\n")
    # relative to our working directory
    monkeypatch.chdir(tmp_path / "proj")
    assert loops.in_loop("app/views.py", 3) is True
    # relative to a root (the directory of an absolute path recorded for the same app)
    monkeypatch.chdir(tmp_path)
    assert loops.in_loop("app/views.py", 3) is None
    assert loops.in_loop("app/views.py", 3, roots=[str(tmp_path / "proj")]) is True
    assert loops.source_line("app/views.py", 3, roots=[str(tmp_path / "proj")]) == "db.q(x)"
    # an edited file is parsed again
    f.write_text("def v(db):\n    db.q()\n    db.q()\n")
    os.utime(f, ns=(10**18, 10**18))
    assert loops.in_loop(str(f), 3) is False


def test_gc_pressure_is_not_a_few_requests_that_met_a_full_collection(synth: Any) -> None:
    """Two requests of twenty on a page that allocates little met a 60 ms full collection of
    the service's heap (16.7 % of the page's time, 6 ms a request on average): luck, not the
    page's pressure. A page whose every request collects 5 ms of its 30 is reported."""
    ms = 1_000_000

    def fill(w: SegmentWriter) -> None:
        for i in range(20):
            unlucky = i in (3, 11)
            w.request("GET /clean", dur_ms=90.0 if unlucky else 30.0,
                      gc_ns=60 * ms if unlucky else 0, gc_count=1 if unlucky else 0,
                      trace_id=f"{0xC000 + i:016x}")  # fmt: skip
            w.request("GET /allocates", dur_ms=30.0, gc_ns=5 * ms, gc_count=2)

    store = synth(fill)
    assert store.query("SELECT count(*) AS n FROM requests WHERE gc_ms > 0")[0]["n"] == 22
    found = [f for f in find(store, config=Config()) if f.kind == "gc_pressure"]
    assert [f.endpoint for f in found] == ["GET /allocates"]
    assert found[0].evidence["gc_share_without_costliest"] == pytest.approx(5 / 30)
    lax = Config()
    lax.apply("gc_pressure.trim_share=0")  # counting every request, /clean was reported
    lax.apply("gc_pressure.min_requests=1")
    lax_found = {f.endpoint: f for f in find(store, config=lax) if f.kind == "gc_pressure"}
    assert set(lax_found) == {"GET /allocates", "GET /clean"}
    # its examples are the requests that collected, on every engine (a request without a
    # collection has no gc_ms: DuckDB ranked those NULLs first, ClickHouse last)
    assert sorted(lax_found["GET /clean"].example_trace_ids) == [f"{0xC003:016x}", f"{0xC00B:016x}"]


def test_repeated_query_must_cost_something(synth: Any) -> None:
    """A 0.05 ms read repeated twice in a 50 ms page (0.1 % of it: Wagtail's admin has a dozen
    such genuine duplicates) is no finding; a 2 ms read repeated twice is (4 ms a request)."""

    def fill(w: SegmentWriter) -> None:
        for _ in range(10):
            for ep, ms in (("GET /cheap", 0.05), ("GET /dear", 2.0)):
                w.request(ep, dur_ms=50.0, calls=[
                    call(text="SELECT * FROM site WHERE id = ?", dur_ms=ms, ph=1, off_ms=k)
                    for k in range(3)
                ])  # fmt: skip

    store = synth(fill)
    assert store.query("SELECT count(*) AS n FROM calls")[0]["n"] == 60
    assert kinds_of(find(store, config=Config())) == [("repeated_query", "GET /dear")]
    lax = Config()
    lax.apply("repeated_query.min_time_share=0")
    lax.apply("repeated_query.min_ms_per_request=0")
    assert kinds_of(find(store, config=lax)) == [
        ("repeated_query", "GET /cheap"),
        ("repeated_query", "GET /dear"),
    ]
