"""A batch of records -> the Arrow tables one transaction adds (:func:`build_tables`).

Request rows become rows of ``requests``; their calls rows of ``calls`` (with the request's ts,
trace id, service and endpoint copied in, and ``rid``, a number the batch's request and its
calls share: DuckDB stores calls by it, see schema.DUCKDB_CALLS; ClickHouse leaves it out)
and per-request aggregates (db/http/cache calls and time) computed once here so ``top`` is
one scan. Event tables are split by day (the store keeps
a table per day). Dictionary records and agent counters become their tables; runtime evidence
and captures are converted by :mod:`perfsleuth.store.evidence` and
:mod:`perfsleuth.store.captures`.

A request is stored once: a batch keeps the first of each trace id and ts
(decode.once_per_trace) and the store leaves out, with their calls and attributes, those it
holds already, each judged on its own: a stored request of its trace id within a minute
(:func:`copied_requests`, :func:`drop_known_traces`). The other event rows and the agent
counters are told apart by the columns of :data:`ROW_KEYS`: a batch keeps the first of each
(:func:`once_per_row`) and both engines leave out those they hold already. Nothing here
depends on the engine the tables go to.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import schema
from perfsleuth.store.captures import table as capture_table
from perfsleuth.store.decode import CALL_WIRE, once_per_trace, parse_requests, to_numpy
from perfsleuth.store.evidence import tables as evidence_tables
from perfsleuth.store.records import Batch, internal_fingerprints
from perfsleuth.store.values import EPOCH, NS_PER_DAY, TS_MAX, as_str, sane_ts, text
from perfsleuth.wire import CAPTURE, internal_sql
from perfsleuth.wire import calls as wcalls


@dataclass
class Tables:
    """What one batch adds: event tables per day, dictionaries, counters."""

    days: dict[date, dict[str, pa.Table]] = field(default_factory=dict)
    fingerprints: pa.Table | None = None
    locations: pa.Table | None = None
    stacks: pa.Table | None = None
    agent_stats: pa.Table | None = None
    captures: pa.Table | None = None
    requests: int = 0
    calls: int = 0
    # a request's ts was not a time (<= 0 or past TS_MAX) and is the time of the conversion:
    # a copy of it stored by an earlier run has another ts
    ts_substituted: bool = False


# The event tables whose rows do not all come with their request, and the agent counters: a
# row is already stored when a stored row has the same values of these columns (looked for
# within the batch's time range). A trace's samples and blockers can arrive over several
# batches, so they are matched by row, not by trace. Nulls are equal: a loop blocked outside
# any request (no trace id) is told apart by its process, time and duration.
ROW_KEYS: dict[str, tuple[str, ...]] = {
    "samples": ("trace_id", "ts", "offset_ms"),
    "blockers": ("trace_id", "host", "pid", "ts", "duration_ms"),
    "gc_pauses": ("host", "pid", "ts", "generation"),
    "agent_stats": ("host", "pid", "name", "ts"),
}
# ... looked for in at most this many ts ranges around the batch's rows (ts_spans), cut where
# they are more than ROW_GAP_US apart
ROW_SPANS = 16
ROW_GAP_US = 60_000_000


# ``rid``: unique among the tables built by this process (OTLP payloads' tables are merged
# before a commit), renumbered by the DuckDB writer into its day table's numbers.
_rid_lock = threading.Lock()
_rid_next = 0


def _rids(n: int) -> int:
    """The first of ``n`` new request numbers."""
    global _rid_next
    with _rid_lock:
        base = _rid_next
        _rid_next += n
    return base


def build_tables(batch: Batch, now_ns: int) -> Tables:
    """Arrow tables for a batch. Undecodable request payloads are added to ``batch.damage``.

    Should a part of the batch (its requests, its evidence, its captures, its dictionaries
    and counters) fail to convert all the same, on values the checks above do not foresee,
    that part is damage of the segments that sent it: its rows are lost, the rest commits and
    ingest goes on, where an error would fail every later run at the same records."""
    out = Tables()
    try:
        wire, src, attr_objs = parse_requests(batch)
        wire, src, attr_objs = once_per_trace(wire, src, attr_objs)
        if wire.num_rows:
            event_tables(out, wire, src, attr_objs, batch, now_ns)
    except MemoryError:
        raise
    except Exception as e:
        out.days.clear()
        out.requests = out.calls = 0
        sent = {c[0] for c in batch.columns}
        _unconverted(batch, sent | set(batch.dict_src), "requests", e)
    events = {t: evs for t, evs in batch.events.items() if t != CAPTURE}
    if events:
        try:
            for d, parts in evidence_tables(batch, now_ns).items():
                # a segment and a copy of it in one batch: each row once, as across batches
                parts = {n: once_per_row(n, t) for n, t in parts.items()}
                out.days.setdefault(d, {}).update(parts)
        except MemoryError:
            raise
        except Exception as e:
            _unconverted(batch, {ev[0] for evs in events.values() for ev in evs}, "evidence", e)
    if batch.events.get(CAPTURE):
        try:
            out.captures = capture_table(batch, now_ns)
        except MemoryError:
            raise
        except Exception as e:
            _unconverted(batch, {ev[0] for ev in batch.events[CAPTURE]}, "captures", e)
    try:
        _dictionaries(out, batch, now_ns)
        if out.agent_stats is not None:
            out.agent_stats = once_per_row("agent_stats", out.agent_stats)
    except MemoryError:
        raise
    except Exception as e:
        out.fingerprints = out.locations = out.stacks = out.agent_stats = None
        _unconverted(batch, set(range(len(batch.segments))), "dictionary and counter records", e)
    return out


def offsets_table(batch: Batch, now: datetime) -> pa.Table:
    """The ``ingest_offsets`` rows of ``batch``: how far each of its segments is stored (both
    engines write them last, in the batch's transaction or after its rows)."""
    return pa.Table.from_pylist(
        [
            {
                "segment": s.base,
                "offset": s.offset,
                "closed": s.final,
                "damaged": s.damaged,
                "service": s.service or None,
                "host": s.host or None,
                "pid": s.pid,
                "updated": now,
                "version": s.version or None,
            }
            for s in batch.segments
        ],
        schema=schema.INGEST_OFFSETS.arrow_schema(),
    )


def _unconverted(batch: Batch, segments: set[int], what: str, exc: Exception) -> None:
    """Damage of each segment in ``segments``: up to where it was read, ``what`` of it could
    not be converted."""
    reason = f"{what} the store could not convert ({type(exc).__name__}: {exc})"[:300]
    for i in sorted(segments):
        seg = batch.segments[i]
        batch.add_damage(seg, 0, seg.offset, reason)


def _dictionaries(out: Tables, batch: Batch, now_ns: int) -> None:
    if batch.fingerprints:
        ids = list(batch.fingerprints)
        kind, op, fp_text = zip(*batch.fingerprints.values(), strict=True)
        out.fingerprints = _table(schema.FINGERPRINTS, id=ids, kind=kind, op=op, text=fp_text)
    if batch.locations:
        ids = list(batch.locations)
        file, line, func, app = zip(*batch.locations.values(), strict=True)
        out.locations = _table(
            schema.LOCATIONS, id=ids, file=file, line=line, function=func, app=app
        )
    if batch.stacks:
        out.stacks = _table(
            schema.STACKS, id=list(batch.stacks), frames=list(batch.stacks.values())
        )
    if batch.stats:
        ts, service, host, pid, name, value = zip(*batch.stats, strict=True)
        out.agent_stats = _table(
            schema.AGENT_STATS,
            ts=pa.array([sane_ts(t, now_ns) // 1000 for t in ts], pa.timestamp("us")),
            service=[s or "" for s in service],
            host=[h or "" for h in host],
            pid=[p if p is not None and 0 <= p < 2**31 else 0 for p in pid],
            name=name,
            value=value,
        )


def _table(t: schema.Table, **cols: Any) -> pa.Table:
    return pa.Table.from_pydict(cols, schema=t.arrow_schema())


# A request, as the copy rule tells requests apart: its trace id and its ts in microseconds.
_KEYS = pa.schema([("trace_id", pa.string()), ("ts", pa.int64())])


def request_keys(parts: Iterable[pa.Table]) -> pa.Table:
    """The requests the rows of ``parts`` belong to, once each: ``trace_id`` (string) and
    ``ts`` (the request's, in microseconds; calls and attributes carry their request's ts).
    Rows without a trace id are left out (never copies)."""
    cols = [
        pa.table(
            {
                "trace_id": p["trace_id"].cast(pa.string()),
                "ts": _us(p["ts"]),
            }
        )
        for p in parts
        if p.num_rows
    ]
    if not cols:
        return _KEYS.empty_table()
    t = pa.concat_tables(cols)
    t = t.filter(pc.fill_null(pc.not_equal(t["trace_id"], ""), False))
    return t.group_by(["trace_id", "ts"], use_threads=False).aggregate([])


def _us(ts: Any) -> Any:
    """A ts column (any unit) as int64 microseconds, as the copy rule compares them."""
    return ts.cast(pa.timestamp("us")).cast(pa.int64())


def copy_window(keys: pa.Table, margin_us: int | None) -> tuple[int, int] | None:
    """The ts range (microseconds, inclusive) that holds every stored copy of the requests
    ``keys`` (:func:`request_keys`): their first ts less ``margin_us`` to their last plus it.
    None: no bound (``margin_us`` None, a copy at any ts; or no keys)."""
    if margin_us is None or not keys.num_rows:
        return None
    lo, hi = pc.min_max(keys["ts"]).values()
    return lo.as_py() - margin_us, hi.as_py() + margin_us


def once_per_row(name: str, t: pa.Table) -> pa.Table:
    """Rows of table ``name`` with the first of each value of its ROW_KEYS columns (see
    there for nulls), in their order; a table without ROW_KEYS as it is."""
    keys = ROW_KEYS.get(name)
    if keys is None or t.num_rows < 2:
        return t
    idx = pa.table({**{k: t[k] for k in keys}, "_row": np.arange(t.num_rows)})
    first = idx.group_by(list(keys), use_threads=False).aggregate([("_row", "min")])
    if first.num_rows == t.num_rows:
        return t
    return t.take(pa.array(np.sort(first["_row_min"].to_numpy())))


def ts_spans(data: pa.Table) -> list[tuple[int, int]]:
    """The ts of ``data`` (microseconds) as at most ROW_SPANS ranges, cut at the widest gaps
    of over ROW_GAP_US between them: a batch holding an old straggler besides recent rows has
    the stored rows around each read, not those of the hours between (of 2M samples stored
    over a day, a batch of 20k recent ones and one 22 hours old read them all: ~105 ms)."""
    v = np.sort(_us(data["ts"]).to_numpy())
    gaps = np.diff(v)
    cut = np.argsort(gaps)[::-1][: ROW_SPANS - 1]
    cut = np.sort(cut[gaps[cut] > ROW_GAP_US])
    return list(zip(v[np.r_[0, cut + 1]].tolist(), v[np.r_[cut, len(v) - 1]].tolist(), strict=True))


def copied_requests(sent: pa.Table, stored: pa.Table, margin_us: int | None) -> pa.Table:
    """The requests of ``sent`` (:func:`request_keys`) that are copies of stored ones: a row of
    ``stored`` (``trace_id``, ``ts`` in microseconds: the store's rows of those trace ids)
    has the trace id at a ts within ``margin_us`` of the request's own (None: at any ts).
    Decided per request: another request of the trace id further from every stored one (the
    id reused, a trace's later request) is not a copy, whatever else the batch holds."""
    if not sent.num_rows or not stored.num_rows:
        return _KEYS.empty_table()
    stored = (
        pa.table(
            {
                "trace_id": stored["trace_id"].cast(pa.string()),
                "stored_ts": stored["ts"].cast(pa.int64()),
            }
        )
        .group_by(["trace_id", "stored_ts"], use_threads=False)
        .aggregate([])
    )
    both = sent.join(stored, "trace_id", join_type="inner")
    if margin_us is not None:
        gap = pc.abs(pc.subtract(both["stored_ts"], both["ts"]))
        both = both.filter(pc.fill_null(pc.less_equal(gap, margin_us), False))
    return both.group_by(["trace_id", "ts"], use_threads=False).aggregate([])


def of_copies(t: pa.Table, copies: pa.Table) -> np.ndarray:
    """Which rows of ``t`` (a requests, calls or attributes table) belong to a request of
    ``copies`` (:func:`copied_requests`): the same trace id and request ts."""
    mask = np.zeros(t.num_rows, bool)
    if not t.num_rows or not copies.num_rows:
        return mask
    ids = t["trace_id"].cast(pa.string())
    maybe = to_numpy(pc.is_in(ids, value_set=copies["trace_id"]), False).astype(bool)
    if not maybe.any():
        return mask
    rows = np.flatnonzero(maybe)
    idx = pa.array(rows)
    keys = pa.table(
        {
            "trace_id": pc.take(ids, idx),
            "ts": _us(pc.take(t["ts"], idx)),
            "row": idx,
        }
    )
    hit = keys.join(copies, ["trace_id", "ts"], join_type="inner")
    mask[to_numpy(hit["row"], 0).astype(np.int64)] = True
    return mask


def _known_rows(t: pa.Table, known: pa.Table | pa.Array) -> np.ndarray:
    """Which rows of ``t`` :func:`drop_known_traces` leaves out."""
    if isinstance(known, pa.Table):
        return of_copies(t, known)
    ids = t["trace_id"].cast(pa.string())
    return to_numpy(pc.is_in(ids, value_set=known.cast(pa.string())), False).astype(bool)


def drop_known_traces(tables: Tables, known: pa.Table | pa.Array) -> None:
    """Leave out of ``tables`` the requests the store holds already, with their calls,
    attributes and loop blocks: ``known`` is either the copied requests
    (:func:`copied_requests`: each judged on its own) or trace ids (every request of them:
    OTLP's ids are per span, see store.otlp.batch). A loop block (it has no request ts) goes
    with its trace id when the batch keeps no request of it."""
    if not len(known):
        return
    gone: list[pa.Array] = []
    kept: list[pa.Array] = []
    for parts in tables.days.values():
        for name in ("requests", "calls", "attributes"):
            t = parts.get(name)
            if t is None or not t.num_rows:
                continue
            out = _known_rows(t, known)
            if not out.any():
                if name == "requests":
                    kept.append(t["trace_id"].cast(pa.string()))
                continue
            left = t.filter(pa.array(~out))
            if name == "requests":
                tables.requests -= int(out.sum())
                gone.append(t.filter(pa.array(out))["trace_id"].cast(pa.string()))
                kept.append(left["trace_id"].cast(pa.string()))
            elif name == "calls":
                tables.calls -= int(out.sum())
            parts[name] = left
    if not gone:
        return
    # the loop blocks of a trace id whose requests here are all copies
    ids = pc.unique(pa.chunked_array(gone, pa.string()).combine_chunks())
    if kept:
        still = pa.chunked_array(kept, pa.string()).combine_chunks()
        ids = ids.filter(pc.invert(pc.is_in(ids, value_set=still)))
    if not len(ids):
        return
    for parts in tables.days.values():
        t = parts.get("blockers")
        if t is not None and t.num_rows:
            hit = pc.fill_null(pc.is_in(t["trace_id"].cast(pa.string()), value_set=ids), False)
            parts["blockers"] = t.filter(pc.invert(hit))


def trace_ids(tables: Tables) -> pa.Array:
    """The trace ids of the requests in ``tables`` (those without one left out)."""
    ids = [p["requests"]["trace_id"] for p in tables.days.values() if "requests" in p]
    if not ids:
        return pa.array([], pa.string())
    all_ids = pa.chunked_array(ids, pa.string()).combine_chunks()
    return all_ids.filter(pc.not_equal(all_ids, ""))


def event_tables(
    out: Tables,
    wire: pa.Table,
    src: np.ndarray,
    attr_objs: list[tuple[int, Any]],
    batch: Batch,
    now_ns: int,
) -> None:
    """Add to ``out`` the requests, calls and attributes tables, by day, of the requests in
    ``wire`` (shaped as decode.REQUEST_WIRE; ``src``: each row's segment in ``batch``;
    ``attr_objs``: (row, object) of the rows with attributes or tags). The one builder of
    these tables: the spool ingest's and OTLP's (store.otlp.tables) requests go through it."""
    n = wire.num_rows
    segs = batch.segments
    service = pc.take(pa.array([s.service or "unknown" for s in segs], pa.string()), src)
    host = pc.take(pa.array([s.host or None for s in segs], pa.string()), src)
    pid = pc.take(pa.array([s.pid for s in segs], pa.int32()), src)
    version = pc.take(pa.array([s.version or None for s in segs], pa.string()), src)

    ts_ns = to_numpy(wire["ts"], 0)
    bad = (ts_ns <= 0) | (ts_ns >= TS_MAX)
    if bad.any():
        ts_ns = np.where(bad, now_ns, ts_ns)
        out.ts_substituted = True
    ts = pa.array(ts_ns // 1000, pa.timestamp("us"))
    day = ts_ns // NS_PER_DAY
    trace_id = pc.fill_null(wire["id"], "")
    endpoint = pc.fill_null(wire["endpoint"], "<unknown>")

    calls = wire["calls"].combine_chunks()
    counts = to_numpy(pc.list_value_length(calls), 0).astype(np.int64)
    flat = pc.list_flatten(calls)
    m = len(flat)
    parent = np.repeat(np.arange(n, dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    seq = np.arange(m, dtype=np.int64) - np.repeat(starts, counts)
    cf = dict(zip([f.name for f in CALL_WIRE], flat.flatten(), strict=True))
    ckind = _internal_kind(pc.fill_null(cf["kind"], "unknown"), cf["fp"])
    cdur = _ms(cf["dur"])
    # Sums of the calls' durations in whole microseconds (what DuckDB keeps of a call, rounded
    # the same way: a request's db_ms is the sum of its calls' stored durations), in ms: a
    # short decimal, which DuckDB's ALP compresses (a sum of ms doubles is none: 7 -> 2.6 B a
    # request each, benchmarks/ingest.py).
    cdur_us = whole_us(to_numpy(cf["dur"], 0))
    parent_pa = pa.array(parent)

    agg: dict[str, Any] = {}
    kind_code = np.zeros(m, np.int8)  # to sort calls by: 1 db, 2 http, 3 cache, 0 others
    for code, k in enumerate(("db", "http", "cache"), 1):
        mask = to_numpy(pc.equal(ckind, k), False).astype(bool)
        kind_code[mask] = code
        p = parent[mask]
        agg[f"{k}_calls"] = pa.array(np.bincount(p, minlength=n).astype(np.int32))
        sums = np.bincount(p, weights=cdur_us[mask], minlength=n)  # exact below 2**53
        agg[f"{k}_ms"] = pa.array(sums / 1e3)

    req = pa.table(
        {
            "ts": ts,
            "trace_id": trace_id,
            "service": service,
            "host": host,
            "pid": pid,
            "kind": pc.fill_null(wire["kind"], "unknown"),
            "method": wire["method"],
            "endpoint": endpoint,
            "path": wire["path"],
            "status": _int32_col(wire["status"]),
            "error": wire["error"],
            "duration_ms": _ms(wire["dur"]),
            "cpu_ms": _ms(wire["cpu_ns"]),
            "req_bytes": wire["req_bytes"],
            "resp_bytes": wire["resp_bytes"],
            "user": wire["user"],
            "tenant": wire["tenant"],
            **agg,
            "calls_dropped": _int32_col(pc.fill_null(wire["calls_dropped"], 0)),
            "gc_ms": _ms(wire["gc_ns"]),
            "gc_count": _int32_col(wire["gc_count"]),
            "version": version,
        },
        schema=schema.REQUESTS.arrow_schema(),
    )
    base = _rids(n)
    req = req.append_column("rid", pa.array(np.arange(base, base + n, dtype=np.int64)))
    # Repeated per call: dictionary-encoded (DuckDB keeps a request number instead).
    service_dict = pc.dictionary_encode(service)
    endpoint_dict = pc.dictionary_encode(endpoint)
    call = pa.table(
        {
            "ts": pc.take(ts, parent_pa),
            "trace_id": pc.take(pc.dictionary_encode(trace_id), parent_pa),
            "service": pc.take(service_dict, parent_pa),
            "endpoint": pc.take(endpoint_dict, parent_pa),
            "rid": pa.array(parent + base),
            "seq": pa.array(seq.astype(np.int32)),
            "kind": ckind,
            "system": cf["system"],
            "fingerprint_id": cf["fp"],
            "offset_ms": _ms(cf["off"]),
            "duration_ms": cdur,
            "rows": cf["rows"],
            "bytes": cf["bytes"],
            "params_hash": cf["ph"],
            "stack_id": cf["stack"],
            "site_id": cf["site"],
            "host": cf["host"],
            "status": _int32_col(cf["status"]),
            "hit": cf["hit"],
            "wait_ms": _ms(cf["wait"]),
            "error": cf["error"],
            "unfinished": cf["unfinished"],
        }
    )
    # Stored side by side, the calls of one statement compress to runs (their fingerprint,
    # site, stack, kind, the columns their kind leaves empty...) and their request numbers
    # grow by little: sorted by (kind, fingerprint), in request order within each, DuckDB's
    # compact calls take ~40 % less room than in request order (benchmarks/ingest.py).
    # Readers order a request's calls by seq.
    if m > 1:
        order = np.lexsort((to_numpy(cf["fp"], wcalls.NULL), kind_code))
        call = call.take(pa.array(order))
        parent = parent[order]
    attr_rows, attr_cols = _attributes(attr_objs)
    attr_idx = pa.array(np.asarray(attr_rows, dtype=np.int64))
    attrs = pa.table(
        {
            "ts": pc.take(ts, attr_idx),
            "trace_id": pc.take(trace_id, attr_idx),
            "service": pc.take(service, attr_idx),
            "endpoint": pc.take(endpoint, attr_idx),
            **attr_cols,
        },
        schema=schema.ATTRIBUTES.arrow_schema(),
    )
    out.requests += n
    out.calls += m
    days = np.unique(day)
    for d in days:
        key = EPOCH + timedelta(days=int(d))
        if len(days) == 1:
            parts = {"requests": req, "calls": call, "attributes": attrs}
        else:
            in_day = day == d
            parts = {
                "requests": req.filter(pa.array(in_day)),
                "calls": call.filter(pa.array(in_day[parent])),
                "attributes": attrs.filter(pa.array(in_day[np.asarray(attr_rows, np.int64)])),
            }
        out.days[key] = parts


def _internal_kind(kind: pa.Array, fp: pa.Array) -> pa.Array:
    """``kind`` with the ``db`` calls of framework-internal statements (their fingerprint is
    one, see :mod:`perfsleuth.wire.internal_sql`) as ``db.internal``."""
    internal = internal_fingerprints()
    if not internal or not len(kind):
        return kind
    hit = pc.and_(
        pc.equal(kind, "db"),
        pc.is_in(fp, value_set=pa.array(sorted(internal), pa.int64())),
    )
    return pc.if_else(pc.fill_null(hit, False), internal_sql.INTERNAL_KIND, kind)


def _int32_col(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """int64 -> int32, out-of-range values to NULL (a status or count never needs more)."""
    ok = pc.and_(pc.greater_equal(arr, -(2**31)), pc.less(arr, 2**31))
    return pc.cast(pc.if_else(ok, arr, pa.scalar(None, pa.int64())), pa.int32())


def _attributes(objs: list[tuple[int, Any]]) -> tuple[list[int], dict[str, list[Any]]]:
    rows: list[int] = []
    kind: list[str] = []
    key: list[str] = []
    value: list[str | None] = []
    num: list[float | None] = []
    for row, obj in objs:
        if not isinstance(obj, dict):
            continue
        for k, name in (("attrs", "attr"), ("tags", "tag")):
            d = obj.get(k)
            if not isinstance(d, dict):
                continue
            for a, v in d.items():
                rows.append(row)
                kind.append(name)
                key.append(text(str(a)))
                value.append(as_str(v))
                num.append(
                    float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
                )
    return rows, {"kind": kind, "key": key, "value": value, "num": num}


def whole_us(ns: np.ndarray) -> np.ndarray:
    """Nanoseconds in whole microseconds (float64), halves up: floor(ns / 1000 + 0.5), as
    DuckDB's compact calls store durations (schema._whole_us); np.round would take halves to
    even (2,500 ns -> 2 us where the call keeps 3)."""
    return np.floor(ns.astype(np.float64) / 1e3 + 0.5)


def _ms(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """ns -> ms. Unsafe cast: an int64 above 2**53 rounds to the nearest double instead of
    raising (a crafted figure must not fail the batch)."""
    return pc.divide(pc.cast(arr, pa.float64(), safe=False), 1e6)
