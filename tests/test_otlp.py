"""OTLP ingest (store.otlp, server.otlp): real OpenTelemetry clients export to a perfsleuth
server started here; their spans become requests and calls, and the detectors run on them."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from apps import otlp_python_app
from perfsleuth.analysis import find
from perfsleuth.server.app import create_app
from tinyfs import tmpfs


class Server:
    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.app = create_app(data_dir, ingest_every=3600)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]})
        self.thread.start()
        for _ in range(500):
            if self.uv.started:
                break
            time.sleep(0.01)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)

    def post(self, body: bytes, ctype: str, encoding: str | None = None) -> tuple[int, Any]:
        headers = {"Content-Type": ctype}
        if encoding:
            headers["Content-Encoding"] = encoding
        req = urllib.request.Request(self.url + "/v1/traces", body, headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def post_huge(self, size: int) -> int:
        """The status answered to a body of ``size`` bytes, sent until the server stops
        reading (it may answer before the body ends)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.putrequest("POST", "/v1/traces")
        conn.putheader("Content-Type", "application/x-protobuf")
        conn.putheader("Content-Length", str(size))
        conn.endheaders()
        chunk = b"\x00" * (1 << 20)
        try:
            for _ in range(size // len(chunk)):
                conn.send(chunk)
        except OSError:
            pass  # refused mid-body: the answer is waiting
        status = conn.getresponse().status
        conn.close()
        return status

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def count(self, table: str) -> int:
        be = self.app.state.backend
        with be.use() as store:
            return int(store.query(f"SELECT count(*) AS n FROM {table}")[0]["n"])


@pytest.fixture
def server(tmp_path: Any) -> Iterator[Server]:
    s = Server(str(tmp_path / "data"))
    yield s
    s.stop()


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=30) as r:
        r.read()
        return r.status


def _hit(url: str) -> int:
    try:
        return _get(url)
    except urllib.error.HTTPError as e:
        return e.code


# -------------------------------------------------------------- a Python service, the SDK


def test_python_sdk_service_n_plus_one_on_the_right_endpoint(server: Server) -> None:
    app, provider = otlp_python_app.build(server.url + "/v1/traces")
    base = f"http://127.0.0.1:{app.server_port}"
    try:
        for _ in range(20):
            assert _hit(base + "/orders") == 200
            assert _hit(base + "/orders/summary") == 200
        assert _hit(base + "/boom") == 500
        assert provider.force_flush(30_000)
    finally:
        app.shutdown()
        provider.shutdown()
    be = server.app.state.backend
    with be.use() as store:
        rows = store.query(
            "SELECT endpoint, count(*) AS n, max(db_calls) AS db, any_value(service) AS service,"
            " any_value(host) AS host, max(error) AS error, max(status) AS status"
            " FROM requests GROUP BY 1 ORDER BY 1"
        )
        by_ep = {r["endpoint"]: r for r in rows}
        # The planted query: its span and the DB-API span inside it count once.
        assert by_ep["GET /orders"]["n"] == 20
        assert by_ep["GET /orders"]["db"] == 1 + otlp_python_app.ORDERS
        assert by_ep["GET /orders"]["service"] == "otlp-shop"
        assert by_ep["GET /orders"]["host"] == "box-1"
        assert by_ep["GET /orders/summary"]["n"] == 20
        assert by_ep["GET /orders/summary"]["db"] == 1
        assert by_ep["GET /boom"]["error"] == "ValueError"
        assert by_ep["GET /boom"]["status"] == 500
        found = find(store)
    n1 = [f for f in found if f.kind == "n_plus_one"]
    assert [f.endpoint for f in n1] == ["GET /orders"], [f.title for f in found]
    assert "items" in (n1[0].fingerprint or "")
    site = n1[0].evidence["call_site"]
    assert site["function"] == "items_of" and site["file"].endswith("otlp_python_app.py")
    assert not [f for f in found if f.endpoint == "GET /orders/summary"]


# ------------------------------------------------------------ two services, linked


def test_a_call_to_another_reporting_service_shows_where_its_time_went(server: Server) -> None:
    from rich.console import Console

    from apps import otlp_linked_apps
    from perfsleuth.cli import render

    servers, providers, shop = otlp_linked_apps.build(server.url + "/v1/traces")
    try:
        for _ in range(6):
            assert _hit(shop + "/checkout") == 200
            assert _hit(shop + "/health") == 200
        for p in providers:
            assert p.force_flush(30_000)
    finally:
        for s in servers:
            s.shutdown()
        for p in providers:
            p.shutdown()
    with server.app.state.backend.use() as store:
        rows = store.query("SELECT trace_id, service, endpoint FROM requests ORDER BY ts")
    checkout = [r["trace_id"] for r in rows if r["endpoint"] == "GET /checkout"]
    invoices = [r for r in rows if r["service"] == "billing"]
    assert len(checkout) == 6 and len(invoices) == 6, rows
    for tid in checkout:
        t = server.get(f"/api/traces/{tid}")
        (http,) = [c for c in t["calls"] if c["kind"] == "http"]
        (down,) = t["links"]["downstream"]
        # the callee's request of the same trace, with where its time went
        assert down["trace_id"][:32] == tid[:32]
        assert (down["service"], down["endpoint"]) == ("billing", "GET /invoices/<int:invoice_id>")
        assert down["seq"] == http["seq"]
        assert down["db_calls"] == otlp_linked_apps.LINES
        assert "FROM lines" in down["top_call"]["text"]
        assert down["top_call"]["calls"] == otlp_linked_apps.LINES
        assert t["links"]["upstream"] is None
        callee = server.get(f"/api/traces/{down['trace_id']}")
        up = callee["links"]["upstream"]
        assert (up["trace_id"], up["service"], up["endpoint"], up["seq"]) == (
            tid,
            "shop",
            "GET /checkout",
            http["seq"],
        )
        assert callee["links"]["downstream"] == []
        console = Console(width=300, record=True)
        console.print(render.trace_header(t))
        shown = console.export_text()
        assert f"call #{http['seq']} GET 127.0.0.1:" in shown
        assert "-> billing GET /invoices/<int:invoice_id>" in shown, shown
        assert f"DB {float(down['db_ms']):.0f} ms in {otlp_linked_apps.LINES} calls" in shown
    health = [r["trace_id"] for r in rows if r["endpoint"] == "GET /health"]
    assert server.get(f"/api/traces/{health[0]}")["links"] is None
    # checkout waits mostly on billing: explain's upstream_latency says where billing's went
    with server.app.state.backend.use() as store:
        found = find(store)
    (slow,) = [f for f in found if f.kind == "upstream_latency"]
    assert slow.endpoint == "GET /checkout", [f.title for f in found]
    server.stop()
    server.app.state.backend.close()
    shown = subprocess.run(
        [sys.executable, "-m", "perfsleuth", "explain", slow.id, "--data", server.data_dir],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, COLUMNS="300"),
    )
    assert shown.returncode == 0, shown.stderr
    assert "Other services in the first example:" in shown.stdout, shown.stdout
    assert "-> billing GET /invoices/<int:invoice_id>" in shown.stdout
    assert f"in {otlp_linked_apps.LINES} calls" in shown.stdout


