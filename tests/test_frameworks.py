"""Framework integrations in-process: real FastAPI/Starlette/Flask apps, real ASGI/WSGI calls
(httpx's ASGI transport, Werkzeug's/Flask's test client), the agent running in this process.

The agent here was started with instrumentation on (conftest), so Starlette and Flask are also
patched: explicit wrapping on top of that must still give one record per request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from werkzeug.test import Client

import perfsleuth.agent as ps
from apps import fastapi_app, flask_app
from perfsleuth.agent import recorder
from perfsleuth.agent.frameworks import asgi as ps_asgi
from perfsleuth.agent.frameworks import wsgi as ps_wsgi
from perfsleuth.agent.frameworks.asgi import PerfsleuthASGI
from perfsleuth.agent.frameworks.wsgi import PerfsleuthWSGI

Captured = Callable[[], list[dict[str, Any]]]
SECRET = "Bearer s3cr3t-token-value"
COOKIE = "session=c00kie-value"


def asgi_client(app: Any, *, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://shop.test")


# ------------------------------------------------------------------------------------ ASGI


@pytest.mark.parametrize("wrap", ["explicit", "auto", "twice"])
async def test_fastapi_endpoints_are_route_templates(captured: Captured, wrap: str) -> None:
    app: Any = fastapi_app.app
    if wrap == "explicit":
        app = ps.asgi(app)
        assert isinstance(app, PerfsleuthASGI)
    elif wrap == "twice":
        app = ps.asgi(ps.asgi(app))
    headers = {"x-user": "alice", "X-Tenant": "acme", "Authorization": SECRET, "Cookie": COOKIE}
    async with asgi_client(app) as c:
        r1 = await c.get("/orders/42", headers=headers)
        r2 = await c.get("/api/v1/items/sku-9", headers=headers)
        r3 = await c.get("/legacy/acme/reports/7", headers=headers)
        r4 = await c.post("/orders", content=b"x" * 1234, headers=headers)
        r5 = await c.get("/stream")
        r6 = await c.get("/async/bob")
        r7 = await c.get("/orders/not-a-number")
        r8 = await c.delete("/orders/42")
        r9 = await c.get("/plain/hello")
        r10 = await c.get("/v2/eu/stock/sku-1")
        r11 = await c.get("/v2/eu/raw/5")
        r12 = await c.get("/v2/eu/nothing")
        r13 = await c.get("/v2/eu/plain/again")
    assert r1.json()["order_id"] == 42 and r4.json() == {"received": 1234}
    assert r2.json() == {"item": "sku-9"} and r3.text == "report 7 of acme"
    assert (r7.status_code, r8.status_code) == (422, 405)
    assert (r9.text, r10.json(), r12.status_code) == ("plain hello", {"sku": "sku-1"}, 404)
    assert (r11.text, r13.text) == ("raw 5", "plain again")

    recs = captured()
    assert [r["endpoint"] for r in recs] == [
        "GET /orders/{order_id}",
        "GET /api/v1/items/{item_id}",  # include_router prefixes joined
        "GET /legacy/{tenant}/reports/{report_id:int}",  # Mount template, not "/legacy/acme"
        "POST /orders",
        "GET /stream",
        "GET /async/{name}",
        "GET /orders/{order_id}",
        "DELETE /orders/{order_id}",
        "GET /plain/{slug}",  # Starlette route in a FastAPI router: found by its endpoint
        "GET /v2/{region}/stock/{sku}",  # a FastAPI app mounted in a FastAPI app
        "GET /v2/{region}/raw/{n:int}",
        "GET <unmatched>",
        "GET /v2/{region}/plain/{slug}",  # one endpoint in two routes: told apart by path
    ]
    assert [r["status"] for r in recs] == [200] * 6 + [422, 405, 200, 200, 200, 404, 200]
    o = recs[0]
    assert o["kind"] == "web" and o["method"] == "GET" and o["status"] == 200
    assert o["user"] == "alice" and o["tenant"] == "acme"
    assert o["resp_bytes"] == len(r1.content)
    assert o["attrs"] == {"order_id": 42, "pid": r1.json()["pid"]}
    assert o["dur"] > 0
    post = recs[3]
    assert post["req_bytes"] == 1234 and post["resp_bytes"] == len(r4.content)
    assert recs[4]["resp_bytes"] == len(r5.content) == 60
    assert recs[5]["resp_bytes"] == len(r6.content)
    blob = json.dumps(recs)
    assert "s3cr3t" not in blob and "c00kie" not in blob


async def test_unmatched_paths_collapse_into_one_endpoint(captured: Captured) -> None:
    paths = ["/wp-admin.php", "/.env", "/a/b/c/d", "/legacy/acme/nothing-here", "/phpmyadmin/x"]
    async with asgi_client(ps.asgi(fastapi_app.app)) as c:
        for p in paths:
            assert (await c.get(p)).status_code == 404
        await c.request("PROPFIND", "/whatever")
        await c.request("X-SCAN-1234", "/whatever")
    recs = captured()
    assert [r["path"] for r in recs] == [*paths, "/whatever", "/whatever"]
    assert [r["endpoint"] for r in recs] == ["GET <unmatched>"] * len(paths) + [
        "OTHER <unmatched>",
        "OTHER <unmatched>",
    ]
    assert all(r["status"] in (404, 405) for r in recs)


async def test_app_exception_propagates_and_is_recorded_as_500(captured: Captured) -> None:
    async with asgi_client(ps.asgi(fastapi_app.app)) as c:
        with pytest.raises(RuntimeError, match="boom"):
            await c.get("/boom")
    (rec,) = captured()
    assert (
        rec["endpoint"] == "GET /boom" and rec["status"] == 500 and rec["error"] == "RuntimeError"
    )

    async with asgi_client(ps.asgi(fastapi_app.app), raise_app_exceptions=False) as c:
        r = await c.get("/boom")
    assert r.status_code == 500


async def raw_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A router-less ASGI app that reads the whole body and answers in three chunks."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    if scope["path"] == "/fail-after-response":
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})
        raise LookupError("after the response")
    await send({"type": "http.response.start", "status": 202, "headers": []})
    for part in (b"ab", b"cde", b""):
        await send({"type": "http.response.body", "body": part, "more_body": part != b""})


async def drive(app: Any, scope: dict[str, Any], chunks: list[bytes]) -> list[dict[str, Any]]:
    incoming = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await app(scope, receive, send)
    return sent


def http_scope(method: str, path: str, headers: list[tuple[bytes, bytes]] = []) -> dict[str, Any]:  # noqa: B006
    return {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}


async def test_raw_asgi_counts_bytes_and_passes_other_scopes(captured: Captured) -> None:
    app = PerfsleuthASGI(raw_app)
    headers = [(b"x-user", b"u-7"), (b"x-tenant", b"t-1"), (b"content-length", b"9")]
    sent = await drive(app, http_scope("PUT", "/objects/123", headers), [b"1234", b"56789"])
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [202]

    # lifespan and websocket scopes are not requests
    lifespan_in = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    lifespan_out: list[Any] = []

    async def lreceive() -> dict[str, Any]:
        return lifespan_in.pop(0)

    async def lsend(msg: Any) -> None:
        lifespan_out.append(msg)

    await app({"type": "lifespan"}, lreceive, lsend)
    assert [m["type"] for m in lifespan_out] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]

    with pytest.raises(LookupError):
        await drive(app, http_scope("GET", "/fail-after-response"), [b""])

    first, second = captured()
    assert first["endpoint"] == "PUT <unmatched>" and first["path"] == "/objects/123"
    assert first["status"] == 202 and first["req_bytes"] == 9 and first["resp_bytes"] == 5
    assert first["user"] == "u-7" and first["tenant"] == "t-1"
    # The response was complete when the app raised: its status stands, the error is kept.
    assert second["status"] == 201 and second["error"] == "LookupError"
    assert recorder.current() is None


async def test_asgi_agent_failure_never_reaches_the_app(
    captured: Captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*a: Any, **k: Any) -> Any:
        raise ZeroDivisionError("agent bug")

    class Broken(dict):  # type: ignore[type-arg]
        get = broken

    monkeypatch.setattr(ps_asgi, "_loop_of", Broken())
    monkeypatch.setattr(ps_asgi, "route_endpoint", broken)
    errors = recorder.stats["internal_errors"]
    async with asgi_client(ps.asgi(fastapi_app.app)) as c:
        r = await c.get("/orders/5")
    assert r.status_code == 200 and r.json()["order_id"] == 5
    assert recorder.stats["internal_errors"] > errors
    assert recorder.current() is None


async def test_starlette_patch_wraps_every_app_once(captured: Captured) -> None:
    assert getattr(Starlette.__call__, "_perfsleuth_original", None) is not None
    async with asgi_client(fastapi_app.app) as c:  # not wrapped: the patch records it
        await c.get("/orders/1")
        await c.get("/legacy/x/reports/2")  # a mounted Starlette app inside: still one record
    assert [r["endpoint"] for r in captured()] == [
        "GET /orders/{order_id}",
        "GET /legacy/{tenant}/reports/{report_id:int}",
    ]


async def test_framework_mounted_in_starlette_is_one_request(captured: Captured) -> None:
    from a2wsgi import WSGIMiddleware
    from fastapi import FastAPI

    outer = FastAPI()
    outer.mount("/backoffice", WSGIMiddleware(flask_app.create_app()))  # type: ignore[arg-type]
    async with asgi_client(outer) as c:
        r1 = await c.get("/backoffice/admin/customers/8", headers={"x-user": "dora"})
        r2 = await c.get("/backoffice/nothing")
    assert r1.json()["customer_id"] == 8 and r2.status_code == 404
    a, b = captured()  # Flask's own recorder stood by: one record each
    assert a["endpoint"] == "GET /backoffice/admin/customers/<int:customer_id>"
    assert a["status"] == 200 and a["user"] == "dora" and a["attrs"]["customer_id"] == 8
    assert b["endpoint"] == "GET <unmatched>" and b["status"] == 404


async def test_fastapi_background_work_and_tasks(captured: Captured) -> None:
    @ps.task("nightly-report")
    async def nightly() -> int:
        ps.attr("rows", 17)
        return 17

    assert await nightly() == 17
    with ps.task("sync-avatars"):
        ps.attr("avatars", 3)
    with pytest.raises(KeyError), ps.task("broken-job"):
        raise KeyError("x")
    recs = captured()
    assert [(r["kind"], r["endpoint"], r["status"]) for r in recs] == [
        ("background", "nightly-report", 200),
        ("background", "sync-avatars", 200),
        ("background", "broken-job", 500),
    ]
    assert recs[0]["attrs"] == {"rows": 17} and recs[1]["attrs"] == {"avatars": 3}
    assert recs[2]["error"] == "KeyError"


# ------------------------------------------------------------------------------------ WSGI


@pytest.mark.parametrize("wrap", ["explicit", "auto"])
@pytest.mark.usefixtures("cpu_every_request")
def test_flask_endpoints_are_url_rules(captured: Captured, wrap: str) -> None:
    app = flask_app.create_app()
    client: Any = Client(ps.wsgi(app)) if wrap == "explicit" else app.test_client()
    headers = {"X-User": "bob", "X-Tenant": "globex", "Authorization": SECRET, "Cookie": COOKIE}
    r1 = client.get("/admin/customers/42", headers=headers)
    cart = "12345678-1234-5678-1234-567812345678"
    r2 = client.get(f"/shop/carts/{cart}/items", headers=headers)
    r3 = client.post("/upload", data=b"y" * 333, headers=headers)
    r4 = client.get("/stream")
    r5 = client.get("/no/such/page")
    r6 = client.delete("/admin/customers/42")
    bodies = [r.get_data() for r in (r1, r2, r3, r4, r5, r6)]
    assert r1.get_json()["customer_id"] == 42 and r3.get_json() == {"received": 333}

    recs = captured()
    assert [r["endpoint"] for r in recs] == [
        "GET /admin/customers/<int:customer_id>",
        "GET /shop/carts/<uuid:cart_id>/items",
        "POST /upload",
        "GET /stream",
        "GET <unmatched>",
        "DELETE <unmatched>",  # 405: Flask matched no rule for this method
    ]
    assert [r["status"] for r in recs] == [200, 200, 200, 200, 404, 405]
    assert [r["resp_bytes"] for r in recs] == [len(b) for b in bodies]
    c = recs[0]
    assert c["user"] == "bob" and c["tenant"] == "globex" and c["attrs"]["customer_id"] == 42
    assert c["cpu_ns"] > 0 and c["kind"] == "web"
    assert recs[2]["req_bytes"] == 333
    blob = json.dumps(recs)
    assert "s3cr3t" not in blob and "c00kie" not in blob


class Buffering:
    """A WSGI middleware on ``app.wsgi_app`` that buffers the response and calls the server's
    start_response after Flask has popped its request context (as gzip middlewares do)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        started: list[Any] = []
        result = self.app(
            environ, lambda status, headers, exc_info=None: started.append((status, headers))
        )
        try:
            body = b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()
        start_response(*started[0])
        return [body]


