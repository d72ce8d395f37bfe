"""Benchmark: the detectors and the call-site tree over a large synthetic store.

    python -m perfsleuth.analysis.bench [--requests 1000000] [--calls-per-request 20] [--data DIR]

Builds DIR/perfsleuth.duckdb directly with SQL (not through ingest, which has its own
benchmark): ``--requests`` requests over one day on 50 endpoints, 20 tenants and 2,000 users,
with ``--calls-per-request`` calls each on average (N+1 loops on some endpoints, repeated
reads, big results, a slow upstream), then times :func:`perfsleuth.analysis.find`, each
detector alone, and :func:`perfsleuth.analysis.calltree.build` on the busiest endpoint.
Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime

import duckdb

from perfsleuth.store import schema
from perfsleuth.store.duckdb_store import DB_NAME, DuckDBStore

ENDPOINTS = 50
SITES = 400
STACK_DEPTH = 12


def build(data: str, requests: int, per_request: int) -> None:
    os.makedirs(data, exist_ok=True)
    path = os.path.join(data, DB_NAME)
    if os.path.exists(path):
        os.remove(path)
    day = datetime.now(UTC).date()
    con = duckdb.connect(path)
    for t in schema.GLOBAL_TABLES:
        con.execute(schema.duckdb_create(t))
    for t in schema.EVENT_TABLES:
        con.execute(schema.duckdb_create(t, schema.day_table(t, day)))
        con.execute(schema.duckdb_view(t, [day]))
    req = schema.quote(schema.day_table(schema.REQUESTS, day))
    calls = schema.quote(schema.day_table(schema.CALLS, day))
    start = datetime.combine(day, datetime.min.time())
    span_us = 20 * 3600 * 1_000_000
    # Locations: SITES app call sites (the first 200 inside loops), plus library frames.
    con.execute(
        """INSERT INTO locations SELECT i, CASE WHEN i < 1000 THEN 'app/views_' || (i % 40)
        || '.py' ELSE '/usr/lib/python3/site-packages/fw/core.py' END, 10 + i % 500,
        'fn_' || i, i < 1000 FROM range(0, 1100) t(i)"""
    )
    # One stack per site: 8 library frames, 3 app frames, the site.
    con.execute(
        f"""INSERT INTO stacks SELECT s, list_value(1000, 1001, 1002, 1003, 1004, 1005,
        1006, 1007, 500 + s % 50, 600 + s % 100, 700 + s, s) FROM range(0, {SITES}) t(s)"""
    )
    con.execute(
        """INSERT INTO fingerprints SELECT i, CASE WHEN i % 10 = 9 THEN 'http' ELSE 'db' END,
        'SELECT', 'SELECT * FROM t' || i || ' WHERE id = ?' FROM range(0, 2000) t(i)"""
    )
    con.execute(
        f"""INSERT INTO {req} SELECT
            TIMESTAMP '{start}' + to_microseconds(CAST(i * {span_us} // {requests} AS BIGINT)),
            printf('%016x', hash(i)), 'svc', 'h1', 1, 'web', 'GET', 'GET /e' || (i % {ENDPOINTS}),
            '/e', 200, NULL, 5 + random() * 100 + (i % {ENDPOINTS} = 7)::INT * 300
                + (i % {ENDPOINTS} = 11)::INT * (i % 1000) / 5, NULL,
            CASE WHEN i % {ENDPOINTS} = 11 THEN (i % 1000) * 2000 ELSE 0 END, 500,
            'u' || (i % 2000), 't' || (i % 20), {per_request}, 20.0, 0, 0.0, 0, 0.0, 0,
            0.5, 1, NULL
        FROM range(0, {requests}) t(i)"""
    )
    # Calls: trace = i // per_request. Endpoints 0-4 loop one statement (N+1), 5-6 repeat a
    # read with the same parameters, 8 loads big results, 7 waits on an upstream.
    n = requests * per_request
    con.execute(
        f"""INSERT INTO {calls} SELECT ts, trace_id, 'svc', endpoint, seq,
            CASE WHEN e = 7 AND seq = 0 THEN 'http' ELSE 'db' END, 'postgresql',
            CASE WHEN e < 5 AND seq > 0 THEN e WHEN e IN (5, 6) AND seq < 3 THEN 50
                 WHEN e = 8 AND seq = 1 THEN 60 ELSE 100 + e * 30 + seq END,
            seq * 1.0, CASE WHEN e = 7 AND seq = 0 THEN 300.0 ELSE random() END,
            CASE WHEN e = 8 AND seq = 1 THEN 50000 ELSE 1 END, NULL,
            CASE WHEN e IN (5, 6) AND seq < 3 THEN 42 ELSE hash(i) % 1000000 END,
            CASE WHEN seq < 2 THEN site ELSE NULL END, site,
            CASE WHEN e = 7 AND seq = 0 THEN 'api.example.com' ELSE NULL END,
            NULL, NULL, NULL, NULL, NULL
        FROM (SELECT i, i // {per_request} AS t, (i % {per_request})::INT AS seq,
                (i // {per_request}) % {ENDPOINTS} AS e,
                CASE WHEN (i // {per_request}) % {ENDPOINTS} < 5 AND i % {per_request} > 0
                     THEN (i // {per_request}) % {ENDPOINTS}
                     ELSE ((i // {per_request}) % {ENDPOINTS}) * 8 + i % 8 END AS site
              FROM range(0, {n}) r(i)) x
        JOIN (SELECT row_number() OVER () - 1 AS t, ts, trace_id, endpoint FROM {req}) q
            USING (t)"""
    )
    con.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--calls-per-request", type=int, default=20)
    p.add_argument("--data", default=None, help="Directory (default: a temporary one).")
    p.add_argument("--keep", action="store_true", help="Keep the data directory.")
    args = p.parse_args()
    data = args.data or tempfile.mkdtemp(prefix="perfsleuth-bench-")
    t0 = time.perf_counter()
    build(data, args.requests, args.calls_per_request)
    print(
        f"built {args.requests:,} requests, {args.requests * args.calls_per_request:,} calls "
        f"in {time.perf_counter() - t0:.1f} s ({data})"
    )
    from perfsleuth.analysis import calltree, find
    from perfsleuth.analysis.detectors import DETECTORS

    store = DuckDBStore(data, read_only=True)
    try:
        for kind in DETECTORS:
            t = time.perf_counter()
            got = find(store, kinds=[kind])
            print(f"  {kind:<20} {time.perf_counter() - t:6.2f} s  {len(got)} findings")
        t = time.perf_counter()
        got = find(store)
        print(f"find (all detectors)   {time.perf_counter() - t:6.2f} s  {len(got)} findings")
        t = time.perf_counter()
        tree = calltree.build(store, "GET /e0", min_share=0.01)
        print(f"calltree GET /e0       {time.perf_counter() - t:6.2f} s  {tree.calls:,} calls")
    finally:
        store.close()
        if not args.keep and args.data is None:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
