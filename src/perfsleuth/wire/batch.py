"""A batch of finished requests as one ``REQUESTS`` record: what the agent writes.

The agent's writer thread wakes up to a few dozen finished requests at a time and writes them
as one record, so the work per request is a row of references gathered into columns, and the
encoding (JSON for the columns, one C call for all the calls' rows) is done per batch::

    payload := JSON object, NUL, rows

The JSON object holds one list per column, each ``n`` long, values in request order:

    id, kind, method, endpoint, path, user, tenant, error      strings (or null)
    ts, dur, status, cpu_ns, req_bytes, resp_bytes,              integers (or null): ns
    calls_dropped, gc_ns, gc_count                               and bytes like REQUEST's
    t0        perf_counter ns at the request's start, on the process clock of the rows
    ncalls    the request's number of rows
    sites     per request, what its rows' ``slot`` points at: indexes into ``site_table``

and ``site_table``, the sites of the batch's requests, each once (requests of a batch mostly
share theirs): [fp, stack, site, kind, system] (fingerprint, stack and call-site location
ids; kind and system codes of wire.calls).

The sparse ones are ``{"<request index>": ...}`` maps: ``attrs``, ``tags`` and ``cx``
(``{"<request index>": {"<call index>": {...}}}``, the per-call values of wire.calls's ``cx``
plus ``fp``, ``status``, ``bytes``, ``hit`` and ``wait``, which a row has no room for).

``rows``: the calls of every request of the batch, in order, five little-endian int64 each:
``slot, start, end, rows, ph`` (end 0: unfinished; NULL: no rows or no parameters), copied
from the agent's request objects (agent.recorder) with no per-call Python.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from perfsleuth.wire.calls import (
    CALL,
    FLAG_UNFINISHED,
    NULL,
    NULL_32,
    OTHER,
    SEPARATOR,
    decode_parts,
)

VERSION = 1  # of the JSON object's layout ("v")
AGENT_ROW = struct.Struct("<qqqqq")
AGENT_FIELDS = ("slot", "start", "end", "rows", "ph")
SITE_FIELDS = ("fp", "stack", "site", "kind", "system")  # an entry of ``sites``
STRING_COLUMNS = ("id", "kind", "method", "endpoint", "path", "user", "tenant", "error")
INT_COLUMNS = (
    "ts",
    "dur",
    "status",
    "cpu_ns",
    "req_bytes",
    "resp_bytes",
    "calls_dropped",
    "gc_ns",
    "gc_count",
    "t0",
    "ncalls",
)
SPARSE = ("attrs", "tags", "cx")
_MASK63 = (1 << 63) - 1
# What a row whose slot names no site gets: its timing stays, without fingerprint or site
_NO_SITE = [NULL, NULL, NULL, OTHER, OTHER]


def split(payload: bytes | memoryview) -> tuple[dict[str, Any], memoryview, int]:
    """(JSON object, rows, number of requests) of a REQUESTS payload, checked for shape: every
    column ``n`` long, whole rows, as many as ``ncalls`` says. ValueError otherwise."""
    view = memoryview(payload)
    sep = bytes(view[: min(len(view), 1 << 26)]).find(SEPARATOR)
    if sep < 0:
        raise ValueError("a REQUESTS payload without its rows")
    try:
        obj = json.loads(bytes(view[:sep]))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"a REQUESTS payload whose JSON does not parse: {e}") from None
    rows = view[sep + 1 :]
    if not isinstance(obj, dict) or type(obj.get("n")) is not int or obj["n"] < 0:
        raise ValueError("a REQUESTS payload without its number of requests")
    n = obj["n"]
    for name in (*STRING_COLUMNS, *INT_COLUMNS, "sites"):
        col = obj.get(name)
        if col is not None and (not isinstance(col, list) or len(col) != n):
            raise ValueError(f"a REQUESTS column {name!r} that is not {n} long")
    for name in SPARSE:
        if obj.get(name) is not None and not isinstance(obj[name], dict):
            raise ValueError(f"a REQUESTS {name!r} that is not a map")
    table = obj.get("site_table") or []
    if not isinstance(table, list) or any(
        not isinstance(site, list) or len(site) != len(SITE_FIELDS) for site in table
    ):
        raise ValueError("a REQUESTS site_table that is not [fp, stack, site, kind, system]s")
    for idx in obj.get("sites") or ():
        if idx is not None and (
            not isinstance(idx, list)
            or any(type(j) is not int or not 0 <= j < len(table) for j in idx)
        ):
            raise ValueError("a REQUESTS sites entry that is not indexes into site_table")
    counts = obj.get("ncalls") or [0] * n
    if any(type(c) is not int or c < 0 for c in counts):
        raise ValueError("a REQUESTS ncalls that is not a count")
    if len(rows) != sum(counts) * AGENT_ROW.size:
        raise ValueError("a REQUESTS payload whose rows do not match ncalls")
    return obj, rows, n


def decode(payload: bytes | memoryview) -> list[dict[str, Any]]:
    """A REQUESTS payload as JSON-shaped requests (``calls``: one dict per call, absent values
    left out, as wire.calls.decode_request gives them): for tools, tests and the store's slow
    path (the store reads batches vectorised). ValueError if malformed."""
    obj, rows, _ = split(payload)
    return decode_columns(obj, rows)


def request_sites(obj: dict[str, Any]) -> list[list[list[int]] | None]:
    """Per request of a batch checked by :func:`split`, its sites as [fp, stack, site, kind,
    system] lists (``site_table`` looked up)."""
    table = obj.get("site_table") or []
    return [
        None if idx is None else [table[j] for j in idx]
        for idx in obj.get("sites") or [None] * obj["n"]
    ]


def decode_columns(obj: dict[str, Any], rows: bytes | memoryview) -> list[dict[str, Any]]:
    """:func:`decode` of a payload already :func:`split` (its object checked for shape)."""
    n = obj["n"]
    sites_of = request_sites(obj)
    out = []
    at = 0
    for i in range(n):
        req: dict[str, Any] = {}
        for name in (*STRING_COLUMNS, *INT_COLUMNS):
            col = obj.get(name)
            if col is not None and col[i] is not None:
                req[name] = col[i]
        for name in SPARSE:
            v = (obj.get(name) or {}).get(str(i))
            if v is not None:
                req[name] = v
        req["sites"] = sites_of[i]
        k = req.get("ncalls", 0) * AGENT_ROW.size
        mine = bytes(rows[at : at + k])
        at += k
        try:
            packed = b"".join(CALL.pack(*r) for r in call_rows(req, mine))
        except (struct.error, TypeError) as e:
            raise ValueError(f"a REQUESTS site entry out of range: {e}") from None
        decoded = decode_parts(req, packed)
        for name in ("t0", "ncalls", "sites"):  # the rows are calls now
            decoded.pop(name, None)
        out.append(decoded)
    return out


def call_rows(req: dict[str, Any], rows: bytes) -> list[tuple[int, ...]]:
    """The ``CALL`` row values of one request of a batch: ``req`` its values (``t0``, ``dur``,
    ``sites``), ``rows`` its agent rows. ValueError if they do not describe the rows; a row
    whose slot is out of range keeps its timing, without fingerprint or site (as the store
    reads it)."""
    if not rows:
        return []
    sites, t0, dur = req.get("sites"), req.get("t0"), req.get("dur")
    if not isinstance(sites, list) or type(t0) is not int or type(dur) is not int:
        raise ValueError("a request with call rows but no sites, t0 or dur")
    out: list[tuple[int, ...]] = []
    for slot, start, end, nrows, ph in AGENT_ROW.iter_unpack(rows):
        site = sites[slot] if 0 <= slot < len(sites) else _NO_SITE
        if not isinstance(site, list) or len(site) != len(SITE_FIELDS):
            raise ValueError("a request whose sites are not [fp, stack, site, kind, system]")
        fp, stack, where, kind, system = site
        out.append(
            (
                start - t0,
                max(0, (end if end else t0 + dur) - start),
                fp,
                stack,
                where,
                NULL if ph == NULL else ph & _MASK63,
                nrows,
                NULL,  # bytes, wait and status: from ``cx``
                NULL,
                NULL_32,
                kind,
                system,
                -1,
                0 if end else FLAG_UNFINISHED,
            )
        )
    return out
