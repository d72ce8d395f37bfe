"""The app-side cost of remote shipping: the agent with ``PERFSLEUTH_COLLECTOR`` set to a local
``perfsleuth server`` against the same agent writing its spool only.

    .venv/bin/python benchmarks/shipping.py [--requests 2000] [--repeats 11] [--json FILE]

The app is a WSGI function making 1 + 10 sqlite3 queries on an in-memory database (an N+1 of
ten), wrapped by ``perfsleuth.agent.wsgi`` and called directly (no sockets, no HTTP parsing),
in three child processes of this script (``--variant bare``: no agent, ``spool`` and ``ship``),
alive at once, taking turns slice by slice (``--requests`` requests each; the order rotates) so
drift of a shared machine hits them alike. A slice is the requests, then
``perfsleuth.agent.flush()`` (the writer has written them to the spool), and for ``ship`` also
the wait until the collector has acknowledged every byte of the spool: the forwarding thread's
reading, gzip, HTTP and bookkeeping for the slice are inside it. CPU is
``time.process_time_ns()`` of the app's process (all its threads: the app's, the writer's, the
forwarder's); the waiting itself is sleep. Each thread's CPU is read from its thread clock and
reported apart. The server's CPU is not counted (another process), but it shares this machine's
cores.

Reported: CPU µs per request of each variant (median over slices), the agent's overhead
spooling and shipping (median of the per-round ratios to bare), the cost of shipping (ship /
spool - 1), each thread's µs per request, and a check that the server stored every request the
shipping child made, once.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

PY = sys.executable
TOKEN = "bench-shipping-token-0123456789"
RESULT = "RESULT "
QUERIES = 10  # the N of the N+1
ORDERS = 50


# ------------------------------------------------------------------------------ the child


def build_app() -> Any:
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT)")
    db.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, order_id INT, product TEXT)")
    db.executemany("INSERT INTO orders VALUES (?, ?)", [(i, f"c{i}") for i in range(ORDERS)])
    db.executemany(
        "INSERT INTO items VALUES (?, ?, ?)",
        [(i, i % ORDERS, f"p{i}") for i in range(ORDERS * QUERIES)],
    )

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        oid = int(environ["PATH_INFO"].rsplit("/", 1)[-1])
        db.execute("SELECT customer FROM orders WHERE id = ?", (oid,)).fetchall()
        ids = [i for i in range(oid, ORDERS * QUERIES, ORDERS)][:QUERIES]
        for item in ids:  # the N+1: one query per item
            db.execute("SELECT product FROM items WHERE id = ?", (item,)).fetchall()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    return app


def call(app: Any, i: int) -> int:
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": f"/orders/{i % ORDERS}",
        "QUERY_STRING": "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": None,
        "HTTP_HOST": "bench",
    }
    status: list[str] = []
    body = app(environ, lambda s, h, exc=None: status.append(s))
    for _ in body:
        pass
    if hasattr(body, "close"):
        body.close()
    return int(status[0].split()[0])


def shipped_all() -> bool:
    """Whether the collector acknowledged every byte of every segment left in the spool."""
    from perfsleuth.agent.spool import forward

    fw = forward._fw
    if fw is None:
        return True
    return all(fw.acked.get(base, 0) >= size for base, _, _, size in fw.segments())


def thread_cpu_ns() -> dict[str, int]:
    """CPU ns of each live thread of this process, by thread name."""
    import threading

    out: dict[str, int] = {}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            ns = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except OSError:  # ended meanwhile
            continue
        out[t.name] = out.get(t.name, 0) + ns
    return out


def run_child(variant: str) -> None:
    import perfsleuth.agent as ps

    if variant == "bare":
        app = build_app()
    else:
        if not ps.start():
            raise RuntimeError("perfsleuth.agent.start() did not start")
        app = ps.wsgi(build_app())
    ship = variant == "ship"

    def slice_(first: int, n: int) -> dict[str, Any]:
        c0, t0 = time.process_time_ns(), thread_cpu_ns()
        bad = sum(call(app, i) != 200 for i in range(first, first + n))
        if variant != "bare":
            ps.flush()
        end = time.monotonic() + 120
        while ship and not shipped_all() and time.monotonic() < end:
            time.sleep(0.25)  # the forwarder ships once a second: a few cheap looks
        cpu, t1 = time.process_time_ns() - c0, thread_cpu_ns()
        return {
            "cpu_us": cpu / n / 1000,
            "threads_us": {k: (v - t0.get(k, 0)) / n / 1000 for k, v in t1.items()},
            "bad": bad,
            "shipped": shipped_all() if ship else None,
        }

    print(RESULT + json.dumps(slice_(0, 200)), flush=True)  # warm-up
    while True:
        line = sys.stdin.readline().split()
        if not line or line[0] != "run":
            break
        print(RESULT + json.dumps(slice_(int(line[1]), int(line[2]))), flush=True)
    print(RESULT + json.dumps(ps.stats()), flush=True)


# ------------------------------------------------------------------------------ the parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    def __init__(self, variant: str, env: dict[str, str]) -> None:
        self.variant = variant
        self.proc = subprocess.Popen(
            [PY, __file__, "--variant", variant],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def result(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                got: dict[str, Any] = json.loads(line[len(RESULT) :])
                return got
        raise RuntimeError(f"the {self.variant} child ended (exit {self.proc.wait()})")

    def run(self, first: int, n: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {first} {n}\n")
        self.proc.stdin.flush()
        return self.result()

    def finish(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("end\n")
        self.proc.stdin.flush()
        stats = self.result()
        self.proc.wait(timeout=60)
        return stats


def server_count(port: int) -> tuple[int, int]:
    """(requests, distinct traces) the server stored."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"query": "SELECT count(*), count(DISTINCT trace_id) FROM requests"})
    conn.request(
        "POST",
        "/api/sql",
        body=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    rows = json.loads(resp.read())["rows"]
    conn.close()
    return int(rows[0][0]), int(rows[0][1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("bare", "spool", "ship"), help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=2000, help="requests per slice")
    ap.add_argument("--repeats", type=int, default=11, help="slices per variant")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = ap.parse_args()
    if args.variant:
        run_child(args.variant)
        return

    tmp = tempfile.mkdtemp(prefix="perfsleuth-shipping-")
    port = free_port()
    server = subprocess.Popen(
        [PY, "-m", "perfsleuth", "server", "--data", os.path.join(tmp, "server"),
         "--port", str(port), "--token", TOKEN],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    children: list[Child] = []
    try:
        end = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > end or server.poll() is not None:
                    raise RuntimeError("perfsleuth server did not start") from None
                time.sleep(0.1)
        base = dict(os.environ, PERFSLEUTH_CAPTURE="0", PERFSLEUTH_SERVICE="bench-shipping")
        for k in ("PERFSLEUTH_COLLECTOR", "PERFSLEUTH_TOKEN"):
            base.pop(k, None)
        spool = Child("spool", dict(base, PERFSLEUTH_DATA=os.path.join(tmp, "spool")))
        ship = Child(
            "ship",
            dict(
                base,
                PERFSLEUTH_DATA=os.path.join(tmp, "ship"),
                PERFSLEUTH_COLLECTOR=f"http://127.0.0.1:{port}",
                PERFSLEUTH_TOKEN=TOKEN,
            ),
        )
        bare = Child("bare", dict(base, PERFSLEUTH_DATA=os.path.join(tmp, "bare")))
        children = [bare, spool, ship]
        for c in children:
            c.result()  # warmed up
        got: dict[str, list[dict[str, Any]]] = {c.variant: [] for c in children}
        n = args.requests
        for k in range(args.repeats):
            shift = k % len(children)  # the order rotates from slice to slice
            for c in children[shift:] + children[:shift]:
                got[c.variant].append(c.run(200 + k * n, n))
        stats = {c.variant: c.finish() for c in children}
        sent = 200 + args.repeats * n
        end = time.monotonic() + 60
        stored = server_count(port)
        while stored[0] < sent and time.monotonic() < end:
            time.sleep(0.5)
            stored = server_count(port)
    finally:
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    def over(a: str, b: str) -> list[float]:
        return [y["cpu_us"] / x["cpu_us"] - 1 for x, y in zip(got[a], got[b], strict=True)]

    ratios = over("spool", "ship")
    out = {
        "requests_per_slice": n,
        "slices": args.repeats,
        "queries_per_request": 1 + QUERIES,
        "bare_cpu_us": statistics.median(r["cpu_us"] for r in got["bare"]),
        "spool_cpu_us": statistics.median(r["cpu_us"] for r in got["spool"]),
        "ship_cpu_us": statistics.median(r["cpu_us"] for r in got["ship"]),
        "agent_overhead_spool": statistics.median(over("bare", "spool")),
        "agent_overhead_ship": statistics.median(over("bare", "ship")),
        "overhead": statistics.median(ratios),
        "overhead_min": min(ratios),
        "overhead_max": max(ratios),
        "threads_us": {
            v: {
                name: statistics.median(r["threads_us"].get(name, 0.0) for r in got[v])
                for name in sorted({k for r in got[v] for k in r["threads_us"]})
            }
            for v in got
        },
        "every_slice_shipped": all(r["shipped"] for r in got["ship"]),
        "bad_responses": sum(r["bad"] for v in got.values() for r in v),
        "sent": sent,
        "stored": stored[0],
        "stored_distinct": stored[1],
        "dropped": {k: v for k, v in stats["ship"].items() if k.startswith("dropped") and v},
        "forward_errors": stats["ship"].get("forward_errors", 0),
        "load_1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    print(
        f"app CPU per request (process_time, median of {args.repeats} slices of {n}, "
        f"1 + {QUERIES} sqlite3 queries each):\n"
        f"  no agent          {out['bare_cpu_us']:8.1f} µs\n"
        f"  agent, spool only {out['spool_cpu_us']:8.1f} µs   "
        f"agent overhead {out['agent_overhead_spool']:+.1%}\n"
        f"  agent, shipping   {out['ship_cpu_us']:8.1f} µs   "
        f"agent overhead {out['agent_overhead_ship']:+.1%}; shipping "
        f"{out['overhead']:+.1%} of spool only (pairs {out['overhead_min']:+.1%} .. "
        f"{out['overhead_max']:+.1%})\n"
        + "".join(
            f"  {v:5} by thread: "
            + ", ".join(f"{k} {us:.1f}" for k, us in out["threads_us"][v].items() if us >= 0.05)
            + "\n"
            for v in ("spool", "ship")
        )
        + f"server stored {stored[0]:,} of {sent:,} requests ({stored[1]:,} distinct); "
        f"load {out['load_1min']:.1f} on {out['cpus']} CPUs"
    )
    ok = stored == (sent, sent) and out["every_slice_shipped"] and not out["bad_responses"]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    if not ok:
        print("FAILED: not every request was shipped and stored once", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
