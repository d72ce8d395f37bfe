"""A batch of finished requests as one ``REQUESTS`` record: what the agent writes.

The agent's writer thread wakes up to a few dozen finished requests at a time and writes them
as one record, so the work per request is a row of references gathered into columns, and the
encoding (JSON for the text columns, one C call each for the integers and the calls' rows)
is done per batch::

    payload := JSON object, NUL, ints, rows, cx rows

The JSON object holds ``v`` (3; 2 is read too: a payload of layout 2 has no cx rows),
``n`` (the number of requests) and one list per text column, each ``n`` long, values in
request order (null: none), or ``{"all": value}`` when every request of the batch has the
same value (most batches share most columns):

    kind, method, endpoint, path, user, tenant, error
    sites     per request, what its rows' ``slot`` points at: indexes into ``site_table``

and ``site_table``, the sites of the batch's requests, each once (requests of a batch mostly
share theirs): [fp, stack, site, kind, system] (fingerprint, stack and call-site location
ids; kind and system codes of wire.calls).

The sparse ones are ``{"<request index>": ...}`` maps: ``attrs``, ``tags`` and ``cx``
(``{"<request index>": {"<call index>": {...}}}``, the per-call values of wire.calls's ``cx``
plus ``fp``, ``status``, ``bytes``, ``hit`` and ``wait``, which a row has no room for).

``ncx`` and ``hosts`` (layout 3): the number of cx rows after the agent rows, and the HTTP
hosts they name. Most per-call values (an HTTP call's status, host and fingerprint, a cache
call's hit) are cx rows, not ``cx`` entries: a JSON map per call was most of a batch's JSON
and of the store's reading (~0.6 of 1.2 CPU s per 100k requests x 10 calls). ``cx`` keeps
the entries with other values (error, extra: the whole entry; unlisted kind or system
names) or values past 64 bits (:func:`pack_cx`); of a cx row and a ``cx`` entry for one
call, the entry's values win.

``ints``: request by request, its integer columns as little-endian int64 (NULL, -2**63: none),
``len(INT_COLUMNS)`` each: decimal text and JSON escaping were most of the writer's work:

    id        the trace id, 64 bits (two's complement; shown as 16 hex digits)
    ts        the start, wall-clock ns since the epoch
    dur, cpu_ns, gc_ns                                   ns
    status, req_bytes, resp_bytes, calls_dropped, gc_count
    t0        perf_counter ns at the request's start, on the process clock of the rows
    ncalls    the request's number of rows

``rows``: the calls of every request of the batch, in order, five little-endian int64 each:
``slot, start, end, rows, ph`` (end 0: unfinished; NULL: no rows or no parameters), copied
from the agent's request objects (agent.recorder) with no per-call Python.

``cx rows``: ``ncx`` of them, eight little-endian int64 each (NULL: not given):
``req, call, fp, status, bytes, wait, hit, host``: the call's request (its index in the
batch) and its index among the request's rows, ``hit`` 1 or 0, ``host`` an index into
``hosts``. A row naming no call of its request is left out, and so is a hit not 0 or 1 or a
host index out of range; of two rows for one call the later one's values win.
"""

from __future__ import annotations

import array
import json
import struct
import sys
from collections.abc import Callable
from itertools import chain
from typing import Any, NamedTuple

from perfsleuth.wire.calls import (
    CALL,
    FLAG_UNFINISHED,
    NULL,
    NULL_32,
    OTHER,
    SEPARATOR,
    decode_parts,
)

