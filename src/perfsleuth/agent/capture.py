"""Replayable captures of chosen requests (stdlib only; ``perfsleuth replay`` re-sends them).

A request is kept when it was slow (``PERFSLEUTH_CAPTURE_SLOW_MS``, 500), failed with a 5xx,
was flagged by the application (``perfsleuth.agent.keep_capture()``) or by the agent (the loop
watchdog flags the request that blocked the loop), or fell in the random sample
(``PERFSLEUTH_CAPTURE_SAMPLE``, 0.01), at most ``PERFSLEUTH_CAPTURE_SAMPLE_PER_MIN`` (60) a
minute. ``PERFSLEUTH_CAPTURE=0`` turns captures off.

The decision runs once per request, after it ended, and costs a few attribute reads and a
countdown when nothing is kept (``benchmarks/capture_decision.py``): the random sample draws
the gap to its next request, not a number per request. Only a kept request
costs more: a copy of its header list and URL parts, handed to the writer thread through
``shipper.emit`` as a wire.CAPTURE record; decoding, redaction, base64 and hashing run there.

Request bodies are observed as the application reads them (ASGI ``receive``, WSGI
``wsgi.input``): the chunks are kept by reference (never copied) while the request runs, up
to ``PERFSLEUTH_CAPTURE_BODY_MAX`` (64 KiB) per request, or the whole body while the budget
of all pending captures (16 MiB) allows, so a large kept body gets its size and sha256. Past
the budget a body keeps only its first bytes (and no hash); a request whose first bytes do not
fit is not captured (``captures_dropped``). A body larger than the maximum is stored as its
first bytes, its size and hash, flagged truncated: replay refuses it unless told otherwise.

Secrets: the values of Authorization, Proxy-Authorization, Cookie, Set-Cookie, of every header
whose name holds token, secret, key, auth, session, passw, csrf or credential (X-CSRF-Token,
X-Amz-Security-Token, Api-Key, ...) and of ``PERFSLEUTH_REDACT_HEADERS`` (comma list) are
replaced by ``[redacted]``; so are query-string parameters and urlencoded form fields with such
names (the body kept is then the redacted one; its size and hash stay the original's). All
unless ``PERFSLEUTH_CAPTURE_SECRETS=1``.

It is one module because the decision, the body taps, the redaction and the record share
the budget of pending bodies and the per-request state, and the agent keeps one module per
concern (the server interfaces call ``finish_*`` and ``tap_wsgi_input`` only).
"""

from __future__ import annotations

import binascii
import math
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from perfsleuth.agent import recorder
from perfsleuth.agent.frameworks.common import SECRET_HEADERS

REDACTED = "[redacted]"
PENDING_MAX = 8 * 1024 * 1024  # bytes of request bodies held for possible captures, in all

recorder.stats.update({"captures": 0, "captures_dropped": 0, "captures_sample_capped": 0})
stats = recorder.stats

# Settings (configure()); ``on`` is read on the request path, so it is a plain module global.
on = False
_slow_ns = 500_000_000
_sample = 0.01
_sample_per_min = 60
_countdown = 100  # requests until the next random sample (_gap)
_window = 0.0  # start of the current minute of random samples, and how many it had
_in_window = 0
_body_max = 64 * 1024
_secrets = False
_redact: frozenset[str] = SECRET_HEADERS
# Parts of a header, parameter or field name that say its value is a secret.
SECRET_WORDS = ("token", "secret", "key", "auth", "session", "passw", "csrf", "credential")


def secret_name(name: str) -> bool:
    """Whether a header, query parameter or form field of this (lower-case) name holds a
    secret."""
    return name in _redact or any(w in name for w in SECRET_WORDS)


def _redact_pairs(encoded: str, where: str, redacted: list[str]) -> str:
    """An urlencoded query string or form body with the values of secret names replaced
    (kept as they were, byte for byte, when nothing is secret)."""
    from urllib.parse import parse_qsl, quote, urlencode  # on the writer thread

    pairs = parse_qsl(encoded, keep_blank_values=True)
    hit = [k for k, _ in pairs if secret_name(k.lower())]
    if not hit:
        return encoded
    redacted.extend(f"{where}:{k}" for k in hit)
    return urlencode(
        [(k, REDACTED if secret_name(k.lower()) else v) for k, v in pairs], quote_via=quote
    )


_fault = False
_random = random.random
# The shipper's emit (it hands itself over in configure(), so this module need not import it).
_emit: Callable[[bytes, Any], bool] | None = None

_pending = 0  # body bytes held by taps and by captures not yet written
_lock = threading.Lock()


