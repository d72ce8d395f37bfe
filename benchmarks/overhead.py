"""Agent overhead benchmark: the reference app bare, with perfsleuth, and with three peers.

    .venv/bin/python benchmarks/overhead.py [--requests 1000] [--repeats 15] [--rounds 3]
        [--variants bare,perfsleuth,otel,sentry,ddtrace] [--cpu N] [--json FILE] [--quick]

The reference app: a FastAPI sync endpoint ``GET /orders/{order_id}`` making 1 + 10 sqlite3
queries (an N+1 loop) on a small file database. Requests go straight into the ASGI callable,
one after another on one event loop (no sockets, no HTTP parsing); FastAPI runs the endpoint
in anyio's thread pool, the same for every variant.

Each variant runs in a child process of its own (this script with ``--variant``), so
instrumentations never mix. In each of ``--rounds`` rounds, fresh children for all variants
are alive at once; after a warm-up they take turns, ``--repeats`` slices of ``--requests``
requests each, the order rotating from slice to slice, so drift of a shared machine hits
neighbouring slices alike. A slice ends with a flush of the variant's background writer or
exporter, so deferred work is inside it. CPU is ``time.process_time_ns()``: every thread of
the process (event loop, pool thread, perfsleuth's writer, OpenTelemetry's batch processor).
A variant's overhead is the median over all slices of its ratio to bare's slice of the same
round and number; its µs per request, the median over its slices.

The peers export into dropping sinks (their serialisation and I/O are not counted), while
perfsleuth's writer really encodes and writes its spool; afterwards (not timed) the perfsleuth
child ingests the spool into a store and checks every request and call arrived with a stack.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("bare", "perfsleuth", "otel", "sentry", "ddtrace")
NEEDS = {  # variant -> distributions it needs (their versions go in the header)
    "otel": (
        "opentelemetry-sdk",
        "opentelemetry-instrumentation-fastapi",
        "opentelemetry-instrumentation-sqlite3",
    ),
    "sentry": ("sentry-sdk",),
    "ddtrace": ("ddtrace",),
}
ORDERS, PRODUCTS, LINES = 1000, 200, 10
CALLS = 1 + LINES  # per request
TARGET, STRETCH = 10.0, 5.0  # % of bare's CPU per request
RESULT = "@@result "  # marks the child's result line on its stdout
SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "GET",
    "scheme": "http",
    "query_string": b"",
    "root_path": "",
    "client": ("127.0.0.1", 50000),
    "server": ("bench", 80),
}


def seed_db(path: str) -> None:
    import sqlite3  # not at the top: a child imports it only after instrumenting

    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT);"
        "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price REAL);"
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, placed TEXT);"
        "CREATE TABLE order_items (order_id INTEGER, line INTEGER, product_id INTEGER,"
        " qty INTEGER, PRIMARY KEY (order_id, line));"
    )
    ids = range(1, ORDERS + 1)
    con.executemany("INSERT INTO customers VALUES (?, ?)", [(i, f"c{i}") for i in ids])
    con.executemany("INSERT INTO products VALUES (?, ?, ?)", [(i, f"p{i}", i / 4) for i in ids])
    con.executemany("INSERT INTO orders VALUES (?, ?, '2024-05-01')", [(i, i) for i in ids])
    con.executemany(
        "INSERT INTO order_items VALUES (?, ?, ?, ?)",
        [(o, j, (o * 31 + j) % PRODUCTS + 1, j + 1) for o in ids for j in range(LINES)],
    )
    con.commit()
    con.close()


def make_app(db_path: str) -> Any:
    """The reference app; imports fastapi and sqlite3 late, after the variant's set-up."""
    import sqlite3

    from fastapi import FastAPI

    app = FastAPI()
    local = threading.local()  # a connection per pool thread, opened (instrumented) lazily

    @app.get("/orders/{order_id}")
    def get_order(order_id: int) -> dict[str, Any]:
        con = getattr(local, "con", None)
        if con is None:
            con = local.con = sqlite3.connect(db_path)
        cur = con.cursor()  # not con.execute: every peer traces cursor.execute
        cur.execute(
            "SELECT o.id, o.placed, c.name FROM orders o"
            " JOIN customers c ON c.id = o.customer_id WHERE o.id = ?",
            (order_id,),
        )
        oid, placed, customer = cur.fetchone()
        items = []
        for line in range(LINES):  # the N+1 loop
            cur.execute(
                "SELECT p.name, p.price, i.qty FROM order_items i"
                " JOIN products p ON p.id = i.product_id WHERE i.order_id = ? AND i.line = ?",
                (order_id, line),
            )
            name, price, qty = cur.fetchone()
            items.append({"product": name, "qty": qty, "price": price})
        total = sum(i["price"] * i["qty"] for i in items)
        return {"id": oid, "placed": placed, "customer": customer, "items": items, "total": total}

    return app