# ------------------------------------------------- a Node.js service, the OTel Node SDK

NODE_APP = os.path.join(os.path.dirname(__file__), "apps", "otlp_node_app")
NODE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".venvs", "node-otlp")


def _node_modules() -> str:
    """The Node apps with their npm packages (pinned in package.json; perfsleuth-node from
    node/), installed once under .venvs/node-otlp (kept between runs; reinstalled when
    package.json changes)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the Node.js OTLP test")
    os.makedirs(NODE_DIR, exist_ok=True)
    with open(os.path.join(NODE_APP, "package.json"), "rb") as fh:
        want = fh.read()
    stamp = os.path.join(NODE_DIR, ".installed")
    have = b""
    if os.path.exists(stamp):
        with open(stamp, "rb") as fh:
            have = fh.read()
    for name in ("package.json", "app.js", "blocker.js", "tracing.js"):
        shutil.copy(os.path.join(NODE_APP, name), NODE_DIR)
    if have != want:
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=NODE_DIR,
            check=True,
            timeout=600,
        )
        with open(stamp, "wb") as fh:
            fh.write(want)
    return NODE_DIR


def test_node_express_pg_n_plus_one_on_the_right_endpoint(server: Server) -> None:
    import psycopg

    from conftest import PG_DSN

    cwd = _node_modules()
    suffix = f"{os.getpid()}_{random.randrange(10**6)}"
    env = dict(
        os.environ,
        DATABASE_URL=PG_DSN,
        TABLE_SUFFIX=suffix,
        OTEL_SERVICE_NAME="node-shop",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=server.url + "/v1/traces",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_BSP_SCHEDULE_DELAY="200",
    )
    proc = subprocess.Popen(
        ["node", "--require", "./tracing.js", "app.js"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening "), line
        base = f"http://127.0.0.1:{int(line.split()[1])}"
        for _ in range(15):
            assert _hit(base + "/users/1/posts") == 200
            assert _hit(base + "/users/1") == 200
        proc.send_signal(signal.SIGTERM)  # the SDK flushes its spans on the way out
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with psycopg.connect(PG_DSN, autocommit=True) as con:
            con.execute(f"DROP TABLE IF EXISTS otlp_posts_{suffix}, otlp_comments_{suffix}")
    be = server.app.state.backend
    with be.use() as store:
        rows = store.query(
            "SELECT endpoint, count(*) AS n, max(db_calls) AS db, any_value(service) AS service"
            " FROM requests GROUP BY 1"
        )
        by_ep = {r["endpoint"]: r for r in rows}
        assert by_ep["GET /users/:id/posts"]["n"] == 15, rows
        assert by_ep["GET /users/:id/posts"]["db"] >= 21
        assert by_ep["GET /users/:id"]["n"] == 15
        assert by_ep["GET /users/:id"]["service"] == "node-shop"
        found = find(store)
    n1 = [f for f in found if f.kind == "n_plus_one"]
    assert [f.endpoint for f in n1] == ["GET /users/:id/posts"], [f.title for f in found]
    assert "otlp_comments" in (n1[0].fingerprint or "")
    assert not [f for f in found if f.endpoint == "GET /users/:id"]


def test_node_event_loop_blocker_names_the_endpoint_whose_code_blocked(server: Server) -> None:
    """perfsleuth-node preloaded next to the SDK: POST /import JSON.parses its body on the
    loop until twice the block threshold has passed (a block on any machine), POST /notes a
    small one once. Each block reaches the server as a span under the handler's, becomes a
    blocker of its request, and event_loop_blocker names POST /import only."""
    cwd = _node_modules()
    env = dict(
        os.environ,
        OTEL_SERVICE_NAME="node-import",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=server.url + "/v1/traces",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_BSP_SCHEDULE_DELAY="200",
        PERFSLEUTH_LOOP_BLOCK_MS="150",
        OTEL_LOG_LEVEL="warn",  # an export that fails says why (in the captured stderr)
        BLOCKER_HOLD_MS="300",  # blocker.js holds the loop this long in each POST /import
    )
    proc = subprocess.Popen(
        ["node", "--require", "./tracing.js", "--require", "perfsleuth-node", "blocker.js"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    rows = [
        {"id": i, "sku": f"sku-{i}", "tags": ["a", "b"], "price": i * 1.5} for i in range(20_000)
    ]
    big = json.dumps(rows).encode()  # parsed again and again for BLOCKER_HOLD_MS
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening "), line
        base = f"http://127.0.0.1:{int(line.split()[1])}"

        def post(path: str, body: bytes) -> Any:
            req = urllib.request.Request(
                base + path, body, {"Content-Type": "application/json"}, method="POST"
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
                return json.loads(r.read())

        for _ in range(3):
            imported = post("/import", big)
            assert imported["imported"] == len(rows) and imported["parses"] >= 1, imported
            for i in range(3):
                assert post("/notes", json.dumps({"text": f"note {i}"}).encode()) == {"saved": 1}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    be = server.app.state.backend
    want = {"POST /import": 3, "POST /notes": 9}
    deadline = time.monotonic() + 60  # a payload may still be on its way in on a busy machine
    while True:
        with be.use() as store:
            reqs = store.query("SELECT endpoint, count(*) AS n FROM requests GROUP BY 1")
        if {r["endpoint"]: r["n"] for r in reqs} == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {r["endpoint"]: r["n"] for r in reqs} == want
    with be.use() as store:
        blocks = store.query(
            "SELECT b.trace_id, b.endpoint, b.duration_ms, b.service, r.endpoint AS request"
            " FROM blockers b LEFT JOIN requests r USING (trace_id) WHERE r.endpoint IS NULL"
            " OR r.endpoint = 'POST /import'"
        )
        found = find(store)
    # Each /import blocked the loop in its own request (a /notes request may meet one block of
    # its own on a machine busy enough to stall a process that long: no finding needs one).
    assert len({b["trace_id"] for b in blocks}) == 3, blocks
    assert all(b["request"] == b["endpoint"] == "POST /import" for b in blocks), blocks
    # perfsleuth-node reports only blocks of PERFSLEUTH_LOOP_BLOCK_MS or more
    assert all(b["duration_ms"] >= 150 and b["service"] == "node-import" for b in blocks)
    elb = [f for f in found if f.kind == "event_loop_blocker"]
    assert [f.endpoint for f in elb] == ["POST /import"], [f.title for f in found]
    assert elb[0].evidence["blocks"] >= 3, elb[0].title
    assert elb[0].title.startswith("Code (no stack was recorded) blocked the event loop in POST")
    assert not [f for f in found if f.endpoint == "POST /notes"], [f.title for f in found]


# ----------------------------------------------------------------- hand-made payloads


def _kv(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": str(value)}}


def _payload(trace: str, *, queries: int = 3, code: bool = False) -> dict[str, Any]:
    """OTLP JSON: one SERVER span with ``queries`` CLIENT spans (postgresql) and one HTTP call."""
    t0 = 1_764_000_000_000_000_000
    spans = [
        {
            "traceId": trace,
            "spanId": "a" * 16,
            "name": "GET /users/:id",
            "kind": 2,
            "startTimeUnixNano": str(t0),
            "endTimeUnixNano": str(t0 + 50_000_000),
            "attributes": [
                _kv("http.request.method", "GET"),
                _kv("http.route", "/users/:id"),
                _kv("url.path", "/users/7"),
                _kv("http.response.status_code", 200),
                _kv("enduser.id", "u7"),
                _kv("tenant.id", "acme"),
                _kv("http.request.body.size", 1234),
            ],
        }
    ]
    for i in range(queries):
        attrs = [
            _kv("db.system", "postgresql"),
            _kv("db.query.text", f"SELECT * FROM posts WHERE user_id = {i}"),
            _kv("db.response.returned_rows", 2),
        ]
        if code:
            attrs += [_kv("code.file.path", "/srv/app.js"), _kv("code.line.number", 12)]
            attrs += [_kv("code.function.name", "loadPosts")]
        spans.append(
            {
                "traceId": trace,
                "spanId": f"{i + 1:016x}",
                "parentSpanId": "a" * 16,
                "name": "pg.query",
                "kind": 3,
                "startTimeUnixNano": str(t0 + (i + 1) * 1_000_000),
                "endTimeUnixNano": str(t0 + (i + 1) * 1_000_000 + 500_000),
                "attributes": attrs,
            }
        )
    spans.append(
        {
            "traceId": trace,
            "spanId": "b" * 16,
            "parentSpanId": "a" * 16,
            "name": "GET",
            "kind": 3,
            "startTimeUnixNano": str(t0 + 40_000_000),
            "endTimeUnixNano": str(t0 + 45_000_000),
            "attributes": [
                _kv("http.request.method", "GET"),
                _kv("url.full", "http://user:pw@billing.internal:8080/accounts/123?x=1"),
                _kv("http.response.status_code", 503),
            ],
            "status": {"code": 2, "message": "upstream down"},
        }
    )
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [_kv("service.name", "node-api")]},
                "scopeSpans": [{"spans": spans}],
            }
        ]
    }


def _proto(obj: dict[str, Any]) -> bytes:
    from perfsleuth.store.otlp.payload import decode

    return bytes(decode(json.dumps(obj).encode(), "application/json", None).SerializeToString())


def test_json_and_gzip_protobuf_map_requests_and_calls_once(server: Server) -> None:
    trace = "0123456789abcdef0123456789abcdef"
    status, _ = server.post(json.dumps(_payload(trace, code=True)).encode(), "application/json")
    assert status == 200
    pb = gzip.compress(_proto(_payload("f" * 32)))
    status, _ = server.post(pb, "application/x-protobuf", "gzip")
    assert status == 200
    # The same payload again: requests are unique by trace + span id, nothing doubles.
    assert server.post(pb, "application/x-protobuf", "gzip")[0] == 200
    assert server.count("requests") == 2
    assert server.count("calls") == 8
    be = server.app.state.backend
    with be.use() as store:
        req = store.query(f"SELECT * FROM requests WHERE trace_id = '{trace}{'a' * 16}'")[0]
        calls = store.query(
            "SELECT c.kind, c.system, c.rows, c.host, c.status, c.error, f.text, l.file, l.line,"
            " l.function FROM calls c LEFT JOIN fingerprints f ON f.id = c.fingerprint_id"
            f" LEFT JOIN locations l ON l.id = c.site_id WHERE c.trace_id = '{trace}{'a' * 16}'"
            " ORDER BY c.seq"
        )
    assert req["endpoint"] == "GET /users/:id" and req["service"] == "node-api"
    assert (req["user"], req["tenant"], req["status"]) == ("u7", "acme", 200)
    assert req["req_bytes"] == 1234 and req["resp_bytes"] is None
    assert req["db_calls"] == 3 and req["http_calls"] == 1
    assert req["duration_ms"] == pytest.approx(50.0)
    db = calls[0]
    assert (db["kind"], db["system"], db["rows"]) == ("db", "postgresql", 2)
    assert db["text"] == "SELECT * FROM posts WHERE user_id = ?"
    assert (db["file"], db["line"], db["function"]) == ("/srv/app.js", 12, "loadPosts")
    http = calls[-1]
    assert (http["kind"], http["host"], http["status"]) == ("http", "billing.internal:8080", 503)
    assert http["text"] == "GET billing.internal:8080/accounts/{id}"
    assert http["error"] == "upstream down"


def test_calls_sent_before_their_server_span_join_it(server: Server) -> None:
    payload = _payload("1" * 32)
    spans = payload["resourceSpans"][0]["scopeSpans"][0]["spans"]
    # a framework's INTERNAL span between the request and its calls (Express's handler)
    handler = dict(spans[0], spanId="c" * 16, parentSpanId="a" * 16, kind=1, attributes=[])
    for s in spans[1:]:
        s["parentSpanId"] = "c" * 16
    spans.insert(1, handler)
    children = json.loads(json.dumps(payload))
    children["resourceSpans"][0]["scopeSpans"][0]["spans"] = spans[1:]
    parent = json.loads(json.dumps(payload))
    parent["resourceSpans"][0]["scopeSpans"][0]["spans"] = spans[:1]
    assert server.post(json.dumps(children).encode(), "application/json")[0] == 200
    assert server.count("requests") == 0
    assert server.post(json.dumps(parent).encode(), "application/json")[0] == 200
    assert server.count("requests") == 1
    assert server.count("calls") == 4


def test_n_plus_one_without_code_attributes_names_no_site(server: Server) -> None:
    for i in range(10):
        body = json.dumps(_payload(f"{i + 2:032x}", queries=12)).encode()
        assert server.post(body, "application/json")[0] == 200
    be = server.app.state.backend
    with be.use() as store:
        found = find(store)
    n1 = [f for f in found if f.kind == "n_plus_one"]
    assert [f.endpoint for f in n1] == ["GET /users/:id"]
    assert n1[0].evidence["call_site"] is None
    assert n1[0].callsite is None
    assert "an unknown call site (no code location was recorded)" in n1[0].title  # not "?"


# -------------------------------------------------------------------- refusals and fuzz


def test_malformed_payloads_are_refused_and_nothing_is_stored(server: Server) -> None:
    good = json.dumps(_payload("2" * 32)).encode()
    cases = [
        (b"\xff\xff\xff\x0f garbage", "application/x-protobuf", None, 400),
        (b'{"resourceSpans": [', "application/json", None, 400),
        (
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
            "application/json",
            None,
            400,
        ),
        (b"[1, 2]", "application/json", None, 400),
        (b"not gzip at all", "application/x-protobuf", "gzip", 400),
        (gzip.compress(good)[:-9], "application/json", "gzip", 400),
        (good, "text/plain", None, 415),
        (good, "application/json", "br", 415),
        (gzip.compress(b" " * (129 * 1024 * 1024)), "application/json", "gzip", 413),
    ]
    for body, ctype, enc, want in cases:
        status, reply = server.post(body, ctype, enc)
        assert status == want, (ctype, enc, body[:40], reply)
        assert reply["error"]
    assert server.post_huge(33 * 1024 * 1024) == 413
    assert server.count("requests") == 0
    # the server is up and takes a good payload
    assert server.post(good, "application/json")[0] == 200
    assert server.count("requests") == 1


def _ld(field: int, b: bytes) -> bytes:
    """A length-delimited protobuf field: its tag, length and bytes."""
    from google.protobuf.internal.encoder import _VarintBytes

    return bytes(_VarintBytes((field << 3) | 2) + _VarintBytes(len(b)) + b)


def _with_span(msg: Any, i: int, span_bytes: bytes) -> bytes:
    """The request's bytes with span ``i`` of its first scope replaced by ``span_bytes``."""
    rs = msg.resource_spans[0]
    ss = rs.scope_spans[0]
    spans = [s.SerializeToString() for s in ss.spans]
    spans[i] = span_bytes
    scope = _ld(1, ss.scope.SerializeToString()) + b"".join(_ld(2, s) for s in spans)
    return _ld(1, _ld(1, rs.resource.SerializeToString()) + _ld(2, scope))


