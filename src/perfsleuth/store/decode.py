"""Request records -> one Arrow table shaped like :data:`REQUEST_WIRE`, a row per request.

The agent's REQUESTS records (:mod:`perfsleuth.wire.batch`) are read vectorised: integer
columns straight from their bytes, calls from the agent rows with their sites looked up in a
few numpy steps per batch. A record Arrow cannot read with the expected types (an odd agent, a
hand-written record), and the requests read past damage (decoded by wire.segment), go through
a slow path that coerces each value (calls as JSON-shaped dicts) or drops it to NULL: one odd
record never fails a batch.

Duplicates: a batch keeps the first request of each trace id (:func:`once_per_trace`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store.records import Batch
from perfsleuth.store.values import ID_MASK, as_bool, as_id, as_int, as_str
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire import calls as wcalls

# The request as the store reads it: one row per request, its calls as a list of structs.
CALL_WIRE = pa.struct(
    [
        ("kind", pa.string()),
        ("system", pa.string()),
        ("fp", pa.int64()),
        ("off", pa.int64()),
        ("dur", pa.int64()),
        ("stack", pa.int64()),
        ("site", pa.int64()),
        ("ph", pa.int64()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("status", pa.int64()),
        ("hit", pa.bool_()),
        ("wait", pa.int64()),
        ("error", pa.string()),
        ("host", pa.string()),
        ("unfinished", pa.bool_()),
    ]
)


REQUEST_WIRE = pa.schema(
    [
        ("id", pa.string()),
        ("ts", pa.int64()),
        ("dur", pa.int64()),
        ("kind", pa.string()),
        ("method", pa.string()),
        ("endpoint", pa.string()),
        ("path", pa.string()),
        ("status", pa.int64()),
        ("error", pa.string()),
        ("cpu_ns", pa.int64()),
        ("req_bytes", pa.int64()),
        ("resp_bytes", pa.int64()),
        ("user", pa.string()),
        ("tenant", pa.string()),
        ("calls_dropped", pa.int64()),
        ("gc_ns", pa.int64()),
        ("gc_count", pa.int64()),
        ("calls", pa.list_(CALL_WIRE)),
        # batched requests only (wire.batch): the request's start on the process clock, and
        # what its call rows' slots point at
        ("t0", pa.int64()),
        ("sites", pa.list_(pa.list_(pa.int64()))),
    ]
)


_ID_FIELDS = frozenset({"fp", "stack", "site", "ph"})


_CALL_DTYPE = np.dtype([(name, "<" + code) for name, code in wcalls.FIELDS])
assert _CALL_DTYPE.itemsize == wcalls.CALL.size


_AGENT_DTYPE = np.dtype([(name, "<i8") for name in wbatch.AGENT_FIELDS])
assert _AGENT_DTYPE.itemsize == wbatch.AGENT_ROW.size


_COERCE = {pa.int64(): as_int, pa.string(): as_str, pa.bool_(): as_bool}


def _coerce_request(obj: Any) -> dict[str, Any] | None:
    """A request object with every value of the type REQUEST_WIRE expects (or None)."""
    if not isinstance(obj, dict):
        return None
    out: dict[str, Any] = {}
    for f in REQUEST_WIRE:
        if f.name in ("calls", "t0", "sites"):  # calls: below; t0, sites: already applied
            out[f.name] = None
            continue
        out[f.name] = _COERCE[f.type](obj.get(f.name))
    calls = obj.get("calls")
    out["calls"] = [
        {
            cf.name: (as_id if cf.name in _ID_FIELDS else _COERCE[cf.type])(c.get(cf.name))
            for cf in CALL_WIRE
        }
        for c in (calls if isinstance(calls, list) else ())
        if isinstance(c, dict)
    ]
    return out


def parse_requests(batch: Batch) -> tuple[pa.Table, np.ndarray, list[tuple[int, Any]]]:
    """(requests as REQUEST_WIRE, segment index per row, [(row, decoded object)] of the rows
    that carry attributes or tags)."""
    parts: list[pa.Table] = []
    src: list[int] = []
    blobs: list[memoryview | None] = []  # agent rows (wire.batch) per row (None: JSON calls)
    where: list[tuple[int, int, int] | None] = []  # (segment, start, end) of the row's record
    ext_rows: list[tuple[int, Any]] = []  # (row, object) of rows with per-call extras
    attr_objs: list[tuple[int, Any]] = []
    slow: list[tuple[int, Any, int, int]] = []  # (segment index, object, start, end)
    rows = 0
    for seg, columns, start, end in batch.columns:
        obj, n = columns.obj, columns.n
        try:
            t, ncalls = _columns_table(columns)
        except (pa.ArrowException, TypeError, ValueError, OverflowError, RecursionError):
            try:  # odd values: request by request, coerced like a hand-written record
                slow.extend((seg, req, start, end) for req in wbatch.decode_columns(columns))
            except (ValueError, RecursionError, TypeError):
                batch.add_damage(batch.segments[seg], start, end - start, "undecodable payload")
            continue
        parts.append(t)
        at = 0
        for c in ncalls.tolist():
            blobs.append(columns.rows[at : at + c * wbatch.AGENT_ROW.size])
            at += c * wbatch.AGENT_ROW.size
        src.extend([seg] * n)
        where.extend([(seg, start, end)] * n)
        for name in ("attrs", "tags"):
            for key, value in (obj.get(name) or {}).items():
                k = as_int(key)
                if k is not None and 0 <= k < n:
                    attr_objs.append((rows + k, {name: value}))
        for key, cx in (obj.get("cx") or {}).items():
            k = as_int(key)
            if k is not None and 0 <= k < n:
                ext_rows.append((rows + k, {"cx": cx}))
        rows += n
    # Records read past damage come decoded, without their offsets (-1: the segment is
    # quarantined anyway).
    slow.extend(
        (i, obj, -1, -1) for i, obj in zip(batch.dict_src, batch.dict_requests, strict=True)
    )
    objs: list[dict[str, Any]] = []
    for seg_i, obj, start, end in slow:
        req = _coerce_request(obj)
        if req is None:
            if start >= 0:
                batch.add_damage(batch.segments[seg_i], start, end - start, "not a request object")
            continue
        if "attrs" in obj or "tags" in obj:
            attr_objs.append((rows + len(objs), obj))
        objs.append(req)
        src.append(seg_i)
        blobs.append(None)
        where.append(None)
    if objs:
        parts.append(pa.Table.from_pylist(objs, schema=REQUEST_WIRE))
    wire = pa.concat_tables(parts) if parts else REQUEST_WIRE.empty_table()
    if any(b is not None for b in blobs):
        rows_ok = _check_agent_rows(wire, blobs)
        for bad in np.flatnonzero(~rows_ok).tolist():
            rec = where[bad]
            if rec is not None:
                seg, start, end = rec
                batch.add_damage(batch.segments[seg], start, end - start, "call rows without sites")
            blobs[bad] = memoryview(b"")
        wire = _with_agent_calls(wire, blobs, ext_rows)
    return wire, np.asarray(src, dtype=np.int64), attr_objs


def once_per_trace(
    wire: pa.Table, src: np.ndarray, attr_objs: list[tuple[int, Any]]
) -> tuple[pa.Table, np.ndarray, list[tuple[int, Any]]]:
    """The requests of a batch with a trace id met before in it left out (a record repeated
    in a segment, a segment copied under another name): the first one stays, with its calls
    and attributes. Requests without a trace id are all kept."""
    n = wire.num_rows
    if n < 2:
        return wire, src, attr_objs
    ids = pc.fill_null(wire["id"], "")
    firsts = (
        pa.table({"id": ids, "row": pa.array(np.arange(n, dtype=np.int64))})
        .group_by("id", use_threads=False)
        .aggregate([("row", "min")])
    )
    if firsts.num_rows == n:
        return wire, src, attr_objs
    keep = to_numpy(pc.equal(ids, ""), True).astype(bool)
    keep[to_numpy(firsts["row_min"], 0).astype(np.int64)] = True
    new_row = np.cumsum(keep) - 1
    attrs = [(int(new_row[row]), obj) for row, obj in attr_objs if keep[row]]
    return wire.filter(pa.array(keep)), src[keep], attrs


def _columns_table(columns: wbatch.Batch) -> tuple[pa.Table, np.ndarray]:
    """A REQUESTS record (wire.batch) as REQUEST_WIRE rows (calls still empty), and the
    number of call rows of each request."""
    obj, n = columns.obj, columns.n
    nulls = [None] * n
    ints = np.frombuffer(columns.ints, dtype=np.int64).reshape(n, len(wbatch.INT_COLUMNS))
    cols = {}
    for j, name in enumerate(wbatch.INT_COLUMNS):
        col = ints[:, j]
        if name == "id":
            cols[name] = pa.array([f"{v:016x}" for v in col.view(np.uint64).tolist()], pa.string())
        elif name in REQUEST_WIRE.names:
            cols[name] = pa.array(col, pa.int64(), mask=col == wcalls.NULL)
    for name in wbatch.STRING_COLUMNS:
        cols[name] = pa.array(obj.get(name) or nulls, REQUEST_WIRE.field(name).type)
    cols["sites"] = pa.array(wbatch.request_sites(obj), REQUEST_WIRE.field("sites").type)
    cols["calls"] = pa.nulls(n, REQUEST_WIRE.field("calls").type)
    table = pa.table({f.name: cols[f.name] for f in REQUEST_WIRE}, schema=REQUEST_WIRE)
    return table, ints[:, wbatch.INT_COLUMNS.index("ncalls")]


def _check_agent_rows(wire: pa.Table, blobs: list[memoryview | None]) -> np.ndarray:
    """Per row: False for a batched request with call rows but no ``t0``/``sites`` (or sites
    that are not five ids each): its rows cannot be read."""
    n = wire.num_rows
    ok = np.ones(n, dtype=bool)
    has = np.fromiter((bool(b) for b in blobs), bool, count=n)
    if not has.any():
        return ok
    sites = wire["sites"].combine_chunks()
    inner_ok = pc.equal(pc.list_value_length(pc.list_flatten(sites)), len(wbatch.SITE_FIELDS))
    parents = to_numpy(pc.list_parent_indices(sites), 0).astype(np.int64)
    bad_site = np.zeros(n, dtype=bool)
    bad_site[parents[~to_numpy(inner_ok, False).astype(bool)]] = True
    missing = to_numpy(pc.is_null(wire["t0"]), True) | to_numpy(pc.is_null(sites), True)
    missing |= to_numpy(pc.is_null(wire["dur"]), True)
    ok[has & (missing | bad_site)] = False
    return ok


def _agent_calls(wire: pa.Table, blobs: list[memoryview], rows_of: np.ndarray) -> np.ndarray:
    """The agent rows (wire.batch) of the requests at wire rows ``rows_of`` (``blobs``, in that
    order) as ``CALL`` rows: offsets from t0, durations (unfinished ones up to the request's
    end), and the fingerprint, stack, site, kind and system of their slot's site."""
    size = wbatch.AGENT_ROW.size
    counts = np.fromiter((len(b) // size for b in blobs), np.int64, len(blobs))
    agent = np.frombuffer(b"".join(blobs), dtype=_AGENT_DTYPE)
    parent = np.repeat(np.arange(len(blobs), dtype=np.int64), counts)
    take = pa.array(rows_of)
    t0 = to_numpy(pc.take(wire["t0"], take), 0).astype(np.int64)[parent]
    req_end = t0 + to_numpy(pc.take(wire["dur"], take), 0).astype(np.int64)[parent]
    sites = pc.take(wire["sites"], take).combine_chunks()
    n_sites = to_numpy(pc.list_value_length(sites), 0).astype(np.int64)
    table = to_numpy(pc.list_flatten(pc.list_flatten(sites)), wcalls.NULL).astype(np.int64)
    table = table.reshape(-1, len(wbatch.SITE_FIELDS))
    slot = agent["slot"]
    valid = (slot >= 0) & (slot < n_sites[parent])
    at = np.where(valid, (np.cumsum(n_sites) - n_sites)[parent] + slot, 0)

    def site_field(k: int, null: int) -> np.ndarray:
        if not len(table):
            return np.full(len(agent), null, dtype=np.int64)
        return np.where(valid, table[at, k], null)

    out = np.zeros(len(agent), dtype=_CALL_DTYPE)
    start, end = agent["start"], agent["end"]
    out["off"] = start - t0
    out["dur"] = np.maximum(np.where(end != 0, end, req_end) - start, 0)
    out["fp"] = site_field(0, wcalls.NULL)
    out["stack"] = site_field(1, wcalls.NULL)
    out["site"] = site_field(2, wcalls.NULL)
    ph = agent["ph"]
    out["ph"] = np.where(ph == wcalls.NULL, wcalls.NULL, ph & ID_MASK)
    out["rows"] = agent["rows"]
    out["bytes"] = out["wait"] = wcalls.NULL
    out["status"] = wcalls.NULL_32
    out["kind"] = np.clip(site_field(3, wcalls.OTHER), 0, 255)
    out["system"] = np.clip(site_field(4, wcalls.OTHER), 0, 255)
    out["hit"] = -1
    out["flags"] = np.where(end == 0, wcalls.FLAG_UNFINISHED, 0)
    return out


def _with_agent_calls(
    wire: pa.Table, blobs: list[memoryview | None], ext_rows: list[tuple[int, Any]]
) -> pa.Table:
    """``wire`` with its ``calls`` column built from the agent rows of REQUESTS records
    (wire.batch), in a few vectorised steps per batch, keeping the JSON calls of the other
    rows (the slow path's: odd or hand-written records, those read past damage) in place."""
    n = wire.num_rows
    has = np.fromiter((b is not None for b in blobs), dtype=bool, count=n)
    size = wbatch.AGENT_ROW.size
    bin_counts = np.fromiter((len(b) if b is not None else 0 for b in blobs), np.int64, n) // size
    which = np.flatnonzero(has & (bin_counts > 0))
    arr = (
        _agent_calls(wire, [blobs[i] or memoryview(b"") for i in which], which)
        if len(which)
        else np.empty(0, dtype=_CALL_DTYPE)
    )
    bin_starts = np.cumsum(bin_counts) - bin_counts
    bin_flat = _binary_struct(arr, bin_starts, ext_rows)

    json_calls = wire["calls"].combine_chunks()
    json_counts = to_numpy(pc.list_value_length(json_calls), 0).astype(np.int64)
    json_counts[has] = 0  # a binary row's calls are its binary rows, whatever its JSON says
    json_flat = pc.list_flatten(json_calls)
    if len(json_flat):
        parents = to_numpy(pc.list_parent_indices(json_calls), 0).astype(np.int64)
        json_flat = json_flat.filter(pa.array(~has[parents]))
    json_starts = np.cumsum(json_counts) - json_counts

    counts = np.where(has, bin_counts, json_counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    src_start = np.where(has, len(json_flat) + bin_starts, json_starts)
    total = int(offsets[-1])
    idx = np.repeat(src_start - offsets[:-1], counts) + np.arange(total, dtype=np.int64)
    both = pa.concat_arrays([json_flat.cast(CALL_WIRE), bin_flat])
    merged = pa.ListArray.from_arrays(pa.array(offsets), both.take(pa.array(idx)))
    return wire.set_column(wire.schema.get_field_index("calls"), "calls", merged)


# cx keys that replace an integer of the call's binary row (REQUESTS records carry them
# there; "hit", a bool, is read apart)
_ROW_EXT_INTS = tuple(k for k in wcalls.ROW_EXT_KEYS if k != "hit")


def _binary_struct(
    arr: np.ndarray, row_starts: np.ndarray, ext_rows: list[tuple[int, Any]]
) -> pa.StructArray:
    """Binary call rows as the CALL_WIRE struct (sentinels to NULL, codes to names)."""
    kinds = np.array([*wcalls.KINDS, None], dtype=object)
    systems = np.array([*wcalls.SYSTEMS, None], dtype=object)
    kind = kinds[np.minimum(arr["kind"], len(wcalls.KINDS))]
    system = systems[np.minimum(arr["system"], len(wcalls.SYSTEMS))]
    error = np.full(len(arr), None, dtype=object)
    host = np.full(len(arr), None, dtype=object)
    if not arr.flags.writeable:
        arr = arr.copy()
    for row, obj in ext_rows:  # rare: errors, HTTP hosts and statuses, cache hits, ...
        cx = obj.get("cx") if isinstance(obj, dict) else None
        if not isinstance(cx, dict) or row >= len(row_starts):
            continue
        base = int(row_starts[row])
        for key, x in cx.items():
            i = as_int(key)
            if i is None or not isinstance(x, dict) or not 0 <= base + i < len(arr):
                continue
            j = base + i
            error[j] = as_str(x.get("error"))
            host[j] = as_str(x.get("host"))
            if "kind" in x:
                kind[j] = as_str(x.get("kind"))
            if "system" in x:
                system[j] = as_str(x.get("system"))
            for name in _ROW_EXT_INTS:
                v = as_int(x.get(name))
                if v is not None:
                    arr[name][j] = v if name != "status" or -(2**31) < v < 2**31 else 0
            if isinstance(x.get("hit"), bool):
                arr["hit"][j] = 1 if x["hit"] else 0

    def ints(name: str, null: int) -> pa.Array:
        col = arr[name]
        return pa.array(col.astype(np.int64), mask=col == null)

    hit = arr["hit"]
    unfinished = (arr["flags"] & wcalls.FLAG_UNFINISHED) != 0
    cols = {
        "kind": pa.array(kind, pa.string()),
        "system": pa.array(system, pa.string()),
        "fp": ints("fp", wcalls.NULL),
        "off": ints("off", wcalls.NULL),
        "dur": ints("dur", wcalls.NULL),
        "stack": ints("stack", wcalls.NULL),
        "site": ints("site", wcalls.NULL),
        "ph": ints("ph", wcalls.NULL),
        "rows": ints("rows", wcalls.NULL),
        "bytes": ints("bytes", wcalls.NULL),
        "status": ints("status", wcalls.NULL_32),
        "hit": pa.array(hit == 1, mask=hit < 0),
        "wait": ints("wait", wcalls.NULL),
        "error": pa.array(error, pa.string()),
        "host": pa.array(host, pa.string()),
        "unfinished": pa.array(unfinished, mask=~unfinished),
    }
    return pa.StructArray.from_arrays([cols[f.name] for f in CALL_WIRE], fields=list(CALL_WIRE))


def to_numpy(arr: pa.Array | pa.ChunkedArray, fill: Any) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, fill).to_numpy(zero_copy_only=False))
