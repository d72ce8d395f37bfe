"""A REQUESTS record (wire.batch) from requests: each request's values (its text columns, its
integer columns as wire bytes, its sites), gathered into columns and encoded once for all.
The C accelerator's ``row()`` gives a request's values as :func:`row_values` does.
"""

from __future__ import annotations

import array
import sys
from typing import Any

from perfsleuth.agent import accel, recorder
from perfsleuth.agent.frameworks.common import (
    LOAD_HEADER,
    Identity,
    content_length,
    identity,
    identity_value,
    load_tags,
)
from perfsleuth.wire import REQUESTS
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire import calls as wcalls
from perfsleuth.wire.segment import encode_json, encode_payload_parts


def row_values(req: recorder.ActiveRequest) -> tuple[Any, ...]:
    """A request's values for wire.batch's text columns, in order, then its integer columns
    as wire bytes (the C accelerator's row() gives the same)."""
    if req.headers is not None:
        read_headers(req)
    gc = req.gc_count
    ints = (
        req.trace_id,
        req.start_wall,
        max(0, req.end - req.start),
        req.status,
        req.cpu_ns,
        req.req_bytes,
        req.resp_bytes,
        req.calls_dropped or None,
        req.gc_ns if gc else None,
        gc or None,
        req.start,
        len(req.calls or NO_CALLS) // recorder.ROW,
    )
    return (
        req.kind,
        req.method,
        req.endpoint or f"{req.method} <unmatched>",
        req.path,
        req.user,
        req.tenant,
        req.error,
        wbatch.pack_ints(ints),
    )


_c_row = accel.pick("row", None)


def request_values(req: recorder.ActiveRequest, ident: Identity) -> tuple[Any, ...]:
    """:func:`row_values`, by the C accelerator when it is there (``ident``: the identity
    headers, frameworks.common.identity())."""
    values = _c_row(req, ident.user_b, ident.tenant_b) if _c_row is not None else None
    if values is None or values is NotImplemented:
        values = row_values(req)
    return values  # type: ignore[no-any-return]


SPARSE = ("attrs", "tags", "cx")


def requests_record(
    rows: list[tuple[Any, ...]], calls_of: list[bytearray], sparse: dict[str, Any]
) -> bytes:
    """One REQUESTS record (wire.batch) of rows made by Encoder._row."""
    body: dict[str, Any] = {"v": wbatch.VERSION, "n": len(rows)}
    columns = list(zip(*rows, strict=True))
    names = (*wbatch.STRING_COLUMNS, "sites")
    for name, col in zip(names, (*columns[: len(wbatch.STRING_COLUMNS)], columns[-1]), strict=True):
        # The requests of a batch mostly share their kind, method, endpoint, tenant, error and
        # sites: one value then, not one per request (JSON encoding is a large part of the
        # writer's work). ``count`` compares by identity first: shared strings cost next to
        # nothing.
        first = col[0]
        body[name] = {"all": first} if col.count(first) == len(col) else col
    sparse = dict(sparse)
    cx_rows, hosts = sparse.pop("cxrows", None), sparse.pop("hosts", None)
    for name, values in sparse.items():
        if values:
            body[name] = values
    packed = b""
    if cx_rows:  # per-call values as binary rows (wire.batch)
        try:
            packed = wbatch.pack_cx_rows(cx_rows)
        except (OverflowError, TypeError):  # a value past 64 bits: the JSON entries hold all
            cx = wbatch.cx_entries(cx_rows, list(hosts or ()), body.get("cx") or {})
            hosts = {}
            body["cx"], cx_rows = wbatch.pack_cx(
                cx, [len(c) // wbatch.AGENT_ROW.size for c in calls_of], hosts
            )
            packed = wbatch.pack_cx_rows(cx_rows)
            if not body["cx"]:
                del body["cx"]
        if cx_rows:
            body["ncx"], body["hosts"] = len(cx_rows), list(hosts or ())
    ints = b"".join(columns[-2])  # packed little-endian by row()
    rows_bytes = b"".join(calls_of)  # the agent's rows are the wire's, in native order
    if _BIG_ENDIAN:
        swapped = array.array("q", rows_bytes)
        swapped.byteswap()
        rows_bytes = swapped.tobytes()
    return encode_payload_parts(
        REQUESTS, (encode_json(body), wcalls.SEPARATOR, ints, rows_bytes, packed)
    )


NO_CALLS = bytearray()
_BIG_ENDIAN = sys.byteorder == "big"


_LOAD_HEADER = LOAD_HEADER.encode("latin-1")


def read_headers(req: recorder.ActiveRequest) -> None:
    """The user, tenant and declared body size of an ASGI request from its raw header list
    (read here rather than on the request path). Values set by the application win."""
    headers = dict(req.headers)  # ASGI header names are lower case
    req.headers = None
    ident = identity()
    if req.user is None:
        req.user = identity_value(headers.get(ident.user_b))
    if req.tenant is None:
        req.tenant = identity_value(headers.get(ident.tenant_b))
    if req.req_bytes is None:
        cl = headers.get(b"content-length")
        req.req_bytes = 0 if cl is None else content_length(cl) or 0
    load = headers.get(_LOAD_HEADER)
    if load is not None:
        load_tags(req, load)


def scalar(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float)):
        return v
    return str(v)[: recorder.MAX_ATTR_CHARS]
