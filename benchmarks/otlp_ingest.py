"""OTLP ingest benchmark: spans per second that ``POST /v1/traces`` stores, on protobuf
payloads made with the official ``opentelemetry-proto`` messages.

    .venv/bin/python benchmarks/otlp_ingest.py [--payloads 40] [--requests 100] [--calls 10]
    .venv/bin/python benchmarks/otlp_ingest.py --literals    # a distinct literal per statement
    .venv/bin/python benchmarks/otlp_ingest.py --fuzz 10000 [--seed 19]  # mutations: no 5xx
    .venv/bin/python benchmarks/otlp_ingest.py --clients 4      # exporters posting at once
    .venv/bin/python benchmarks/otlp_ingest.py --json           # OTLP JSON (Node's exporter)

Each payload holds ``--requests`` SERVER spans (20 endpoints) with ``--calls`` CLIENT spans each
(DB statements with code.* sites, one HTTP call), like an exporter's batch. The statements have
placeholders, as pg's and psycopg's instrumentations report them; ``--literals`` writes a
distinct value into each instead (every statement is normalised anew). Timed three ways: one
payload a transaction in one thread (decode, map, insert: a payload's cost on its own); the
server's queue (server.otlp_queue) in process, every payload accepted as ``POST /v1/traces``
does while the queue's thread stores them many to a transaction (what one server process does);
and over HTTP to a ``perfsleuth server`` child process (``--clients`` exporters in this
process, each posting its share of the payloads in turn), until every payload is stored.
Rates are given per wall second and per CPU second (of this process in process; of the server
process over HTTP, every thread: the rate it would reach with a core to itself, when the
machine is shared).
Target (issue 19): 100,000 spans/s per server process.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

import server_child  # (benchmarks/, this script's directory)

TARGET = 100_000


def _kv(key: str, value: object) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _extra(*pairs: tuple[str, object]) -> list[KeyValue]:
    return [_kv(k, v) for k, v in pairs]


# What instrumentations add besides the attributes the mapping reads (Flask's, pg's)
SERVER_EXTRA = _extra(
    ("http.scheme", "http"),
    ("http.host", "127.0.0.1:8000"),
    ("net.host.port", 8000),
    ("http.flavor", "1.1"),
    ("http.user_agent", "python-requests/2.32"),
    ("net.peer.ip", "127.0.0.1"),
    ("net.peer.port", 51234),
    ("http.server_name", "127.0.0.1"),
)
DB_EXTRA = _extra(
    ("db.name", "shop"),
    ("db.user", "app"),
    ("net.peer.name", "127.0.0.1"),
    ("net.peer.port", 5432),
    ("db.connection_string", "postgresql://127.0.0.1:5432/shop"),
)


def payload(
    rnd: random.Random, requests: int, calls: int, t0: int, literals: bool = False
) -> bytes:
    msg = ExportTraceServiceRequest()
    rs = msg.resource_spans.add()
    rs.resource.attributes.extend([_kv("service.name", "bench"), _kv("host.name", "h1")])
    spans = rs.scope_spans.add().spans
    for r in range(requests):
        trace = rnd.randbytes(16)
        root = rnd.randbytes(8)
        ep = rnd.randrange(20)
        start = t0 + r * 10_000_000
        spans.append(
            Span(
                trace_id=trace,
                span_id=root,
                name=f"GET /items{ep}/:id",
                kind=Span.SPAN_KIND_SERVER,
                start_time_unix_nano=start,
                end_time_unix_nano=start + 8_000_000,
                attributes=[
                    _kv("http.request.method", "GET"),
                    _kv("http.route", f"/items{ep}/:id"),
                    _kv("http.response.status_code", 200),
                    _kv("enduser.id", f"u{rnd.randrange(500)}"),
                    *SERVER_EXTRA,
                ],
            )
        )
        for c in range(calls):
            attrs = (
                [
                    _kv("db.system", "postgresql"),
                    _kv(
                        "db.query.text",
                        f"SELECT * FROM t{c} WHERE id = {rnd.randrange(9999)}"
                        if literals
                        else f"SELECT * FROM t{c} WHERE id = $1",
                    ),
                    _kv("code.file.path", "/srv/app.js"),
                    _kv("code.line.number", 10 + c),
                    _kv("code.function.name", f"load{c}"),
                    *DB_EXTRA,
                ]
                if c < calls - 1
                else [_kv("http.request.method", "GET"), _kv("url.full", "http://api:80/x/1")]
            )
            spans.append(
                Span(
                    trace_id=trace,
                    span_id=rnd.randbytes(8),
                    parent_span_id=root,
                    name="pg.query",
                    kind=Span.SPAN_KIND_CLIENT,
                    start_time_unix_nano=start + (c + 1) * 500_000,
                    end_time_unix_nano=start + (c + 1) * 500_000 + 300_000,
                    attributes=attrs,
                )
            )
    return msg.SerializeToString()


def json_body(pb: bytes) -> bytes:
    """The OTLP JSON of a protobuf payload (ids in hex, as OTLP JSON spells them)."""
    from google.protobuf import json_format

    obj = json_format.MessageToDict(ExportTraceServiceRequest.FromString(pb))
    for rs in obj.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in sp:
                        sp[k] = base64.b64decode(sp[k]).hex()
    return json.dumps(obj).encode()


def serve(data_dir: str) -> tuple[str, Any, threading.Thread, Any]:
    """(the /v1/traces URL, uvicorn server, its thread, its backend) of the server app on a
    free port, in this process (the fuzzing run)."""
    import uvicorn

    from perfsleuth.server.app import create_app

    app = create_app(data_dir, ingest_every=3600)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}/v1/traces", server, thread, app.state.backend


def _status(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + "/api/status", timeout=30) as r:
        return json.loads(r.read())


def server_run(bodies: list[bytes], ctype: str, clients: int, total: int) -> None:
    """POST the payloads to a ``perfsleuth server`` child process (``clients`` exporters, each
    posting its share in turn) and wait until its queue has stored them all; print spans per
    second of wall time and per CPU second of the server process (every thread: HTTP, queue
    and DuckDB), until stored and until its stop (the checkpoint DuckDB defers counted)."""
    with tempfile.TemporaryDirectory() as data_dir:
        server, port = server_child.start(data_dir)
        base = f"http://127.0.0.1:{port}"
        try:
            failed: list[int] = []

            def post(mine: list[bytes]) -> None:
                for body in mine:
                    req = urllib.request.Request(
                        base + "/v1/traces", body, {"Content-Type": ctype}, method="POST"
                    )
                    with urllib.request.urlopen(req, timeout=120) as r:
                        if r.status != 200:
                            failed.append(r.status)

            threads = [
                threading.Thread(target=post, args=(bodies[i::clients],)) for i in range(clients)
            ]
            cpu0, wall = server_child.cpu_seconds(server.pid), time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            while True:  # until what was acknowledged is stored (a status waits for it)
                st = _status(base)["otlp"]
                if st["committed"] + st["failed"] >= len(bodies) or server.poll() is not None:
                    break
                time.sleep(0.02)
            wall, cpu = time.perf_counter() - wall, server_child.cpu_seconds(server.pid) - cpu0
        finally:
            cpu_closed = server_child.stop(server) - cpu0
    if failed or st["committed"] != len(bodies):
        sys.exit(f"POST answered {failed[:1]}; {st['committed']} of {len(bodies)} stored")
    rate = total / wall
    print(
        f"server process over HTTP ({clients} client{'s' * (clients > 1)}): {rate:,.0f} spans/s "
        f"({rate / TARGET:.0%} of the {TARGET:,} target), {total / cpu:,.0f} spans per CPU "
        f"second of the server ({total / cpu / TARGET:.0%}), until every payload is stored; "
        f"{total / cpu_closed:,.0f} with its stop; {st['commits']} transactions"
    )


def fuzz(n: int, seed: int = 19) -> None:
    """Post ``n`` random mutations (from ``seed``) of valid protobuf, JSON and gzip payloads;
    print the statuses answered. Exit 1 on any 5xx or a server that stops answering."""
    import gzip

    rnd = random.Random(seed)
    t0 = time.time_ns() - 3_600 * 10**9
    seeds: list[tuple[bytes, str, str | None]] = []
    for i in range(4):
        pb = payload(rnd, 3, 4, t0 + i * 10**9)
        seeds += [
            (pb, "application/x-protobuf", None),
            (json_body(pb), "application/json", None),
            (gzip.compress(pb), "application/x-protobuf", "gzip"),
        ]
    statuses: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        url, server, thread, _ = serve(os.path.join(tmp, "fuzz"))
        try:
            for _ in range(n):
                body, ctype, enc = rnd.choice(seeds)
                data = bytearray(body)
                for _ in range(rnd.randint(1, 8)):
                    i = rnd.randrange(len(data))
                    op = rnd.random()
                    if op < 0.5:
                        data[i] = rnd.randrange(256)
                    elif op < 0.75:
                        del data[i : i + rnd.randint(1, 16)]
                    else:
                        data[i:i] = rnd.randbytes(rnd.randint(1, 8))
                headers = {"Content-Type": ctype}
                if enc:
                    headers["Content-Encoding"] = enc
                req = urllib.request.Request(url, bytes(data), headers, method="POST")
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        status = r.status
                except urllib.error.HTTPError as e:
                    status = e.code
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            server.should_exit = True
            thread.join()
    print(f"{n} fuzzed payloads: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))
    if any(k >= 500 for k in statuses):
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payloads", type=int, default=40)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--literals", action="store_true", help="a distinct literal per statement")
    ap.add_argument("--fuzz", type=int, default=0, help="post N mutated payloads instead")
    ap.add_argument("--seed", type=int, default=19, help="the fuzzing run's seed")
    ap.add_argument("--clients", type=int, default=1, help="exporters posting at once (over HTTP)")
    ap.add_argument("--json", action="store_true", help="OTLP JSON payloads instead of protobuf")
    args = ap.parse_args()
    if args.fuzz:
        fuzz(args.fuzz, args.seed)
        return
    rnd = random.Random(19)
    t0 = time.time_ns() - 3_600 * 10**9
    bodies = [
        payload(rnd, args.requests, args.calls, t0 + i * 10**9, args.literals)
        for i in range(args.payloads)
    ]
    ctype = "application/json" if args.json else "application/x-protobuf"
    if args.json:
        bodies = [json_body(b) for b in bodies]
    per = args.requests * (args.calls + 1)
    total = per * len(bodies)
    print(f"{len(bodies)} payloads of {per} spans ({sum(map(len, bodies)) / len(bodies):,.0f} B)")

    from perfsleuth.server.backend import Backend
    from perfsleuth.store.duckdb_store import DuckDBStore
    from perfsleuth.store.otlp.batch import insert, to_batch
    from perfsleuth.store.otlp.payload import decode
    from perfsleuth.store.otlp.spans import Keys, Pending

    with tempfile.TemporaryDirectory() as tmp:
        # One payload a transaction, in one thread: the cost of a payload on its own.
        store = DuckDBStore(os.path.join(tmp, "alone"))
        phases = {"decode": 0.0, "map": 0.0, "insert": 0.0}  # CPU seconds (process_time)
        pending = Pending()
        wall = time.perf_counter()
        for body in bodies:
            a = time.process_time()
            msg = decode(body, ctype, None)
            b = time.process_time()
            mapped = to_batch(msg, Keys(), pending)
            c = time.process_time()
            insert(store, mapped, pending)
            d = time.process_time()
            phases["decode"] += b - a
            phases["map"] += c - b
            phases["insert"] += d - c
        wall = time.perf_counter() - wall
        cpu = sum(phases.values())
        store.close()
        rate = total / wall
        print(
            f"one payload a transaction: {rate:,.0f} spans/s, {total / cpu:,.0f} spans per CPU "
            "second; CPU ms per payload: "
            + ", ".join(f"{k} {v / len(bodies) * 1000:.1f}" for k, v in phases.items())
        )

        # The server's queue (server.otlp_queue): each payload accepted as POST /v1/traces
        # does (decoded, its spans read, written to the queue's disk), while the queue's
        # thread stores what has queued, many payloads to a transaction.
        be = Backend(os.path.join(tmp, "queue"), ingest_every=3600)
        q = be.otlp
        assert q is not None
        wall, cpu, side = time.perf_counter(), time.process_time(), time.thread_time()
        for body in bodies:
            q.accept(body, ctype, None, "")
        side = time.thread_time() - side
        q.wait(600)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        st = q.status()
        with be.use() as store:
            stored = store.query("SELECT count(*) AS n FROM calls")[0]["n"]
        be.close()
        rate = total / wall
        print(
            f"server queue: {rate:,.0f} spans/s ({rate / TARGET:.0%} of the {TARGET:,} target), "
            f"{total / cpu:,.0f} spans per CPU second ({total / cpu / TARGET:.0%}); CPU ms per "
            f"payload: accept (decode, read, write) {side / len(bodies) * 1000:.1f}, store (map, "
            f"insert) {(cpu - side) / len(bodies) * 1000:.1f}; {st['commits']} transactions for "
            f"{st['committed']} payloads; {stored:,} calls stored"
        )
        if st["committed"] != len(bodies) or st["failed"]:
            sys.exit(f"the queue stored {st['committed']} of {len(bodies)} payloads")

    server_run(bodies, ctype, args.clients, total)


if __name__ == "__main__":
    main()
