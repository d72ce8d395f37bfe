"""Request records -> one Arrow table shaped like :data:`REQUEST_WIRE`, a row per request.

The agent's REQUESTS records (:mod:`perfsleuth.wire.batch`) are read in bulk: the records of a
batch are joined and read in a few numpy steps per batch, not per request or call: integer
columns straight from their bytes, call rows with their sites looked up by index, the
per-call values (HTTP statuses and hosts, cache hits, per-call fingerprints) from their cx
rows' bytes (layout 3), and those of JSON ``cx`` entries (layout 2, or what a row cannot
hold) gathered key by key into columns. A record Arrow cannot read with the expected types (an odd
agent, a hand-written record), and the requests read past damage (decoded by wire.segment), go
through a slow path that coerces each value (calls as JSON-shaped dicts) or drops it to NULL:
one odd record never fails a batch.

Duplicates: a batch keeps the first request of each trace id (:func:`once_per_trace`).

One module (about 600 lines): the bulk read and the slow path must agree value by
value, and each is read against the other.
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import contains
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


# A REQUESTS record of the batch: (segment index, its parts, record start, record end)
_Record = tuple[int, wbatch.Batch, int, int]

# What a record whose values are not of the types the bulk read expects raises there
_ODD_VALUES = (
    pa.ArrowException,
    TypeError,
    ValueError,
    OverflowError,
    RecursionError,
    IndexError,
    KeyError,
)

_INT_AT = {name: j for j, name in enumerate(wbatch.INT_COLUMNS)}
_KIND_NAMES = pa.array([*wcalls.KINDS, None], pa.string())
_SYSTEM_NAMES = pa.array([*wcalls.SYSTEMS, None], pa.string())


def parse_requests(batch: Batch) -> tuple[pa.Table, np.ndarray, list[tuple[int, Any]]]:
    """(requests as REQUEST_WIRE, segment index per row, [(row, decoded object)] of the rows
    that carry attributes or tags)."""
    parts: list[pa.Table] = []
    src: list[np.ndarray] = []
    attr_objs: list[tuple[int, Any]] = []
    slow: list[tuple[int, Any, int, int]] = []  # (segment index, object, start, end)
    rows = 0

    def take(records: list[_Record]) -> None:
        nonlocal rows
        table, bad = _agent_table(records)
        attrs = [(rows + row, obj) for row, obj in _sparse_attrs(records)]
        for seg, start, end in bad:
            batch.add_damage(batch.segments[seg], start, end - start, "call rows without sites")
        parts.append(table)
        src.extend(np.full(columns.n, seg, dtype=np.int64) for seg, columns, _, _ in records)
        attr_objs.extend(attrs)
        rows += table.num_rows

    try:  # every record of the batch at once
        if batch.columns:
            take(batch.columns)
    except _ODD_VALUES:  # record by record: those that fail again go the slow way
        for record in batch.columns:
            try:
                take([record])
            except _ODD_VALUES:
                seg, columns, start, end = record
                try:  # odd values: request by request, coerced like a hand-written record
                    slow.extend((seg, req, start, end) for req in wbatch.decode_columns(columns))
                except (ValueError, RecursionError, TypeError):
                    batch.add_damage(batch.segments[seg], start, end - start, "undecodable payload")
    # Records read past damage come decoded, without their offsets (-1: the segment is
    # quarantined anyway).
    slow.extend(
        (i, obj, -1, -1) for i, obj in zip(batch.dict_src, batch.dict_requests, strict=True)
    )
    objs: list[dict[str, Any]] = []
    slow_src: list[int] = []
    for seg_i, obj, start, end in slow:
        req = _coerce_request(obj)
        if req is None:
            if start >= 0:
                batch.add_damage(batch.segments[seg_i], start, end - start, "not a request object")
            continue
        if "attrs" in obj or "tags" in obj:
            attr_objs.append((rows + len(objs), obj))
        objs.append(req)
        slow_src.append(seg_i)
    if objs:
        parts.append(pa.Table.from_pylist(objs, schema=REQUEST_WIRE))
        src.append(np.asarray(slow_src, dtype=np.int64))
    wire = pa.concat_tables(parts) if parts else REQUEST_WIRE.empty_table()
    return wire, (np.concatenate(src) if src else np.empty(0, dtype=np.int64)), attr_objs


def once_per_trace(
    wire: pa.Table, src: np.ndarray, attr_objs: list[tuple[int, Any]]
) -> tuple[pa.Table, np.ndarray, list[tuple[int, Any]]]:
    """The requests of a batch with a trace id and ts met before in it left out (a record
    repeated in a segment, a segment copied under another name: a copy has its original's
    ts): the first one stays, with its calls and attributes. A trace id met again at another
    ts is another request (the id reused, a trace's later request), kept: the store judges
    it on its own (tables.copied_requests). Requests without a trace id are all kept."""
    n = wire.num_rows
    if n < 2:
        return wire, src, attr_objs
    ids = pc.fill_null(wire["id"], "")
    firsts = (
        pa.table({"id": ids, "ts": wire["ts"], "row": pa.array(np.arange(n, dtype=np.int64))})
        .group_by(["id", "ts"], use_threads=False)
        .aggregate([("row", "min")])
    )
    if firsts.num_rows == n:
        return wire, src, attr_objs
    keep = to_numpy(pc.equal(ids, ""), True).astype(bool)
    keep[to_numpy(firsts["row_min"], 0).astype(np.int64)] = True
    new_row = np.cumsum(keep) - 1
    attrs = [(int(new_row[row]), obj) for row, obj in attr_objs if keep[row]]
    return wire.filter(pa.array(keep)), src[keep], attrs


def _sparse_attrs(records: list[_Record]) -> list[tuple[int, Any]]:
    """(row among the records' requests, {"attrs" or "tags": values}) of each request that has
    attributes or tags."""
    out: list[tuple[int, Any]] = []
    base = 0
    for _, columns, _, _ in records:
        obj, n = columns.obj, columns.n
        for name in ("attrs", "tags"):
            for key, value in (obj.get(name) or {}).items():
                k = as_int(key)
                if k is not None and 0 <= k < n:
                    out.append((base + k, {name: value}))
        base += n
    return out


def _agent_table(records: list[_Record]) -> tuple[pa.Table, list[tuple[int, int, int]]]:
    """REQUESTS records (wire.batch) as REQUEST_WIRE rows with their calls, read together;
    and (segment, start, end) of the record of each request whose call rows cannot be read
    (no ``t0``, ``dur`` or ``sites``): it is kept without calls. Raises one of _ODD_VALUES
    on values of other types than the wire's."""
    batches = [r[1] for r in records]
    ns = np.fromiter((b.n for b in batches), np.int64, len(batches))
    n = int(ns.sum())
    ints = np.concatenate([np.frombuffer(b.ints, dtype=np.int64) for b in batches])
    ints = ints.reshape(n, len(wbatch.INT_COLUMNS))
    cols: dict[str, pa.Array] = {}
    for j, name in enumerate(wbatch.INT_COLUMNS):
        col = np.ascontiguousarray(ints[:, j])
        if name == "id":
            cols[name] = hex_ids(col)
        elif name in REQUEST_WIRE.names:
            cols[name] = pa.array(col, pa.int64(), mask=col == wcalls.NULL)
    for name in wbatch.STRING_COLUMNS:
        cols[name] = pa.array(
            list(chain.from_iterable(b.obj.get(name) or [None] * b.n for b in batches)),
            pa.string(),
        )
    calls, bad_rows = _agent_calls(batches, ns, ints)
    cols["calls"] = calls
    cols["sites"] = pa.nulls(n, REQUEST_WIRE.field("sites").type)
    table = pa.table({f.name: cols[f.name] for f in REQUEST_WIRE}, schema=REQUEST_WIRE)
    rec_of = np.repeat(np.arange(len(records)), ns)
    bad = [records[i] for i in rec_of[bad_rows].tolist()]
    return table, [(seg, start, end) for seg, _, start, end in bad]


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


def hex_ids(ids: np.ndarray) -> pa.Array:
    """int64 trace ids as 16 lowercase hex digits of their 64 bits (``f"{v & 2**64-1:016x}"``),
    made a byte at a time in numpy instead of a Python string per id."""
    n = len(ids)
    octets = np.ascontiguousarray(ids, np.int64).view(np.uint64).astype(">u8").view(np.uint8)
    octets = octets.reshape(n, 8)
    text = np.empty((n, 16), np.uint8)
    text[:, 0::2] = _HEX_DIGITS[octets >> 4]
    text[:, 1::2] = _HEX_DIGITS[octets & 15]
    offsets = np.arange(0, 16 * n + 1, 16, dtype=np.int32)
    return pa.Array.from_buffers(
        pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(text.reshape(-1))]
    )


def _agent_calls(
    batches: list[wbatch.Batch], ns: np.ndarray, ints: np.ndarray
) -> tuple[pa.ListArray, np.ndarray]:
    """The calls of the requests of ``batches`` (their integer columns ``ints``) as a list
    of CALL_WIRE per request, from their agent rows: offsets from t0, durations (unfinished
    ones up to the request's end), the fingerprint, stack, site, kind and system of their
    slot's site, and the values of ``cx``. Also the requests whose rows cannot be read."""
    n = len(ints)
    ncalls = ints[:, _INT_AT["ncalls"]]
    t0_all, dur_all = ints[:, _INT_AT["t0"]], ints[:, _INT_AT["dur"]]
    agent = np.frombuffer(b"".join(b.rows for b in batches), dtype=_AGENT_DTYPE)

    # Each record's site_table, stacked; each request's sites, as indexes into its record's.
    tables = [b.obj.get("site_table") or [] for b in batches]
    site_n = np.fromiter((len(t) for t in tables), np.int64, len(tables))
    flat = pa.array(list(chain.from_iterable(chain.from_iterable(tables))), pa.int64())
    table = to_numpy(flat, wcalls.NULL).astype(np.int64).reshape(-1, len(wbatch.SITE_FIELDS))
    sites = list(chain.from_iterable(b.obj.get("sites") or [None] * b.n for b in batches))
    if None in sites:
        has_sites = np.fromiter((s is not None for s in sites), bool, n)
        n_sites = np.fromiter((len(s) if s is not None else 0 for s in sites), np.int64, n)
        sites = [s for s in sites if s is not None]
    else:  # every request has its sites (the agent's batches): no Python step per request
        has_sites = np.ones(n, bool)
        n_sites = np.fromiter(map(len, sites), np.int64, n)
    site_idx = np.fromiter(chain.from_iterable(sites), np.int64, int(n_sites.sum()))
    site_base = np.repeat(np.cumsum(site_n) - site_n, ns)

    # A request with rows but without what they point at keeps none of them.
    bad = (ncalls > 0) & (~has_sites | (t0_all == wcalls.NULL) | (dur_all == wcalls.NULL))
    counts = np.where(bad, 0, ncalls)
    parent = np.repeat(np.arange(n, dtype=np.int64), ncalls)
    if bad.any():
        keep = ~bad[parent]
        agent, parent = agent[keep], parent[keep]
    m = len(agent)
    t0 = t0_all[parent]
    req_end = t0 + dur_all[parent]
    slot = agent["slot"]
    valid = (slot >= 0) & (slot < n_sites[parent])
    at = np.where(valid, (np.cumsum(n_sites) - n_sites)[parent] + slot, 0)
    row = np.where(valid, site_idx[at] + site_base[parent], 0) if m and len(site_idx) else at

    def site_field(k: int, null: int) -> np.ndarray:
        if not len(table):
            return np.full(m, null, dtype=np.int64)
        return np.where(valid, table[row, k], null)

    start, end = agent["start"], agent["end"]
    ph = agent["ph"]
    c = {
        "off": start - t0,
        "dur": np.maximum(np.where(end != 0, end, req_end) - start, 0),
        "fp": site_field(0, wcalls.NULL),
        "stack": site_field(1, wcalls.NULL),
        "site": site_field(2, wcalls.NULL),
        "ph": np.where(ph == wcalls.NULL, wcalls.NULL, ph & ID_MASK),
        "rows": np.array(agent["rows"]),
        "bytes": np.full(m, wcalls.NULL, dtype=np.int64),
        "wait": np.full(m, wcalls.NULL, dtype=np.int64),
        "status": np.full(m, wcalls.NULL_32, dtype=np.int64),
        "hit": np.full(m, -1, dtype=np.int64),
    }
    kind_code = np.minimum(np.clip(site_field(3, wcalls.OTHER), 0, 255), len(wcalls.KINDS))
    system_code = np.minimum(np.clip(site_field(4, wcalls.OTHER), 0, 255), len(wcalls.SYSTEMS))
    call_start = np.cumsum(counts) - counts
    row_hosts = _apply_cx_rows(c, batches, ns, ncalls, bad, call_start)
    strs = _apply_cx(c, batches, ns, call_start, counts)
    if row_hosts is not None:  # a cx entry's host over a cx row's
        at, values = row_hosts
        if "host" in strs:
            at = np.concatenate([at, strs["host"][0]])
            values = pa.concat_arrays([values, strs["host"][1]])
        strs["host"] = (at, values)
    kind = _names(_KIND_NAMES, kind_code, strs.get("kind"))
    system = _names(_SYSTEM_NAMES, system_code, strs.get("system"))
    unfinished = end == 0

    def ints_of(name: str, null: int) -> pa.Array:
        col = c[name]
        mask = col == null
        if not mask.any():
            return pa.array(col, pa.int64())
        if mask.all():
            return pa.nulls(m, pa.int64())
        return pa.array(col, pa.int64(), mask=mask)

    fields = {
        "kind": kind,
        "system": system,
        "fp": ints_of("fp", wcalls.NULL),
        "off": ints_of("off", wcalls.NULL),
        "dur": ints_of("dur", wcalls.NULL),
        "stack": ints_of("stack", wcalls.NULL),
        "site": ints_of("site", wcalls.NULL),
        "ph": ints_of("ph", wcalls.NULL),
        "rows": ints_of("rows", wcalls.NULL),
        "bytes": ints_of("bytes", wcalls.NULL),
        "status": ints_of("status", wcalls.NULL_32),
        "hit": pa.array(c["hit"] == 1, mask=c["hit"] < 0),
        "wait": ints_of("wait", wcalls.NULL),
        "error": _strings(m, strs.get("error")),
        "host": _strings(m, strs.get("host")),
        "unfinished": pa.array(unfinished, mask=~unfinished),
    }
    struct = pa.StructArray.from_arrays([fields[f.name] for f in CALL_WIRE], fields=list(CALL_WIRE))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), struct), np.flatnonzero(bad)


