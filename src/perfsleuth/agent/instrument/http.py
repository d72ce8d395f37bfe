"""HTTP clients: urllib3 (and so requests, botocore, ...), httpx (sync and async), aiohttp.

Every outbound request made inside a request becomes one ``http`` call whose target is
``(method, url)``: the fingerprint (``GET host/path/{id}``), its operation and the ``host``
column are derived from it by the writer thread, which drops the query string and any
``user:password@`` (see :mod:`perfsleuth.agent.shipper`). Header values, bodies, query
strings and credentials are never read or stored. Recorded: status, response bytes, the error
class name (the exception itself propagates unchanged) and, for redirects followed inside one
call, ``extra={"redirects": n}``.

How each library is hooked (one layer each, so nothing is recorded twice):

* **urllib3** -- ``HTTPConnectionPool.urlopen`` (``HTTPSConnectionPool`` inherits it).
  requests, botocore and pip all end there; requests itself is *not* patched. urllib3 calls
  ``urlopen`` again from inside ``urlopen`` to retry or to follow a same-host redirect: those
  attempts are part of the outer call (detected by the caller's code object, no state).
  ``PoolManager`` redirects across hosts go through a new pool's ``urlopen``: one call per
  hop. The URL is the pool's ``scheme://host[:port]`` (cached on the pool once, default
  ports omitted) + the request path. Bytes: bytes already read from the socket plus
  ``length_remaining`` (urllib3's parsed Content-Length): Content-Length for a streamed
  response (requests), the bytes read for a preloaded one; the body is never read for us.
  A ``MaxRetryError`` also records its cause: ``extra={"cause": "NewConnectionError"}``.
* **httpx** -- ``Client.send`` and ``AsyncClient.send``: every request of the public API goes
  through them exactly once (redirects and auth flows inside). Bytes:
  ``num_bytes_downloaded`` when ``send`` has read the body (``stream=False``), else the
  Content-Length header. The URL is kept as the ``httpx.URL`` reference (turned into text by
  the writer thread).
* **aiohttp** -- ``ClientSession._request`` (``get``/``post``/``request``/``ws_connect`` and
  ``aiohttp.request`` all call it). It returns once the response headers are in, so the
  duration is time to headers; bytes come from Content-Length. A session ``base_url`` is
  joined lazily (on the writer thread). ``ClientResponseError`` (``raise_for_status``) also
  records its status.

Outside a request ``start_call`` returns None and the wrappers only forward the call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from perfsleuth.agent import recorder
from perfsleuth.agent.instrument._patch import mark, patch

_start_call = recorder.start_call
_internal_error = recorder.internal_error
_getframe = sys._getframe
_BASE = "_perfsleuth_base"
_UNKNOWN_URL = "http://unknown/"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _on_error(call: recorder.Call, exc: BaseException) -> None:
    """Error name (and what the library knows cheaply about it); never raises."""
    call.error = type(exc).__name__
    try:
        reason = getattr(exc, "reason", None)  # urllib3 MaxRetryError / ProxyError
        if isinstance(reason, BaseException):
            call.extra = {"cause": type(reason).__name__}
        status = getattr(exc, "status", None)  # aiohttp ClientResponseError
        if type(status) is int and status > 0:
            call.status = status
    except Exception:
        _internal_error()


# ---------------------------------------------------------------------------------------------
# urllib3


def _pool_base(pool: Any) -> str:
    """``scheme://host[:port]`` of a connection pool, computed once per pool."""
    base = getattr(pool, _BASE, None)
    if base is None:
        scheme = str(pool.scheme or "http")
        host = str(pool.host or "")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        port = pool.port
        if port is None or _DEFAULT_PORTS.get(scheme) == port:
            base = f"{scheme}://{host}"
        else:
            base = f"{scheme}://{host}:{port}"
        try:
            setattr(pool, _BASE, base)
        except Exception:
            pass  # a pool class with __slots__: compute it every time
    return base


def _pool_url(pool: Any, url: Any) -> str:
    if type(url) is str:
        if url[:1] == "/":
            return _pool_base(pool) + url
        if "://" in url:  # absolute URL: an HTTP proxy pool
            return url
        return _pool_base(pool) + "/" + url
    return _pool_base(pool) + "/"


def _urllib3_bytes(call: recorder.Call, resp: Any) -> None:
    # parsed Content-Length minus the bytes read so far (None: no Content-Length)
    remaining = getattr(resp, "length_remaining", None)
    tell = getattr(resp, "tell", None)
    done = tell() if tell is not None else 0  # bytes read from the socket so far
    if type(done) is not int:
        done = 0
    if remaining is not None:
        call.bytes = done + remaining
    elif done:
        call.bytes = done