def test_a_malformed_attribute_status_or_event_is_refused(server: Server) -> None:
    """The spans' attributes, status and events are decoded after the payload (each distinct
    attribute once, store.otlp.view): one that is not the official message still refuses
    the payload with a 400, as a full parse did, and stores nothing of it."""
    from perfsleuth.store.otlp.view import messages

    good = _proto(_payload("4" * 32, code=True))
    bad_key = b"\x0a\x02\xff\xfe"  # KeyValue.key: two bytes that are not UTF-8
    bad_status = b"\x12\x02\xff\xfe"  # Status.message: the same
    bad_event = b"\x1a\x03\x0a\x01"  # Span.Event.name: cut short
    for field, raw in (("attributes", bad_key), ("status", bad_status), ("events", bad_event)):
        msg = messages().request.FromString(good)
        span = msg.resource_spans[0].scope_spans[0].spans[1]
        if field == "status":  # a message of the view: its bytes after the span's
            body = _with_span(msg, 1, span.SerializeToString() + _ld(15, raw))
        else:
            getattr(span, field).append(raw)
            body = msg.SerializeToString()
        status, reply = server.post(body, "application/x-protobuf")
        assert status == 400, (field, reply)
        assert "bad protobuf" in reply["error"]
    assert server.count("requests") == 0
    assert server.post(good, "application/x-protobuf")[0] == 200
    assert server.count("requests") == 1


