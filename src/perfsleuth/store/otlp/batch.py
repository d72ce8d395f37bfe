"""A decoded payload to the store's rows (:func:`to_batch`) and their commit (:func:`insert`):
requests from SERVER and CONSUMER spans, their calls, links and loop blocks, tied together
from the other modules of this package."""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import gc_pause, records, values
from perfsleuth.store.otlp.blocks import blocker, served_request
from perfsleuth.store.otlp.calls import MAX_CACHED, Dictionary, call_columns
from perfsleuth.store.otlp.links import inner_link_rows, link_rows
from perfsleuth.store.otlp.spans import (
    BLOCK_MS,
    FOUND,
    MISSING,
    REQUEST_KINDS,
    ROOT,
    SPAN_CLIENT,
    SPAN_CONSUMER,
    SPAN_SERVER,
    Keys,
    Pending,
    Served,
    Span,
    ancestry,
    first,
    http_method,
    is_call,
    nanos,
    read,
)
from perfsleuth.store.otlp.tables import to_tables
from perfsleuth.store.tables import Tables, drop_known_traces, trace_ids
from perfsleuth.wire import BLOCKER, FINGERPRINT
from perfsleuth.wire import fingerprint as fpr


@dataclass
class Mapped:
    batch: records.Batch
    tables: Tables | None = None  # None: nothing to store
    spans: int = 0
    requests: int = 0
    calls: int = 0
    blockers: int = 0
    waiting: int = 0  # client spans held for a SERVER span still to come
    new: list[tuple[bytes, int]] = field(default_factory=list)  # dictionary rows it adds
    # What the mapping changed in Pending, undone (rollback) when the commit fails: the
    # spans it took by trace (with when they began waiting), those it parked, the requests
    # it recorded as served.
    taken: dict[str, tuple[float, list[Span]]] = field(default_factory=dict)
    parked: list[Span] = field(default_factory=list)
    served: list[tuple[str, Served]] = field(default_factory=list)


def insert(store: Any, mapped: Mapped, pending: Pending) -> None:
    """Commit a payload's tables (``store.insert_tables``), in one transaction, and remember
    its dictionary rows as stored. Its segments are not recorded: they stand for the payload's
    sources, which have no spool offsets to keep."""
    insert_many(store, [mapped], pending)


def insert_many(
    store: Any,
    mapped: list[Mapped],
    pending: Pending,
    lock: AbstractContextManager[Any] | None = None,
    *,
    undo: bool = True,
) -> None:
    """Commit the tables of several payloads in one transaction (a DuckDB transaction costs
    milliseconds whatever its size: payloads of concurrent exporters share one), a request
    that two of them bring stored once. When the commit fails, each payload's changes to
    ``pending`` are undone (:func:`rollback`, latest first) unless ``undo`` is False (the
    caller tries the payloads again on their own, then undoes those that still fail).
    ``lock`` guards ``pending`` (held only to change it, not during the commit)."""
    guard = lock if lock is not None else nullcontext()
    parts = [m for m in mapped if m.tables is not None]
    if not parts:
        return
    try:
        tables = _merged([m.tables for m in parts if m.tables is not None])
        _drop_stored_blocks(store, tables)
        store.insert_tables(records.Batch(), tables)
    except BaseException:
        if undo:
            with guard:
                for m in reversed(parts):
                    rollback(m, pending)
        raise
    with guard:
        if len(pending.stored) > MAX_CACHED * 5:
            pending.stored.clear()
        for m in parts:
            pending.stored.update(m.new)