async def request(app: Any, order_id: int) -> int:
    """One GET through the ASGI callable; returns the response status."""
    path = f"/orders/{order_id}"
    headers = [(b"host", b"bench"), (b"x-user", b"u%d" % (order_id % 50))]
    scope = {**SCOPE, "path": path, "raw_path": path.encode(), "headers": headers}
    messages = [{"type": "http.request", "body": b"", "more_body": False}]
    status = 0

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


# ----------------------------------------------------------------------------- the variants
# Each returns (app, flush, check): flush() pushes deferred work into the sink (timed);
# check(n) says what the instrumentation produced for n requests (not timed).

Setup = tuple[Any, Callable[[], Any], Callable[[int], tuple[bool, str]]]


def setup_bare(db: str, tmp: str) -> Setup:
    return make_app(db), lambda: None, lambda n: (True, "")


def setup_perfsleuth(
    db: str, tmp: str, all_stacks: bool = False, evidence: bool = True, capture: bool = True
) -> Setup:
    data = os.environ["PERFSLEUTH_DATA"] = os.path.join(tmp, "agent")
    os.environ["PERFSLEUTH_EVIDENCE"] = "1" if evidence else "0"
    os.environ["PERFSLEUTH_CAPTURE"] = "1" if capture else "0"
    if all_stacks:  # default: one stack per (statement, call site) and request
        os.environ["PERFSLEUTH_STACKS_PER_SITE"] = "1000000"
    import perfsleuth.agent as ps

    if not ps.start():  # default config: patches starlette (every request), sqlite3 (every call)
        raise RuntimeError("perfsleuth.agent.start() did not start")

    def check(n: int) -> tuple[bool, str]:
        from perfsleuth.agent import shipper
        from perfsleuth.store.duckdb_store import DuckDBStore

        shipper.shutdown()  # what atexit would do: write and close the last segment
        drops = {k: v for k, v in ps.stats().items() if k.startswith("dropped") and v}
        with DuckDBStore(data) as store:
            rep = store.ingest()
            calls = store.query("SELECT count(*) AS n, count(stack_id) AS stacked FROM calls")[0]
            eps = [r["endpoint"] for r in store.query("SELECT DISTINCT endpoint FROM requests")]
        ok = rep.requests == n and rep.calls == calls["n"] == calls["stacked"] == CALLS * n
        ok = ok and eps == ["GET /orders/{order_id}"] and not drops
        text = f"{rep.requests}/{n} requests, {rep.calls}/{CALLS * n} calls"
        return ok, text + f", {calls['stacked']} with stack" + (f", {drops}" if drops else "")

    return make_app(db), ps.flush, check


def setup_otel(db: str, tmp: str) -> Setup:
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.instrumentation.sqlite3 import SQLite3Instrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class DropExporter(SpanExporter):
        spans = 0

        def export(self, spans: Any) -> SpanExportResult:
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

    exporter = DropExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    SQLite3Instrumentor().instrument(tracer_provider=provider)  # before any connection
    app = make_app(db)
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    return app, provider.force_flush, lambda n: (True, f"{exporter.spans / n:.1f} spans/request")


def setup_sentry(db: str, tmp: str) -> Setup:
    import sentry_sdk
    from sentry_sdk.transport import Transport

    class DropTransport(Transport):
        transactions = 0

        def capture_envelope(self, envelope: Any) -> None:
            self.transactions += sum(item.type == "transaction" for item in envelope.items)

    transport = DropTransport()
    # Default integrations: Starlette and FastAPI are auto-enabled (sentry has none for sqlite3).
    sentry_sdk.init(dsn="http://public@127.0.0.1:1/1", traces_sample_rate=1.0, transport=transport)

    def check(n: int) -> tuple[bool, str]:
        return transport.transactions == n, f"{transport.transactions / n:.1f} tx/request"

    return make_app(db), sentry_sdk.flush, check