def test_a_malformed_event_or_status_beside_an_exception_event_is_refused(
    server: Server,
) -> None:
    """Every event and the status of a span are parsed, also after its ``exception`` event
    gave the error: a malformed one refuses the payload (400) as a full parse does (they
    were accepted)."""
    from perfsleuth.store.otlp.view import messages

    good = _proto(_payload("5" * 32, code=True))
    msg = messages().official.FromString(good)
    span = msg.resource_spans[0].scope_spans[0].spans[1]
    ev = span.events.add(name="exception")
    ev.attributes.add(key="exception.type").value.string_value = "ValueError"
    for extra in (_ld(11, b"\xff\xff\xff"), _ld(15, b"\xff\xff\xff")):  # an event, a status
        body = _with_span(msg, 1, span.SerializeToString() + extra)
        with pytest.raises(Exception):  # noqa: B017 (the official parse refuses it)
            messages().official.FromString(body)
        status, reply = server.post(body, "application/x-protobuf")
        assert status == 400, reply
        assert "bad protobuf" in reply["error"]
    assert server.count("requests") == 0


def test_a_status_sent_twice_is_merged_as_a_full_parse_does() -> None:
    """A span's Status field sent twice is one Status, the two merged (protobuf's rule for a
    message field): an ERROR code in the first and a message in the second is an error with
    that message (the view kept the last bytes only: no error)."""
    from opentelemetry.proto.trace.v1 import trace_pb2

    from perfsleuth.store.otlp import spans
    from perfsleuth.store.otlp.payload import decode
    from perfsleuth.store.otlp.view import messages

    first = trace_pb2.Span(
        trace_id=b"\x01" * 16, span_id=b"\x02" * 8, kind=2, name="GET /x",
        start_time_unix_nano=10**18, end_time_unix_nano=10**18 + 10**6,
        status=trace_pb2.Status(code=2, message="boom"),
    )  # fmt: skip
    later = trace_pb2.Span(status=trace_pb2.Status(message="later"))
    body = _ld(1, _ld(2, _ld(2, first.SerializeToString() + later.SerializeToString())))
    official = messages().official.FromString(body)
    st = official.resource_spans[0].scope_spans[0].spans[0].status
    assert (st.code, st.message) == (2, "later")
    (span,) = spans.read(decode(body, "application/x-protobuf", None), spans.Keys())
    assert span.error == "later"
    assert spans.read(official, spans.Keys()) == [span]