def _merged(parts: list[Tables]) -> Tables:
    """Several payloads' tables as one: each day's tables concatenated, a trace's request (with
    its calls, attributes and blocks) from the first payload that brings it, dictionary rows
    once. A later payload loses only the requests it sends again: its blocks of a request an
    earlier payload brings (a late block) are kept."""
    if len(parts) == 1:
        return parts[0]
    out = Tables()
    seen = pa.array([], pa.string())
    for t in parts:
        # a copy to drop from: a payload committed on its own after the group failed has all
        t = replace(t, days={d: dict(tabs) for d, tabs in t.days.items()})
        ids = trace_ids(t)
        drop_known_traces(t, ids.filter(pc.is_in(ids, value_set=seen)))
        seen = pa.concat_arrays([seen, ids])
        out.requests += t.requests
        out.calls += t.calls
        out.ts_substituted |= t.ts_substituted
        for d, tabs in t.days.items():
            day = out.days.setdefault(d, {})
            for name, tab in tabs.items():
                day[name] = pa.concat_tables([day[name], tab]) if name in day else tab
    for day in out.days.values():  # a loop block two payloads bring (none of a request)
        blocks = day.get("blockers")
        if blocks is not None and blocks.num_rows > 1:
            cols = (blocks[c].to_pylist() for c in ("ts", "service", "trace_id"))
            met: set[tuple[Any, ...]] = set()
            keep = []
            for key in zip(*cols, strict=True):
                keep.append(key not in met)
                met.add(key)
            day["blockers"] = blocks.filter(pa.array(keep, pa.bool_()))
    for name in ("fingerprints", "locations", "stacks"):
        rows = [getattr(t, name) for t in parts if getattr(t, name) is not None]
        if rows:
            both = pa.concat_tables(rows)
            _, first = np.unique(both["id"].to_numpy(), return_index=True)
            setattr(out, name, both.take(pa.array(np.sort(first))))
    return out


def _drop_stored_blocks(store: Any, tables: Tables) -> None:
    """Leave out the loop blocks the store holds already (a payload sent again): same time,
    service and request. ``insert_tables`` leaves out those of the requests it holds that the
    payload brings again; this is for a block of a request an earlier payload brought, or of
    none."""
    for parts in tables.days.values():
        t = parts.get("blockers")
        if t is None or not t.num_rows:
            continue
        ts = t["ts"].to_pylist()
        marks = ", ".join("?" * len(ts))
        sql = f"SELECT ts, service, trace_id FROM blockers WHERE ts IN ({marks})"
        held = {(r["ts"], r["service"], r["trace_id"]) for r in store.query(sql, ts)}
        if held:
            rows = zip(ts, t["service"].to_pylist(), t["trace_id"].to_pylist(), strict=True)
            parts["blockers"] = t.filter(pa.array([r not in held for r in rows], pa.bool_()))


def rollback(mapped: Mapped, pending: Pending) -> None:
    """Undo a mapping's changes to ``pending`` when its tables were not committed: the client
    spans it took wait again for the exporter's retry, those it parked leave (the retry parks
    them again), and its requests are not taken as stored."""
    pending.undo(mapped.taken, mapped.parked, mapped.served)
    mapped.taken, mapped.parked, mapped.served = {}, [], []


def to_batch(msg: Any, keys: Keys = Keys(), pending: Pending | None = None) -> Mapped:
    """The rows of an ExportTraceServiceRequest: one request per SERVER (or CONSUMER) span
    with its calls, fingerprints, locations, stacks, links and loop blocks, as the store's
    Arrow tables (``Mapped.tables``), built column by column; ``Mapped.batch`` holds the
    segments standing for the payload's sources. Its changes to ``pending`` stand once the
    tables are committed (:func:`insert`); :func:`rollback` undoes them otherwise.
    :func:`read_spans` then :func:`map_spans` (the server reads a payload when it comes, to
    refuse a bad one, and maps it when it stores it)."""
    return map_spans(read_spans(msg, keys), keys, pending)


# spans.read's attribute caches (view.AttributeCache) are module-wide and not thread-safe:
# one reader at a time, whichever server, queue or caller reads.
_read_lock = threading.Lock()


def read_spans(msg: Any, keys: Keys = Keys()) -> list[Span]:
    """Every span of the payload with what the mapping reads (:func:`spans.read`); OtlpError
    (400) for a span that is not OTLP. Thread-safe (one reader at a time)."""
    with _read_lock, gc_pause.paused():
        return read(msg, keys)


