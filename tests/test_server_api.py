"""The UI server's JSON API on real data: the demo's apps under the agent (see the
``demo_data`` fixture), ingested by the server itself; every endpoint, bad input, the token,
the SQL limits, and continuous ingest of a spool that grows while the server runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import store_engines
from perfsleuth.analysis.findings import find
from perfsleuth.demo import ENDPOINTS
from perfsleuth.server import create_app
from perfsleuth.store.duckdb_store import DuckDBStore
from service_wide import gc_pressure_data

N1 = "GET /customers/{customer_id}/orders"
SINCE = "24h"


@pytest.fixture(scope="module")
def data(demo_data: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    # A copy: the server opens the store for writing (it ingests), other tests read the demo.
    d = str(tmp_path_factory.mktemp("api") / "data")
    shutil.copytree(demo_data, d)
    return d


@pytest.fixture(scope="module")
def client(data: str, store_engine: str) -> Iterator[TestClient]:
    # on each engine (tests/store_engines.py): on chDB the app opens a copy of the demo's
    # store (the app is made once serving() is entered)
    with (
        store_engines.serving(store_engine, data),
        TestClient(create_app(data, ingest_every=0, sql_time_limit=2.0)) as c,
    ):
        yield c


def get(client: TestClient, path: str, **params: Any) -> Any:
    r = client.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_openapi_lists_the_api(client: TestClient) -> None:
    spec = get(client, "/api/openapi.json")
    paths = set(spec["paths"])
    for p in (
        "/api/overview",
        "/api/endpoint",
        "/api/calltree",
        "/api/profile",
        "/api/traces",
        "/api/traces/{trace_id}",
        "/api/findings",
        "/api/findings/{finding_id}",
        "/api/sql",
        "/api/status",
    ):
        assert p in paths


def test_overview_matches_store_top(client: TestClient, data: str) -> None:
    ov = get(client, "/api/overview", since=SINCE)
    names = {r["endpoint"] for r in ov["endpoints"]}
    assert set(ENDPOINTS) <= names
    assert ov["totals"]["requests"] == sum(r["count"] for r in ov["endpoints"])
    assert abs(sum(r["time_share"] for r in ov["endpoints"]) - 1.0) < 1e-9
    # the busiest endpoint by time leads, and its numbers are store.top's
    first = ov["endpoints"][0]
    assert first["time_share"] == max(r["time_share"] for r in ov["endpoints"])
    # P95 over time: one series per top endpoint (the eight busiest by time, in the table's
    # order), aligned with x, with values where the endpoint had requests
    p95 = ov["p95"]
    top = [r["endpoint"] for r in ov["endpoints"][:8]]
    assert [s["endpoint"] for s in p95["series"]] == top
    assert all(len(s["values"]) == len(p95["x"]) for s in p95["series"])
    assert all(max(v for v in s["values"] if v is not None) > 0 for s in p95["series"])
    # throughput adds up to the total; the slow counts are counts of requests over 1/2/5 s
    assert sum(ov["throughput"]["requests"]) == ov["totals"]["requests"]
    slow = ov["slow"]
    assert slow["thresholds"] == [1000, 2000, 5000]
    assert [t["threshold_ms"] for t in slow["totals"]] == [1000, 2000, 5000]
    over1 = client.post(
        "/api/sql",
        json={"query": "SELECT count(*) FROM requests WHERE duration_ms > 1000"},
    ).json()["rows"][0][0]
    assert slow["totals"][0]["now"] == over1
    assert slow["totals"][0]["week_ago"] == 0  # the demo has no data a week ago
    assert len(slow["week_ago"]["1000"]) == len(slow["x"])


def test_endpoint_detail(client: TestClient) -> None:
    d = get(client, "/api/endpoint", name=N1, since=SINCE)
    assert d["summary"]["endpoint"] == N1
    assert d["summary"]["db_calls_per_request"] > 10  # the N+1
    pc = d["percentiles"]
    assert (
        len(pc["p95"]) == len(pc["x"]) and sum(c or 0 for c in pc["count"]) == d["summary"]["count"]
    )
    assert sum(b["count"] for b in d["histogram"]) == d["summary"]["count"]
    assert all(b["lo_ms"] < b["hi_ms"] for b in d["histogram"])
    # the N+1's statement: the one run most often per request (which statement costs the most
    # time depends on the machine's load)
    fps = d["fingerprints"]
    assert fps == sorted(fps, key=lambda r: -(r["total_ms"] or 0))
    loop = max(fps, key=lambda r: r["calls_per_request"] or 0)
    assert "order_items" in loop["statement"] and loop["calls_per_request"] > 10
    slowest = d["slowest"]
    assert slowest and slowest == sorted(slowest, key=lambda r: -r["duration_ms"])
    assert {t["name"] for t in d["tenants"]} >= {"megacorp"}
    assert d["users"]
    # the shipping quote waits for the upstream carrier: it is an upstream host
    ship = get(client, "/api/endpoint", name="GET /shipping/quote", since=SINCE)
    assert ship["hosts"] and ship["hosts"][0]["calls"] > 0


def test_calltree_profile_and_findings_of_an_endpoint(client: TestClient) -> None:
    tree = get(client, "/api/calltree", endpoint=N1, since=SINCE)
    assert tree["name"] == N1 and tree["calls"] > 0
    names = []

    def walk(n: dict[str, Any]) -> None:
        names.append(n["name"])
        for c in n["children"]:
            walk(c)

    walk(tree)
    assert any("customer_orders" in n for n in names)
    prof = get(client, "/api/profile", endpoint="GET /search", since=SINCE)
    assert prof["samples"] > 0 and prof["tree"]["children"]
    assert any(t["function"] == "_edit_distance" for t in prof["top"])
    # findings of one endpoint: those of the whole list for that endpoint; a service-wide
    # finding's "<service>" (cpu_starved on a busy machine) too
    everything = get(client, "/api/findings", since=SINCE)
    assert everything
    endpoints = {everything[0]["endpoint"], N1} | {
        f["endpoint"] for f in everything if f["endpoint"] == "<service>"
    }
    for ep in endpoints:
        mine = get(client, "/api/findings", endpoint=ep, since=SINCE)
        assert [f["id"] for f in mine] == [f["id"] for f in everything if f["endpoint"] == ep]


def test_findings_and_explain(client: TestClient, data: str) -> None:
    """The API lists what the detectors find (which planted problems a 6-second demo on a busy
    machine shows is test_detectors' business), ranked, each with its evidence."""
    found = get(client, "/api/findings", since=SINCE)
    with DuckDBStore(data, read_only=True) as store:
        expected = [f.to_dict() for f in find(store, since=timedelta(hours=24))]
    assert [f["id"] for f in found] == [f["id"] for f in expected] and found
    impacts = [f["impact_ms_per_min"] for f in found]
    assert impacts == sorted(impacts, reverse=True)
    with_site = next(f for f in found if f["callsite"])
    one = get(client, f"/api/findings/{with_site['id'][:8]}", since=SINCE)
    assert one["id"] == with_site["id"] and one["evidence"] and one["example_trace_ids"]
    assert one["source_line"]  # the line of code, read from the source file
    r = client.get("/api/findings/ffffffffffff", params={"since": SINCE})
    assert r.status_code == 404 and "no finding" in r.json()["error"]


def test_traces_and_trace(client: TestClient) -> None:
    rows = get(client, "/api/traces", endpoint=N1, since=SINCE, slowest=3)
    assert len(rows) == 3
    t = get(client, f"/api/traces/{rows[0]['trace_id'][:10]}")
    assert t["trace_id"] == rows[0]["trace_id"] and t["endpoint"] == N1
    assert len(t["calls"]) == t["db_calls"] > 10
    assert all(c["offset_ms"] is not None for c in t["calls"])
    assert any(c["site"] and c["site"]["function"] == "customer_orders" for c in t["calls"])
    # a slow search request has its stack samples inline
    search = get(client, "/api/traces", endpoint="GET /search", since=SINCE, slowest=1)[0]
    ts = get(client, f"/api/traces/{search['trace_id']}")
    assert ts["samples"] == len(ts["stack_samples"]) > 0
    assert ts["stack_samples"][0]["stack"]
    assert ts["profile"]["value"] == ts["samples"]  # its own flame graph
    # a request that blocked the event loop (the catalog import) has its blocker inline
    rows = client.post(
        "/api/sql",
        json={"query": "SELECT trace_id, duration_ms FROM blockers WHERE trace_id IS NOT NULL"},
    ).json()["rows"]
    assert rows, "the demo's catalog import blocks the loop: blockers expected"
    blocked = get(client, f"/api/traces/{rows[0][0]}")
    assert blocked["endpoint"] == "POST /catalog/import"
    assert rows[0][1] in [b["duration_ms"] for b in blocked["blocker_events"]]


def test_replay_command_of_a_captured_request(client: TestClient, data: str) -> None:
    from perfsleuth.analysis.replay import curl_for
    from perfsleuth.store.duckdb_store import DuckDBStore

    rows = client.post(
        "/api/sql", json={"query": "SELECT trace_id FROM captures ORDER BY body_size LIMIT 1"}
    ).json()["rows"]
    assert rows, "the demo's slow requests are captured"
    tid = rows[0][0]
    t = get(client, f"/api/traces/{tid}")
    with DuckDBStore(data, read_only=True) as store:
        expected = curl_for(store.capture(tid) or {})
    assert t["replay"]["curl"] == expected and t["replay"]["complete"]
    assert t["path"] in expected and t["replay"]["reason"]
    text = client.get(f"/api/traces/{tid}/curl")
    assert text.status_code == 200 and text.text == expected + "\n"
    # a request that was not captured: no replay, and the curl URL says why
    plain = client.post(
        "/api/sql",
        json={
            "query": "SELECT trace_id FROM requests WHERE trace_id NOT IN "
            "(SELECT trace_id FROM captures) LIMIT 1"
        },
    ).json()["rows"][0][0]
    assert get(client, f"/api/traces/{plain}")["replay"] is None
    r = client.get(f"/api/traces/{plain}/curl")
    assert r.status_code == 404 and "not captured" in r.json()["error"]
    assert client.get("/api/traces/zzzz/curl").status_code == 404


def test_fleet(client: TestClient) -> None:
    """The hosts and services that sent requests (the UI's overview waits for it)."""
    f = get(client, "/api/fleet", since="all")
    assert f["sources"] and sum(s["requests"] for s in f["sources"]) > 0
    assert f["hosts"] == sorted({s["host"] for s in f["sources"]})


def test_sql(client: TestClient) -> None:
    r = client.post(
        "/api/sql",
        json={"query": "SELECT endpoint, count(*) AS n FROM requests GROUP BY 1 ORDER BY 1"},
    )
    body = r.json()
    assert r.status_code == 200 and body["columns"] == ["endpoint", "n"]
    assert {row[0] for row in body["rows"]} >= set(ENDPOINTS) and not body["truncated"]
    capped = client.post("/api/sql", json={"query": "SELECT * FROM requests", "limit": 5}).json()
    assert len(capped["rows"]) == 5 and capped["truncated"]
    # timestamps and lists come back as JSON
    one = client.post("/api/sql", json={"query": "SELECT ts, [1, 2] AS l FROM requests LIMIT 1"})
    assert one.status_code == 200 and isinstance(one.json()["rows"][0][0], str)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("DELETE FROM requests", "only read-only queries"),
        ("SELECT * FROM no_such_table", "no_such_table"),
        ("SELEC 1", "syntax"),
        ("SELECT 1; SELECT 2", "one statement"),
        ("", "empty"),
        ("SELECT * FROM read_csv('/etc/passwd')", "disabled"),
    ],
)
def test_bad_sql(client: TestClient, query: str, message: str) -> None:
    r = client.post("/api/sql", json={"query": query})
    assert r.status_code == 400, r.text
    assert message.lower() in r.json()["error"].lower()


