"""Runtime-evidence records (stack samples, loop blockers, GC pauses) -> rows of their tables.

The agent ships them as JSON records (wire.SAMPLES, wire.BLOCKER, wire.GC; see
perfsleuth.agent.sampler / watchdog / gcwatch). Values are coerced like requests are: a bad
field becomes NULL, a record that is not an object is skipped, a record that cannot be
made rows anyway is damage of its segment (alone), nothing raises. A sample's
``state`` is kept as sent (agent.sampler's cpu, starved, gil, wait or call). The sampler's
process figures (run-queue and throttled time) come as STATS counters into ``agent_stats``
(store.records), not through here.
"""

from __future__ import annotations

from datetime import date
from typing import Any

import pyarrow as pa

from perfsleuth.store import schema
from perfsleuth.store.records import Batch, SegmentState
from perfsleuth.store.values import (
    as_float,
    as_id,
    as_int,
    as_int32,
    as_str,
    day_of,
    ns_to_ms,
    sane_ts,
)
from perfsleuth.wire import BLOCKER, GC, SAMPLES

Row = tuple[str, int, dict[str, Any]]  # (table, ts in ns, columns but ts)


def tables(batch: Batch, now_ns: int) -> dict[date, dict[str, pa.Table]]:
    """Per day, the evidence tables this batch adds (only those with rows). A record whose
    values cannot be made rows (whatever its shape) is damage of its segment, alone."""
    rows: dict[date, dict[str, list[tuple[dict[str, Any], int, int, int]]]] = {}
    segs = batch.segments
    for rtype, convert in ((SAMPLES, _samples), (BLOCKER, _blocker), (GC, _gc)):
        for seg_i, obj, start, end in batch.events.get(rtype, ()):
            try:
                made = convert(segs[seg_i], obj, now_ns)
            except Exception:  # hostile input: any failure is this record's alone
                _damage(batch, seg_i, start, end)
                continue
            for table, ts_ns, row in made:
                row["ts"] = ts_ns // 1000
                by_table = rows.setdefault(day_of(ts_ns), {})
                by_table.setdefault(table, []).append((row, seg_i, start, end))
    out: dict[date, dict[str, pa.Table]] = {}
    for d, by_table in rows.items():
        out[d] = {name: _table(batch, name, rs) for name, rs in by_table.items()}
    return out


def _table(batch: Batch, name: str, rows: list[tuple[dict[str, Any], int, int, int]]) -> pa.Table:
    """The rows as a table; should one not fit the schema, row by row without the misfits."""
    arrow_schema = schema.TABLES[name].arrow_schema()
    try:
        return pa.Table.from_pylist([r for r, *_ in rows], schema=arrow_schema)
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        pass
    good = []
    for row, seg_i, start, end in rows:
        try:
            pa.Table.from_pylist([row], schema=arrow_schema)
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            _damage(batch, seg_i, start, end)
            continue
        good.append(row)
    return pa.Table.from_pylist(good, schema=arrow_schema)


def _damage(batch: Batch, seg_i: int, start: int, end: int) -> None:
    seg = batch.segments[seg_i]
    if start >= 0:
        batch.add_damage(seg, start, end - start, "invalid evidence record")
    else:  # read past damage: the segment is quarantined already
        seg.damaged = True


def _list(v: Any) -> list[Any]:
    """A record's list field: anything but a list is a bad field, read as empty."""
    return v if isinstance(v, list) else []


def _samples(seg: SegmentState, obj: dict[str, Any], now_ns: int) -> list[Row]:
    start = sane_ts(obj.get("ts"), now_ns)
    base = {
        "trace_id": as_str(obj.get("id")) or "",
        "service": seg.service or "unknown",
        "endpoint": as_str(obj.get("endpoint")) or "",
        "method": as_str(obj.get("method")),
        "path": as_str(obj.get("path")),
    }
    out: list[Row] = []
    for s in _list(obj.get("samples")):
        if not isinstance(s, list) or len(s) < 3:
            continue
        off = as_int(s[0])
        row = dict(base, offset_ms=ns_to_ms(off), state=as_str(s[1]), stack_id=as_id(s[2]))
        out.append(("samples", sane_ts(start + (off or 0), start), row))
    return out


def _blocker(seg: SegmentState, obj: dict[str, Any], now_ns: int) -> list[Row]:
    stacks = [s for s in _list(obj.get("stacks")) if isinstance(s, list) and len(s) == 2]
    top = stacks[0] if stacks else [None, None]
    last = obj.get("last_call")
    last = last if isinstance(last, dict) else {}
    samples = sum(as_int(s[1]) or 0 for s in stacks)
    row = {
        "trace_id": as_str(obj.get("id")),
        "service": seg.service or "unknown",
        "host": seg.host,
        "pid": seg.pid,
        "endpoint": as_str(obj.get("endpoint")) or "",
        "method": as_str(obj.get("method")),
        "path": as_str(obj.get("path")),
        "duration_ms": ns_to_ms(obj.get("dur")),
        "stack_id": as_id(top[0]),
        "stack_samples": as_int32(top[1]),
        "samples": as_int32(samples),
        "delayed": as_int32(obj.get("delayed")),
        "last_kind": as_str(last.get("kind")),
        "last_call": as_str(last.get("text")),
        "last_rows": as_int(last.get("rows")),
        "last_bytes": as_int(last.get("bytes")),
        "last_ms": as_float(last.get("ms")),
    }
    return [("blockers", sane_ts(obj.get("ts"), now_ns), row)]


def _gc(seg: SegmentState, obj: dict[str, Any], now_ns: int) -> list[Row]:
    out: list[Row] = []
    for p in _list(obj.get("pauses")):
        if not isinstance(p, dict):
            continue
        ids = p.get("ids")
        row = {
            "service": seg.service or "unknown",
            "host": seg.host,
            "pid": seg.pid,
            "endpoint": "",
            "generation": as_int32(p.get("gen")),
            "duration_ms": ns_to_ms(p.get("dur")),
            "collected": as_int(p.get("collected")),
            "trace_ids": ",".join(as_str(i) or "" for i in ids) if isinstance(ids, list) else None,
        }
        out.append(("gc_pauses", sane_ts(p.get("ts"), now_ns), row))
    return out