@pytest.mark.parametrize("wrap", ["explicit", "auto"])
def test_flask_behind_a_buffering_middleware_is_named_by_its_url_rule(
    captured: Captured, wrap: str
) -> None:
    app = flask_app.create_app()
    app.wsgi_app = Buffering(app.wsgi_app)  # type: ignore[method-assign]
    client: Any = Client(ps.wsgi(app)) if wrap == "explicit" else app.test_client()
    r1 = client.get("/admin/customers/7")
    r2 = client.get("/no/such/page")
    assert r1.get_json()["customer_id"] == 7 and r2.status_code == 404
    recs = captured()
    assert [(r["endpoint"], r["status"]) for r in recs] == [
        ("GET /admin/customers/<int:customer_id>", 200),
        ("GET <unmatched>", 404),
    ]


def test_flask_exception_propagates_or_becomes_500(captured: Captured) -> None:
    testing = flask_app.create_app(TESTING=True)  # PROPAGATE_EXCEPTIONS
    with pytest.raises(ValueError, match="boom"):
        testing.test_client().get("/boom")
    prod = flask_app.create_app()
    r = prod.test_client().get("/boom")
    assert r.status_code == 500 and r.get_data()
    first, second = captured()
    for rec in (first, second):
        assert rec["endpoint"] == "GET /boom"
        assert rec["status"] == 500 and rec["error"] == "ValueError"