def _strings(m: int, given: tuple[np.ndarray, pa.Array] | None) -> pa.Array:
    """``m`` strings, null but where ``given`` (calls, their strings) says."""
    if given is None:
        return pa.nulls(m, pa.string())
    return _names(pa.nulls(1, pa.string()), np.zeros(m, np.int64), given)


def _names(
    names: pa.Array, code: np.ndarray, overrides: tuple[np.ndarray, pa.Array] | None
) -> pa.Array:
    """``names[code]`` per call, with ``overrides`` (calls, their strings) in place."""
    if overrides is None:
        return names.take(pa.array(code))
    at, values = overrides
    idx = code.astype(np.int64)
    idx[at] = len(names) + np.arange(len(at))
    return pa.concat_arrays([names, values]).take(pa.array(idx))


def _apply_cx_rows(
    c: dict[str, np.ndarray],
    batches: list[wbatch.Batch],
    ns: np.ndarray,
    ncalls: np.ndarray,
    bad: np.ndarray,
    call_start: np.ndarray,
) -> tuple[np.ndarray, pa.Array] | None:
    """The cx rows of the records (wire.batch, layout 3) into the integer columns ``c``, read
    in numpy; returns their hosts (calls, strings). ``ncalls``: each request's rows, ``bad``:
    the requests whose rows are not kept, ``call_start``: where each request's kept calls
    begin. A row naming no call of its request is left out, a value NULL (or a hit not 0 or
    1, a host index out of range) is not given; of two rows for one call the later one's
    values win."""
    parts = [(i, b) for i, b in enumerate(batches) if len(b.cx)]
    if not parts or not len(ncalls):
        return None
    k = len(wbatch.CX_FIELDS)
    counts = [len(b.cx) // wbatch.CX_ROW.size for _, b in parts]
    # the rows' fields as contiguous columns (one pass), little-endian int64
    cols = np.frombuffer(b"".join(b.cx for _, b in parts), "<i8").reshape(-1, k).T.copy()
    field = dict(zip(wbatch.CX_FIELDS, cols, strict=True))
    rec = np.repeat(np.fromiter((i for i, _ in parts), np.int64, len(parts)), counts)
    local, call = field["req"], field["call"]
    ok = (local >= 0) & (local < ns[rec])
    req = np.minimum((np.cumsum(ns) - ns)[rec] + np.where(ok, local, 0), len(ncalls) - 1)
    ok &= (call >= 0) & (call < ncalls[req]) & ~bad[req]
    at = call_start[req] + call
    if not ok.all():
        at, rec = at[ok], rec[ok]
        field = {name: v[ok] for name, v in field.items()}

    def put(name: str, v: np.ndarray, has: np.ndarray) -> None:
        if has.all():
            c[name][at] = v
        elif has.any():
            c[name][at[has]] = v[has]

    for name in _ROW_EXT_INTS:
        v = field[name]
        if name == "status":
            v = np.where((v > -(2**31)) & (v < 2**31), v, wcalls.NULL_32)  # int32 or none
        put(name, v, field[name] != wcalls.NULL)
    hit = field["hit"]
    put("hit", hit, (hit == 0) | (hit == 1))
    hosts = [b.obj.get("hosts") or [] for _, b in parts]
    n_hosts = np.zeros(len(batches), np.int64)
    n_hosts[[i for i, _ in parts]] = [len(h) for h in hosts]
    host_base = np.cumsum(n_hosts) - n_hosts
    idx = field["host"]
    has = (idx >= 0) & (idx < n_hosts[rec])
    names = pa.array(list(chain.from_iterable(hosts)), pa.string())
    return at[has], names.take(pa.array(host_base[rec[has]] + idx[has]))


# cx keys that replace an integer of the call's row (REQUESTS records carry them there; "hit",
# a bool, is read apart)
_ROW_EXT_INTS = tuple(k for k in wcalls.ROW_EXT_KEYS if k != "hit")
_CX_STRINGS = ("error", "host", "kind", "system")
# cx keys as the agent writes them ("0", "1", ...), read without int() per key
_KEY = {str(i): i for i in range(10_000)}


def _apply_cx(
    c: dict[str, np.ndarray],
    batches: list[wbatch.Batch],
    ns: np.ndarray,
    call_start: np.ndarray,
    counts: np.ndarray,
) -> dict[str, tuple[np.ndarray, pa.Array]]:
    """The ``cx`` values of the records' calls (``{"<request>": {"<call>": {...}}}``) into the
    integer columns ``c``; returns the string ones per column: (calls, strings). A key that is
    not a request or call of its record, and a value of the wrong type, is left out; of two
    entries for one call the later one's values win (numpy assigns repeated indexes in
    order)."""
    rec_base = np.cumsum(ns) - ns
    maps = [(i, b.obj["cx"]) for i, b in enumerate(batches) if b.obj.get("cx")]
    if not maps:
        return {}
    try:
        found = _cx_entries(maps, rec_base, ns, call_start, counts)
    except (AttributeError, TypeError, ValueError):  # odd keys or entries: one by one
        found = None
    if found is None:
        found = _cx_entries_slowly(maps, rec_base, ns, call_start, counts)
    at, entries = found
    if not len(at):
        return {}
    keys = set().union(*entries)
    for name in _ROW_EXT_INTS:
        if name not in keys:
            continue
        values = _typed(list(map(dict.get, entries, repeat(name))), pa.int64(), as_int)
        has = ~np.asarray(pc.is_null(values).to_numpy(zero_copy_only=False), dtype=bool)
        v = to_numpy(values, 0).astype(np.int64)
        if name == "status":
            v = np.where((v > -(2**31)) & (v < 2**31), v, wcalls.NULL_32)  # int32 or none
        c[name][at[has]] = v[has]
    if "hit" in keys:
        hits = _typed(list(map(dict.get, entries, repeat("hit"))), pa.bool_(), _only_bool)
        has = ~np.asarray(pc.is_null(hits).to_numpy(zero_copy_only=False), dtype=bool)
        c["hit"][at[has]] = to_numpy(hits, False).astype(np.int64)[has]
    strs: dict[str, tuple[np.ndarray, pa.Array]] = {}
    for name in _CX_STRINGS:
        if name not in keys:
            continue
        if name in ("kind", "system"):  # replaced only where given (null included)
            given = [i for i, x in enumerate(entries) if name in x]
            names = pa.array([as_str(entries[i][name]) for i in given], pa.string())
            strs[name] = (at[given], names)
        elif name == "host":  # replaced where given (over a cx row's), in C-level passes
            raw = list(map(dict.get, entries, repeat(name)))
            has = np.fromiter(map(contains, entries, repeat(name)), bool, len(entries))
            strs[name] = (at[has], _typed(raw, pa.string(), as_str).filter(pa.array(has)))
        else:  # error: every entry has its own (none when not given)
            raw = list(map(dict.get, entries, repeat(name)))
            strs[name] = (at, _typed(raw, pa.string(), as_str))
    return strs


def _only_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _typed(values: list[Any], typ: pa.DataType, coerce: Any) -> pa.Array:
    """``values`` as an Arrow array of ``typ`` when each is of its Python type (or None),
    else each coerced."""
    try:
        arr = pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        arr = None
    if arr is None or arr.type not in (typ, pa.null()):
        return pa.array([coerce(v) for v in values], typ)
    return arr.cast(typ)


def _cx_entries(
    maps: list[tuple[int, Any]],
    rec_base: np.ndarray,
    ns: np.ndarray,
    call_start: np.ndarray,
    counts: np.ndarray,
) -> tuple[np.ndarray, list[dict[str, Any]]] | None:
    """(call index, entry) of each cx entry, read in bulk (no Python step per entry); None
    when a key is not a plain decimal number, an entry is not a map or two keys name one call
    (the careful reader decides those). Raises TypeError on a request's value that is not a
    map."""
    per_request = list(chain.from_iterable(cx.values() for _, cx in maps))
    rkeys = list(chain.from_iterable(cx.keys() for _, cx in maps))
    lens = np.fromiter(map(len, per_request), np.int64, len(per_request))
    ckeys = list(chain.from_iterable(map(dict.keys, per_request)))
    entries = list(chain.from_iterable(map(dict.values, per_request)))
    if not entries:
        return np.empty(0, dtype=np.int64), []
    if set(map(type, entries)) != {dict}:
        return None
    try:
        rk = np.fromiter(map(_KEY.__getitem__, rkeys), np.int64, len(rkeys))
        ck = np.fromiter(map(_KEY.__getitem__, ckeys), np.int64, len(ckeys))
    except KeyError:  # a key past _KEY's, or not a number as the agent writes it
        return None
    rec = np.repeat(
        np.fromiter((i for i, _ in maps), np.int64, len(maps)),
        list(map(len, (cx for _, cx in maps))),
    )
    ok_req = rk < ns[rec]
    req = np.where(ok_req, rec_base[rec] + rk, 0)
    req = np.repeat(req, lens)
    ok = np.repeat(ok_req, lens) & (ck < counts[req])
    at = (call_start[req] + ck)[ok]
    if len(at) and np.bincount(at).max() > 1:
        return None
    if not ok.all():
        entries = list(compress(entries, ok.tolist()))
    return at, entries


def _cx_entries_slowly(
    maps: list[tuple[int, Any]],
    rec_base: np.ndarray,
    ns: np.ndarray,
    call_start: np.ndarray,
    counts: np.ndarray,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """:func:`_cx_entries` for odd maps, entry by entry: keys as :func:`as_int` reads them
    (``"01"`` and ``"1"`` name one call: both entries apply, in order), entries that are not
    maps left out."""
    at: list[int] = []
    entries: list[dict[str, Any]] = []
    for i, cx in maps:
        if not isinstance(cx, dict):
            continue
        for rk, per_call in cx.items():
            r = as_int(rk)
            if r is None or not 0 <= r < ns[i] or not isinstance(per_call, dict):
                continue
            req = int(rec_base[i]) + r
            for ck, x in per_call.items():
                k = as_int(ck)
                if k is None or not 0 <= k < counts[req] or not isinstance(x, dict):
                    continue
                at.append(int(call_start[req]) + k)
                entries.append(x)
    return np.asarray(at, dtype=np.int64), entries


def to_numpy(arr: pa.Array | pa.ChunkedArray, fill: Any) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, fill).to_numpy(zero_copy_only=False))