VERSION = 3  # of the payload's layout ("v"); 1 had the integer columns in the JSON
VERSIONS = (2, 3)  # read: 2 is 3 without cx rows
AGENT_ROW = struct.Struct("<qqqqq")
AGENT_FIELDS = ("slot", "start", "end", "rows", "ph")
CX_ROW = struct.Struct("<qqqqqqqq")
CX_FIELDS = ("req", "call", "fp", "status", "bytes", "wait", "hit", "host")
# cx entry keys a cx row holds (hit a bool, host a string: the rest 64-bit integers)
_CX_ROW_KEYS = frozenset(("fp", "status", "bytes", "wait", "hit", "host"))
SITE_FIELDS = ("fp", "stack", "site", "kind", "system")  # an entry of ``sites``
STRING_COLUMNS = ("kind", "method", "endpoint", "path", "user", "tenant", "error")
INT_COLUMNS = (
    "id",
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
_MASK64 = (1 << 64) - 1
_BIG_ENDIAN = sys.byteorder == "big"
INT_ROW = struct.Struct("<" + "q" * len(INT_COLUMNS))  # a request's ints
_INT_SIZE = INT_ROW.size
_NCALLS = INT_COLUMNS.index("ncalls")
# What a row whose slot names no site gets: its timing stays, without fingerprint or site
_NO_SITE = [NULL, NULL, NULL, OTHER, OTHER]


class Batch(NamedTuple):
    """A REQUESTS payload checked by :func:`split`."""

    obj: dict[str, Any]  # the JSON object
    ints: array.array[int]  # n * len(INT_COLUMNS) int64, native order
    rows: memoryview  # the agent rows, little-endian
    n: int
    cx: memoryview = memoryview(b"")  # the cx rows (layout 3), little-endian


def split(payload: bytes | memoryview, loads: Callable[[bytes], Any] = json.loads) -> Batch:
    """A REQUESTS payload in its parts, checked for shape: every column ``n`` long, whole
    rows, as many as ``ncalls`` says. ValueError otherwise. ``loads``: the JSON head's
    parser (the store passes a faster one that returns what ``json.loads`` does)."""
    view = memoryview(payload)
    head = payload if isinstance(payload, bytes) else bytes(view[: min(len(view), 1 << 26)])
    sep = head.find(SEPARATOR, 0, 1 << 26)
    if sep < 0:
        raise ValueError("a REQUESTS payload without its rows")
    try:
        obj = loads(head[:sep])
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"a REQUESTS payload whose JSON does not parse: {e}") from None
    if not isinstance(obj, dict) or type(obj.get("n")) is not int or obj["n"] < 0:
        raise ValueError("a REQUESTS payload without its number of requests")
    if obj.get("v") not in VERSIONS or type(obj["v"]) is not int:
        raise ValueError(f"a REQUESTS payload of layout {obj.get('v')!r}, not one of {VERSIONS}")
    n = obj["n"]
    ncx = obj.get("ncx", 0) if obj["v"] >= 3 else 0
    if type(ncx) is not int or ncx < 0:
        raise ValueError("a REQUESTS ncx that is not a count")
    hosts = obj.get("hosts") if ncx else None
    if hosts is not None and (not isinstance(hosts, list) or not _all_type(hosts, str)):
        raise ValueError("a REQUESTS hosts that is not a list of strings")
    for name in (*STRING_COLUMNS, "sites"):
        col = obj.get(name)
        if isinstance(col, dict):  # {"all": value}: every request's
            if list(col) != ["all"]:
                raise ValueError(f"a REQUESTS column {name!r} that is a map but not {{'all'}}")
            col = obj[name] = [col["all"]] * n
        if col is not None and (not isinstance(col, list) or len(col) != n):
            raise ValueError(f"a REQUESTS column {name!r} that is not {n} long")
    for name in SPARSE:
        if obj.get(name) is not None and not isinstance(obj[name], dict):
            raise ValueError(f"a REQUESTS {name!r} that is not a map")
    table = obj.get("site_table") or []
    # Checked a column at a time (set(map(...)): no Python step per entry); JSON makes lists
    # and ints of exactly these types.
    if (
        not isinstance(table, list)
        or not _all_type(table, list)
        or (table and set(map(len, table)) != {len(SITE_FIELDS)})
    ):
        raise ValueError("a REQUESTS site_table that is not [fp, stack, site, kind, system]s")
    sites = [idx for idx in obj.get("sites") or () if idx is not None]
    if sites:
        flat = list(chain.from_iterable(sites)) if _all_type(sites, list) else None
        if flat is None or (
            flat and (not _all_type(flat, int) or min(flat) < 0 or max(flat) >= len(table))
        ):
            raise ValueError("a REQUESTS sites entry that is not indexes into site_table")
    end = sep + 1 + n * _INT_SIZE
    if len(view) < end:
        raise ValueError("a REQUESTS payload shorter than its integer columns")
    ints = array.array("q")
    ints.frombytes(view[sep + 1 : end])
    if _BIG_ENDIAN:
        ints.byteswap()
    counts = ints[_NCALLS :: len(INT_COLUMNS)]
    if any(c < 0 for c in counts):
        raise ValueError("a REQUESTS ncalls that is not a count")
    rows_end = end + sum(counts) * AGENT_ROW.size
    if len(view) != rows_end + ncx * CX_ROW.size:
        raise ValueError("a REQUESTS payload whose rows do not match ncalls and ncx")
    return Batch(obj, ints, view[end:rows_end], n, view[rows_end:])


