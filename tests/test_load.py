"""`perfsleuth load`: traffic sources, target checks, the verdict's statistics, the agent's
load tags, and an A/B run between two versions of a Flask app under `perfsleuth run` (one with
a planted N+1): the right verdict, the asked rate kept, and the targets' data splitting by side.

App: tests/apps/load_app.py (LOAD_APP_VERSION=nplus1 plants the N+1 on GET /orders).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.analysis import load as ld
from perfsleuth.store.duckdb_store import DuckDBStore
from test_run_servers import gunicorn, launched
from test_startup import ui_server
from test_ui import SHOTS, TOKEN, browser, fmt_ms, wait_ready  # noqa: F401  (fixtures)
from test_ui import page as page


def cli(data: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "perfsleuth", *args, "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sql(data: Path, query: str) -> list[dict[str, Any]]:
    res = cli(data, "sql", query, "--json")
    assert res.returncode == 0, res.stderr
    rows: list[dict[str, Any]] = json.loads(res.stdout)
    return rows


# ------------------------------------------------------------------------------- statistics


def test_verdicts_find_the_shifted_endpoint_and_no_other() -> None:
    for seed in range(10):
        rng = random.Random(seed)

        def lat(base: float, n: int = 80, rng: random.Random = rng) -> list[float]:
            return [base * rng.lognormvariate(0, 0.3) for _ in range(n)]

        samples = {f"GET /e{i}": {"a": lat(10), "b": lat(10)} for i in range(4)}
        samples["GET /slow"] = {"a": lat(10), "b": lat(14)}
        samples["GET /rare"] = {"a": lat(10, 3), "b": lat(30, 3)}
        rows = {r["endpoint"]: r for r in ld.verdicts(samples)}
        assert rows["GET /slow"]["verdict"] == "slower", (seed, rows["GET /slow"])
        assert rows["GET /slow"]["significant"] and rows["GET /slow"]["p95_change"] > 0
        assert rows["GET /rare"]["verdict"] == "too_few"
        for i in range(4):
            assert rows[f"GET /e{i}"]["verdict"] == "same", (seed, rows[f"GET /e{i}"])
        line = ld.verdict_line(list(rows.values()))
        assert line.startswith("b is slower on 1 endpoint: GET /slow p"), line
        assert line.endswith("unchanged on 4 endpoints, too few requests on 1 endpoint"), line


# ------------------------------------------------------------------------- sources, targets


def test_targets_must_be_loopback_unless_allowed() -> None:
    assert ld.check_target("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert ld.check_target("http://localhost:8000") == "http://localhost:8000"
    assert ld.check_target("http://[::1]:8000") == "http://[::1]:8000"
    with pytest.raises(ld.LoadError, match="--allow-remote"):
        ld.check_target("http://10.1.2.3:8000")
    assert ld.check_target("http://10.1.2.3:8000", allow_remote=True) == "http://10.1.2.3:8000"
    with pytest.raises(ld.LoadError, match="http"):
        ld.check_target("ftp://127.0.0.1/")


def test_sources_keep_path_and_query_only(tmp_path: Path) -> None:
    har = tmp_path / "t.har"
    har.write_text(
        json.dumps(
            {
                "log": {
                    "entries": [
                        {
                            "request": {
                                "method": "post",
                                "url": "https://shop.example.com/cart?x=1",
                                "headers": [
                                    {"name": "Host", "value": "shop.example.com"},
                                    {"name": "Content-Type", "value": "application/json"},
                                    {"name": "Authorization", "value": "[redacted]"},
                                ],
                                "postData": {"text": '{"sku": 3}'},
                            }
                        }
                    ]
                }
            }
        )
    )
    (item,) = ld.from_har(har)
    assert item == ld.Item(
        "POST", "/cart?x=1", "POST /cart", (("Content-Type", "application/json"),), b'{"sku": 3}'
    )
    urls = tmp_path / "urls.txt"
    urls.write_text("# comment\n\nhttp://h:1/a?q=2\nDELETE /b/7\n")
    assert [(i.method, i.path, i.endpoint) for i in ld.from_urls(urls)] == [
        ("GET", "/a?q=2", "GET /a"),
        ("DELETE", "/b/7", "DELETE /b/7"),
    ]
    with pytest.raises(ld.LoadError, match="HAR"):
        ld.from_har(urls)
    cap = {
        "method": "GET",
        "url": "http://127.0.0.1:9/orders/5?full=1",
        "endpoint": "GET /orders/{id}",
        "headers": json.dumps([["X-Tenant", "t1"], ["Cookie", "[redacted]"], ["Host", "x"]]),
        "body_b64": "",
        "body_truncated": False,
    }
    assert ld.from_captures([cap, {**cap, "body_truncated": True}]) == [
        ld.Item("GET", "/orders/5?full=1", "GET /orders/{id}", (("X-Tenant", "t1"),))
    ]


def test_cli_refuses_a_remote_target(tmp_path: Path) -> None:
    urls = tmp_path / "urls.txt"
    urls.write_text("/health\n")
    res = cli(tmp_path, "load", "--urls", str(urls), "--a", "http://192.0.2.1:80", "--rate", "5")
    assert res.returncode != 0 and "--allow-remote" in res.stderr


# ------------------------------------------------------------------------------ agent tags


def test_wsgi_request_with_the_load_header_is_tagged(captured: Any) -> None:
    from perfsleuth.agent.frameworks.wsgi import PerfsleuthWSGI

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    wrapped = PerfsleuthWSGI(app)
    for path, header in (("/a", "run42;b"), ("/b", None)):
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "CONTENT_LENGTH": ""}
        if header:
            environ["HTTP_X_PERFSLEUTH_LOAD"] = header
        assert b"".join(wrapped(environ, lambda *a: None)) == b"ok"
    tagged, plain = captured()
    assert tagged["path"] == "/a" and tagged["tags"] == {"load_run": "run42", "load_side": "b"}
    assert plain["path"] == "/b" and "tags" not in plain


# ------------------------------------------------------------------------------ A/B run


# every request captured, for the replay from captures: on both sides, since capturing costs
# time (with it on a alone, b came out faster on the endpoints the versions share)
CAPTURE_ALL = {"PERFSLEUTH_CAPTURE_SAMPLE": "1", "PERFSLEUTH_CAPTURE_SAMPLE_PER_MIN": "100000"}


def test_ab_run_between_two_app_versions(tmp_path: Path, page: Any) -> None:
    data = tmp_path / "data"
    urls = tmp_path / "urls.txt"
    urls.write_text("/orders\n/health\n/products/3\n")
    # four sync workers, one request each: a side's slow endpoint neither queues its other
    # endpoints behind it nor makes them wait for its worker's GIL (with threads in two
    # workers, GET /health came out "slower" on b though only /orders changed); 30 ticks a
    # second, not 50: at 50, in a full CI run (a browser up, both sides' agents capturing
    # every request), one of b's unchanged endpoints once came out "slower" too, its
    # requests sharing the two cores and their workers' GIL with b's 400-query /orders and
    # the writers encoding them
    cmd = gunicorn("load_app:app", 4)
    with (
        launched(tmp_path, data, cmd, service="shop-a", ready="/health", **CAPTURE_ALL) as a,
        launched(
            tmp_path,
            data,
            cmd,
            service="shop-b",
            ready="/health",
            LOAD_APP_VERSION="nplus1",
            **CAPTURE_ALL,
        ) as b,
    ):
        res = cli(
            data,
            "load", "--urls", str(urls),
            "--a", f"http://127.0.0.1:{a.port}", "--b", f"http://127.0.0.1:{b.port}",
            "--rate", "30", "--requests", "240", "--warmup", "15", "--seed", "7", "--json",
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        report = json.loads(res.stdout)
        # the asked rate, from the run's own counts and clock
        assert report["measured_ticks"] == 240
        achieved = (report["measured_ticks"] - 1) / report["send_window_s"]
        assert 0.9 <= achieved / 30 <= 1.1, report
        assert report["achieved_rate"] == pytest.approx(achieved, rel=1e-3)
        for side in ("a", "b"):
            assert report["sides"][side]["count"] == 240
            assert report["sides"][side]["errors"] == 0
        rows = {r["endpoint"]: r for r in report["endpoints"]}
        assert set(rows) == {"GET /orders", "GET /health", "GET /products/3"}
        assert rows["GET /orders"]["verdict"] == "slower", rows["GET /orders"]
        assert rows["GET /orders"]["significant"] and rows["GET /orders"]["p50_change"] > 0.2
        assert rows["GET /orders"]["a"]["count"] == rows["GET /orders"]["b"]["count"] == 80
        for ep in ("GET /health", "GET /products/3"):
            assert rows[ep]["verdict"] in ("same", "too_few"), rows
        assert report["verdict"].startswith("b is slower on 1 endpoint: GET /orders p"), report
        run_id = report["run_id"]

        # The targets tagged every request with the run and its side: the call-level data
        # split by side says why b is slower (one items query per order).
        want = 2 * (240 + 15)
        deadline = time.monotonic() + 30
        while True:
            tagged = sql(
                data,
                "SELECT count(*) AS n FROM attributes WHERE kind = 'tag' AND key = 'load_run' "
                f"AND value = '{run_id}'",
            )[0]["n"]
            if tagged >= want or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert tagged == want
        by_side = sql(
            data,
            "SELECT r.service, t.value AS side, count(*) AS n, avg(r.db_calls) AS db_calls "
            "FROM requests r JOIN attributes t ON t.trace_id = r.trace_id "
            "AND t.kind = 'tag' AND t.key = 'load_side' "
            "WHERE r.endpoint = 'GET /orders' GROUP BY 1, 2 ORDER BY 1",
        )
        assert [(r["service"], r["side"]) for r in by_side] == [("shop-a", "a"), ("shop-b", "b")]
        assert by_side[0]["db_calls"] == 2 and by_side[1]["db_calls"] == 401
        # compare on the targets' own data gives the same verdict and says what moved with it
        res = cli(data, "compare", "--by", "tag:load_side", "--a", "a", "--b", "b", "--json")
        assert res.returncode == 0, res.stderr
        served = {r["endpoint"]: r for r in json.loads(res.stdout)["endpoints"]}
        assert served["GET /orders"]["verdict"] == "slower", served["GET /orders"]
        assert served["GET /orders"]["moved"]["db_calls"]["change"] == 399
        assert served["GET /health"]["moved"]["db_calls"]["change"] == 0

        # the captured GET /orders requests, replayed to a alone
        res = cli(
            data,
            "load", "--endpoint", "GET /orders", "--a", f"http://127.0.0.1:{a.port}",
            "--rate", "20", "--requests", "30", "--warmup", "0", "--json",
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        replayed = json.loads(res.stdout)
        assert replayed["sides"]["a"]["count"] == 30 and replayed["sides"]["a"]["errors"] == 0
        assert [(e["endpoint"], e["count"]) for e in replayed["endpoints"]] == [("GET /orders", 30)]

    # The UI's Load page shows the run: its verdict line and the table's verdicts and numbers.
    with ui_server(data) as base:
        page.goto(f"{base}/?token={TOKEN}#/load?run={report['name']}")
        wait_ready(page, "load")
        assert page.locator(".verdict-line").inner_text().strip() == report["verdict"]
        for ep, r in rows.items():
            tr = page.locator(f".load-table tr[data-endpoint='{ep}']")
            assert tr.get_attribute("data-verdict") == r["verdict"]
            assert tr.locator("td[data-col='p50_b']").inner_text().strip() == fmt_ms(
                r["b"]["p50_ms"]
            )
        assert "30/s" in page.locator(".load-rate").inner_text()
        page.screenshot(path=str(SHOTS / "load.png"), full_page=True)


# ------------------------------------------------------------------------- pacing and bounds


@contextmanager
def plain_server() -> Iterator[str]:
    """A stdlib threaded HTTP server answering 200 to GET (a real target, no agent)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_concurrency_mode_progress_and_time_bound() -> None:
    items = [ld.Item("GET", "/x", "GET /x"), ld.Item("GET", "/y?q=1", "GET /y")]
    with plain_server() as url:
        seen: list[ld.Progress] = []
        plan = ld.Plan({"a": url}, items, concurrency=4, requests=40, warmup=4, seed=1)
        report = ld.run(plan, seen.append)
        assert report["mode"] == "concurrency" and report["ticks"] == 44
        assert report["sides"]["a"]["count"] == 40 and report["sides"]["a"]["errors"] == 0
        assert {e["endpoint"]: e["count"] for e in report["endpoints"]} == {
            "GET /x": 20,
            "GET /y": 20,
        }
        final = seen[-1]
        assert final.done == 44 and final.sides["a"]["count"] == 40
        assert final.sides["a"]["p50_ms"] is not None and final.sides["a"]["errors"] == 0

        # bounded in time: 1 s at 20/s stops after about 20 of the 1,000 asked
        plan = ld.Plan({"a": url}, items, rate=20, requests=1000, duration=1.0, warmup=0)
        report = ld.run(plan)
        assert 15 <= report["ticks"] <= 21, report["ticks"]
        assert report["elapsed_s"] < 5