def configure(cfg: Any, emit: Callable[[bytes, Any], bool] | None = None) -> None:
    """Settings from the agent's config; ``emit`` queues a record (the shipper's), kept when
    not given."""
    global on, _slow_ns, _sample, _sample_per_min, _countdown, _body_max, _secrets, _redact, _fault
    global PENDING_MAX, _emit
    if emit is not None:
        _emit = emit
    _slow_ns = int(float(cfg.capture_slow_ms) * 1e6)
    _sample = max(0.0, min(1.0, float(cfg.capture_sample)))
    _sample_per_min = max(0, int(cfg.capture_sample_per_min))
    _countdown = _gap()
    _body_max = max(0, int(cfg.capture_body_max))
    # a quarter of the agent's memory budget (the shipper shares out the rest)
    PENDING_MAX = max(1 << 18, int(float(cfg.memory_budget_mb) * (1 << 20)) // 4)
    _secrets = bool(cfg.capture_secrets)
    extra = {h.strip().lower() for h in str(cfg.redact_headers or "").split(",") if h.strip()}
    _redact = SECRET_HEADERS | frozenset(extra)
    _fault = cfg.fault == "capture_crash"
    on = bool(cfg.capture)


def keep_capture(reason: str = "flag") -> None:
    """Keep a replayable capture of the current request, whatever its duration and status."""
    req = recorder._current.get()
    if req is not None:
        req.keep = str(reason)[:32] or "flag"


def _reserve(n: int) -> bool:
    global _pending
    with _lock:
        if _pending + n > PENDING_MAX:
            return False
        _pending += n
        return True


def _release(n: int) -> None:
    global _pending
    if n:
        with _lock:
            _pending = max(0, _pending - n)


class BodyTap:
    """The request body chunks seen so far, by reference, within the pending budget."""

    __slots__ = ("chunks", "full", "kept", "lost", "size")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.kept = 0  # bytes referenced by ``chunks`` (reserved in the budget)
        self.size = 0  # bytes seen
        self.full = True  # chunks hold the whole body so far
        self.lost = False  # not even the first body_max bytes could be kept

    def add(self, data: Any) -> None:
        if _fault:
            raise RuntimeError("injected capture crash")
        n = len(data)
        self.size += n
        if self.lost or (not self.full and self.kept >= _body_max):
            return
        if self.full and _reserve(n):
            self.chunks.append(data if type(data) is bytes else bytes(data))
            self.kept += n
            return
        # Out of budget (now or before): the first body_max bytes only, and no hash.
        self.full = False
        if self.kept > _body_max:
            held, total = self.chunks, 0
            self.chunks = []
            for c in held:
                if total >= _body_max:
                    break
                self.chunks.append(c)
                total += len(c)
            _release(self.kept - total)
            self.kept = total
        elif self.kept < _body_max:
            part = data[: _body_max - self.kept]  # a copy of at most body_max bytes
            if _reserve(len(part)):
                self.chunks.append(bytes(part))
                self.kept += len(part)
            else:
                self.lost = True
                self.release()

    def release(self) -> None:
        kept, self.kept = self.kept, 0
        self.chunks = []
        _release(kept)


def reason(req: recorder.ActiveRequest) -> str | None:
    """Why ``req`` (ended) is kept, or None: the per-request decision."""
    why = req.keep
    if why is not None:
        return why
    status = req.status
    if status is not None and status >= 500:
        return "error"
    if req.end - req.start >= _slow_ns:
        return "slow"
    global _countdown
    _countdown -= 1
    if _countdown > 0:
        return None
    _countdown = _gap()
    return "sample" if _sample_budget() else None


def _gap() -> int:
    """Requests until the next random sample: geometric with mean 1 / PERFSLEUTH_CAPTURE_SAMPLE
    (each request kept with that probability, for one random draw per sample, not per
    request)."""
    if _sample <= 0.0:
        return 1 << 62
    if _sample >= 1.0:
        return 1
    return 1 + int(math.log(1.0 - _random()) / math.log(1.0 - _sample))


def _sample_budget() -> bool:
    """Whether one more random sample fits this minute (PERFSLEUTH_CAPTURE_SAMPLE_PER_MIN): a
    busy service would otherwise keep (and write) a capture every few milliseconds."""
    global _window, _in_window
    now = time.monotonic()
    if now - _window >= 60.0:
        _window, _in_window = now, 0
    if _in_window >= _sample_per_min:
        stats["captures_sample_capped"] += 1
        return False
    _in_window += 1
    return True


def finish_asgi(req: recorder.ActiveRequest, scope: Any, tap: BodyTap | None) -> None:
    """After an ASGI request ended: keep a capture of it if chosen. Never raises."""
    try:
        if _fault:
            raise RuntimeError("injected capture crash")
        why = reason(req)
        if why is None:
            if tap is not None:
                tap.release()
            return
        server = scope.get("server")
        parts = (
            str(scope.get("scheme") or "http"),
            f"{server[0]}:{server[1]}" if server and server[1] is not None else "",
            scope.get("raw_path") or scope.get("path") or "/",
            scope.get("query_string") or b"",
        )
        _keep(req, why, list(scope.get("headers") or ()), parts, tap)
    except Exception:
        recorder.internal_error()
        if tap is not None:
            tap.release()


def finish_wsgi(req: recorder.ActiveRequest, environ: Any, tap: BodyTap | None) -> None:
    """After a WSGI request ended: keep a capture of it if chosen. Never raises."""
    try:
        if _fault:
            raise RuntimeError("injected capture crash")
        why = reason(req)
        if why is None:
            if tap is not None:
                tap.release()
            return
        headers = [
            (k, v)
            for k, v in environ.items()
            if type(k) is str
            and (k.startswith("HTTP_") or k in ("CONTENT_TYPE", "CONTENT_LENGTH"))
            and type(v) is str
        ]
        parts = (
            str(environ.get("wsgi.url_scheme") or "http"),
            f"{environ.get('SERVER_NAME', '')}:{environ.get('SERVER_PORT', '')}",
            environ.get("RAW_URI") or environ.get("REQUEST_URI"),
            (environ.get("SCRIPT_NAME") or "") + (environ.get("PATH_INFO") or "/"),
            environ.get("QUERY_STRING") or "",
        )
        _keep(req, why, headers, parts, tap)
    except Exception:
        recorder.internal_error()
        if tap is not None:
            tap.release()


def finish_django(req: recorder.ActiveRequest, request: Any) -> None:
    """After a request recorded by the Django middleware ended (WSGI or ASGI): keep a capture
    of it if chosen. The body is the one Django read and cached (``request.body``), if any."""
    try:
        if _fault:
            raise RuntimeError("injected capture crash")
        why = reason(req)
        if why is None:
            return
        meta = request.META
        headers = [
            (k, v)
            for k, v in meta.items()
            if type(k) is str
            and (k.startswith("HTTP_") or k in ("CONTENT_TYPE", "CONTENT_LENGTH"))
            and type(v) is str
        ]
        parts = (
            str(request.scheme or "http"),
            f"{meta.get('SERVER_NAME', '')}:{meta.get('SERVER_PORT', '')}",
            request.get_full_path(),
            "",
            "",
        )
        body = getattr(request, "_body", None)
        tap = None
        if isinstance(body, bytes) and body:
            tap = BodyTap()
            tap.add(body)
        _keep(req, why, headers, parts, tap)
    except Exception:
        recorder.internal_error()


def _keep(
    req: recorder.ActiveRequest,
    why: str,
    headers: list[Any],
    parts: tuple[Any, ...],
    tap: BodyTap | None,
) -> None:
    if tap is not None and tap.lost:
        stats["captures_dropped"] += 1
        tap.release()
        return
    fields = (
        req.trace_id,
        req.start_wall,
        max(0, req.end - req.start),
        req.endpoint or f"{req.method} <unmatched>",
        req.method,
        req.status,
        why,
    )

    emit = _emit
    if emit is not None and emit(b"C", _Build(fields, headers, parts, tap)):
        stats["captures"] += 1
    else:
        stats["captures_dropped"] += 1
        if tap is not None:
            tap.release()


# ------------------------------------------------------------------ writer thread: the record


class _Build:
    """The queued event: builds the record on the writer thread. Its body bytes leave the
    budget when it has run or, if the shipper dropped it unbuilt, when it is freed."""

    __slots__ = ("fields", "headers", "parts", "tap")

    def __init__(
        self, fields: tuple[Any, ...], headers: list[Any], parts: tuple[Any, ...], tap: Any
    ) -> None:
        self.fields, self.headers, self.parts, self.tap = fields, headers, parts, tap

    def __call__(self, _intern: Any) -> dict[str, Any]:
        try:
            return _record(self.fields, self.headers, self.parts, self.tap)
        finally:
            self.done()

    def done(self) -> None:
        tap, self.tap = self.tap, None
        if tap is not None:
            tap.release()

    def __del__(self) -> None:
        try:
            self.done()
        except Exception:
            pass


def _text(v: Any) -> str:
    return bytes(v).decode("latin-1") if isinstance(v, bytes | bytearray) else str(v)


def _sha256(data: bytes) -> Any:
    import hashlib  # on the writer thread, at the first capture: not at start-up

    return hashlib.sha256(data)


def _kept_body(body: bytes, content_type: str | None, redacted: list[str]) -> bytes:
    """The body bytes stored: its first _body_max, with the secret fields of an urlencoded
    form redacted (a form cut short is kept as is only up to its last whole field)."""
    kept = body[:_body_max]
    if _secrets or not content_type or "x-www-form-urlencoded" not in content_type.lower():
        return kept
    try:
        text = kept.decode("latin-1")
        if len(body) > _body_max:  # a truncated form: only its whole fields
            text = text.rsplit("&", 1)[0]
        return _redact_pairs(text, "form", redacted).encode("latin-1")
    except Exception:
        return b""  # a form that cannot be read is not kept: it may hold a secret


def _record(
    fields: tuple[Any, ...], headers: list[Any], parts: tuple[Any, ...], tap: BodyTap | None
) -> dict[str, Any]:
    trace_id, ts, dur, endpoint, method, status, why = fields
    pairs: list[list[str]] = []
    redacted: list[str] = []
    host = content_length = content_type = None
    for k, v in headers:
        name = _text(k)
        if name.startswith("HTTP_"):  # WSGI environ key
            name = name[5:]
        name = name.replace("_", "-").lower() if name.isupper() else name.lower()
        value = _text(v)
        if name == "host":
            host = value
        elif name == "content-length":
            content_length = value
        elif name == "content-type":
            content_type = value
        if secret_name(name) and not _secrets:
            redacted.append(name)
            value = REDACTED
        pairs.append([name, value])
    if len(parts) == 4:  # ASGI: scheme, server, raw path, query string
        scheme, server, path, query = parts
        path = _text(path)
        query = _text(query)
    else:  # WSGI: scheme, server, raw URI, decoded path, query string
        scheme, server, raw_uri, path, query = parts
        if raw_uri:
            path, _, query = str(raw_uri).partition("?")
        else:
            from urllib.parse import quote  # on the writer thread; not at start-up

            path = quote(str(path).encode("latin-1"), safe="/:@!$&'()*+,;=-._~%")
    if query and not _secrets:
        query = _redact_pairs(str(query), "query", redacted)
    url = f"{scheme}://{host or server}{path or '/'}" + (f"?{query}" if query else "")
    body = b"".join(tap.chunks) if tap is not None else b""
    size = tap.size if tap is not None else 0
    try:  # a body the application never read counts by its declared size
        declared = int(content_length) if content_length is not None else 0
    except ValueError:
        declared = 0
    complete = tap is None or tap.full
    if declared > size:
        size, complete = declared, False
    truncated = size > _body_max or not complete
    kept = _kept_body(body, content_type, redacted)  # before "redacted" is listed: it adds to it
    return {
        "id": f"{trace_id:016x}",
        "ts": ts,
        "dur": dur,
        "endpoint": endpoint,
        "method": method,
        "status": status,
        "reason": why,
        "url": url,
        "headers": pairs,
        "redacted": sorted(set(redacted)),
        "body_b64": binascii.b2a_base64(kept, newline=False).decode("ascii"),
        "body_size": size,
        "body_sha256": _sha256(body).hexdigest() if complete else None,
        "body_truncated": truncated,
    }


# --------------------------------------------------------------------------- WSGI input tap


class InputTap:
    """``wsgi.input`` seen through: what the application reads also feeds a BodyTap. No
    ``readinto`` on purpose, so readers (werkzeug) use ``read`` and chunks stay whole."""

    __slots__ = ("_stream", "tap")

    def __init__(self, stream: Any, tap: BodyTap) -> None:
        self._stream = stream
        self.tap = tap

    def _seen(self, data: Any) -> Any:
        if data:
            try:
                self.tap.add(data)
            except Exception:
                recorder.internal_error()
        return data

    def read(self, *args: Any) -> Any:
        return self._seen(self._stream.read(*args))

    def readline(self, *args: Any) -> Any:
        return self._seen(self._stream.readline(*args))

    def readlines(self, *args: Any) -> Any:
        lines = self._stream.readlines(*args)
        for line in lines:
            self._seen(line)
        return lines

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tap_wsgi_input(environ: Any) -> BodyTap | None:
    """Wrap ``wsgi.input`` when the request has a body (cheap no-op otherwise)."""
    if not on:
        return None
    try:
        if environ.get("CONTENT_LENGTH") in (None, "", "0") and "chunked" not in str(
            environ.get("HTTP_TRANSFER_ENCODING", "")
        ):
            return None
        stream = environ.get("wsgi.input")
        if stream is None:
            return None
        tap = BodyTap()
        environ["wsgi.input"] = InputTap(stream, tap)
        return tap
    except Exception:
        recorder.internal_error()
        return None


def _after_fork_in_child() -> None:
    global _pending, _lock
    _pending = 0  # the parent's pending captures are the parent's
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