def map_spans(spans: list[Span], keys: Keys = Keys(), pending: Pending | None = None) -> Mapped:
    """The rows of a payload's spans (:func:`read_spans`), joined with ``pending``'s: see
    :func:`to_batch`. Payloads are mapped one at a time, in the order they came: ``pending``
    is not thread-safe. ``spans`` is left as it is (a payload tried again maps it again)."""
    pending = pending if pending is not None else Pending()
    with gc_pause.paused():
        out = Mapped(records.Batch(), spans=len(spans))
        try:
            return _map(list(spans), keys, pending, out)
        except BaseException:
            rollback(out, pending)
            raise


def _map(spans: list[Span], keys: Keys, pending: Pending, out: Mapped) -> Mapped:
    now = time.monotonic()
    for trace in {s.trace for s in spans if s.kind in REQUEST_KINDS}:
        hit = pending.traces.get(trace)
        if hit is not None:
            out.taken[trace] = hit
            spans.extend(pending.take(trace))
    if not spans:
        return out
    n = len(spans)
    kind = np.array([s.kind for s in spans], dtype=np.int64)
    is_req = (kind == SPAN_SERVER) | (kind == SPAN_CONSUMER)
    is_block = np.array([BLOCK_MS in s.attrs for s in spans], dtype=bool) & ~is_req
    callish = np.array([is_call(s) for s in spans], dtype=bool) & ~is_req & ~is_block
    # Each span by id (trace + span), the last of a span sent twice: one request per id.
    last = {s.trace + s.span: i for i, s in enumerate(spans)}
    par, owner, state, nested = ancestry(spans, last, is_req, callish)
    servers = [
        i for i in np.nonzero(is_req)[0].tolist() if last[spans[i].trace + spans[i].span] == i
    ]
    row_of = np.full(n + 1, -1, dtype=np.int64)  # row_of[-1]: no request
    row_of[servers] = np.arange(len(servers))
    # A call or block whose ancestry stops at a span not seen yet waits, with the spans
    # between (a framework's INTERNAL spans), for a later payload of its trace; a block of a
    # request stored before goes to it. A client span inside another call (a transport's in
    # a library's) waits too: the service it called names it as its parent (links).
    early: list[tuple[Span, Served | None]] = []
    waiting: dict[int, Span] = {}
    lone = (callish | is_block) & (state == MISSING)
    for i in np.nonzero(lone | (is_block & (state == ROOT)))[0].tolist():
        s = spans[i]
        if is_block[i]:
            stored = served_request(s, pending)
            if stored is not None or state[i] == ROOT:
                early.append((s, stored))
                continue
        j = i
        while j >= 0 and j not in waiting:
            waiting[j] = spans[j]
            j = int(par[j])
    out.parked = list(waiting.values())
    pending.add(out.parked, now)
    out.waiting = len(waiting)

    start, end = nanos(spans, 5), nanos(spans, 6)
    calls = np.nonzero(callish & ~nested & (state == FOUND) & (row_of[owner] >= 0))[0]
    crow = row_of[owner[calls]]
    order = np.lexsort((start[calls], crow))
    calls, crow = calls[order], crow[order]
    segments: dict[tuple[str, str, str], records.SegmentState] = {}
    dictionary: Dictionary = {}
    reqs = _requests([spans[i] for i in servers], keys, segments, out.batch)
    call_spans = [spans[i] for i in calls.tolist()]
    cols = call_columns(call_spans, dictionary)
    req_start = start[servers]
    cols["off"] = start[calls] - req_start[crow]
    cols["dur"] = np.maximum(end[calls] - start[calls], 0)
    seq = np.arange(len(calls)) - np.searchsorted(crow, crow)
    for trace, served in zip(reqs["trace"], reqs["served"], strict=True):
        pending.served(trace, served)
        out.served.append((trace, served))
    blocks = np.nonzero(is_block & (state == FOUND))[0].tolist()
    for i in blocks:
        row = int(row_of[owner[i]])
        if row < 0:
            continue
        b = spans[i]
        lo, hi = np.searchsorted(crow, [row, row + 1])
        done = [k for k in range(lo, hi) if int(end[calls[k]]) <= b.start]
        last_call = None
        if done:
            k = max(done, key=lambda k: int(end[calls[k]]))
            fp = dictionary.get((FINGERPRINT, cols["fp"][k]), {})
            last_call = {
                "kind": cols["kind"][k],
                "text": fp.get("text"),
                "rows": cols["rows"][k],
                "ms": int(cols["dur"][k]) / 1e6,
            }
        out.batch.add(_segment(segments, b), BLOCKER, blocker(b, reqs["served"][row], last_call))
        out.blockers += 1
    for b, stored in early:
        out.batch.add(_segment(segments, b), BLOCKER, blocker(b, stored, None))
        out.blockers += 1
    links = link_rows([spans[i] for i in servers], call_spans, crow, seq, cols)
    links += inner_link_rows(
        spans, par, calls, crow, seq, cols, callish & nested & (kind == SPAN_CLIENT)
    )
    out.requests, out.calls = len(servers), len(calls)
    if servers or out.blockers:
        times = (req_start, end[servers])
        out.new = [k for k in dictionary if k not in pending.stored]
        out.tables = to_tables(out.batch, reqs, times, cols, crow, seq, links, dictionary, out.new)
    return out


