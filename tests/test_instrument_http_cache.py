"""HTTP-client and cache instrumentation against real components: a local HTTP server (stdlib,
in a thread), requests / urllib3, httpx (sync and async), aiohttp, redis-py (sync and asyncio)
and pymemcache against real Redis and memcached servers.

No mocks and no timing thresholds: the assertions are about call counts, fingerprints,
statuses, bytes, hits, error names and call sites (file and line in this file).
"""

from __future__ import annotations

import glob
import inspect
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import httpx
import pymemcache
import pytest
import redis
import redis.asyncio
import redis.client
import requests
import urllib3
import urllib3.connectionpool
from pymemcache.client.base import Client as MemcacheClient
from pymemcache.client.base import PooledClient

from conftest import MEMCACHED, REDIS_URL

HERE = os.path.abspath(__file__)
AVATAR = bytes(range(256)) * 4 + b"a" * 210  # 1234 bytes
CHUNKS = [b"x" * 100, b"y" * 250, b"z" * 7]  # 357 bytes, sent chunked (no Content-Length)
SLOW_SECONDS = 1.0

Captured = Callable[[], list[dict[str, Any]]]


def here() -> int:
    """The line number of the caller (the call under test is placed on the next line)."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def uid() -> int:
    """A number unique to one test run (keys and URL ids are templated to ``{id}``)."""
    return uuid.uuid4().int % 10**12


def one_request(captured: Captured) -> dict[str, Any]:
    reqs = captured()
    assert len(reqs) == 1, [r["endpoint"] for r in reqs]
    return reqs[0]


def calls_of(req: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [c for c in req["calls"] if c["kind"] == kind]


def assert_site(call: dict[str, Any], line: int) -> None:
    loc = call["site_loc"]
    assert loc is not None
    assert os.path.abspath(loc["file"]) == HERE, loc
    assert loc["line"] == line, (loc, line)
    assert loc["app"] is True


def spool_bytes(data_dir: str) -> bytes:
    out = b""
    for path in glob.glob(os.path.join(data_dir, "spool", "*")):
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                out += fh.read()
    assert out
    return out


def closed_port() -> int:
    """A local port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# The HTTP server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._route(body=True)

    def do_HEAD(self) -> None:
        self._route(body=False)

    def _send(self, code: int, data: bytes, body: bool, headers: dict[str, str] | None = None):
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _route(self, body: bool) -> None:
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) == 3 and parts[0] == "users" and parts[2] == "avatar":
            self._send(200, AVATAR, body)
        elif parts[0] == "slow":
            time.sleep(SLOW_SECONDS)
            self._send(200, b"late", body)
        elif parts[0] == "redirect" and len(parts) == 2:
            self._send(302, b"", body, {"Location": f"/users/{parts[1]}/avatar"})
        elif parts[0] == "chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if body:
                for chunk in CHUNKS:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")
        elif parts[0] == "status" and len(parts) == 2:
            self._send(int(parts[1]), b"status body", body)
        else:
            self._send(404, b"not found", body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that time out on /slow break the pipe: expected


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """Base URL ``http://127.0.0.1:PORT`` of a local HTTP server."""
    srv = _Server(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, name="test-http-server", daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(autouse=True)
def no_internal_errors() -> Iterator[None]:
    """The instrumentation never swallowed an error of its own during a test."""
    from perfsleuth.agent import recorder

    before = recorder.stats["internal_errors"]
    yield
    assert recorder.stats["internal_errors"] == before


def avatar_fp(base: str) -> str:
    return f"GET {base.split('://', 1)[1]}/users/{{id}}/avatar"


def assert_avatar(call: dict[str, Any], base: str, line: int) -> None:
    assert call["kind"] == "http" and call["system"] == "http"
    assert call["fingerprint"] == avatar_fp(base)
    assert call["op"] == "GET"
    assert call["host"] == base.split("://", 1)[1]
    assert call["status"] == 200
    assert call["bytes"] == len(AVATAR)
    assert "error" not in call
    assert_site(call, line)


@pytest.fixture
def session() -> Iterator[requests.Session]:
    s = requests.Session()
    s.trust_env = False  # no proxy from the environment
    yield s
    s.close()


# ---------------------------------------------------------------------------------------------
# requests / urllib3


def test_requests_get(server, session, in_request, captured) -> None:
    n = uid()
    with in_request("GET /profile"):
        line = here() + 1
        resp = session.get(f"{server}/users/{n}/avatar?size=large&sig=abc", timeout=5)
        assert resp.content == AVATAR
        session.get(f"{server}/users/{n + 1}/avatar", timeout=5)
    calls = calls_of(one_request(captured), "http")
    assert len(calls) == 2
    assert_avatar(calls[0], server, line)
    assert_avatar(calls[1], server, line + 2)
    assert calls[0]["fp"] == calls[1]["fp"]  # query string and ids do not split fingerprints


def test_requests_redirect_is_one_call_per_hop(server, session, in_request, captured) -> None:
    n = uid()
    with in_request():
        line = here() + 1
        resp = session.get(f"{server}/redirect/{n}", timeout=5)
    assert resp.status_code == 200 and len(resp.history) == 1
    calls = calls_of(one_request(captured), "http")
    host = server.split("://", 1)[1]
    assert [(c["fingerprint"], c["status"]) for c in calls] == [
        (f"GET {host}/redirect/{{id}}", 302),
        (avatar_fp(server), 200),
    ]
    assert calls[0]["bytes"] == 0
    assert calls[1]["bytes"] == len(AVATAR)
    for c in calls:
        assert_site(c, line)


def test_requests_streamed_body_is_not_read(server, session, in_request, captured) -> None:
    with in_request():
        resp = session.get(f"{server}/users/{uid()}/avatar", stream=True, timeout=5)
        assert resp.raw.tell() == 0  # nothing read for the agent
        assert len(resp.content) == len(AVATAR)
        # chunked: no Content-Length and the body is not read yet: bytes unknown
        chunked = session.get(f"{server}/chunked", stream=True, timeout=5)
        assert chunked.raw.tell() == 0
        assert chunked.content == b"".join(CHUNKS)
    calls = calls_of(one_request(captured), "http")
    assert [c["status"] for c in calls] == [200, 200]
    assert calls[0]["bytes"] == len(AVATAR)
    assert "bytes" not in calls[1]


def test_requests_head_and_error_status(server, session, in_request, captured) -> None:
    with in_request():
        session.head(f"{server}/users/{uid()}/avatar", timeout=5)
        resp = session.get(f"{server}/status/503", timeout=5)
    assert resp.status_code == 503
    head, err = calls_of(one_request(captured), "http")
    assert head["op"] == "HEAD" and head["status"] == 200 and head["bytes"] == 0
    assert err["status"] == 503 and err["bytes"] == len(b"status body")
    assert "error" not in err  # an HTTP error status is not an exception


def test_requests_connection_refused(session, in_request, captured) -> None:
    port = closed_port()
    with in_request():
        line = here() + 2
        with pytest.raises(requests.ConnectionError):
            session.get(f"http://127.0.0.1:{port}/users/1/avatar", timeout=5)
    (call,) = calls_of(one_request(captured), "http")
    assert call["fingerprint"] == f"GET 127.0.0.1:{port}/users/{{id}}/avatar"
    assert call["error"] == "MaxRetryError"
    assert call["extra"] == {"cause": "NewConnectionError"}
    assert "status" not in call and "bytes" not in call
    assert_site(call, line)


def test_requests_read_timeout(server, session, in_request, captured) -> None:
    with in_request(), pytest.raises(requests.ReadTimeout):
        session.get(f"{server}/slow", timeout=0.2)
    (call,) = calls_of(one_request(captured), "http")
    assert call["fingerprint"] == f"GET {server.split('://', 1)[1]}/slow"
    assert call["error"] == "ReadTimeoutError"
    assert "status" not in call


def test_urllib3_pool_manager(server, in_request, captured) -> None:
    n = uid()
    http = urllib3.PoolManager()
    with in_request():
        line = here() + 1
        resp = http.request("GET", f"{server}/users/{n}/avatar")  # preloaded body
        assert resp.data == AVATAR
        chunked = http.request("GET", f"{server}/chunked")
        assert chunked.data == b"".join(CHUNKS)
        # PoolManager follows redirects itself: one call per hop
        redirected = http.request("GET", f"{server}/redirect/{n}")
        assert redirected.status == 200
    calls = calls_of(one_request(captured), "http")
    assert len(calls) == 4
    assert_avatar(calls[0], server, line)
    assert calls[1]["status"] == 200  # chunked, no Content-Length: the bytes urllib3 read
    assert calls[1]["bytes"] == len(b"".join(CHUNKS))
    assert [c["status"] for c in calls[2:]] == [302, 200]
    assert calls[2]["fingerprint"].endswith("/redirect/{id}")
    http.clear()


def test_urllib3_retries_and_same_host_redirects_are_one_call(server, in_request, captured) -> None:
    port = closed_port()
    pool = urllib3.HTTPConnectionPool("127.0.0.1", port)
    base = server.split("://", 1)[1]
    host, sport = base.split(":")
    live = urllib3.HTTPConnectionPool(host, int(sport))
    with in_request():
        with pytest.raises(urllib3.exceptions.MaxRetryError):
            pool.urlopen("GET", "/users/7/avatar", retries=urllib3.Retry(total=2, backoff_factor=0))
        # redirect=True on a pool: urllib3 recurses into urlopen for the second hop
        resp = live.urlopen("GET", f"/redirect/{uid()}", redirect=True)
        assert resp.status == 200 and resp.data == AVATAR
    refused, redirected = calls_of(one_request(captured), "http")
    assert refused["error"] == "MaxRetryError"
    assert refused["fingerprint"] == f"GET 127.0.0.1:{port}/users/{{id}}/avatar"
    assert redirected["fingerprint"] == f"GET {base}/redirect/{{id}}"
    assert redirected["status"] == 200 and redirected["bytes"] == len(AVATAR)
    pool.close()
    live.close()


# ---------------------------------------------------------------------------------------------
# httpx


def test_httpx_sync(server, in_request, captured) -> None:
    n = uid()
    with httpx.Client(trust_env=False) as client, in_request():
        line = here() + 1
        resp = client.get(f"{server}/users/{n}/avatar", params={"v": "2"})
        assert resp.content == AVATAR
        with client.stream("GET", f"{server}/users/{n}/avatar") as streamed:
            assert streamed.num_bytes_downloaded == 0  # not read for the agent
            streamed.read()
        chunked = client.get(f"{server}/chunked")
        assert chunked.content == b"".join(CHUNKS)
        redirected = client.get(f"{server}/redirect/{n}", follow_redirects=True)
        assert redirected.status_code == 200
    calls = calls_of(one_request(captured), "http")
    assert len(calls) == 4
    assert_avatar(calls[0], server, line)
    assert calls[1]["fingerprint"] == avatar_fp(server) and calls[1]["bytes"] == len(AVATAR)
    assert calls[2]["bytes"] == len(b"".join(CHUNKS))  # read by send(): bytes downloaded
    # redirects followed inside send(): one call, the requested URL, the final status
    assert calls[3]["fingerprint"].endswith("/redirect/{id}")
    assert calls[3]["status"] == 200 and calls[3]["extra"] == {"redirects": 1}


async def test_httpx_async(server, in_request, captured) -> None:
    n = uid()
    async with httpx.AsyncClient(trust_env=False) as client:
        with in_request():
            line = here() + 1
            resp = await client.get(f"{server}/users/{n}/avatar")
            assert resp.content == AVATAR
            head = await client.head(f"{server}/users/{n}/avatar")
            assert head.status_code == 200
    calls = calls_of(one_request(captured), "http")
    assert len(calls) == 2
    assert_avatar(calls[0], server, line)
    assert calls[1]["op"] == "HEAD" and calls[1]["bytes"] == 0


def test_httpx_errors(server, in_request, captured) -> None:
    port = closed_port()
    with httpx.Client(trust_env=False) as client, in_request():
        line = here() + 2
        with pytest.raises(httpx.ConnectError):
            client.get(f"http://127.0.0.1:{port}/users/1/avatar")
        with pytest.raises(httpx.ReadTimeout):
            client.get(f"{server}/slow", timeout=0.2)
    refused, timeout = calls_of(one_request(captured), "http")
    assert refused["error"] == "ConnectError"
    assert refused["fingerprint"] == f"GET 127.0.0.1:{port}/users/{{id}}/avatar"
    assert_site(refused, line)
    assert timeout["error"] == "ReadTimeout" and "status" not in timeout


async def test_httpx_async_connection_refused(in_request, captured) -> None:
    port = closed_port()
    async with httpx.AsyncClient(trust_env=False) as client:
        with in_request(), pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/x")
    (call,) = calls_of(one_request(captured), "http")
    assert call["error"] == "ConnectError"


# ---------------------------------------------------------------------------------------------
# aiohttp


async def test_aiohttp(server, in_request, captured) -> None:
    n = uid()
    async with aiohttp.ClientSession() as s:
        with in_request():
            line = here() + 1
            async with s.get(f"{server}/users/{n}/avatar", params={"q": "1"}) as resp:
                assert await resp.read() == AVATAR
            async with s.get(f"{server}/redirect/{n}") as resp:
                assert resp.status == 200
                await resp.read()
            resp = await s.request("HEAD", f"{server}/users/{n}/avatar")
            resp.release()
    calls = calls_of(one_request(captured), "http")
    assert len(calls) == 3
    assert_avatar(calls[0], server, line)
    assert calls[1]["fingerprint"].endswith("/redirect/{id}")
    assert calls[1]["status"] == 200 and calls[1]["extra"] == {"redirects": 1}
    assert calls[2]["op"] == "HEAD" and "bytes" not in calls[2]


async def test_aiohttp_base_url_and_errors(server, in_request, captured) -> None:
    port = closed_port()
    async with aiohttp.ClientSession(base_url=server) as s:
        with in_request():
            line = here() + 1
            async with s.get(f"/users/{uid()}/avatar") as resp:
                await resp.read()
            with pytest.raises(aiohttp.ClientResponseError):
                async with s.get("/status/404", raise_for_status=True):
                    pass
            with pytest.raises(aiohttp.ClientConnectorError):
                async with s.get(f"http://127.0.0.1:{port}/users/1/avatar"):
                    pass
            with pytest.raises(TimeoutError):
                async with s.get("/slow", timeout=aiohttp.ClientTimeout(total=0.2)):
                    pass
    ok, not_found, refused, slow = calls_of(one_request(captured), "http")
    assert_avatar(ok, server, line)
    assert not_found["status"] == 404 and not_found["error"] == "ClientResponseError"
    assert refused["error"] == "ClientConnectorError"
    assert refused["fingerprint"] == f"GET 127.0.0.1:{port}/users/{{id}}/avatar"
    assert slow["error"] in ("ServerTimeoutError", "ConnectionTimeoutError", "TimeoutError")
    assert slow["fingerprint"].endswith("/slow")


# ---------------------------------------------------------------------------------------------
# Safety: secrets, outside requests, idempotent patches


def test_http_secrets_never_reach_the_spool(
    server, session, in_request, captured, agent_data_dir
) -> None:
    token = f"Bearer tok-{uuid.uuid4().hex}"
    cookie = f"sid-{uuid.uuid4().hex}"
    query = f"qsecret{uuid.uuid4().hex}"
    password = f"pw{uuid.uuid4().hex}"
    user = f"user{uuid.uuid4().hex}"
    headers = {"Authorization": token, "Cookie": cookie, "X-Api-Key": query}
    with in_request():
        session.get(f"{server}/users/1/avatar?api_key={query}", headers=headers, timeout=5)
        urllib3.PoolManager().request("GET", f"{server}/users/2/avatar?k={query}", headers=headers)
        host = server.split("://", 1)[1]
        with httpx.Client(trust_env=False) as client:
            client.get(f"http://{user}:{password}@{host}/users/3/avatar?t={query}", headers=headers)
    (req,) = [r for r in captured() if r["calls"]]
    calls = calls_of(req, "http")
    assert len(calls) == 3
    for c in calls:
        assert c["fingerprint"] == avatar_fp(server)
        assert c["host"] == host
    data = spool_bytes(agent_data_dir)
    for secret in (token, cookie, query, password, user):
        assert secret.encode() not in data, secret


def test_nothing_recorded_outside_a_request(server, session, captured) -> None:
    session.get(f"{server}/users/1/avatar", timeout=5)
    with httpx.Client(trust_env=False) as client:
        client.get(f"{server}/users/1/avatar")
    r = redis.Redis.from_url(REDIS_URL)
    r.get(f"outside:{uid()}")
    r.close()
    assert captured() == []


def test_patches_are_idempotent(server, session, in_request, captured) -> None:
    from perfsleuth.agent.instrument import cache, http

    for _ in range(2):
        http.patch_urllib3(urllib3)
        http.patch_httpx(httpx)
        http.patch_aiohttp(aiohttp)
        cache.patch_redis(redis)
        cache.patch_pymemcache(pymemcache)
    for fn in (
        urllib3.connectionpool.HTTPConnectionPool.urlopen,
        httpx.Client.send,
        httpx.AsyncClient.send,
        aiohttp.ClientSession._request,
        redis.Redis.execute_command,
        redis.client.Pipeline.execute,
        redis.asyncio.Redis.execute_command,
        MemcacheClient.get,
        MemcacheClient.get_multi,
    ):
        orig = fn._perfsleuth_orig  # type: ignore[attr-defined]
        assert not hasattr(orig, "_perfsleuth_orig"), fn  # wrapped exactly once
    assert MemcacheClient.get_multi is MemcacheClient.get_many
    with in_request():
        session.get(f"{server}/users/1/avatar", timeout=5)
    assert len(calls_of(one_request(captured), "http")) == 1


# ---------------------------------------------------------------------------------------------
# Redis


@pytest.fixture(scope="session")
def redis_url() -> str:
    host, port = "127.0.0.1", 6379
    if not port_open(host, port) and shutil.which("redis-server"):
        os.makedirs("/var/lib/redis", exist_ok=True)
        os.makedirs("/var/log/redis", exist_ok=True)
        subprocess.run(
            [
                "redis-server",
                "--daemonize",
                "yes",
                "--bind",
                "127.0.0.1",
                "-::1",
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                "/var/lib/redis",
                "--logfile",
                "/var/log/redis/ci.log",
            ],
            check=False,
        )
        for _ in range(100):
            if port_open(host, port):
                break
            time.sleep(0.05)
    if not port_open(host, port):
        pytest.fail("redis is not running at 127.0.0.1:6379 and could not be started")
    return REDIS_URL


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def cache_calls(req: dict[str, Any]) -> list[dict[str, Any]]:
    return calls_of(req, "cache")


def test_redis_get_miss_set_get_hit(r, in_request, captured) -> None:
    key = f"user:{uid()}:profile"
    with in_request():
        line = here() + 1
        assert r.get(key) is None
        r.set(key, b"0123456789", ex=60)
        assert r.get(key) == b"0123456789"
        assert r.hget(f"user:{uid()}:attrs", "name") is None
        assert r.hgetall(f"user:{uid()}:attrs") == {}
    miss, set_, hit, hget, hgetall = cache_calls(one_request(captured))
    for c in (miss, set_, hit, hget, hgetall):
        assert c["system"] == "redis"
    assert miss["fingerprint"] == "GET user:{id}:profile" and miss["op"] == "GET"
    assert miss["hit"] is False and "bytes" not in miss
    assert set_["fingerprint"] == "SET user:{id}:profile" and "hit" not in set_
    assert hit["hit"] is True and hit["bytes"] == 10
    assert hit["fp"] == miss["fp"]
    assert hget["fingerprint"] == "HGET user:{id}:attrs" and hget["hit"] is False
    assert hgetall["fingerprint"] == "HGETALL user:{id}:attrs" and hgetall["hit"] is False
    assert_site(miss, line)
    assert_site(set_, line + 1)
    assert_site(hit, line + 2)


def test_redis_mget_counts_hits_and_misses(r, in_request, captured) -> None:
    keys = [f"user:{uid()}:profile" for _ in range(3)]
    r.set(keys[0], "a", ex=60)
    r.set(keys[2], "c", ex=60)
    with in_request():
        assert r.mget(keys) == [b"a", None, b"c"]
        assert r.mget(keys[:1]) == [b"a"]
    partial, full = cache_calls(one_request(captured))
    assert partial["fingerprint"] == "MGET user:{id}:profile"
    assert partial["extra"] == {"hits": 2, "misses": 1} and partial["hit"] is False
    assert full["extra"] == {"hits": 1, "misses": 0} and full["hit"] is True


def test_redis_pipeline_is_one_call(r, in_request, captured) -> None:
    key = f"user:{uid()}:profile"
    with in_request():
        pipe = r.pipeline()
        pipe.set(key, "v", ex=60)
        pipe.get(key)
        pipe.incr(f"counter:{uid()}")
        line = here() + 1
        assert pipe.execute() == [True, b"v", 1]
        with r.pipeline(transaction=False) as p2:
            p2.get(key).get(key)
            p2.execute()
        r.pipeline().execute()  # nothing queued: no round trip, nothing recorded
    calls = cache_calls(one_request(captured))
    assert [(c["fingerprint"], c["extra"]) for c in calls] == [
        ("PIPELINE", {"commands": 3}),
        ("PIPELINE", {"commands": 2}),
    ]
    assert_site(calls[0], line)


def test_redis_watch_transaction(r, in_request, captured) -> None:
    key = f"user:{uid()}:balance"
    r.set(key, 10, ex=60)
    with in_request(), r.pipeline() as pipe:
        pipe.watch(key)
        current = int(pipe.get(key))  # immediate: between WATCH and MULTI
        pipe.multi()
        pipe.set(key, current + 1, ex=60)
        pipe.execute()
    calls = cache_calls(one_request(captured))
    assert [c["fingerprint"] for c in calls] == [
        "WATCH user:{id}:balance",
        "GET user:{id}:balance",
        "PIPELINE",
    ]
    assert calls[1]["hit"] is True
    assert calls[2]["extra"] == {"commands": 1}


def test_redis_errors_propagate(r, in_request, captured, redis_url) -> None:
    key = f"user:{uid()}:name"
    r.set(key, "not a number", ex=60)
    bad = redis.Redis(host="127.0.0.1", port=closed_port(), retry=None)
    with in_request():
        line = here() + 2
        with pytest.raises(redis.ResponseError):
            r.incr(key)
        with pytest.raises(redis.ConnectionError):
            bad.get("user:1:profile")
    err, refused = cache_calls(one_request(captured))
    assert err["fingerprint"] == "INCRBY user:{id}:name" and err["error"] == "ResponseError"
    assert_site(err, line)
    assert refused["error"] == "ConnectionError"
    assert refused["fingerprint"] == "GET user:{id}:profile"


def test_redis_credentials_and_values_never_recorded(
    r, in_request, captured, agent_data_dir
) -> None:
    secret = f"pw{uuid.uuid4().hex}"
    value = f"val{uuid.uuid4().hex}"
    with in_request():
        with pytest.raises(redis.RedisError):
            r.execute_command("AUTH", "someone", secret)
        r.set(f"user:{uid()}:token", value, ex=60)
        r.execute_command("ECHO", value)
        r.execute_command("get", f"user:{uid()}:profile")  # lower case, still a GET
    auth, set_, echo, get = cache_calls(one_request(captured))
    assert auth["fingerprint"] == "AUTH" and auth["error"]
    assert set_["fingerprint"] == "SET user:{id}:token"
    assert echo["fingerprint"] == "ECHO"
    assert get["fingerprint"] == "GET user:{id}:profile" and get["hit"] is False
    data = spool_bytes(agent_data_dir)
    assert secret.encode() not in data
    assert value.encode() not in data


async def test_redis_asyncio(redis_url, in_request, captured) -> None:
    key = f"user:{uid()}:profile"
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        with in_request():
            line = here() + 1
            assert await client.get(key) is None
            await client.set(key, "hello", ex=60)
            assert await client.get(key) == b"hello"
            async with client.pipeline() as pipe:
                pipe.get(key)
                pipe.exists(key)
                assert await pipe.execute() == [b"hello", 1]
            assert await client.mget([key, f"user:{uid()}:profile"]) == [b"hello", None]
    finally:
        await client.aclose()
    miss, set_, hit, pipe_call, mget = cache_calls(one_request(captured))
    assert miss["fingerprint"] == "GET user:{id}:profile" and miss["hit"] is False
    assert_site(miss, line)
    assert set_["fingerprint"] == "SET user:{id}:profile"
    assert hit["hit"] is True and hit["bytes"] == 5
    assert pipe_call["fingerprint"] == "PIPELINE" and pipe_call["extra"] == {"commands": 2}
    assert mget["extra"] == {"hits": 1, "misses": 1}


# ---------------------------------------------------------------------------------------------
# memcached


@pytest.fixture(scope="session")
def memcached() -> Iterator[tuple[str, int]]:
    host, port = MEMCACHED
    proc = None
    if not port_open(host, port):
        exe = shutil.which("memcached")
        if exe is None:
            pytest.fail("memcached is not installed (apt-get install -y memcached)")
        proc = subprocess.Popen(
            [exe, "-u", "root", "-l", host, "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(100):
            if port_open(host, port):
                break
            time.sleep(0.05)
        else:
            proc.kill()
            pytest.fail("memcached did not start")
    try:
        yield (host, port)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


def test_memcached_get_miss_set_get_hit(memcached, in_request, captured) -> None:
    client = MemcacheClient(memcached)
    key = f"user:{uid()}:profile"
    try:
        with in_request():
            line = here() + 1
            assert client.get(key) is None
            client.set(key, b"0123456789", expire=60)
            assert client.get(key) == b"0123456789"
            assert client.get(f"user:{uid()}:profile", default=b"") == b""
            value, cas = client.gets(key)
            assert value == b"0123456789" and cas is not None
            client.delete(key)
    finally:
        client.close()
    miss, set_, hit, miss_default, gets, delete = cache_calls(one_request(captured))
    for c in (miss, set_, hit, miss_default, gets, delete):
        assert c["system"] == "memcached"
    assert miss["fingerprint"] == "GET user:{id}:profile" and miss["hit"] is False
    assert set_["fingerprint"] == "SET user:{id}:profile" and "hit" not in set_
    assert hit["hit"] is True and hit["bytes"] == 10 and hit["fp"] == miss["fp"]
    assert miss_default["hit"] is False
    assert gets["fingerprint"] == "GETS user:{id}:profile" and gets["hit"] is True
    assert delete["fingerprint"] == "DELETE user:{id}:profile"
    assert_site(miss, line)
    assert_site(set_, line + 1)


def test_memcached_many_and_pooled(memcached, in_request, captured) -> None:
    pooled = PooledClient(memcached)
    keys = [f"user:{uid()}:profile" for _ in range(3)]
    try:
        with in_request():
            pooled.set_many({keys[0]: b"a", keys[1]: b"b"}, expire=60)
            line = here() + 1
            found = pooled.get_multi(keys)
            assert found == {keys[0]: b"a", keys[1]: b"b"}
            assert pooled.incr(f"counter:{uid()}", 1) is None  # missing counter
    finally:
        pooled.close()
    set_many, get_many, incr = cache_calls(one_request(captured))  # once each, not twice
    assert set_many["fingerprint"] == "SET_MANY user:{id}:profile"
    assert set_many["extra"] == {"keys": 2}
    assert get_many["fingerprint"] == "GET_MANY user:{id}:profile"
    assert get_many["extra"] == {"hits": 2, "misses": 1} and get_many["hit"] is False
    assert_site(get_many, line)
    assert incr["fingerprint"] == "INCR counter:{id}"


def test_memcached_errors_propagate(memcached, in_request, captured) -> None:
    port = closed_port()
    client = MemcacheClient(("127.0.0.1", port), connect_timeout=2)
    with in_request(), pytest.raises(ConnectionRefusedError):
        client.get("user:1:profile")
    (call,) = cache_calls(one_request(captured))
    assert call["error"] == "ConnectionRefusedError"
    assert call["fingerprint"] == "GET user:{id}:profile"


# ---------------------------------------------------------------------------------------------
# The import hooks


def test_libraries_imported_after_start_are_patched(tmp_path) -> None:
    """In a fresh interpreter: agent first, libraries afterwards (the post-import hooks)."""
    code = """
import sys
import perfsleuth.agent as ps
assert ps.start(sys.argv[1], service="hooks")
import requests, httpx, aiohttp, redis, pymemcache
import urllib3.connectionpool, redis.asyncio.client, pymemcache.client.base
for fn in (
    urllib3.connectionpool.HTTPConnectionPool.urlopen,
    httpx.Client.send,
    httpx.AsyncClient.send,
    aiohttp.ClientSession._request,
    redis.Redis.execute_command,
    redis.client.Pipeline.execute,
    redis.client.Pipeline.immediate_execute_command,
    redis.asyncio.client.Redis.execute_command,
    redis.asyncio.client.Pipeline.execute,
    pymemcache.client.base.Client.get,
    pymemcache.client.base.Client.set_multi,
):
    assert hasattr(fn, "_perfsleuth_orig"), fn
assert ps.stats()["internal_errors"] == 0
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