def test_attributes_decoded_once_read_as_a_full_parse_does(monkeypatch: Any) -> None:
    """Spans read through the attribute cache, when it starts over in the middle of a payload
    (more distinct attributes than it keeps) and with attributes too long to keep, are the
    spans read from freshly decoded official messages."""
    from perfsleuth.store.otlp import spans, view

    def payloads() -> list[ExportTraceServiceRequest]:
        out = []
        for i in range(3):
            p = _payload(f"{i + 5:032x}", queries=6, code=True)
            sp = p["resourceSpans"][0]["scopeSpans"][0]["spans"]
            sp[1]["attributes"].append(_kv("db.query.parameter.0", "x" * 3000))
            sp[2]["attributes"].append(_kv("db.statement", "SELECT " + "y" * 2000))
            sp[0]["events"] = [
                {"name": "exception", "attributes": [_kv("exception.type", "KeyError")]}
            ]
            out.append(ExportTraceServiceRequest.FromString(_proto(p)))
        return out

    def read_all(keys: spans.Keys) -> list[spans.Span]:
        return [s for m in payloads() for s in spans.read(m, keys)]

    def fresh(keys: spans.Keys) -> list[spans.Span]:
        spans._caches.clear()
        return read_all(keys)

    want = fresh(spans.Keys())
    assert want[0].error == "KeyError" and want[1].attrs["db.query.parameter.0"] == "x" * 3000
    assert want[1].attrs[spans.PARAMETER] is True and spans.PARAMETER not in want[2].attrs
    assert read_all(spans.Keys()) == want  # from the cache
    cache = spans._cache(spans.SPAN_KEYS | set(spans.Keys().user) | set(spans.Keys().tenant))
    assert all(len(k) <= view.MAX_ATTRIBUTE_BYTES for k in cache.known)  # long ones forgotten
    assert cache.bytes == sum(map(len, cache.known))
    monkeypatch.setattr(view, "MAX_ATTRIBUTES", 5)
    assert fresh(spans.Keys()) == want  # started over in every payload
    assert read_all(spans.Keys()) == want
    monkeypatch.setattr(view, "MAX_ATTRIBUTES", 20_000)
    monkeypatch.setattr(view, "MAX_KEPT_BYTES", 200)  # by their bytes
    assert fresh(spans.Keys()) == want
    assert read_all(spans.Keys()) == want
    cache = spans._cache(spans.SPAN_KEYS | set(spans.Keys().user) | set(spans.Keys().tenant))
    assert cache.bytes == sum(map(len, cache.known)) <= 200 + 3 * view.MAX_ATTRIBUTE_BYTES
    other = spans.Keys(user=("db.system",))
    assert [s.attrs.get("db.system") for s in fresh(other)] == [
        s.attrs.get("db.system") for s in want
    ]


def test_a_payload_over_the_cache_s_bounds_is_not_kept_after_it(monkeypatch: Any) -> None:
    """A payload with more distinct attributes (or more of their bytes) than the cache keeps
    is decoded whole, and the cache holds none of it afterwards: it stays within its bounds
    between payloads (30,000 distinct 1 KB statements were all kept, 68 MB)."""
    from perfsleuth.store.otlp import spans, view

    def big(n: int) -> ExportTraceServiceRequest:
        p = _payload("6" * 32, queries=n)
        return ExportTraceServiceRequest.FromString(_proto(p))

    monkeypatch.setattr(view, "MAX_ATTRIBUTES", 20)
    spans._caches.clear()
    cache = spans._cache(spans.SPAN_KEYS | set(spans.Keys().user) | set(spans.Keys().tenant))
    out = spans.read(big(40), spans.Keys())  # 40 distinct statements
    assert len(out) == 42 and out[40].attrs["db.query.text"].endswith("= 39")
    assert len(cache.known) <= view.MAX_ATTRIBUTES
    assert cache.bytes == sum(map(len, cache.known))
    monkeypatch.setattr(view, "MAX_ATTRIBUTES", 20_000)
    monkeypatch.setattr(view, "MAX_KEPT_BYTES", 500)  # by their bytes
    spans._caches.clear()
    cache = spans._cache(spans.SPAN_KEYS | set(spans.Keys().user) | set(spans.Keys().tenant))
    assert spans.read(big(40), spans.Keys()) == out
    assert cache.bytes == sum(map(len, cache.known)) <= view.MAX_KEPT_BYTES
    assert spans.read(big(3), spans.Keys())  # a small payload is kept again
    assert 0 < cache.bytes <= view.MAX_KEPT_BYTES


def test_json_payloads_decode_as_protobuf_s_json_mapping_does() -> None:
    """payload.decode parses each distinct JSON attribute once (and keeps its bytes): the
    message is the one protobuf's JSON mapping makes of the whole payload, for attributes of
    every value type, repeated and not, spelled in the ways the mapping takes, and a bad one
    is refused as the mapping refuses it."""
    import base64
    import copy

    from google.protobuf import json_format

    from perfsleuth.store.otlp.payload import OtlpError, decode

    def whole(obj: dict[str, Any]) -> ExportTraceServiceRequest:
        obj = copy.deepcopy(obj)
        for rs in obj["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    for d in (sp, *sp.get("links", ())):
                        for k in ("traceId", "spanId", "parentSpanId"):
                            if k in d:
                                d[k] = base64.b64encode(bytes.fromhex(d[k])).decode()
        return json_format.ParseDict(obj, ExportTraceServiceRequest(), ignore_unknown_fields=True)

    odd: list[Any] = [
        {"key": "s", "value": {"stringValue": "x"}},
        {"key": "i", "value": {"intValue": "7"}},
        {"key": "i", "value": {"intValue": 7}},  # a number, and the same key twice
        {"key": "d", "value": {"doubleValue": 1}},
        {"key": "d", "value": {"doubleValue": 1.5}},
        {"key": "b", "value": {"boolValue": True}},
        {"key": "y", "value": {"bytesValue": "AAE="}},
        {"key": "a", "value": {"arrayValue": {"values": [{"intValue": "1"}]}}},
        {"key": "m", "value": {"kvlistValue": {"values": [{"key": "k", "value": {}}]}}},
        {"key": "e", "value": {}},
        {"key": "u", "value": {"stringValue": "x"}, "unknownField": 1},
        {"key": "n"},
        [],  # (the mapping takes these as empty KeyValues)
        "not an attribute",
    ]
    payloads = [_payload(f"{i + 7:032x}", code=True) for i in range(2)]
    for p in payloads:
        spans = p["resourceSpans"][0]["scopeSpans"][0]["spans"]
        spans[1]["attributes"] += odd
        spans[2]["attributes"] = None
        del spans[3]["attributes"]
        del spans[3]["parentSpanId"]
        spans[4]["parentSpanId"] = ""
        spans[1]["links"] = [{"traceId": "ab" * 16, "spanId": "cd" * 8, "attributes": odd[:2]}]
        spans[1]["kind"] = "SPAN_KIND_CLIENT"  # a name (the mapping takes both)
        spans[2]["startTimeUnixNano"] = int(spans[2]["startTimeUnixNano"])  # a number
        spans[2]["end_time_unix_nano"] = spans[2].pop("endTimeUnixNano")  # the field's name
        spans[2]["name"] = ""
        spans[3]["startTimeUnixNano"] = "00" + spans[3]["startTimeUnixNano"]
        del spans[3]["kind"]
    for _ in range(2):  # parsed, then from what was kept
        for p in payloads:
            got = decode(json.dumps(p).encode(), "application/json", None)
            assert ExportTraceServiceRequest.FromString(got.SerializeToString()) == whole(p)
    for bad in (
        {"key": "b", "value": {"boolValue": 1}},  # a number for a bool (True is kept)
        {"key": "i", "value": {"intValue": "seven"}},
        {"key": 3, "value": {"stringValue": "x"}},
        7,
        {"key": "not a list"},
        {"name": 7},
        {"startTimeUnixNano": "1 2"},
        {"startTimeUnixNano": "-5"},
        {"startTimeUnixNano": str(2**64)},
        {"endTimeUnixNano": 1.5},
        # what the mapping takes, though odd (an unknown kind is left out, True is 1, the
        # field twice is the last)
        {"kind": "SPAN_KIND_NOT"},
        {"kind": True},
        {"kind": 2**40},
        {"kind": 99},
        {"traceId": "ab" * 16, "trace_id": "q80="},
    ):
        p = copy.deepcopy(payloads[0])
        span = p["resourceSpans"][0]["scopeSpans"][0]["spans"][1]
        if isinstance(bad, dict) and "key" in bad:
            span["attributes"] = bad
        elif isinstance(bad, dict):
            span.update(bad)
        else:
            span["attributes"].append(bad)
        try:
            want = whole(p)
        except (json_format.ParseError, TypeError, ValueError):
            with pytest.raises(OtlpError) as e:
                decode(json.dumps(p).encode(), "application/json", None)
            assert e.value.status == 400
        else:
            got = decode(json.dumps(p).encode(), "application/json", None)
            assert ExportTraceServiceRequest.FromString(got.SerializeToString()) == want, bad


def test_json_attributes_minus_zero_and_zero_are_told_apart() -> None:
    """A JSON double -0.0 after a 0.0 of the same key (and the other way) decodes to its own
    value, as protobuf's JSON mapping makes it: the attribute cache keys floats by their repr
    (-0.0 == 0.0 took the other's bytes)."""
    import math

    from google.protobuf import json_format
    from opentelemetry.proto.common.v1 import common_pb2

    from perfsleuth.store.otlp.payload import decode

    def body(v: float) -> bytes:
        sp = _payload("7" * 32, queries=0)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        sp["attributes"] = [{"key": "ratio", "value": {"doubleValue": v}}]
        return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [sp]}]}]}).encode()

    for v in (0.0, -0.0, 0.0, -0.0):
        msg = decode(body(v), "application/json", None)
        raw = msg.resource_spans[0].scope_spans[0].spans[0].attributes[0]
        got = common_pb2.KeyValue.FromString(raw).value.double_value
        ref = json_format.Parse(body(v), ExportTraceServiceRequest(), ignore_unknown_fields=True)
        want = ref.resource_spans[0].scope_spans[0].spans[0].attributes[0].value.double_value
        assert math.copysign(1, got) == math.copysign(1, want) == math.copysign(1, v)


