"""Store ingest benchmark: a synthetic spool written with the real wire encoder, then timed
ingest into DuckDB, the same spool through a collector, and timed queries.

    .venv/bin/python benchmarks/ingest.py [--requests 100000] [--calls 10] [--dir DIR]
                                          [--no-collector] [--phases] [--spool-cache DIR]
                                          [--segments-per-round N]

``--spool-cache DIR`` keeps the written spool in DIR (per --requests and --calls) and copies
it from there on later runs: paired runs of two versions then ingest the same bytes, without
~45 s of writing each. Its requests keep the times they were written with (an hour before
then): ``top since 30 min`` finds none in a copy.

The spool is written by the agent's encoder (tests/spoolwrite.py): 8 MB segments of REQUESTS
records of BATCH_MAX requests, each after the L/S/F dictionary records it uses; 300
Zipf-distributed endpoints, lognormal durations, 5,000 users, ``--calls`` DB/HTTP/cache calls
per request with a call site and a stack of up to 12 frames.

Printed, each against its target (issue 20 item 4, issue 19):

- spool ingest: requests per CPU second of this process (``time.process_time``: every thread
  of the process, DuckDB's included, so a busy machine does not change it), and wall time;
- stored size: bytes of the database file per request with its calls;
- with ``--segments-per-round N``: the same segments ingested in process in rounds of N, as a
  server ingests what arrived since its last round, in requests per CPU second with the
  store's close (the checkpoint DuckDB defers) and bytes per request;
- collector: a ``perfsleuth server`` child receives the same segments as remote agents send
  them (``POST /api/ingest/segment``, gzip) and ingests them; requests per CPU second of the
  server process (every thread: HTTP and ingest) from the first segment sent to its stop
  (SIGTERM once its spool is empty: the store's last checkpoint, work DuckDB defers, is
  counted), and wall time until its spool is empty;
- the time of ``top`` and ``traces`` on the store;
- with chDB installed (``--engines duckdb,chdb``, the default then): the same spool ingested
  into ClickHouse's engine in-process (``chdb://``), in requests per CPU second, and the bytes
  of its active parts per request.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import os
import random
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

from perfsleuth.agent.spool.encode import BATCH_MAX
from perfsleuth.store import open_store
from perfsleuth.store.duckdb_store import DuckDBStore

# The tests' spool writer (tests/ is not a package: its modules are found through sys.path);
# server_child is this script's neighbour in benchmarks/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import server_child
from spoolwrite import SegmentWriter, call

SEGMENT_BYTES = 8_000_000
# Targets: issue 20 item 4 (spool ingest, size on disk), issue 19 (a collector's agent ingest)
TARGET_REQUESTS_PER_CPU_S = 100_000
TARGET_BYTES_PER_REQUEST = 150
TARGET_COLLECTOR_REQUESTS_PER_CPU_S = 50_000


def verdict(ok: bool) -> str:
    return "meets the target" if ok else "MISSES the target"


def rounds_run(segments: str, per_round: int) -> None:
    """Ingest the segments in process in rounds of ``per_round`` (copied into the spool
    before each), as a server does with what arrived since its last round; print the CPU per
    request, the store's close (DuckDB's deferred checkpoint) included, and the size."""
    data_dir = tempfile.mkdtemp(prefix="perfsleuth-bench-rounds-")
    spool = os.path.join(data_dir, "spool")
    os.makedirs(spool)
    names = sorted(os.listdir(segments))
    try:
        store = DuckDBStore(data_dir)
        c0, requests = time.process_time(), 0
        for i in range(0, len(names), per_round):
            for name in names[i : i + per_round]:
                shutil.copy(os.path.join(segments, name), spool)
            requests += store.ingest().requests
        store.close()
        cpu = time.process_time() - c0
        size = os.path.getsize(os.path.join(data_dir, "perfsleuth.duckdb"))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    rounds = -(-len(names) // per_round)
    print(
        f"ingest in {rounds} rounds of {per_round} segments: {cpu:.2f} CPU s with the store's "
        f"close = {requests / cpu:,.0f} requests per CPU second; {size / requests:.0f} bytes "
        "per request"
    )


def collector_run(segments: str, requests: int) -> None:
    """Send the segments in ``segments`` to a fresh ``perfsleuth server`` as an agent's
    forwarder does, wait until it has ingested them all, print its CPU per request."""
    data_dir = tempfile.mkdtemp(prefix="perfsleuth-bench-collector-")
    server, port = server_child.start(data_dir)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        names = sorted(os.listdir(segments))
        cpu0, t0 = server_child.cpu_seconds(server.pid), time.perf_counter()
        for name in names:
            with open(os.path.join(segments, name), "rb") as fh:
                body = gzip.compress(fh.read(), 1)
            base = name.rsplit(".", 1)[0]
            conn.request(
                "POST",
                f"/api/ingest/segment?agent=bench&segment={base}&offset=0&final=1",
                body=body,
                headers={"Content-Encoding": "gzip", "Content-Type": "application/octet-stream"},
            )
            reply = conn.getresponse()
            reply.read()
            if reply.status != 200:
                raise SystemExit(f"collector: {name} refused: {reply.status}")
        spool = os.path.join(data_dir, "spool")
        while any(n.endswith((".seg", ".open")) for n in os.listdir(spool)):
            if time.perf_counter() - t0 > 1800 or server.poll() is not None:
                raise SystemExit("collector: the server did not ingest everything")
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        cpu = server_child.cpu_seconds(server.pid) - cpu0
    finally:
        # the deferred part of the work: DuckDB's checkpoint of what its log holds
        cpu_closed = server_child.stop(server) - cpu0
    store = DuckDBStore(data_dir, read_only=True)
    stored = store.query("SELECT count(*) AS n FROM requests")[0]["n"]
    store.close()
    shutil.rmtree(data_dir, ignore_errors=True)
    rate = stored / cpu_closed if cpu_closed else 0.0
    target = TARGET_COLLECTOR_REQUESTS_PER_CPU_S
    print(
        f"collector: {stored:,} of {requests:,} requests stored, server CPU {cpu_closed:.2f} s "
        f"with its stop ({cpu:.2f} s until stored) = {rate:,.0f} requests per CPU second "
        f"(target >= {target:,}: {verdict(rate >= target)}), wall {wall:.2f} s until "
        f"stored = {stored / wall:,.0f} requests/s"
    )


def write_spool(data_dir: str, n_requests: int, calls_per_request: int, seed: int = 1) -> int:
    """Write the synthetic spool; returns its size in bytes."""
    rng = random.Random(seed)
    n_endpoints = 300
    endpoints = [f"GET /api/v1/resource{i}/{{id}}" for i in range(n_endpoints)]
    weights = [1 / (i + 1) for i in range(n_endpoints)]
    frames = [
        (f"{'app' if i % 3 else 'lib'}/module{i}.py", 10 + i, f"func{i}", i % 3 != 0)
        for i in range(40)
    ]
    # Per endpoint: six call sites (kind, statement / URL / cache command, stack)
    templates: list[list[tuple[str, str, list[tuple[str, int, str, bool]]]]] = []
    for e in range(n_endpoints):
        stack = frames[e % 20 : e % 20 + 12]
        while not stack[-1][3]:  # the call site: an application frame, innermost
            stack = stack[:-1]
        texts = {
            "db": f"SELECT * FROM table{e} WHERE k{{j}} = ?",
            "http": f"GET api.example.com/v1/service{e}/op{{j}}",
            "cache": f"GET key{e}:{{j}}",
        }
        templates.append(
            [
                (kind, texts[kind].format(j=j), stack)
                for j, kind in enumerate(("db", "http", "cache") * 2)
            ]
        )
    start_ns = time.time_ns() - 3_600 * 10**9
    total = 0
    seq = 0
    w: SegmentWriter | None = None
    picks = rng.choices(range(n_endpoints), weights, k=n_requests)
    for lo in range(0, n_requests, BATCH_MAX):
        if w is None:
            seq += 1
            w = SegmentWriter(data_dir, service="bench", pid=1, seq=seq)
        specs = []
        for i in range(lo, min(lo + BATCH_MAX, n_requests)):
            e = picks[i]
            dur = rng.lognormvariate(3.0, 0.8)
            calls = []
            off = 0.0
            for j in range(calls_per_request):
                kind, text, stack = templates[e][j % 6]
                cdur = dur / (calls_per_request * 2) * rng.random()
                extra: dict[str, Any] = {}
                if kind == "db":
                    extra = {"rows": rng.randint(0, 50), "ph": rng.getrandbits(62)}
                elif kind == "http":
                    extra = {"status": 200}
                else:
                    extra = {"hit": rng.random() < 0.8}
                calls.append(call(kind, text, dur_ms=cdur, off_ms=off, stack=stack, **extra))
                off += cdur
            specs.append(
                {
                    "endpoint": endpoints[e],
                    "ts_ns": start_ns + i * 3_600 * 10**9 // max(1, n_requests),
                    "dur_ms": dur,
                    "status": 500 if rng.random() < 0.01 else 200,
                    "calls": calls,
                    "user": f"user{rng.randint(0, 4999)}",
                    "tenant": f"tenant{rng.randint(0, 49)}",
                    "cpu_ns": int(dur * 0.3e6),
                }
            )
        w.write_requests(specs)
        if os.path.getsize(w.path) >= SEGMENT_BYTES:
            total += os.path.getsize(w.close())
            w = None
    if w is not None:
        total += os.path.getsize(w.close())
    return total


# What --phases times (CPU of the process, inclusive: a step's time includes the steps it
# calls), as (label, module under perfsleuth., attribute); one a module lacks is left out.
PHASES = (
    ("read segments (mmap, frame, crc)", "store.spool", "read_file"),
    ("  split REQUESTS records (JSON heads)", "wire.batch", "split"),
    ("build tables (store.tables)", "store.tables", "build_tables"),
    ("  bulk read of records (store.decode)", "store.decode", "parse_requests"),
    ("    cx rows (per-call values, layout 3)", "store.decode", "_apply_cx_rows"),
    ("    cx JSON entries", "store.decode", "_apply_cx"),
    ("  requests/calls tables", "store.tables", "event_tables"),
    ("stage a batch in the group's transaction", "store.duckdb_writer", "DuckDBWriter.stage"),
    ("  known traces left out", "store.duckdb_writer", "DuckDBWriter._drop_known_traces"),
    ("  requests + calls insert", "store.duckdb_writer", "DuckDBWriter._insert_requests"),
    ("commit a group (one transaction)", "store.duckdb_writer", "DuckDBWriter.commit_group"),
    ("  rollups (make + insert)", "store.duckdb_rollups", "DuckDBRollups._insert_rollups"),
    ("    rollups_of", "store.rollups", "rollups_of"),
    ("  DuckDB commit", "store.duckdb_writer", "DuckDBWriter._commit"),
    ("rollup compaction", "store.duckdb_rollups", "DuckDBRollups.compact_committed"),
)  # fmt: skip


def timed_phases() -> dict[str, list[float]]:
    """Wrap the PHASES functions with process_time counters: {label: [seconds, calls]}."""
    import importlib

    spent: dict[str, list[float]] = {}
    for label, module, attr in PHASES:
        owner: Any = importlib.import_module("perfsleuth." + module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        spent[label] = [0.0, 0]

        def wrapped(*a: Any, _fn: Any = fn, _acc: list[float] = spent[label], **k: Any) -> Any:
            t = time.process_time()
            try:
                return _fn(*a, **k)
            finally:
                _acc[0] += time.process_time() - t
                _acc[1] += 1

        setattr(owner, name, wrapped)
        # modules that imported the function by name call their own reference
        for other in ("store.ingest", "store.tables"):
            m = importlib.import_module("perfsleuth." + other)
            if not path and getattr(m, name, None) is fn:
                setattr(m, name, wrapped)
    return spent


def chdb_run(segments: str) -> None:
    """Ingest the segments into a chDB store; print requests per CPU second and bytes of
    its active parts per request, fresh (as the inserts left them) and after ``OPTIMIZE ...
    FINAL`` (merged, as background merges would leave them), against the DuckDB targets."""
    data_dir = tempfile.mkdtemp(prefix="perfsleuth-bench-chdb-")
    chdb_dir = tempfile.mkdtemp(prefix="perfsleuth-bench-chdb-db-")
    shutil.copytree(segments, os.path.join(data_dir, "spool"))
    parts_sql = (
        "SELECT sum(bytes_on_disk) AS b FROM system.parts WHERE database = 'bench' AND active"
    )
    store = None
    try:
        store = open_store(data_dir, url=f"chdb://{chdb_dir}?database=bench")
        c0, t0 = time.process_time(), time.perf_counter()
        rep = store.ingest()
        cpu, dt = time.process_time() - c0, time.perf_counter() - t0
        fresh = store.query(parts_sql)[0]["b"] or 0
        for (table,) in store._q("SELECT name FROM system.tables WHERE database = 'bench'"):
            store._client.command(f"OPTIMIZE TABLE bench.{table} FINAL")
        merged = store.query(parts_sql)[0]["b"] or 0
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(chdb_dir, ignore_errors=True)
    rate = rep.requests / cpu
    print(
        f"chdb ingest: {rep.requests:,} requests in {cpu:.2f} CPU s = {rate:,.0f} requests per "
        f"CPU second (target >= {TARGET_REQUESTS_PER_CPU_S:,}: "
        f"{verdict(rate >= TARGET_REQUESTS_PER_CPU_S)}); wall {dt:.2f} s"
    )
    for label, size in (("fresh", fresh), ("after OPTIMIZE FINAL", merged)):
        per_request = size / max(1, rep.requests)
        print(
            f"chdb parts, {label}: {size / 1e6:.1f} MB, {per_request:.0f} bytes per request "
            f"with its calls (target <= {TARGET_BYTES_PER_REQUEST}: "
            f"{verdict(per_request <= TARGET_BYTES_PER_REQUEST)})"
        )


def _chdb_installed() -> bool:
    try:
        import chdb  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--dir", default=None, help="data dir to use (default: a temporary one)")
    ap.add_argument("--no-collector", action="store_true", help="skip the collector run")
    ap.add_argument(
        "--segments-per-round",
        type=int,
        default=0,
        help="also ingest in rounds of this many segments (a server's rounds), in process",
    )
    ap.add_argument(
        "--phases", action="store_true", help="print the spool ingest's CPU per step (slower)"
    )
    ap.add_argument(
        "--spool-cache",
        default=None,
        help="keep the written spool here and copy it from here on later runs",
    )
    ap.add_argument(
        "--engines",
        default="duckdb,chdb" if _chdb_installed() else "duckdb",
        help="also ingest into chdb (ClickHouse in-process) when it is named",
    )
    args = ap.parse_args()
    data_dir = args.dir or tempfile.mkdtemp(prefix="perfsleuth-bench-")
    try:
        t0 = time.perf_counter()
        cached = None
        if args.spool_cache:
            cached = os.path.join(args.spool_cache, f"spool-{args.requests}x{args.calls}")
        if cached is not None and os.path.isdir(cached):
            shutil.copytree(cached, os.path.join(data_dir, "spool"), dirs_exist_ok=True)
            spool_bytes = sum(os.path.getsize(os.path.join(cached, n)) for n in os.listdir(cached))
            how = f"copied from {cached}"
        else:
            spool_bytes = write_spool(data_dir, args.requests, args.calls)
            how = "written"
            if cached is not None:
                shutil.copytree(os.path.join(data_dir, "spool"), cached + ".tmp")
                os.replace(cached + ".tmp", cached)
        print(
            f"spool: {args.requests:,} requests x {args.calls} calls, "
            f"{spool_bytes / 1e6:.1f} MB, {how} in {time.perf_counter() - t0:.1f} s"
        )
        segments = tempfile.mkdtemp(prefix="perfsleuth-bench-segments-")
        engines = {e.strip() for e in args.engines.split(",")}
        if not args.no_collector or "chdb" in engines or args.segments_per_round:
            # the same segments, for the other runs
            for name in os.listdir(os.path.join(data_dir, "spool")):
                shutil.copy(os.path.join(data_dir, "spool", name), segments)
        spent = timed_phases() if args.phases else {}
        store = DuckDBStore(data_dir)
        c0, t0 = time.process_time(), time.perf_counter()
        rep = store.ingest()
        cpu, dt = time.process_time() - c0, time.perf_counter() - t0
        rate = rep.requests / cpu
        print(
            f"ingest: {rep.requests:,} requests, {rep.calls:,} calls in {cpu:.2f} CPU s = "
            f"{rate:,.0f} requests per CPU second (target >= {TARGET_REQUESTS_PER_CPU_S:,}: "
            f"{verdict(rate >= TARGET_REQUESTS_PER_CPU_S)}), {rep.calls / cpu:,.0f} calls per "
            f"CPU second; wall {dt:.2f} s = {rep.requests / dt:,.0f} requests/s, "
            f"{spool_bytes / dt / 1e6:.1f} MB/s of spool"
        )
        for label, (secs, calls) in spent.items():
            print(f"  {label:<44} {secs:6.2f} CPU s {secs / cpu:5.0%}  ({calls:,.0f} calls)")
        store.close()
        db_bytes = os.path.getsize(os.path.join(data_dir, "perfsleuth.duckdb"))
        per_request = db_bytes / max(1, rep.requests)
        print(
            f"database: {db_bytes / 1e6:.1f} MB, {per_request:.0f} bytes per request with its "
            f"calls (target <= {TARGET_BYTES_PER_REQUEST}: "
            f"{verdict(per_request <= TARGET_BYTES_PER_REQUEST)})"
        )
        if args.segments_per_round:
            rounds_run(segments, args.segments_per_round)
        if not args.no_collector:
            collector_run(segments, args.requests)
        if "chdb" in engines:
            chdb_run(segments)
        shutil.rmtree(segments, ignore_errors=True)
        store = DuckDBStore(data_dir, read_only=True)
        for label, fn in (
            ("top by endpoint", lambda: store.top()),
            ("top by endpoint x user", lambda: store.top(by=("endpoint", "user"))),
            ("top since 30 min", lambda: store.top(since=timedelta(minutes=30))),
            ("traces slowest 20", lambda: store.traces(slowest=20)),
        ):
            fn()  # warm
            t0 = time.perf_counter()
            rows = fn()
            print(f"{label}: {(time.perf_counter() - t0) * 1000:.0f} ms ({len(rows)} rows)")
        tid = store.traces(limit=1)[0]["trace_id"]
        t0 = time.perf_counter()
        store.trace(tid)
        print(f"trace by id: {(time.perf_counter() - t0) * 1000:.0f} ms")
        store.close()
    finally:
        if args.dir is None:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