def setup_ddtrace(db: str, tmp: str) -> Setup:
    os.environ.update(
        DD_TRACE_ENABLED="true",
        DD_INSTRUMENTATION_TELEMETRY_ENABLED="false",
        DD_REMOTE_CONFIGURATION_ENABLED="false",
        DD_TRACE_STARTUP_LOGS="false",
        DD_CRASHTRACKING_ENABLED="false",
        # Used only if the writer cannot be replaced below: a closed local port, so the
        # background writer thread fails fast and nothing leaves the machine.
        DD_TRACE_AGENT_URL="http://127.0.0.1:9",
    )
    from ddtrace import patch

    patch(fastapi=True, sqlite3=True)  # before make_app imports fastapi and sqlite3
    from ddtrace.internal.writer import TraceWriter
    from ddtrace.trace import tracer

    class DropWriter(TraceWriter):
        spans = 0

        def recreate(self, appsec_enabled: Any = None, llmobs_enabled: Any = None) -> Any:
            return self

        def stop(self, timeout: Any = None) -> None:
            pass

        def write(self, spans: Any = None) -> None:
            self.spans += len(spans or ())

        def flush_queue(self) -> None:
            pass

    writer = DropWriter()
    note = ""
    try:
        tracer._span_aggregator.writer = writer  # private, but there is no public way to drop
    except AttributeError:
        note = " (agent writer, closed port)"

    def check(n: int) -> tuple[bool, str]:
        return True, f"{writer.spans / n:.1f} spans/request{note}"

    return make_app(db), tracer.flush, check


SETUPS: dict[str, Callable[[str, str], Setup]] = {
    "bare": setup_bare,
    "perfsleuth": setup_perfsleuth,
    # Opt-in (--variants): a freshly captured stack for every call, not one per site and request.
    "perfsleuth-all-stacks": lambda db, tmp: setup_perfsleuth(db, tmp, all_stacks=True),
    # Opt-in: without the runtime-evidence thread and GC hook (what they cost under load).
    "perfsleuth-no-evidence": lambda db, tmp: setup_perfsleuth(db, tmp, evidence=False),
    # Opt-in: without replayable captures (the per-request decision and the 1 % sample).
    "perfsleuth-no-capture": lambda db, tmp: setup_perfsleuth(db, tmp, capture=False),
    "otel": setup_otel,
    "sentry": setup_sentry,
    "ddtrace": setup_ddtrace,
}


def run_child(args: argparse.Namespace) -> None:
    """A variant's process: set up, warm up, then run the slices the parent asks for, one at a
    time (``run FIRST N`` on stdin: a result line on stdout), then ``check TOTAL``."""
    if args.cpu >= 0:  # before any thread starts, so that every thread inherits it
        os.sched_setaffinity(0, {args.cpu})
    tmp = tempfile.mkdtemp(prefix="perfsleuth-overhead-")
    try:
        app, flush, check = SETUPS[args.variant](args.db, tmp)

        async def timed(first: int, n: int) -> dict[str, Any]:
            gc.collect()
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            bad = 0
            for i in range(first, first + n):
                bad += await request(app, i % ORDERS + 1) != 200
            flush()  # the slice's deferred work (writer, batch processor) counts in it
            cpu, wall = time.process_time_ns() - c0, time.perf_counter_ns() - w0
            return {"cpu_us": cpu / n / 1000, "wall_us": wall / n / 1000, "bad": bad}

        async def serve() -> None:
            loop = asyncio.get_running_loop()
            warm = await timed(0, args.warmup)
            print(RESULT + json.dumps(warm), flush=True)
            while True:
                line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
                if not line or line[0] != "run":
                    total = int(line[1]) if line else 0
                    ok, text = check(total)
                    print(RESULT + json.dumps({"ok": ok, "check": text}), flush=True)
                    return
                print(RESULT + json.dumps(await timed(int(line[1]), int(line[2]))), flush=True)

        asyncio.run(serve())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------- the parent


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_cpu() -> int:
    """The last CPU we may use (-1 where affinity cannot be set): children are pinned to it.

    Unpinned, on a 2-core machine a child's event loop and pool thread either share a core or
    ping-pong between the two, and which one a process gets is luck: bare measured 250 or
    330 µs of CPU per request from one process to the next, more than the 10 % being tested.
    Pinned, every thread still counts, but background work no longer overlaps the requests,
    so wall time includes it too.
    """
    return max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else -1