def test_the_garbage_collector_is_off_only_while_payloads_are_mapped(monkeypatch: Any) -> None:
    """Mapping pauses the cyclic collector (store.gc_pause: seen off from inside the
    mapping) and turns it on again after, when it fails too, and only once the last of
    overlapping pauses is done."""
    import gc

    from perfsleuth.store import gc_pause
    from perfsleuth.store.otlp import batch
    from perfsleuth.store.otlp.payload import OtlpError, decode
    from perfsleuth.store.otlp.view import messages

    inside: list[bool] = []
    map_ = batch._map

    def watched(*args: Any) -> Any:
        inside.append(gc.isenabled())
        return map_(*args)

    monkeypatch.setattr(batch, "_map", watched)
    assert gc.isenabled()
    good = _proto(_payload("6" * 32, code=True))
    assert batch.to_batch(decode(good, "application/x-protobuf", None)).requests == 1
    assert inside == [False]
    assert gc.isenabled()
    bad = messages().request.FromString(good)
    bad.resource_spans[0].scope_spans[0].spans[1].attributes.append(b"\x0a\x02\xff\xfe")
    with pytest.raises(OtlpError):
        batch.to_batch(bad)
    assert gc.isenabled()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def a() -> None:
        with gc_pause.paused():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with gc_pause.paused():
            b_in.set()
            a_out.wait(10)
            seen.append(gc.isenabled())  # A is out, B still in

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [False]
    assert gc.isenabled()
    gc_pause.thaw()
    assert gc.get_freeze_count() == 0


def test_fuzzed_payloads_never_fail_the_server(server: Server) -> None:
    rnd = random.Random(19)
    seeds = [_proto(_payload(f"{i + 3:032x}", code=True)) for i in range(3)]
    seeds_json = [json.dumps(_payload(f"{i + 9:032x}")).encode() for i in range(3)]
    statuses: dict[int, int] = {}
    for n in range(300):
        is_json = n % 3 == 0
        data = bytearray(rnd.choice(seeds_json if is_json else seeds))
        for _ in range(rnd.randint(1, 8)):
            op = rnd.random()
            i = rnd.randrange(len(data))
            if op < 0.5:
                data[i] = rnd.randrange(256)
            elif op < 0.75:
                del data[i : i + rnd.randint(1, 16)]
            else:
                data[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 8)))
        status, reply = server.post(
            bytes(data), "application/json" if is_json else "application/x-protobuf"
        )
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400), (n, status, reply)
    assert statuses.get(200) and statuses.get(400)
    assert server.count("requests") > 0


# ------------------------------------------------- detectors on OTLP requests and calls


def _server_payload(
    trace: int, route: str, total_ms: float, calls: list[tuple[float, float, dict[str, Any]]]
) -> dict[str, Any]:
    """OTLP JSON of one SERVER span (``route``, ``total_ms``) with CLIENT spans given as
    (start ms, duration ms, attributes)."""
    t0 = 1_764_000_000_000_000_000 + trace * 1_000_000_000
    tid = f"{trace:032x}"
    root = f"{trace:016x}"
    spans = [
        {
            "traceId": tid,
            "spanId": root,
            "name": f"GET {route}",
            "kind": 2,
            "startTimeUnixNano": str(t0),
            "endTimeUnixNano": str(t0 + int(total_ms * 1e6)),
            "attributes": [
                _kv("http.request.method", "GET"),
                _kv("http.route", route),
                _kv("http.response.status_code", 200),
            ],
        }
    ]
    for i, (start, dur, attrs) in enumerate(calls):
        spans.append(
            {
                "traceId": tid,
                "spanId": f"{trace % 2**32:08x}{i + 1:08x}",
                "parentSpanId": root,
                "name": "call",
                "kind": 3,
                "startTimeUnixNano": str(t0 + int(start * 1e6)),
                "endTimeUnixNano": str(t0 + int((start + dur) * 1e6)),
                "attributes": [_kv(k, v) for k, v in attrs.items()],
            }
        )
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [_kv("service.name", "java-shop")]},
                "scopeSpans": [{"spans": spans}],
            }
        ]
    }


