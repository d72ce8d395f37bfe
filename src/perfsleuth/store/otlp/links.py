"""Requests of different services linked by OTLP span ids: the link attributes stored with a
request (its parent span, its HTTP calls' spans), and the queries and words that follow them
from one request to the other services' requests."""

from __future__ import annotations

from typing import Any

import numpy as np

from perfsleuth.store.otlp.spans import Span

# Attributes (kind LINK) that link a request to the call of another service that made it.
LINK = "link"
PARENT_SPAN = "otlp.parent_span"
CALL_SPAN = "otlp.call_span"


def link_rows(
    servers: list[Span], calls: list[Span], crow: np.ndarray, seq: np.ndarray, cols: dict[str, Any]
) -> list[tuple[int, str, str, int | None]]:
    """The span ids that link a request to the call of another service that made it: (row,
    key, trace + span id, call seq). A request's parent span (``otlp.parent_span``); an HTTP
    call's own span (``otlp.call_span``), which the callee's request names as its parent."""
    out: list[tuple[int, str, str, int | None]] = []
    for row, s in enumerate(servers):
        if s.parent:
            out.append((row, PARENT_SPAN, s.trace + s.parent, None))
    for k, c in enumerate(calls):
        if cols["kind"][k] == "http":
            out.append((int(crow[k]), CALL_SPAN, c.trace + c.span, int(seq[k])))
    return out


def inner_link_rows(
    spans: list[Span],
    par: np.ndarray,
    calls: np.ndarray,
    crow: np.ndarray,
    seq: np.ndarray,
    cols: dict[str, Any],
    inner: np.ndarray,
) -> list[tuple[int, str, str, int | None]]:
    """The ``otlp.call_span`` rows of client spans inside an HTTP call (a transport's span in
    a library's): the service called names the innermost as its parent."""
    out: list[tuple[int, str, str, int | None]] = []
    at = {int(i): k for k, i in enumerate(calls.tolist())}
    for i in np.nonzero(inner)[0].tolist():
        j = int(par[i])
        for _ in range(256):
            if j < 0 or j in at:
                break
            j = int(par[j])
        k = at.get(j)
        if k is not None and cols["kind"][k] == "http":
            s = spans[i]
            out.append((int(crow[k]), CALL_SPAN, s.trace + s.span, int(seq[k])))
    return out


def links(store: Any, trace_id: str) -> dict[str, Any]:
    """The requests of other services a request is linked with by OTLP span ids: ``upstream``,
    the call of another service's request that made it (None: none reported), and
    ``downstream``, for each of its calls that another reporting service served, that
    request with where its time went (its calls by kind, and the statement or call that
    took most of it)."""
    cols = (
        "r.trace_id, r.service, r.endpoint, r.duration_ms, r.status, r.error, r.db_calls,"
        " r.db_ms, r.http_calls, r.http_ms, r.cache_calls, r.cache_ms"
    )
    prefix = trace_id[:32]
    down = store.query(
        f"""
        SELECT CAST(c.num AS INTEGER) AS seq, {cols}
        FROM attributes c
        JOIN attributes p ON p.kind = '{LINK}' AND p.key = '{PARENT_SPAN}' AND p.value = c.value
            AND starts_with(p.trace_id, ?)
        JOIN requests r ON r.trace_id = p.trace_id
        WHERE c.kind = '{LINK}' AND c.key = '{CALL_SPAN}' AND c.trace_id = ?
        ORDER BY seq
        """,
        [prefix, trace_id],
    )
    up = store.query(
        f"""
        SELECT CAST(c.num AS INTEGER) AS seq, {cols}
        FROM attributes p
        JOIN attributes c ON c.kind = '{LINK}' AND c.key = '{CALL_SPAN}' AND c.value = p.value
            AND starts_with(c.trace_id, ?)
        JOIN requests r ON r.trace_id = c.trace_id
        WHERE p.kind = '{LINK}' AND p.key = '{PARENT_SPAN}' AND p.trace_id = ?
        LIMIT 1
        """,
        [prefix, trace_id],
    )
    for d in down:
        top = store.query(
            """
            SELECT f.text, c.kind, count(*) AS calls, sum(c.duration_ms) AS ms
            FROM calls c LEFT JOIN fingerprints f ON f.id = c.fingerprint_id
            WHERE c.trace_id = ? GROUP BY 1, 2 ORDER BY ms DESC LIMIT 1
            """,
            [d["trace_id"]],
        )
        d["top_call"] = top[0] if top else None
    return {"upstream": up[0] if up else None, "downstream": down}


def link_lines(found: dict[str, Any], calls: list[dict[str, Any]]) -> list[str]:
    """``links`` in words, for a request whose calls are ``calls`` (by seq)."""
    out = []
    up = found.get("upstream")
    if up:
        out.append(
            f"called by {up['service']} {up['endpoint']} (its call #{up['seq']}, "
            f"trace {up['trace_id']})"
        )
    by_seq = {c.get("seq"): c for c in calls}
    for d in found.get("downstream") or []:
        call = by_seq.get(d["seq"]) or {}
        what = call.get("fingerprint") or "the call"
        spent = [
            f"{label} {float(d[k + '_ms'] or 0):.0f} ms in {d[k + '_calls']} calls"
            for k, label in (("db", "DB"), ("http", "HTTP"), ("cache", "cache"))
            if d[k + "_calls"]
        ]
        line = (
            f"call #{d['seq']} {what} -> {d['service']} {d['endpoint']} "
            f"{float(d['duration_ms'] or 0):.0f} ms"
        )
        if spent:
            line += ": " + ", ".join(spent)
        top = d.get("top_call")
        if top and top["text"]:
            line += f"; most in `{top['text'][:80]}` x{top['calls']} ({float(top['ms']):.0f} ms)"
        out.append(line + f" (trace {d['trace_id']})")
    return out