def _requests(
    servers: list[Span],
    keys: Keys,
    segments: dict[tuple[str, str, str], records.SegmentState],
    batch: records.Batch,
) -> dict[str, list[Any]]:
    """The request columns of the SERVER and CONSUMER spans (and the segment of each)."""
    cols: dict[str, list[Any]] = {k: [] for k in _REQUEST_COLUMNS}
    for srv in servers:
        seg = _segment(segments, srv)
        a = srv.attrs
        method = http_method(a)
        target = values.as_str(first(a, "url.path", "http.target")) or ""
        path = target.split("?", 1)[0] or None
        route = values.as_str(first(a, "http.route"))
        if srv.kind == SPAN_CONSUMER:
            endpoint = srv.name or "<unknown>"
        elif route:
            endpoint = f"{method} {route}" if method else route
        elif path:
            endpoint = f"{method or 'GET'} {fpr.url_template(path)}"
        else:
            endpoint = srv.name or "<unknown>"
        rid = srv.trace + srv.span
        cols["trace"].append(srv.trace)
        cols["id"].append(rid)
        cols["seg"].append(batch.touch(seg))
        cols["kind"].append("web" if srv.kind == SPAN_SERVER else "background")
        cols["method"].append(method)
        cols["endpoint"].append(values.text(endpoint))
        cols["path"].append(values.text(path) if path else None)
        cols["status"].append(
            values.as_int32(first(a, "http.response.status_code", "http.status_code"))
        )
        cols["error"].append(srv.error)
        cols["user"].append(values.as_str(first(a, *keys.user) or first(srv.resource, *keys.user)))
        cols["tenant"].append(
            values.as_str(first(a, *keys.tenant) or first(srv.resource, *keys.tenant))
        )
        cols["req_bytes"].append(
            values.as_int(first(a, "http.request.body.size", "http.request_content_length"))
        )
        cols["resp_bytes"].append(
            values.as_int(first(a, "http.response.body.size", "http.response_content_length"))
        )
        cols["served"].append(Served(rid, endpoint, method, path, srv.start, srv.end, srv.source))
    return cols


_REQUEST_COLUMNS = (
    "trace", "id", "seg", "kind", "method", "endpoint", "path", "status", "error", "user",
    "tenant", "req_bytes", "resp_bytes", "served",
)  # fmt: skip


def _segment(
    segments: dict[tuple[str, str, str], records.SegmentState], s: Span
) -> records.SegmentState:
    """The segment standing for a span's source (service, host, version; the process id)."""
    seg = segments.get(s.source)
    if seg is None:
        service, host, version = s.source
        base = f"otlp/{service}/{host}"
        seg = segments[s.source] = records.SegmentState(base, base, 0, service, host)
        seg.version = version
        pid = values.as_int(s.resource.get("process.pid"))
        seg.pid = pid if pid is not None and 0 <= pid < 2**31 else None
    return seg
