"""The calls of a request as fixed-width binary rows (``CALL``): the codes and sentinels the
agent's rows and the store share, and the JSON shape of decoded calls.

The agent writes its calls as agent rows in REQUESTS records (:mod:`perfsleuth.wire.batch`);
decoding a batch request by request (tools, tests, the store's slow path) turns them into
``CALL`` rows (:func:`perfsleuth.wire.batch.call_rows`) and then into one dict per call
(:func:`decode_parts`).

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
``{"many": n}`` for executemany) go into the request's JSON object as
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

_EXT_KEYS = ("error", "host", "kind", "system", "extra")
# What a batched call's ``cx`` entry may also carry (values of its CALL row)
ROW_EXT_KEYS = ("fp", "status", "bytes", "hit", "wait")
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
SYSTEM_CODE = {s: i for i, s in enumerate(SYSTEMS)}


def decode_parts(head: bytes | dict[str, Any], rows: bytes) -> dict[str, Any]:
    """A request as JSON-shaped dicts (``calls``: one dict per call, absent values left out)
    from its JSON object (or its decoded dict) and its ``CALL`` rows. ValueError if the object
    is not a JSON object."""
    obj = json.loads(head) if isinstance(head, bytes | bytearray | memoryview) else head
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