def test_sql_time_limit(client: TestClient, store_engine: str) -> None:
    if store_engine != "duckdb":
        pytest.skip("a DuckDB query (range()); ClickHouse stops at max_execution_time")
    slow = (
        "SELECT count(*) FROM range(200000) a, range(200000) b "
        "WHERE (a.range * 7 + b.range) % 1000003 = 5"
    )
    t0 = time.perf_counter()
    r = client.post("/api/sql", json={"query": slow})
    assert r.status_code == 400 and "longer than 2 s" in r.json()["error"]
    assert time.perf_counter() - t0 < 30
    # the connection still works afterwards
    ok = client.post("/api/sql", json={"query": "SELECT 1 AS x"})
    assert ok.status_code == 200 and ok.json()["rows"] == [[1]]


@pytest.mark.parametrize(
    ("path", "params", "status", "message"),
    [
        ("/api/endpoint", {"name": "GET /nope", "since": SINCE}, 404, "unknown endpoint"),
        ("/api/endpoint", {"name": "GET /serch", "since": SINCE}, 404, "GET /search"),
        ("/api/endpoint", {"since": SINCE}, 400, "name"),
        ("/api/overview", {"since": "yesterday"}, 400, "invalid since"),
        ("/api/overview", {"since": "0m"}, 400, "invalid since"),
        ("/api/findings", {"since": "-1h"}, 400, "invalid since"),
        ("/api/calltree", {"endpoint": N1, "kind": "gpu"}, 400, "kind"),
        ("/api/calltree", {"endpoint": "GET /nope"}, 404, "unknown endpoint"),
        ("/api/profile", {"endpoint": "GET /nope"}, 404, "unknown endpoint"),
        ("/api/traces", {"endpoint": "GET /nope"}, 404, "unknown endpoint"),
        ("/api/traces", {"slowest": "0"}, 400, "slowest"),
        ("/api/traces/zzzz", {}, 404, "no trace"),
        ("/api/nothing-here", {}, 404, "no such api path"),
    ],
)
def test_bad_input(
    client: TestClient, path: str, params: dict[str, str], status: int, message: str
) -> None:
    r = client.get(path, params=params)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == status and message.lower() in body["error"].lower()