def _db(sql: str, **more: Any) -> dict[str, Any]:
    return {"db.system": "mysql", "db.statement": sql, **more}


# endpoint -> (the detector that must fire there, or None for a clean endpoint; its traffic)
_PLANTED: dict[str, tuple[str | None, Any]] = {
    "/n1": (
        "n_plus_one",
        lambda: [
            (1 + 6 * i, 5, _db(f"SELECT * FROM items WHERE order_id = {i}")) for i in range(12)
        ],
    ),
    "/repeat": (
        "repeated_query",
        lambda: [
            (1 + 10 * i, 8, _db("SELECT * FROM settings WHERE name = 'tax'")) for i in range(3)
        ],
    ),
    "/export": (
        "oversized_result",
        lambda: [(1, 60, _db("SELECT * FROM orders", **{"db.response.returned_rows": 60_000}))],
    ),
    "/quote": (
        "upstream_latency",
        lambda: [(1, 70, {"http.request.method": "GET", "url.full": "http://carrier:9000/q"})],
    ),
    "/clean": ("", lambda: [(1, 2, _db("SELECT * FROM users WHERE id = $1"))]),
}
_TOTAL_MS = {"/n1": 80.0, "/repeat": 30.0, "/export": 80.0, "/quote": 75.0, "/clean": 5.0}


def test_detectors_on_otlp_requests_and_calls(server: Server) -> None:
    trace = 10_000
    for route, (_, calls) in _PLANTED.items():
        for _ in range(10):
            trace += 1
            body = _server_payload(trace, route, _TOTAL_MS[route], calls())
            assert server.post(json.dumps(body).encode(), "application/json")[0] == 200
    assert server.count("requests") == 10 * len(_PLANTED)  # the clean endpoint's too
    be = server.app.state.backend
    with be.use() as store:
        found = find(store)
    kinds = {(f.endpoint, f.kind) for f in found}
    for route, (kind, _) in _PLANTED.items():
        if kind:
            assert (f"GET {route}", kind) in kinds, sorted(kinds)
    assert not [k for k in kinds if k[0] == "GET /clean"], sorted(kinds)
    # each finding on its planted endpoint only
    assert {k for k in kinds if k[1] in {v[0] for v in _PLANTED.values()}} == {
        (f"GET {r}", v[0]) for r, v in _PLANTED.items() if v[0]
    }, sorted(kinds)


