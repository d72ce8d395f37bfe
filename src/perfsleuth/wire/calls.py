"""The calls of a request as binary rows, in two record types.

Calls are most of what the agent writes (an N+1 request has thousands), so they are not JSON:
a request record is the request's JSON object, one NUL byte (JSON text never contains a raw
NUL), then one binary row per call.

``REQUEST_ROWS`` (what the agent writes): the rows are the agent's own (agent.recorder), five
int64 per call, copied to bytes by one C call on the writer thread with no per-call Python::

    slot            index into the JSON object's ``sites``: [fp, stack, site, kind, system]
                    ids and codes, what the calls of one statement from one place share
    start, end      perf_counter ns on the process's clock; ``t0`` in the JSON object is the
                    request's start on that clock; end 0: unfinished
    rows, ph        rows returned / affected, hash of the bound parameters (NULL: absent)

and what does not fit goes to the ``cx`` entry of the call (below), with ``fp``, ``status``,
``bytes``, ``hit`` and ``wait`` too. The store turns them into ``CALL`` rows, vectorised.

``REQUEST_BIN`` (earlier agents; still read): one fixed ``CALL`` row per call, packed by the
writer one call at a time.

``CALL`` row fields, little-endian; ``NULL`` marks an absent integer:
    off, dur        ns from the request start, ns duration
    fp, stack, site ids of the interned fingerprint, stack and call-site location
    ph              hash of the bound parameters (compared within one request only)
    rows, bytes     rows returned / affected, response bytes
    wait            ns spent waiting for a pooled connection
    status          HTTP status (int32, NULL_32 when absent)
    kind, system    codes into KINDS / SYSTEMS (OTHER: the name is in the JSON ``cx`` entry)
    hit             1 hit, 0 miss, -1 unknown
    flags           FLAG_UNFINISHED, FLAG_EXT (an entry in ``cx`` holds its strings)

Rare per-call values (error class, HTTP host, unlisted kind/system, driver details such as
``{"many": n}`` for executemany) go into the JSON object as
``"cx": {"<call index>": {"error": ..., "host": ..., "kind": ..., "system": ..., "extra": ...}}``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

CALL = struct.Struct("<qqqqqqqqqiBBbB")
FIELDS = (
    ("off", "q"), ("dur", "q"), ("fp", "q"), ("stack", "q"), ("site", "q"), ("ph", "q"),
    ("rows", "q"), ("bytes", "q"), ("wait", "q"), ("status", "i"), ("kind", "B"),
    ("system", "B"), ("hit", "b"), ("flags", "B"),
)  # fmt: skip
NULL = -(1 << 63)
NULL_32 = -(1 << 31)
KINDS = ("db", "http", "cache")
SYSTEMS = ("sqlite", "postgresql", "mysql", "redis", "memcached", "http")
OTHER = 255
FLAG_UNFINISHED = 1
FLAG_EXT = 2
SEPARATOR = b"\x00"
_MASK63 = (1 << 63) - 1

_EXT_KEYS = ("error", "host", "kind", "system", "extra")
# What a REQUEST_ROWS call's ``cx`` entry may also carry (values of its CALL row)
ROW_EXT_KEYS = ("fp", "status", "bytes", "hit", "wait")

AGENT_ROW = struct.Struct("<qqqqq")  # slot, start, end, rows, ph
AGENT_FIELDS = ("slot", "start", "end", "rows", "ph")
SITE_FIELDS = ("fp", "stack", "site", "kind", "system")  # an entry of ``sites``
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
SYSTEM_CODE = {s: i for i, s in enumerate(SYSTEMS)}


def split(payload: bytes) -> tuple[bytes, bytes]:
    """(JSON object, call rows) of a REQUEST_BIN payload. ValueError if the rows are torn."""
    head, sep, rows = payload.partition(SEPARATOR)
    if not sep or len(rows) % CALL.size:
        raise ValueError("a REQUEST_BIN payload without whole call rows")
    return head, rows


def decode_request(payload: bytes) -> dict[str, Any]:
    """A REQUEST_BIN payload as the JSON-shaped request (``calls``: one dict per call, absent
    values left out): for tools, tests and the store's slow path. ValueError if malformed."""
    return decode_parts(*split(payload))


