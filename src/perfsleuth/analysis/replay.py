"""Replaying a captured request (``perfsleuth replay``): as a curl command, or re-sent to a
running server with the new timings next to the original ones.

A capture comes from ``Store.capture`` (see agent.capture). Headers whose values were redacted
at capture time are never sent (their value is ``[redacted]``); the curl command says which
ones were left out. A body that was too large to keep whole is refused unless the caller
allows sending its first bytes only.

The captured URL's host is the request's own ``Host`` header, which whoever sent the request
chose: it is sent as a header again, never used as the place to send the replay to. That is
``to_url`` (``--to``), or in a curl command without one, ``$PERFSLEUTH_TARGET`` when it runs.
"""

from __future__ import annotations

import base64
import http.client
import shlex
import time
from typing import Any
from urllib.parse import urlsplit

# Not replayed as captured: curl and http.client set them for the request they send.
_SKIP = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect"}
)
REDACTED = "[redacted]"
TARGET_VAR = "PERFSLEUTH_TARGET"
_TARGET = (
    f'"${{{TARGET_VAR}:?set {TARGET_VAR} to the server to send it to, like http://127.0.0.1:8000}}"'
)


class ReplayError(Exception):
    """A capture cannot be replayed as asked (one sentence for the user)."""


def _headers(capture: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """(headers to send, names left out because they were redacted)."""
    send: list[tuple[str, str]] = []
    redacted = set(capture.get("redacted") or ())
    for name, value in capture.get("headers") or ():
        low = str(name).lower()
        if low in _SKIP:
            continue
        if value == REDACTED:
            redacted.add(low)
            continue
        send.append((str(name), str(value)))
    return send, sorted(redacted)


def body(capture: dict[str, Any], *, allow_truncated: bool = False) -> bytes:
    """The request body to send; ReplayError for a truncated body unless allowed."""
    data = base64.b64decode(capture.get("body_b64") or "")
    if capture.get("body_truncated") and not allow_truncated:
        raise ReplayError(
            f"the captured body of trace {capture.get('trace_id')} was truncated (kept "
            f"{len(data):,} of {capture.get('body_size') or 0:,} bytes), so a replay would "
            "send a different request; pass --allow-truncated to send the kept bytes anyway"
        )
    return data


def host_header(capture: dict[str, Any]) -> str | None:
    """The captured ``Host`` header, if there was one."""
    for name, value in capture.get("headers") or ():
        if str(name).lower() == "host":
            return str(value)
    return None


def path_and_query(capture: dict[str, Any]) -> str:
    """The captured request's path and query string (``/orders/7?x=1``)."""
    url = str(capture.get("url") or "")
    _, sep, rest = url.partition("://")
    host = host_header(capture)
    if sep and host is not None and rest.startswith(host):
        # The URL was built as scheme://HOST/path: cut the Host value off as it was, so that a
        # Host with '/', '?' or '#' in it cannot change the path.
        tail = rest[len(host) :]
        if not tail or tail.startswith("/"):
            return tail or "/"
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def target_url(capture: dict[str, Any], to_url: str | None) -> str:
    """The captured path and query on ``to_url`` (scheme://host:port[/prefix])."""
    if not to_url:
        raise ReplayError("say where to send it: --to URL, e.g. --to http://127.0.0.1:8000")
    base = urlsplit(to_url)
    if base.scheme not in ("http", "https") or not base.netloc:
        raise ReplayError(f"--to needs an http(s) URL like http://127.0.0.1:8000, not {to_url!r}")
    return f"{base.scheme}://{base.netloc}{base.path.rstrip('/')}{path_and_query(capture)}"


def _comment(text: str) -> str:
    """``text`` as one comment line: no character of it can end the comment."""
    return "".join(c if c.isprintable() else "?" for c in text)


def curl_for(
    capture: dict[str, Any], to_url: str | None = None, *, allow_truncated: bool = False
) -> str:
    """A shell-safe curl command re-sending the captured request to ``to_url``, or to
    $PERFSLEUTH_TARGET when it runs (a leading comment names the headers that were redacted and
    are therefore left out). URLs are taken literally (``--globoff``: no ``{a,b}`` or ``[1-3]``
    ranges); the captured Host header is sent as a header."""
    send, redacted = _headers(capture)
    data = body(capture, allow_truncated=allow_truncated)
    method = str(capture.get("method") or "GET")
    host = host_header(capture)
    if host is not None:
        send.insert(0, ("Host", host))
    args = ["curl", "-sS", "-X", method, "--globoff"]
    url = shlex.quote(target_url(capture, to_url)) if to_url else None
    for name, value in send:
        args += ["-H", f"{name}: {value}"]
    lines: list[str] = []
    if redacted:
        lines.append(
            _comment(
                f"# redacted at capture time, not sent: {', '.join(redacted)} "
                "(add them with -H 'Name: value' if the request needs them)"
            )
        )
    if url is None:
        url = _TARGET + shlex.quote(path_and_query(capture))
        lines.append(f"# sent to ${TARGET_VAR} (scheme://host:port), the server to replay it on")
    if capture.get("body_truncated"):
        lines.append(
            f"# the body is truncated: {len(data):,} of {capture.get('body_size') or 0:,} bytes"
        )
    cmd = " ".join([*(shlex.quote(a) for a in args[:5]), url, *(shlex.quote(a) for a in args[5:])])
    if data:
        try:
            text = data.decode("utf-8")
            printable = text.isprintable() or all(c.isprintable() or c in "\r\n\t" for c in text)
        except UnicodeDecodeError:
            printable = False
        if printable:
            cmd += " --data-raw " + shlex.quote(text)
        else:  # binary: decoded from base64 in the pipeline
            b64 = base64.b64encode(data).decode("ascii")
            cmd = f"printf %s {b64} | base64 -d | {cmd} --data-binary @-"
    lines.append(cmd)
    return "\n".join(lines)


def send_once(
    method: str, url: str, headers: list[tuple[str, str]], data: bytes, timeout: float = 60.0
) -> dict[str, Any]:
    """Send one request; {status, duration_ms} (time until the whole response was read)."""
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    has_host = any(name.lower() == "host" for name, _ in headers)
    try:
        conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    except ValueError as e:  # e.g. a port that is not a number
        raise ReplayError(f"cannot send to {parts.netloc}: {e}") from e
    try:
        t0 = time.perf_counter()
        conn.putrequest(method, path, skip_host=has_host, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if data or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data or None)
        resp = conn.getresponse()
        resp.read()
        return {"status": resp.status, "duration_ms": (time.perf_counter() - t0) * 1000}
    except ConnectionRefusedError as e:
        raise ReplayError(f"cannot connect to {parts.netloc}: connection refused") from e
    except TimeoutError as e:
        raise ReplayError(f"{parts.netloc} did not answer within {timeout:g} s") from e
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise ReplayError(f"replaying to {parts.netloc} failed: {e}") from e
    finally:
        conn.close()


def replay(
    capture: dict[str, Any],
    to_url: str,
    times: int = 1,
    *,
    allow_truncated: bool = False,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Re-send a capture ``times`` times to ``to_url``: {url, original: {status, duration_ms},
    runs: [{status, duration_ms}], redacted: [names not sent]}."""
    if times < 1:
        raise ReplayError(f"--times must be at least 1 (got {times})")
    send, redacted = _headers(capture)
    host = host_header(capture)
    if host is not None:
        send.insert(0, ("Host", host))
    data = body(capture, allow_truncated=allow_truncated)
    url = target_url(capture, to_url)
    method = str(capture.get("method") or "GET")
    runs = [send_once(method, url, send, data, timeout) for _ in range(times)]
    return {
        "trace_id": capture.get("trace_id"),
        "endpoint": capture.get("endpoint"),
        "method": method,
        "url": url,
        "original": {"status": capture.get("status"), "duration_ms": capture.get("duration_ms")},
        "runs": runs,
        "redacted": redacted,
    }
