"""A client span as a call: its kind (DB, cache, HTTP), fingerprint, site and parameters hash,
worked out once per shape of span (services repeat their calls) with the dictionary rows
(fingerprints, locations, stacks) it uses."""

from __future__ import annotations

import re
from typing import Any

from perfsleuth.store import values
from perfsleuth.store.otlp.spans import PARAMETER, Span, first, http_method
from perfsleuth.wire import FINGERPRINT, LOCATION, STACK
from perfsleuth.wire import fingerprint as fpr

CACHE_SYSTEMS = frozenset({"redis", "memcached"})
# The location, stack and fingerprint records a payload's calls use, by (type, id).
Dictionary = dict[tuple[bytes, int], dict[str, Any]]
# Entries a look-up cache of this package holds before it starts over.
MAX_CACHED = 20_000
# Normalised text and operation of statements met lately (normalising costs far more than a
# look-up, and services repeat their statements).
_normalized: dict[str, tuple[str, str]] = {}
# Stable ids of the texts and locations met lately.
_ids: dict[tuple[str | int, ...], int] = {}


def _stable_id(*parts: str | int) -> int:
    """fpr.stable_id (the agent's ids for the same text or location), for parts met lately."""
    hit = _ids.get(parts)
    if hit is None:
        if len(_ids) >= MAX_CACHED:
            _ids.clear()
        hit = _ids[parts] = fpr.stable_id(*parts)
    return hit


def _normalize(statement: str) -> tuple[str, str]:
    hit = _normalized.get(statement)
    if hit is None:
        text = fpr.normalize_sql(statement)
        if len(_normalized) >= MAX_CACHED:
            _normalized.clear()
        hit = _normalized[statement] = (text, fpr.sql_operation(text))
    return hit


# What a call is, but its rows and status, by its span's name and other attributes: services
# repeat their calls, and working one out (normalising a statement) costs far more than a look-up.
Shape = tuple[str, str, int, int | None, str | None, int | None, int | None, Dictionary]
_shapes: dict[tuple[Any, ...], Shape] = {}
_ROWS = "db.response.returned_rows"
_VARYING = frozenset({_ROWS, "http.response.status_code", "http.status_code"})


def _shape(c: Span) -> Shape:
    a = c.attrs
    if _VARYING.isdisjoint(a):
        key: tuple[Any, ...] = (c.name, *a.items())
    else:
        key = (c.name, *(kv for kv in a.items() if kv[0] not in _VARYING))
    try:
        hit = _shapes.get(key)
    except TypeError:  # a list or map value: not cached
        key, hit = (), None
    if hit is None:
        hit = _call(c)
        if key:
            if len(_shapes) >= MAX_CACHED:
                _shapes.clear()
            _shapes[key] = hit
    return hit


def call_columns(calls: list[Span], dictionary: Dictionary) -> dict[str, Any]:
    """The call columns (but times) of the client spans, in order."""
    names = ("kind", "system", "fp", "ph", "host", "site", "stack")
    if not calls:
        return {k: [] for k in (*names, "rows", "status", "error")}
    shapes = [_shape(c) for c in calls]
    *parts, entries = zip(*shapes, strict=True)
    cols: dict[str, Any] = dict(zip(names, parts, strict=True))
    for e in {id(e): e for e in entries}.values():  # one dict per shape, shared by its calls
        dictionary.update(e)
    rows: list[int | None] = []
    status: list[int | None] = []
    for k, c in zip(cols["kind"], calls, strict=True):
        a = c.attrs
        if k == "http":
            rows.append(None)
            status.append(
                values.as_int32(first(a, "http.response.status_code", "http.status_code"))
            )
        else:
            rows.append(values.as_int(a[_ROWS]) if _ROWS in a else None)
            status.append(None)
    cols["rows"], cols["status"] = rows, status
    cols["error"] = [c.error for c in calls]
    return cols


def _call(c: Span) -> Shape:
    """The shape of a client span's call: kind, system, fingerprint id, parameters hash, host
    (HTTP), location and stack ids (its site), and the dictionary rows they name."""
    a = c.attrs
    system = values.as_str(first(a, "db.system.name", "db.system"))
    ph = host = None
    if system is not None:
        system = system.lower()
        statement = values.as_str(first(a, "db.query.text", "db.statement"))
        operation = values.as_str(first(a, "db.operation.name", "db.operation"))
        if system in CACHE_SYSTEMS:
            kind = "cache"
            words = (statement or operation or c.name).split()
            cmd = words[0].upper() if words else "?"
            key = fpr.cache_key_template(words[1]) if len(words) > 1 else ""
            text, op = f"{cmd} {key}".strip(), cmd
        else:
            kind = "db"
            if statement:
                text, op = _normalize(statement)
            else:
                text = (operation or c.name).upper()
                op = text.split()[0] if text.split() else "OTHER"
        ph = _params_hash(statement or "", text, a)
    else:
        kind, system = "http", "http"
        method = http_method(a) or "GET"
        url = values.as_str(first(a, "url.full", "http.url")) or ""
        rest = url.split("://", 1)[-1]
        url_host, _, url_path = rest.partition("/")
        url_host = url_host.rsplit("@", 1)[-1]  # never keep credentials in a URL
        host = values.as_str(first(a, "server.address", "net.peer.name")) or url_host
        port = first(a, "server.port", "net.peer.port")
        if host and port is not None and ":" not in host:
            host = f"{host}:{port}"
        host = host or c.name
        text, op = f"{method} {host}{fpr.url_template('/' + url_path)}", method
    fid = _stable_id(kind, text)
    entries: Dictionary = {(FINGERPRINT, fid): {"id": fid, "kind": kind, "text": text, "op": op}}
    site = _site(a)
    if site is None:
        return kind, system, fid, ph, host, None, None, entries
    lid = _stable_id(*site)
    sid = _stable_id(lid)
    file, line, func = site
    entries[LOCATION, lid] = {"id": lid, "file": file, "line": line, "func": func, "app": True}
    entries[STACK, sid] = {"id": sid, "frames": [lid]}
    return kind, system, fid, ph, host, lid, sid, entries


_PLACEHOLDER = re.compile(r"\$\d+|%s|%\(\w+\)s|\?|(?<![:\w]):[A-Za-z_]\w*")


def _params_hash(statement: str, text: str, a: dict[str, Any]) -> int | None:
    """What the agent's params_hash says (the same statement with the same values, within a
    request): the ``db.query.parameter.*`` values when reported; else the statement itself
    when its values are written into it (literals the fingerprint replaced); None when the
    values are unknown (placeholders without parameters) or there are none."""
    if PARAMETER in a:
        params = sorted(
            (k, str(v)) for k, v in a.items() if k.startswith(PARAMETER) and k != PARAMETER
        )
        if params:
            return _stable_id(*(x for kv in params for x in kv))
    if not statement or _PLACEHOLDER.search(statement):
        return None
    if "?" in text or "(...)" in text:
        return _stable_id(statement)
    return None


def _site(a: dict[str, Any]) -> tuple[str, int, str] | None:
    """(file, line, function) of the ``code.*`` attributes (old and current names)."""
    file = values.as_str(first(a, "code.file.path", "code.filepath"))
    line = values.as_int(first(a, "code.line.number", "code.lineno"))
    func = values.as_str(first(a, "code.function.name", "code.function"))
    if file is None and func is None:
        return None
    ns = values.as_str(first(a, "code.namespace"))
    if func and ns and "." not in func:
        func = f"{ns}.{func}"
    return file or "?", line if line is not None and 0 <= line < 2**31 else 0, func or "?"