def split_rows(payload: bytes) -> tuple[bytes, bytes]:
    """(JSON object, agent rows) of a REQUEST_ROWS payload. ValueError if the rows are torn."""
    head, sep, rows = payload.partition(SEPARATOR)
    if not sep or len(rows) % AGENT_ROW.size:
        raise ValueError("a REQUEST_ROWS payload without whole call rows")
    return head, rows


def decode_rows_request(payload: bytes) -> dict[str, Any]:
    """A REQUEST_ROWS payload as the JSON-shaped request, like :func:`decode_request`."""
    return decode_rows_parts(*split_rows(payload))


def decode_rows_parts(head: bytes, rows: bytes) -> dict[str, Any]:
    """:func:`decode_rows_request` of a payload already split: the agent rows turned into
    ``CALL`` rows (the store does the same, vectorised), then :func:`decode_parts`."""
    try:
        packed = b"".join(CALL.pack(*r) for r in call_rows(json.loads(head), rows))
    except (struct.error, TypeError) as e:
        raise ValueError(f"a REQUEST_ROWS site entry out of range: {e}") from None
    return decode_parts(head, packed)


def call_rows(obj: Any, rows: bytes) -> list[tuple[int, ...]]:
    """The ``CALL`` row values of a REQUEST_ROWS request: ``obj`` its JSON object, ``rows``
    its agent rows. ValueError if the object does not describe them."""
    if not isinstance(obj, dict):
        raise ValueError("a request record that is not a JSON object")
    sites, t0, dur = obj.get("sites"), obj.get("t0"), obj.get("dur")
    if not rows:
        return []
    if not isinstance(sites, list) or type(t0) is not int or type(dur) is not int:
        raise ValueError("a REQUEST_ROWS request without sites, t0 or dur")
    out: list[tuple[int, ...]] = []
    for slot, start, end, nrows, ph in AGENT_ROW.iter_unpack(rows):
        site = sites[slot] if 0 <= slot < len(sites) else None
        if not isinstance(site, list) or len(site) != len(SITE_FIELDS):
            raise ValueError("a call row whose slot names no site")
        fp, stack, where, kind, system = site
        dur_ns = (end if end else t0 + dur) - start
        out.append(
            (
                start - t0,
                max(0, dur_ns),
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


def decode_parts(head: bytes, rows: bytes) -> dict[str, Any]:
    """:func:`decode_request` of a payload already :func:`split` into JSON object and rows."""
    obj = json.loads(head)
    if not isinstance(obj, dict):
        raise ValueError("a request record that is not a JSON object")
    ext = obj.pop("cx", None)
    ext = ext if isinstance(ext, dict) else {}
    calls = []
    for i, row in enumerate(CALL.iter_unpack(rows)):
        c: dict[str, Any] = {name: v for (name, _), v in zip(FIELDS, row, strict=True)}
        for name in ("off", "dur", "fp", "stack", "site", "ph", "rows", "bytes", "wait"):
            if c[name] == NULL:
                del c[name]
        if c["status"] == NULL_32:
            del c["status"]
        c["hit"] = None if c["hit"] < 0 else bool(c["hit"])
        if c["hit"] is None:
            del c["hit"]
        flags = c.pop("flags")
        if flags & FLAG_UNFINISHED:
            c["unfinished"] = True
        c["kind"] = KINDS[c["kind"]] if c["kind"] < len(KINDS) else None
        c["system"] = SYSTEMS[c["system"]] if c["system"] < len(SYSTEMS) else None
        x = ext.get(str(i))
        if isinstance(x, dict):
            c.update({k: v for k, v in x.items() if k in _EXT_KEYS or k in ROW_EXT_KEYS})
        calls.append(c)
    obj["calls"] = calls
    return obj