def test_odd_but_valid_spans_are_stored_or_left_out_never_a_failure(server: Server) -> None:
    """Seeded well-formed payloads with odd contents: parent cycles, ids of any length, times
    at the ends of uint64, attribute values of every type where strings or numbers belong."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    rnd = random.Random(7)
    keys = [
        "http.route", "http.request.method", "http.response.status_code", "url.path",
        "db.system", "db.statement", "db.query.text", "db.response.returned_rows",
        "code.filepath", "code.lineno", "code.function", "url.full", "server.port",
        "enduser.id", "db.query.parameter.0", "http.request.body.size",
    ]  # fmt: skip

    def value() -> AnyValue:
        pick = rnd.randrange(7)
        if pick == 0:
            return AnyValue(
                string_value=rnd.choice(["", "SELECT 1", "redis", "\u00e9\U0001f600", "x" * 5000])
            )
        if pick == 1:
            return AnyValue(int_value=rnd.choice([0, -1, 2**63 - 1, -(2**63), 200]))
        if pick == 2:
            return AnyValue(double_value=rnd.choice([float("nan"), float("inf"), -0.0, 1e300]))
        if pick == 3:
            return AnyValue(bool_value=True)
        if pick == 4:
            return AnyValue(bytes_value=rnd.randbytes(5))
        if pick == 5:
            v = AnyValue()
            v.array_value.values.add(string_value="a")
            return v
        return AnyValue()

    stored_before = 0
    for n in range(60):
        msg = ExportTraceServiceRequest()
        rs = msg.resource_spans.add()
        rs.resource.attributes.append(KeyValue(key="service.name", value=value()))
        spans = rs.scope_spans.add().spans
        ids = [rnd.randbytes(rnd.choice([8, 8, 8, 0, 3])) for _ in range(8)]
        trace = rnd.randbytes(rnd.choice([16, 16, 0, 5]))
        for i in range(8):
            spans.append(
                Span(
                    trace_id=trace,
                    span_id=ids[i],
                    parent_span_id=rnd.choice([*ids, b""]),
                    kind=rnd.choice([0, 1, 2, 2, 3, 3, 4, 5, 99]),
                    start_time_unix_nano=rnd.choice([0, 1, 2**64 - 1, 1_764_000_000 * 10**9]),
                    end_time_unix_nano=rnd.choice([0, 2**64 - 1, 1_764_000_001 * 10**9]),
                    attributes=[KeyValue(key=rnd.choice(keys), value=value()) for _ in range(6)],
                )
            )
        status, reply = server.post(msg.SerializeToString(), "application/x-protobuf")
        assert status == 200, (n, reply)
        stored = server.count("requests")
        assert stored >= stored_before
        stored_before = stored
    assert stored_before > 0


def _span(
    trace: str,
    span: str,
    parent: str,
    kind: int,
    start_ms: float,
    dur_ms: float,
    attrs: dict[str, Any] | None = None,
    name: str = "span",
) -> dict[str, Any]:
    t0 = 1_764_000_000_000_000_000
    out = {
        "traceId": trace,
        "spanId": span,
        "name": name,
        "kind": kind,
        "startTimeUnixNano": str(t0 + int(start_ms * 1e6)),
        "endTimeUnixNano": str(t0 + int((start_ms + dur_ms) * 1e6)),
        "attributes": [_kv(k, v) for k, v in (attrs or {}).items()],
    }
    if parent:
        out["parentSpanId"] = parent
    return out


def _otlp(service: str, *spans: dict[str, Any]) -> bytes:
    body = {
        "resourceSpans": [
            {
                "resource": {"attributes": [_kv("service.name", service)]},
                "scopeSpans": [{"spans": list(spans)}],
            }
        ]
    }
    return json.dumps(body).encode()


def test_loop_blocks_find_their_request_in_any_payload_order(server: Server) -> None:
    """A block span sent after its request was stored is filed under it (the request whose
    span holds it); one sent before its request waits for it, and gets the last call the
    request finished before the block; one under no request is a blocker of none."""
    tr = [f"{i + 1:032x}" for i in range(3)]
    route = {"http.request.method": "POST", "http.route": "/import"}
    srv = [_span(t, "a" * 16, "", 2, 0, 900, route) for t in tr]
    handler = [_span(t, "b" * 16, "a" * 16, 1, 1, 890, name="request handler") for t in tr]
    sql = {"db.system": "postgresql", "db.query.text": "SELECT * FROM big_table"}
    query = _span(tr[1], "c" * 16, "b" * 16, 3, 5, 40, {**sql, "db.response.returned_rows": 90_000})
    blocked = {"perfsleuth.block.ms": 700.0, "perfsleuth.block.delayed": 2}
    block = [_span(t, "d" * 16, "b" * 16, 1, 50, 700, blocked, "perfsleuth.loop_block") for t in tr]
    # 1: the request first, its block in a later payload
    assert server.post(_otlp("node-api", srv[0], handler[0]), "application/json")[0] == 200
    assert server.post(_otlp("node-api", block[0]), "application/json")[0] == 200
    # 2: the block first (its request has not ended yet), then the request with its query
    assert server.post(_otlp("node-api", block[1], handler[1]), "application/json")[0] == 200
    assert server.count("blockers") == 1
    assert server.post(_otlp("node-api", srv[1], query), "application/json")[0] == 200
    # 3: a block under no span at all
    alone = {"perfsleuth.block.ms": 300.0}
    lone = _span(tr[2], "e" * 16, "", 1, 0, 300, alone, "perfsleuth.loop_block")
    assert server.post(_otlp("node-api", lone), "application/json")[0] == 200
    with server.app.state.backend.use() as store:
        rows = store.query(
            "SELECT trace_id, endpoint, duration_ms, delayed, last_call, last_rows, service"
            " FROM blockers ORDER BY trace_id NULLS LAST"
        )
    assert [(r["trace_id"], r["endpoint"]) for r in rows] == [
        (tr[0] + "a" * 16, "POST /import"),
        (tr[1] + "a" * 16, "POST /import"),
        (None, ""),
    ], rows
    assert rows[0]["last_call"] is None
    assert (rows[1]["last_call"], rows[1]["last_rows"]) == ("SELECT * FROM big_table", 90000)
    assert [r["duration_ms"] for r in rows] == pytest.approx([700.0, 700.0, 300.0])
    assert [r["delayed"] for r in rows] == [2, 2, None]
    assert {r["service"] for r in rows} == {"node-api"}
    with server.app.state.backend.use() as store:
        (elb,) = [f for f in find(store) if f.kind == "event_loop_blocker"]
    assert elb.endpoint == "POST /import" and elb.callsite is None
    assert elb.title.startswith("Code (no stack was recorded) blocked the event loop in POST")
    assert "right after `SELECT * FROM big_table` returned 90,000 rows" in elb.title, elb.title


def test_a_transport_span_inside_an_http_call_links_the_call(server: Server) -> None:
    """The service called names the innermost client span as its parent (urllib3's inside
    requests'): the link is to the outer span's call."""
    t = "9" * 32
    get = {"http.request.method": "GET", "url.full": "http://billing:8080/invoices/7"}
    caller = _otlp(
        "shop",
        _span(t, "a" * 16, "", 2, 0, 100, {"http.request.method": "GET", "http.route": "/c"}),
        _span(t, "b" * 16, "a" * 16, 3, 5, 80, get),
        _span(t, "c" * 16, "b" * 16, 3, 6, 78, get),
    )
    route = {"http.request.method": "GET", "http.route": "/invoices/:id"}
    callee = _otlp("billing", _span(t, "d" * 16, "c" * 16, 2, 8, 70, route))
    assert server.post(callee, "application/json")[0] == 200
    assert server.post(caller, "application/json")[0] == 200
    t_shop = server.get(f"/api/traces/{t}{'a' * 16}")
    assert len(t_shop["calls"]) == 1  # the transport's span is not a second call
    (down,) = t_shop["links"]["downstream"]
    assert (down["seq"], down["service"], down["endpoint"]) == (0, "billing", "GET /invoices/:id")
    up = server.get(f"/api/traces/{t}{'d' * 16}")["links"]["upstream"]
    assert (up["trace_id"], up["seq"]) == (f"{t}{'a' * 16}", 0)


def test_client_spans_waiting_for_their_server_span_are_bounded() -> None:
    from perfsleuth.store.otlp.spans import Pending, Span

    pending = Pending(max_spans=10, max_age_s=60.0)
    spans = [
        Span(f"{i:032x}", f"{i:016x}", "ff" * 8, 3, "q", 0, 1, {}, None, ("s", "", ""), {})
        for i in range(25)
    ]
    pending.add(spans, now=0.0)
    assert (pending.size, pending.dropped) == (10, 15)
    assert pending.take(f"{24:032x}") == [spans[24]]  # the newest stay
    pending.add([], now=61.0)  # and wait no longer than max_age_s
    assert (pending.size, pending.dropped) == (0, 24)


def test_a_consumer_span_is_a_background_task_with_its_calls(server: Server) -> None:
    body = _payload("c" * 32, queries=4)
    root = body["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    root.update(kind=5, name="orders process", attributes=[])
    assert server.post(json.dumps(body).encode(), "application/json")[0] == 200
    be = server.app.state.backend
    with be.use() as store:
        rows = store.query("SELECT kind, endpoint, db_calls, http_calls FROM requests")
    assert rows == [
        {"kind": "background", "endpoint": "orders process", "db_calls": 4, "http_calls": 1}
    ]


def test_a_full_disk_asks_the_exporter_to_retry_and_loses_nothing(tmp_path: Any) -> None:
    """ENOSPC while storing a payload: a 503 with Retry-After (OTLP exporters send a 503
    again, not a 500), the server keeps serving, and the same payload once there is room is
    stored whole."""
    with tmpfs(tmp_path / "small", "4m") as mnt:
        s = None
        try:
            s = Server(str(mnt / "data"))
            many = [_payload(f"{i:032x}", queries=20) for i in range(1, 201)]
            spans = [sp for p in many for sp in p["resourceSpans"][0]["scopeSpans"][0]["spans"]]
            resource = many[0]["resourceSpans"][0]["resource"]
            one = {"resource": resource, "scopeSpans": [{"spans": spans}]}
            body = json.dumps({"resourceSpans": [one]}).encode()
            filler = str(mnt / "filler")
            st = os.statvfs(str(mnt))
            with open(filler, "wb") as fh:
                try:
                    fh.write(b"\0" * max(0, st.f_bavail * st.f_frsize - 16_384))
                except OSError:
                    pass
            req = urllib.request.Request(
                s.url + "/v1/traces", body, {"Content-Type": "application/json"}, method="POST"
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=60)
            assert refused.value.code == 503
            assert refused.value.headers.get("Retry-After")
            assert "full" in json.loads(refused.value.read())["error"]
            assert _get(s.url + "/api/status") == 200
            os.remove(filler)
            assert s.post(body, "application/json")[0] == 200
            assert s.count("requests") == 200
            assert s.count("calls") == 200 * 21
        finally:
            if s is not None:
                s.stop()
