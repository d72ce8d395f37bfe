"""Runtime-evidence records (stack samples, loop blockers, GC pauses) -> rows of their tables.

The agent ships them as JSON records (wire.SAMPLES, wire.BLOCKER, wire.GC; see
perfsleuth.agent.sampler / watchdog / gcwatch). Values are coerced like requests are: a bad
field becomes NULL, a record that is not an object is skipped, nothing raises. A sample's
``state`` is kept as sent (agent.sampler's cpu, starved, gil, wait or call). The sampler's
process figures (run-queue and throttled time) come as STATS counters into ``agent_stats``
(store.ingest), not through here.
"""

from __future__ import annotations

from datetime import date, timedelta
from typing import Any

import pyarrow as pa

from perfsleuth.store import schema
from perfsleuth.store.ingest import Batch, _id, _int32, _str, as_int
from perfsleuth.wire import BLOCKER, GC, SAMPLES

NS_PER_DAY = 86_400 * 10**9
_EPOCH = date(1970, 1, 1)
_TS_MAX = 4_102_444_800 * 10**9  # 2100-01-01


def _ts(v: Any, now_ns: int) -> int:
    t = as_int(v)
    return t if t is not None and 0 < t < _TS_MAX else now_ns


def _ms(v: Any) -> float | None:
    n = as_int(v)
    return n / 1e6 if n is not None else None


def _day(ts_ns: int) -> date:
    return _EPOCH + timedelta(days=ts_ns // NS_PER_DAY)


def tables(batch: Batch, now_ns: int) -> dict[date, dict[str, pa.Table]]:
    """Per day, the evidence tables this batch adds (only those with rows)."""
    rows: dict[date, dict[str, list[dict[str, Any]]]] = {}

    def add(table: str, ts_ns: int, row: dict[str, Any]) -> None:
        row["ts"] = ts_ns // 1000
        rows.setdefault(_day(ts_ns), {}).setdefault(table, []).append(row)

    segs = batch.segments
    for seg_i, obj in batch.events.get(SAMPLES, ()):
        service = segs[seg_i].service or "unknown"
        start = _ts(obj.get("ts"), now_ns)
        samples = obj.get("samples")
        if not isinstance(samples, list):
            continue
        base = {
            "trace_id": _str(obj.get("id")) or "",
            "service": service,
            "endpoint": _str(obj.get("endpoint")) or "",
            "method": _str(obj.get("method")),
            "path": _str(obj.get("path")),
        }
        for s in samples:
            if not isinstance(s, list) or len(s) < 3:
                continue
            off = as_int(s[0])
            add(
                "samples",
                start + (off or 0),
                dict(base, offset_ms=_ms(off), state=_str(s[1]), stack_id=_id(s[2])),
            )
    for seg_i, obj in batch.events.get(BLOCKER, ()):
        seg = segs[seg_i]
        stacks = [s for s in obj.get("stacks") or () if isinstance(s, list) and len(s) == 2]
        top = stacks[0] if stacks else [None, None]
        last = obj.get("last_call")
        last = last if isinstance(last, dict) else {}
        add(
            "blockers",
            _ts(obj.get("ts"), now_ns),
            {
                "trace_id": _str(obj.get("id")),
                "service": seg.service or "unknown",
                "host": seg.host,
                "pid": seg.pid,
                "endpoint": _str(obj.get("endpoint")) or "",
                "method": _str(obj.get("method")),
                "path": _str(obj.get("path")),
                "duration_ms": _ms(obj.get("dur")),
                "stack_id": _id(top[0]),
                "stack_samples": _int32(top[1]),
                "samples": _int32(sum(as_int(s[1]) or 0 for s in stacks)),
                "delayed": _int32(obj.get("delayed")),
                "last_kind": _str(last.get("kind")),
                "last_call": _str(last.get("text")),
                "last_rows": as_int(last.get("rows")),
                "last_bytes": as_int(last.get("bytes")),
                "last_ms": _float(last.get("ms")),
            },
        )
    for seg_i, obj in batch.events.get(GC, ()):
        seg = segs[seg_i]
        for p in obj.get("pauses") or ():
            if not isinstance(p, dict):
                continue
            ids = p.get("ids")
            add(
                "gc_pauses",
                _ts(p.get("ts"), now_ns),
                {
                    "service": seg.service or "unknown",
                    "host": seg.host,
                    "pid": seg.pid,
                    "endpoint": "",
                    "generation": _int32(p.get("gen")),
                    "duration_ms": _ms(p.get("dur")),
                    "collected": as_int(p.get("collected")),
                    "trace_ids": ",".join(map(str, ids)) if isinstance(ids, list) else None,
                },
            )
    out: dict[date, dict[str, pa.Table]] = {}
    for d, by_table in rows.items():
        out[d] = {
            name: pa.Table.from_pylist(rs, schema=schema.TABLES[name].arrow_schema())
            for name, rs in by_table.items()
        }
    return out


def _float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)
