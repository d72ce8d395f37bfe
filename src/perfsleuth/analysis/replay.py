"""Replaying a captured request (``perfsleuth replay``): as a curl command, or re-sent to a
running server with the new timings next to the original ones.

A capture comes from ``Store.capture`` (see agent.capture). Headers whose values were redacted
at capture time are never sent (their value is ``[redacted]``); the curl command says which
ones were left out. A body that was too large to keep whole is refused unless the caller
allows sending its first bytes only.
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


def target_url(capture: dict[str, Any], to_url: str | None = None) -> str:
    """The captured URL, or its path and query sent to ``to_url`` (scheme://host:port[/prefix])."""
    url = str(capture.get("url") or "")
    if not to_url:
        return url
    base = urlsplit(to_url)
    if base.scheme not in ("http", "https") or not base.netloc:
        raise ReplayError(f"--to needs an http(s) URL like http://127.0.0.1:8000, not {to_url!r}")
    orig = urlsplit(url)
    path = base.path.rstrip("/") + (orig.path or "/")
    return f"{base.scheme}://{base.netloc}{path}" + (f"?{orig.query}" if orig.query else "")


def curl_for(
    capture: dict[str, Any], to_url: str | None = None, *, allow_truncated: bool = False
) -> str:
    """A shell-safe curl command re-sending the captured request (a leading comment names the
    headers that were redacted and are therefore left out)."""
    send, redacted = _headers(capture)
    data = body(capture, allow_truncated=allow_truncated)
    method = str(capture.get("method") or "GET")
    args = ["curl", "-sS", "-X", method, target_url(capture, to_url)]
    for name, value in send:
        args += ["-H", f"{name}: {value}"]
    lines: list[str] = []
    if redacted:
        lines.append(
            f"# redacted at capture time, not sent: {', '.join(redacted)} "
            "(add them with -H 'Name: value' if the request needs them)"
        )
    if capture.get("body_truncated"):
        lines.append(
            f"# the body is truncated: {len(data):,} of {capture.get('body_size') or 0:,} bytes"
        )
    cmd = " ".join(shlex.quote(a) for a in args)
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
    conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        t0 = time.perf_counter()
        conn.putrequest(method, path, skip_accept_encoding=True)
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
    except (OSError, http.client.HTTPException) as e:
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