def _all_type(values: list[Any], typ: type) -> bool:
    """Whether every value is of exactly ``typ`` (not a subclass: bool is no int here)."""
    return set(map(type, values)) <= {typ}


def int_columns(ints: array.array[int], n: int) -> dict[str, list[Any]]:
    """The integer columns of a batch as lists (None for NULL, the id as 16 hex digits)."""
    k = len(INT_COLUMNS)
    cols: dict[str, list[Any]] = {
        name: [None if v == NULL else v for v in ints[j : n * k : k]]
        for j, name in enumerate(INT_COLUMNS)
    }
    cols["id"] = [f"{v & _MASK64:016x}" for v in ints[0 : n * k : k]]
    return cols


def pack_ints(values: tuple[Any, ...] | list[Any]) -> bytes:
    """One request's integer columns (INT_COLUMNS order) as wire bytes: None, a bool or a
    value that is not a 64-bit integer is NULL; the id is taken modulo 2**64."""
    tid = values[0]
    out = [_int64(v) for v in values]
    if _is_int(tid):  # 64 bits of any sign: two's complement
        out[0] = ((int(tid) + (1 << 63)) & _MASK64) - (1 << 63)
    return INT_ROW.pack(*out)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int64(v: Any) -> int:
    return int(v) if _is_int(v) and -_MASK63 <= v <= _MASK63 else NULL


def decode(payload: bytes | memoryview) -> list[dict[str, Any]]:
    """A REQUESTS payload as JSON-shaped requests (``calls``: one dict per call, absent values
    left out, as wire.calls.decode_parts gives them): for tools, tests and the store's slow
    path (the store reads batches vectorised). ValueError if malformed."""
    return decode_columns(split(payload))


def request_sites(obj: dict[str, Any]) -> list[list[list[int]] | None]:
    """Per request of a batch checked by :func:`split`, its sites as [fp, stack, site, kind,
    system] lists (``site_table`` looked up)."""
    table = obj.get("site_table") or []
    return [
        None if idx is None else [table[j] for j in idx]
        for idx in obj.get("sites") or [None] * obj["n"]
    ]


def pack_cx(
    cx: dict[str, dict[str, dict[str, Any]]], ncalls: list[int], hosts: dict[str, int]
) -> tuple[dict[str, dict[str, dict[str, Any]]], list[tuple[int, ...]]]:
    """Per-call values in the layout 2 shape (``{"<request index>": {"<call index>": {...}}}``;
    ``ncalls``: each request's number of rows) as layout 3 writes them: (the ``cx`` entries
    left in the JSON, the cx rows). An entry becomes a row when it holds only what a row has
    room for (:func:`cx_row`) and names a call of its request; any other stays in the JSON as
    it is. ``hosts``: the batch's host indexes, added to."""
    rest: dict[str, dict[str, dict[str, Any]]] = {}
    rows: list[tuple[int, ...]] = []
    for rk, per in cx.items():
        r = _index(rk, len(ncalls))
        size = ncalls[r] if r is not None else 0
        for ck, x in per.items():
            c = _index(ck, size)
            row = cx_row(r, c, x, hosts) if r is not None and c is not None else None
            if row is None:
                rest.setdefault(rk, {})[ck] = x
            else:
                rows.append(row)
    return rest, rows