def _wrap_urlopen(orig: Callable[..., Any]) -> Callable[..., Any]:
    orig_code = getattr(orig, "__code__", None)

    def urlopen(self: Any, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        if _getframe(1).f_code is orig_code:
            # urllib3 retrying or following a redirect from inside urlopen: the outer call
            # covers it (one call per application request, its duration includes retries)
            return orig(self, method, url, *args, **kwargs)
        call = _start_call("http", "http", None)
        if call is None:
            return orig(self, method, url, *args, **kwargs)
        try:
            call.target = (method, _pool_url(self, url))
        except Exception:
            call.target = (method, _UNKNOWN_URL)
            _internal_error()
        try:
            resp = orig(self, method, url, *args, **kwargs)
        except BaseException as exc:
            _on_error(call, exc)
            call.finish()
            raise
        call.finish()
        try:
            call.status = resp.status
            _urllib3_bytes(call, resp)
        except Exception:
            _internal_error()
        return resp

    return mark(urlopen, orig)


def patch_urllib3(module: ModuleType) -> None:
    import urllib3.connectionpool

    patch(urllib3.connectionpool.HTTPConnectionPool, "urlopen", _wrap_urlopen)


# ---------------------------------------------------------------------------------------------
# httpx


def _content_length(headers: Any) -> int | None:
    value = headers.get("content-length")
    if value is not None:
        value = value.strip()
        if value.isdigit():
            return int(value)
    return None


def _httpx_response(call: recorder.Call, resp: Any, method: Any) -> None:
    call.status = resp.status_code
    if resp.is_stream_consumed:  # send() read the body (stream=False): bytes received
        call.bytes = resp.num_bytes_downloaded
    elif method != "HEAD":
        call.bytes = _content_length(resp.headers)
    redirects = len(resp.history)
    if redirects:
        call.extra = {"redirects": redirects}


def _httpx_target(call: recorder.Call, request: Any) -> Any:
    try:
        method = request.method
        call.target = (method, request.url)  # httpx.URL: stringified by the writer
        return method
    except Exception:
        call.target = ("GET", _UNKNOWN_URL)
        _internal_error()
        return None


def _wrap_httpx_send(orig: Callable[..., Any]) -> Callable[..., Any]:
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call("http", "http", None)
        if call is None:
            return orig(self, request, *args, **kwargs)
        method = _httpx_target(call, request)
        try:
            resp = orig(self, request, *args, **kwargs)
        except BaseException as exc:
            _on_error(call, exc)
            call.finish()
            raise
        call.finish()
        try:
            _httpx_response(call, resp, method)
        except Exception:
            _internal_error()
        return resp

    return mark(send, orig)


def _wrap_httpx_async_send(orig: Callable[..., Any]) -> Callable[..., Any]:
    async def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call("http", "http", None)
        if call is None:
            return await orig(self, request, *args, **kwargs)
        method = _httpx_target(call, request)
        try:
            resp = await orig(self, request, *args, **kwargs)
        except BaseException as exc:
            _on_error(call, exc)
            call.finish()
            raise
        call.finish()
        try:
            _httpx_response(call, resp, method)
        except Exception:
            _internal_error()
        return resp

    return mark(send, orig)


def patch_httpx(module: ModuleType) -> None:
    patch(module.Client, "send", _wrap_httpx_send)
    patch(module.AsyncClient, "send", _wrap_httpx_async_send)


# ---------------------------------------------------------------------------------------------
# aiohttp


class _JoinedURL:
    """A session ``base_url`` and a request URL, joined only when turned into text (on the
    writer thread) the way aiohttp does it."""

    __slots__ = ("base", "url")

    def __init__(self, base: Any, url: Any) -> None:
        self.base = base
        self.url = url

    def __str__(self) -> str:
        base = self.base
        url = self.url if isinstance(self.url, type(base)) else type(base)(str(self.url))
        return str(url if url.absolute else base.join(url))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _JoinedURL)
            and str(self.base) == str(other.base)
            and str(self.url) == str(other.url)
        )

    def __hash__(self) -> int:
        return hash((str(self.base), str(self.url)))


def _aiohttp_target(call: recorder.Call, session: Any, method: Any, url: Any) -> None:
    try:
        base = getattr(session, "_base_url", None)
        call.target = (method, url if base is None else _JoinedURL(base, url))
    except Exception:
        call.target = (method, _UNKNOWN_URL)
        _internal_error()


def _aiohttp_response(call: recorder.Call, resp: Any) -> None:
    call.status = resp.status
    if resp.method != "HEAD":
        call.bytes = _content_length(resp.headers)
    redirects = len(resp.history)
    if redirects:
        call.extra = {"redirects": redirects}


def _wrap_aiohttp_request(orig: Callable[..., Any]) -> Callable[..., Any]:
    async def _request(self: Any, method: Any, str_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call("http", "http", None)
        if call is None:
            return await orig(self, method, str_or_url, *args, **kwargs)
        _aiohttp_target(call, self, method, str_or_url)
        try:
            resp = await orig(self, method, str_or_url, *args, **kwargs)
        except BaseException as exc:
            _on_error(call, exc)
            call.finish()
            raise
        call.finish()
        try:
            _aiohttp_response(call, resp)
        except Exception:
            _internal_error()
        return resp

    return mark(_request, orig)


def patch_aiohttp(module: ModuleType) -> None:
    import aiohttp.client

    patch(aiohttp.client.ClientSession, "_request", _wrap_aiohttp_request)