def test_wsgi_response_iterable_ends_request_exactly_once(captured: Captured) -> None:
    closed: list[str] = []

    class Body:
        def __init__(self, name: str) -> None:
            self.name = name

        def __iter__(self) -> Iterator[bytes]:
            ps.attr("streamed_by", self.name)  # the request is current while it streams
            yield b"12345"
            if self.name == "/d":
                raise RuntimeError("generator failed halfway")
            yield b"678"

        def close(self) -> None:
            closed.append(self.name)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("203 Partial", [("Content-Type", "text/plain")])
        return Body(environ["PATH_INFO"])

    wrapped = PerfsleuthWSGI(app)

    def call(path: str) -> Any:
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "CONTENT_LENGTH": ""}
        return wrapped(environ, lambda status, headers, exc_info=None: None)

    # a PEP 3333 server: iterate, then close
    it = call("/a")
    assert recorder.current() is None  # nothing left in the thread between app and server
    assert b"".join(it) == b"12345678"
    it.close()
    # closed without being iterated (the client went away)
    call("/b").close()
    # exhausted but never closed (a sloppy server)
    assert list(call("/c")) == [b"12345", b"678"]
    # the body fails halfway; the server closes it, twice
    broken = call("/d")
    with pytest.raises(RuntimeError, match="halfway"):
        list(broken)
    broken.close()
    broken.close()

    recs = captured()
    assert [r["path"] for r in recs] == ["/a", "/b", "/c", "/d"]
    a, b, c, d = recs
    assert a["resp_bytes"] == 8 and a["status"] == 203 and a["endpoint"] == "GET <unmatched>"
    assert a["attrs"] == {"streamed_by": "/a"}
    assert b["resp_bytes"] == 0 and "attrs" not in b
    assert c["resp_bytes"] == 8
    assert d["status"] == 500 and d["error"] == "RuntimeError" and d["resp_bytes"] == 5
    assert closed == ["/a", "/b", "/d", "/d"]
    assert recorder.current() is None