def cx_row(req: int, call: int, x: Any, hosts: dict[str, int]) -> tuple[int, ...] | None:
    """The cx row of a ``cx`` entry (``x``) of call ``call`` of request ``req``, or None
    when a row has no room for it: other keys than ``fp``, ``status``, ``bytes``, ``wait``
    (64-bit integers, NULL is none), ``hit`` (a bool) and ``host`` (a string: its index in
    ``hosts``, added if new)."""
    if type(x) is not dict or not x.keys() <= _CX_ROW_KEYS:
        return None
    ints = [x.get(name, NULL) for name in ("fp", "status", "bytes", "wait")]
    for name, v in zip(("fp", "status", "bytes", "wait"), ints, strict=True):
        if name in x and (type(v) is not int or not NULL <= v <= _MASK63):  # NULL: none
            return None
    hit, host = x.get("hit"), x.get("host")
    if (hit is not None and type(hit) is not bool) or (host is not None and type(host) is not str):
        return None
    return (
        req,
        call,
        *ints,
        NULL if hit is None else int(hit),
        NULL if host is None else hosts.setdefault(host, len(hosts)),
    )


def pack_cx_rows(rows: list[tuple[int, ...]]) -> bytes:
    """cx rows (tuples of CX_FIELDS) as wire bytes."""
    packed = array.array("q", chain.from_iterable(rows))
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _index(key: Any, size: int) -> int | None:
    """``key`` as the agent writes an index ("0", "1", ...) below ``size``, or None."""
    if type(key) is not str or not key.isdigit() or (key[0] == "0" and key != "0"):
        return None
    i = int(key)
    return i if i < size else None


def cx_maps(batch: Batch) -> dict[str, Any]:
    """The batch's per-call values in the layout 2 shape, ``{"<request index>": {"<call
    index>": {...}}}``: its cx rows (values not given left out; rows naming no call of their
    request left out) and its JSON ``cx`` entries, an entry's values over a row's for one
    call."""
    obj = batch.obj
    cx = obj.get("cx") or {}
    if not len(batch.cx):
        return cx  # type: ignore[no-any-return]
    k = len(INT_COLUMNS)
    counts = batch.ints[_NCALLS : batch.n * k : k]
    rows = [
        r for r in CX_ROW.iter_unpack(batch.cx) if 0 <= r[0] < batch.n and 0 <= r[1] < counts[r[0]]
    ]
    return cx_entries(rows, obj.get("hosts") or [], cx)


def cx_entries(rows: list[tuple[int, ...]], hosts: list[str], cx: Any) -> dict[str, Any]:
    """cx rows and ``cx`` entries (``{"<request index>": {"<call index>": {...}}}``) as
    entries of that shape, an entry's values over a row's for one call."""
    out: dict[str, Any] = {}
    for req, call, *values in rows:
        x: dict[str, Any] = {
            name: v
            for name, v in zip(("fp", "status", "bytes", "wait"), values, strict=False)
            if v != NULL
        }
        hit, host = values[4], values[5]
        if hit in (0, 1):
            x["hit"] = bool(hit)
        if 0 <= host < len(hosts):
            x["host"] = hosts[host]
        out.setdefault(str(req), {}).setdefault(str(call), {}).update(x)
    if isinstance(cx, dict):
        for rk, per in cx.items():
            if not isinstance(per, dict):  # no entry to read (wire.calls.decode_parts)
                continue
            mine = out.setdefault(rk, {})
            for ck, x in per.items():
                if not isinstance(x, dict):
                    continue
                row = mine.get(ck)
                if row:  # a row's value stays where the entry's is none (as the store reads)
                    x = {**row, **{k: v for k, v in x.items() if v is not None or k == "host"}}
                mine[ck] = x
    return out


def decode_columns(batch: Batch) -> list[dict[str, Any]]:
    """:func:`decode` of a payload already :func:`split`."""
    obj, n = batch.obj, batch.n
    sites_of = request_sites(obj)
    ints = int_columns(batch.ints, n)
    cx = cx_maps(batch)
    out = []
    at = 0
    for i in range(n):
        req: dict[str, Any] = {}
        for name in STRING_COLUMNS:
            col = obj.get(name)
            if col is not None and col[i] is not None:
                req[name] = col[i]
        for name, col in ints.items():
            if col[i] is not None:
                req[name] = col[i]
        for name in SPARSE:
            v = (cx if name == "cx" else obj.get(name) or {}).get(str(i))
            if v is not None:
                req[name] = v
        req["sites"] = sites_of[i]
        k = req.get("ncalls", 0) * AGENT_ROW.size
        mine = bytes(batch.rows[at : at + k])
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