class Child:
    """One variant's process, driven slice by slice over pipes."""

    def __init__(self, name: str, db: str, args: argparse.Namespace) -> None:
        self.name = name
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", name, "--db", db]
        for opt in ("warmup", "cpu"):
            cmd += [f"--{opt}", str(getattr(args, opt))]
        # stderr into a file, not a pipe: nobody reads it while the child runs, and a child
        # whose library logs a lot would block on a full pipe
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed by finish())
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )
        self.requests = args.warmup
        self.error = ""

    def result(self) -> dict[str, Any] | None:
        """The child's next result line; None (and ``error`` set) if it died."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                out: dict[str, Any] = json.loads(line[len(RESULT) :])
                return out
        self.proc.wait()
        self.stderr.seek(0)
        tail = " | ".join(self.stderr.read().splitlines()[-3:])
        self.error = self.error or f"child failed: {tail}"
        return None

    def ask(self, command: str) -> dict[str, Any] | None:
        if self.error or self.proc.stdin is None:
            return None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: result() says how
        return self.result()

    def run(self, n: int) -> dict[str, Any] | None:
        out = self.ask(f"run {self.requests} {n}")
        self.requests += n
        return out

    def finish(self) -> tuple[bool, str]:
        out = self.ask(f"check {self.requests}")
        self.proc.wait(timeout=300)
        self.stderr.close()
        if out is None:
            return False, self.error
        return bool(out["ok"]), str(out["check"])


def run_round(names: list[str], db: str, args: argparse.Namespace, rnd: int) -> dict[str, Any]:
    """One round: a fresh process per variant, all alive at once; slice after slice, each
    variant in turn runs ``--requests`` requests (the order rotating from slice to slice), so
    neighbouring slices of different variants see the same state of a shared machine."""
    children = [Child(name, db, args) for name in names]
    runs: dict[str, dict[str, Any]] = {n: {"cpu_us": [], "wall_us": [], "bad": 0} for n in names}
    for child in children:  # warm-ups ran side by side; wait for all of them
        warm = child.result()
        if warm is not None:
            runs[child.name]["bad"] += warm["bad"]
    for s in range(args.repeats):
        for child in children[s % len(children) :] + children[: s % len(children)]:
            res = child.run(args.requests)
            if res is None:
                continue
            for key in ("cpu_us", "wall_us"):
                runs[child.name][key].append(res[key])
            runs[child.name]["bad"] += res["bad"]
    for child in children:
        ok, text = child.finish()
        r = runs[child.name]
        if r["bad"]:
            ok, text = False, f"{r['bad']} responses not 200; {text}"
        r.update(ok=ok and not child.error, check=text)
        if child.error:  # a slice list with holes cannot be paired
            r["cpu_us"], r["wall_us"] = [], []
        cpu = statistics.median(r["cpu_us"]) if r["cpu_us"] else float("nan")
        msg = f"  round {rnd}: {child.name:<22}{cpu:8.1f} µs CPU/request  {text}"
        print(msg, file=sys.stderr, flush=True)
    return runs


def summarise(runs: list[dict[str, Any]], bare: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-request figures (median over every slice) and the overhead: the median over
    slices of the ratio to bare's slice next to it (same round, same slice number)."""
    med = statistics.median
    cpu = [x for r in runs for x in r["cpu_us"]]
    wall = [x for r in runs for x in r["wall_us"]]
    ratios = [
        (a / b, c / d)
        for r, base in zip(runs, bare, strict=True)
        if len(r["cpu_us"]) == len(base["cpu_us"])
        for a, b, c, d in zip(
            r["cpu_us"], base["cpu_us"], r["wall_us"], base["wall_us"], strict=True
        )
    ]
    cpu_r = sorted(x[0] for x in ratios)
    q = statistics.quantiles(cpu_r, n=4) if len(cpu_r) >= 2 else [cpu_r[0]] * 3 if cpu_r else []
    return {
        "cpu_us": med(cpu) if cpu else None,
        "wall_us": med(wall) if wall else None,
        "ratio_cpu": med(cpu_r) if cpu_r else None,
        "ratio_wall": med(x[1] for x in ratios) if ratios else None,
        # the middle half of the paired ratios, in points of overhead: a feel for the noise
        "iqr_pct": [(q[0] - 1) * 100, (q[2] - 1) * 100] if q else None,
        "cpu_us_slices": [r["cpu_us"] for r in runs],  # every slice, by round
        "ok": bool(runs) and all(r["ok"] for r in runs),
        "check": runs[-1]["check"] if runs else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per timed slice")
    ap.add_argument("--repeats", type=int, default=15, help="slices per variant and round")
    ap.add_argument("--warmup", type=int, default=300, help="untimed requests first")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the variants")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"among {', '.join(SETUPS)}")
    ap.add_argument("--cpu", type=int, default=default_cpu(), help="pin children; -1: don't")
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="a short run, for development")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--db", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return run_child(args)
    if args.quick:
        args.requests, args.repeats, args.warmup, args.rounds = 500, 4, 100, 1
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if "bare" not in names or set(names) - set(SETUPS):
        ap.error(f"--variants must include bare, among: {', '.join(SETUPS)}")

    started = time.perf_counter()
    dists = ["fastapi", "starlette", "perfsleuth", *(d for v in NEEDS.values() for d in v)]
    pin = f"children pinned to CPU {args.cpu}" if args.cpu >= 0 else "not pinned"
    print(f"perfsleuth agent overhead: Python {platform.python_version()}, {os.cpu_count()} CPUs")
    print("versions: " + ", ".join(f"{d} {version(d) or '-'}" for d in dists))
    print(
        f"{args.rounds} rounds x {args.repeats} slices x {args.requests} requests (+{args.warmup} "
        f"warm-up) per variant, interleaved, 1 + {LINES} sqlite3 queries per request, {pin}\n"
    )
    skipped = [v for v in names if any(version(d) is None for d in NEEDS.get(v, ()))]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in names if v not in skipped}
    tmp = tempfile.mkdtemp(prefix="perfsleuth-overhead-db-")
    try:
        db = os.path.join(tmp, "shop.db")
        seed_db(db)
        for rnd in range(1, args.rounds + 1):
            for name, res in run_round(list(runs), db, args, rnd).items():
                runs[name].append(res)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    summary = {name: summarise(rs, runs["bare"]) for name, rs in runs.items()}
    base = summary["bare"]
    head = f"{'variant':<22}{'CPU µs/req':>11}{'× bare':>8}{'overhead':>10}{'IQR':>16}"
    head += f"{'wall µs/req':>13}{'× bare':>8}   check"
    print(head + "\n" + "-" * len(head))
    for name in names:
        s = summary.get(name)
        if s is None:
            print(f"{name:<22}skipped (not installed)")
        elif s["ratio_cpu"] is None or base["cpu_us"] is None:
            print(f"{name:<22}failed: {s['check']}")
        else:
            s["overhead_pct"] = (s["ratio_cpu"] - 1) * 100
            over = "-" if name == "bare" else f"{s['overhead_pct']:+.1f} %"
            lo, hi = s["iqr_pct"]
            iqr = "-" if name == "bare" else f"{lo:+.1f}..{hi:+.1f} %"
            print(
                f"{name:<22}{s['cpu_us']:>11.1f}{s['ratio_cpu']:>7.2f}x{over:>10}{iqr:>16}"
                f"{s['wall_us']:>13.1f}{s['ratio_wall']:>7.2f}x   "
                + ("" if s["ok"] else "FAILED: ")
                + s["check"]
            )
    ps = summary.get("perfsleuth", {})
    met = None
    if ps.get("overhead_pct") is None:
        print("\nperfsleuth: not measured.")
    else:
        pct = ps["overhead_pct"]
        met = pct <= TARGET and ps["ok"]
        capture = "capture verified" if ps["ok"] else "capture verification FAILED"
        print(
            f"\nperfsleuth adds {pct:+.1f} % CPU per request to bare ({capture}): target "
            f"≤ {TARGET:.0f} % {'met' if met else 'NOT met'}, stretch ≤ {STRETCH:.0f} % "
            + ("met." if met and pct <= STRETCH else "not met.")
        )
    elapsed = time.perf_counter() - started
    print(f"(took {elapsed:.0f} s)")
    if args.json:
        doc = {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "pinned_cpu": args.cpu,
            "versions": {d: version(d) for d in dists},
            "config": {k: getattr(args, k) for k in ("requests", "repeats", "warmup", "rounds")},
            "skipped": skipped,
            "results": summary,
            "target_pct": TARGET,
            "target_met": met,
            "seconds": round(elapsed, 1),
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)


if __name__ == "__main__":
    main()