@pytest.mark.parametrize("speedups", ["1", "0"])
def test_asgi_request_with_the_load_header_is_tagged(tmp_path: Path, speedups: str) -> None:
    """An ASGI app (the header list is read by the writer, in C or in Python) tags a request
    carrying perfsleuth load's header, and only that one."""
    data = tmp_path / "data"
    code = textwrap.dedent(
        """
        import asyncio, sys
        import httpx
        from fastapi import FastAPI
        import perfsleuth.agent as ps

        ps.start(sys.argv[1], service="asgi-load")
        api = FastAPI()

        @api.get("/a")
        def a():
            return {"ok": True}

        async def main():
            transport = httpx.ASGITransport(app=ps.asgi(api))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                await c.get("/a", headers={"X-Perfsleuth-Load": "run7;a", "X-User": "u1"})
                await c.get("/a", headers={"X-User": "u2"})

        asyncio.run(main())
        ps.flush()
        """
    )
    env = {**os.environ, "PERFSLEUTH_SPEEDUPS": speedups}
    out = subprocess.run(
        [sys.executable, "-c", code, str(data)], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    with DuckDBStore(str(data)) as store:
        store.ingest()
        rows = store.query(
            "SELECT r.user, t.key, t.value FROM requests r LEFT JOIN attributes t"
            " ON t.trace_id = r.trace_id AND t.kind = 'tag' ORDER BY r.user, t.key"
        )
    assert [(r["user"], r["key"], r["value"]) for r in rows] == [
        ("u1", "load_run", "run7"),
        ("u1", "load_side", "a"),
        ("u2", None, None),
    ]