def test_token(data: str) -> None:
    with TestClient(create_app(data, token="s3cret", ingest_every=0)) as c:
        missing = c.get("/api/overview")
        assert missing.status_code == 401 and "token" in missing.json()["error"]
        wrong = c.get("/api/overview", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403 and "wrong token" in wrong.json()["error"]
        assert c.get("/api/openapi.json").status_code == 401
        assert c.post("/api/sql", json={"query": "SELECT 1"}).status_code == 401
        ok = c.get("/api/overview", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/api/status", params={"token": "s3cret"}).status_code == 200
        assert c.get("/api/status", params={"token": "s3cre"}).status_code == 403


def test_the_ui_needs_a_token_off_loopback(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "perfsleuth", "ui", "--data", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PERFSLEUTH_TOKEN"},
    )
    assert r.returncode == 2 and "--token" in r.stderr


APP = textwrap.dedent(
    """
    import sqlite3, sys, time
    import perfsleuth.agent as ps
    from perfsleuth.agent import recorder

    assert ps.start(sys.argv[1], service="grow", instrument=False)
    db = sqlite3.connect(":memory:")
    for i in range(int(sys.argv[2])):
        req = recorder.begin("web", "GET", "/grow")
        req.endpoint = "GET /grow"
        call = recorder.start_call("db", "sqlite", "select ?", (i,))
        db.execute("select ?", (i,)).fetchall()
        call.finish()
        req.status = 200
        recorder.end(req)
    ps.flush()
    """
)


def test_the_server_ingests_the_spool_as_it_grows(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    script = tmp_path / "app.py"
    script.write_text(APP)

    def count(c: TestClient) -> int:
        rows = get(c, "/api/overview", since="1h")["endpoints"]
        return sum(r["count"] for r in rows if r["endpoint"] == "GET /grow")

    def wait_for(c: TestClient, n: int) -> None:
        deadline = time.time() + 60
        while count(c) != n and time.time() < deadline:
            time.sleep(0.2)
        assert count(c) == n

    with TestClient(create_app(data, ingest_every=0.2)) as c:
        assert count(c) == 0
        for total in (7, 7 + 5):
            subprocess.run(
                [sys.executable, str(script), data, str(total - (0 if total == 7 else 7))],
                check=True,
                timeout=60,
            )
            wait_for(c, total)
        status = get(c, "/api/status")
        assert status["ingest"]["error"] is None and status["endpoints"] == 1


def test_cli_commands_run_beside_a_read_only_server(
    client: TestClient, data: str, store_engine: str
) -> None:
    """The demo serves its UI without ingest (read-only): the commands it suggests still work."""
    if store_engine == "chdb":
        pytest.skip("chDB serves one process at a time (a ClickHouse server: any number)")
    assert get(client, "/api/status")["endpoints"] > 0
    r = subprocess.run(
        [sys.executable, "-m", "perfsleuth", "top", "--data", data, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert '"GET /search"' in r.stdout


def test_findings_of_the_service(synth: Any) -> None:
    """A service-wide finding (here gc_pressure's: every endpoint pays about the same share of
    its time to collections of one big heap) names "<service>", not an endpoint: the API lists
    it for endpoint=<service> instead of answering 404 'unknown endpoint'."""
    data = gc_pressure_data(synth)
    with TestClient(create_app(data, ingest_every=0)) as c:
        everything = get(c, "/api/findings", since="all")
        service = [f["id"] for f in everything if f["endpoint"] == "<service>"]
        assert service, everything
        assert [f["id"] for f in get(c, "/api/findings", endpoint="<service>", since="all")] == (
            service
        )
        r = c.get("/api/findings", params={"endpoint": "GET /e", "since": "all"})
        assert r.status_code == 404 and "unknown endpoint 'GET /e'" in r.json()["error"]