def test_wsgi_list_results_and_legacy_write(captured: Captured) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> Any:
        write = start_response("200 OK", [("Content-Length", "7")])
        if environ["PATH_INFO"] == "/write":
            write(b"abc")
            return [b"defg"]
        return [b"abc", b"defg"]

    wrapped = ps.wsgi(app)
    out: list[bytes] = []
    env = {"REQUEST_METHOD": "POST", "CONTENT_LENGTH": "11", "HTTP_X_USER": "carol"}
    assert wrapped({**env, "PATH_INFO": "/list"}, lambda s, h, e=None: out.append) == [
        b"abc",
        b"defg",
    ]
    wrapped({**env, "PATH_INFO": "/write"}, lambda s, h, e=None: out.append)
    assert out == [b"abc"]
    a, b = captured()
    assert a["resp_bytes"] == 7 and b["resp_bytes"] == 7
    assert a["req_bytes"] == 11 and a["user"] == "carol" and a["endpoint"] == "POST <unmatched>"


@pytest.mark.parametrize(
    ("environ", "has_body", "size"),
    [
        ({}, False, 0),
        ({"CONTENT_LENGTH": ""}, False, 0),
        ({"CONTENT_LENGTH": "0"}, False, 0),
        ({"HTTP_TRANSFER_ENCODING": "chunked"}, True, 0),
        ({"CONTENT_LENGTH": "11"}, True, 11),
        ({"CONTENT_LENGTH": "junk"}, True, 0),
    ],
)
def test_read_environ_says_whether_the_request_has_a_body(
    agent_data_dir: str, environ: dict[str, str], has_body: bool, size: int
) -> None:
    """One reader of the environ for WSGI and Django (frameworks.common.read_environ): WSGI
    taps the input for a capture only when it says the request has a body."""
    from perfsleuth.agent.frameworks.common import read_environ

    req = recorder.python_begin("web", "POST", "/x")
    assert req is not None
    try:
        environ = {**environ, "HTTP_X_USER": "dana", "HTTP_X_PERFSLEUTH_LOAD": "run1;b"}
        assert read_environ(req, environ) is has_body
        assert req.req_bytes == size and req.user == "dana"
        assert req.tags == {"load_run": "run1", "load_side": "b"}
    finally:
        recorder.python_end(req)


def test_wsgi_agent_failure_never_reaches_the_app(
    captured: Captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*a: Any, **k: Any) -> Any:
        raise ZeroDivisionError("agent bug")

    monkeypatch.setattr(ps_wsgi, "read_environ", broken)
    client = flask_app.create_app().test_client()
    r = client.get("/admin/customers/9")
    assert r.status_code == 200 and r.get_json()["customer_id"] == 9
    assert recorder.current() is None


def test_agent_off_means_plain_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder, "_sink", None)
    client = Client(ps.wsgi(flask_app.create_app()))
    r = client.get("/admin/customers/3")
    assert r.status_code == 200 and r.get_json()["customer_id"] == 3
    assert recorder.current() is None
