"""The web UI at scale: the overview API and the page in Chromium over 10M requests.

    python benchmarks/ui.py [--requests 10000000] [--days 8] [--data DIR] [--keep]

Builds DIR/perfsleuth.duckdb directly with SQL (ingest has its own benchmark): ``--requests``
requests spread evenly over the last ``--days`` days (so the overview's "a week earlier"
comparison has data), on 60 endpoints with a skewed (Zipf-like) mix, durations with a long
tail, 2% errors, 2,000 users and 20 tenants; two DB calls per request of the last day with call
sites and statements (for the endpoint page). Then it times, in one process:

- the overview API (``GET /api/overview``) for 1h, 24h, 7d and all, through the ASGI app (JSON
  included), best and median of 5;
- the endpoint API for the busiest endpoint (24h), and the findings API (24h: the detectors
  run once, then the server keeps their answer for 30 s);
- the overview page in headless Chromium (Debian's /usr/bin/chromium) until it is usable
  (tables and charts drawn), for 24h and 7d, 3 loads each.

Not a test: numbers depend on the machine. Targets: overview API < 1 s, page usable < 2 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import duckdb

from perfsleuth.store import schema
from perfsleuth.store.duckdb_store import DB_NAME

ENDPOINTS = 60
CHROMIUM = "/usr/bin/chromium"


def build(data: str, requests: int, days: int) -> None:
    os.makedirs(data, exist_ok=True)
    path = os.path.join(data, DB_NAME)
    if os.path.exists(path):
        os.remove(path)
    now = datetime.now(UTC).replace(tzinfo=None)
    start = now - timedelta(days=days)
    span_us = int((now - start).total_seconds() * 1_000_000)
    con = duckdb.connect(path)
    for t in schema.GLOBAL_TABLES:
        con.execute(schema.duckdb_create(t))
    # All requests first (ts spread evenly over the span), then one insert per day table.
    con.execute(
        f"""CREATE TEMP TABLE r AS SELECT
            TIMESTAMP '{start}' + to_microseconds(CAST(i * {span_us} // {requests} AS BIGINT))
                AS ts,
            printf('%016x', hash(i)) AS trace_id, e,
            -- a base per endpoint (2-200 ms), an exponential body and a Pareto tail
            (2 + (e * 37) % 200) * (0.3 - ln(random())) * CASE WHEN random() < 0.01
                THEN pow(random(), -0.7) ELSE 1 END AS duration_ms,
            random() < 0.02 AS failed, i
        FROM (SELECT i, floor(pow(random(), 2.2) * {ENDPOINTS})::INT AS e
              FROM range(0, {requests}) t(i))"""
    )
    day0 = start.date()
    days_list = [day0 + timedelta(days=k) for k in range((now.date() - day0).days + 1)]
    for d in days_list:
        for t in schema.EVENT_TABLES:
            con.execute(schema.duckdb_create(t, schema.day_table(t, d)))
        req = schema.quote(schema.day_table(schema.REQUESTS, d))
        con.execute(
            f"""INSERT INTO {req} BY NAME SELECT ts, trace_id, 'svc' AS service, 'h1' AS host,
                1 AS pid, 'web' AS kind, 'GET' AS method, 'GET /api/e' || e AS endpoint,
                '/api/e' || e AS path, CASE WHEN failed THEN 500 ELSE 200 END AS status,
                duration_ms, duration_ms * 0.3 AS cpu_ms, 200 AS req_bytes, 2000 AS resp_bytes,
                'u' || (i % 2000) AS "user", 't' || (i % 20) AS tenant, 2 AS db_calls,
                duration_ms * 0.4 AS db_ms, 0 AS http_calls, 0.0 AS http_ms, 0 AS cache_calls,
                0.0 AS cache_ms, 0 AS calls_dropped
            FROM r WHERE ts >= TIMESTAMP '{d}' AND ts < TIMESTAMP '{d + timedelta(days=1)}'"""
        )
    for t in schema.EVENT_TABLES:
        con.execute(schema.duckdb_view(t, days_list))
    # Code locations, stacks and statements for the calls of the last day.
    con.execute(
        """INSERT INTO locations SELECT i, 'app/views_' || (i % 30) || '.py', 10 + i % 400,
        'view_' || i, true FROM range(0, 200) t(i)"""
    )
    con.execute("INSERT INTO stacks SELECT s, [100 + s % 50, s] FROM range(0, 100) t(s)")
    con.execute(
        """INSERT INTO fingerprints SELECT i, 'db', 'SELECT',
        'SELECT * FROM table_' || i || ' WHERE id = ?' FROM range(0, 200) t(i)"""
    )
    last = days_list[-1]
    calls = schema.quote(schema.day_table(schema.CALLS, last))
    con.execute(
        f"""INSERT INTO {calls} BY NAME SELECT ts, trace_id, 'svc' AS service,
            'GET /api/e' || e AS endpoint, seq::INT AS seq, 'db' AS kind,
            'postgresql' AS system, (e * 2 + seq) % 200 AS fingerprint_id,
            seq * 2.0 AS offset_ms, duration_ms * 0.2 AS duration_ms, 1 AS rows,
            (e * 2 + seq) % 100 AS stack_id, (e * 2 + seq) % 100 AS site_id
        FROM r, range(0, 2) s(seq)
        WHERE ts >= TIMESTAMP '{last}' AND seq < 2"""
    )
    con.execute("DROP TABLE r")
    con.close()


def timed(fn: Callable[[], object], n: int) -> tuple[float, float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out), statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000_000)
    p.add_argument("--days", type=int, default=8)
    p.add_argument("--data", default=None, help="Directory (default: a temporary one).")
    p.add_argument("--keep", action="store_true", help="Keep the data directory.")
    p.add_argument("--no-browser", action="store_true", help="Only the API timings.")
    args = p.parse_args()
    data = args.data or tempfile.mkdtemp(prefix="perfsleuth-bench-ui-")
    t0 = time.perf_counter()
    build(data, args.requests, args.days)
    size = os.path.getsize(os.path.join(data, DB_NAME)) / 1e6
    print(
        f"built {args.requests:,} requests over {args.days} days in "
        f"{time.perf_counter() - t0:.1f} s ({size:,.0f} MB, {data})"
    )
    from fastapi.testclient import TestClient

    from perfsleuth.server import create_app

    try:
        with TestClient(create_app(data, ingest_every=0)) as c:

            def get(path: str, **params: str) -> object:
                r = c.get(path, params=params)
                assert r.status_code == 200, r.text
                return r.json()

            for since in ("1h", "24h", "7d", "all"):
                n = sum(r["count"] for r in get("/api/overview", since=since)["endpoints"])  # type: ignore[index]
                best, med = timed(lambda s=since: get("/api/overview", since=s), 5)
                print(
                    f"overview API  since={since:<4} {n:>11,} requests  "
                    f"best {best:5.2f} s  median {med:5.2f} s"
                )
            top = get("/api/endpoints", since="24h")[0]["endpoint"]  # type: ignore[index]
            best, med = timed(lambda: get("/api/endpoint", name=top, since="24h"), 3)
            print(f"endpoint API  since=24h  {top}  best {best:5.2f} s  median {med:5.2f} s")
            t = time.perf_counter()
            n = len(get("/api/findings", since="24h"))  # type: ignore[arg-type]
            first = time.perf_counter() - t
            best, _ = timed(lambda: get("/api/findings", since="24h"), 3)
            print(
                f"findings API since=24h  {n} findings  first {first:5.2f} s  "
                f"then (cached for 30 s) {best:5.3f} s"
            )
        if not args.no_browser:
            browser_timings(data)
    finally:
        if not args.keep and args.data is None:
            shutil.rmtree(data, ignore_errors=True)


def browser_timings(data: str) -> None:
    import uvicorn
    from playwright.sync_api import sync_playwright

    from perfsleuth.cli.ui import free_port
    from perfsleuth.server import create_app
    from perfsleuth.server.app import STATIC_DIR

    if not os.path.isfile(os.path.join(STATIC_DIR, "index.html")):
        raise SystemExit("the web UI is not built: run `bash scripts/setup.sh`")
    port = free_port("127.0.0.1", 0)
    app = create_app(data, ingest_every=0)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            for since in ("24h", "7d"):
                times = []
                for _ in range(3):
                    ctx = b.new_context(viewport={"width": 1400, "height": 1000})
                    page = ctx.new_page()
                    t = time.perf_counter()
                    page.goto(f"http://127.0.0.1:{port}/#/overview?since={since}&refresh=0")
                    # usable: the endpoint table and the three charts are on screen
                    page.wait_for_selector("#app[data-ready='overview'] tr[data-endpoint]")
                    page.wait_for_function("document.querySelectorAll('.uplot').length === 3")
                    times.append(time.perf_counter() - t)
                    ctx.close()
                print(
                    f"overview page since={since:<4} usable in best {min(times):5.2f} s  "
                    f"median {statistics.median(times):5.2f} s (headless Chromium)"
                )
            b.close()
    finally:
        srv.should_exit = True
        th.join(timeout=30)


if __name__ == "__main__":
    main()
