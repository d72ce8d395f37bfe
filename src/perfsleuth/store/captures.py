"""Replayable request captures (wire.CAPTURE records, agent.capture) -> rows of ``captures``.

One row per trace id (the table's key: a record ingested twice is ignored). Values are coerced
like requests are: a bad field becomes NULL, a record without an id is skipped, nothing raises.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from perfsleuth.store import schema
from perfsleuth.store.records import Batch
from perfsleuth.store.values import as_bool, as_int, as_int32, as_str, sane_ts
from perfsleuth.wire import CAPTURE


def table(batch: Batch, now_ns: int) -> pa.Table:
    rows: dict[str, dict[str, Any]] = {}
    segs = batch.segments
    for seg_i, obj, start, end in batch.events.get(CAPTURE, ()):
        try:
            row = _row(obj, segs[seg_i].service, now_ns)
        except Exception:  # hostile input: any failure is this record's alone
            row = None
        if row is not None:
            try:  # the row alone against the schema: a misfit is damage, not a failed batch
                pa.Table.from_pylist([row], schema=schema.CAPTURES.arrow_schema())
            except (pa.ArrowException, ValueError, TypeError, OverflowError):
                row = None
            else:
                rows[row["trace_id"]] = row
                continue
        if start >= 0:
            batch.add_damage(segs[seg_i], start, end - start, "invalid capture record")
        else:  # read past damage: the segment is quarantined already
            segs[seg_i].damaged = True
    return pa.Table.from_pylist(list(rows.values()), schema=schema.CAPTURES.arrow_schema())


def _row(obj: dict[str, Any], service: str, now_ns: int) -> dict[str, Any] | None:
    tid = as_str(obj.get("id"))
    if not tid:
        return None
    ts = as_int(obj.get("ts"))
    dur = as_int(obj.get("dur"))
    headers = obj.get("headers")
    pairs = [
        [as_str(p[0]) or "", as_str(p[1]) or ""]
        for p in (headers if isinstance(headers, list) else ())
        if isinstance(p, list) and len(p) == 2
    ]
    redacted = obj.get("redacted")
    return {
        "trace_id": tid.lower(),
        "ts": sane_ts(ts, now_ns) // 1000,
        "service": service or "unknown",
        "endpoint": as_str(obj.get("endpoint")),
        "method": as_str(obj.get("method")),
        "status": as_int32(obj.get("status")),
        "duration_ms": dur / 1e6 if dur is not None else None,
        "reason": as_str(obj.get("reason")),
        "url": as_str(obj.get("url")),
        "headers": json.dumps(pairs, ensure_ascii=False),
        "redacted": ",".join(as_str(r) or "" for r in redacted)
        if isinstance(redacted, list)
        else None,
        "body_b64": as_str(obj.get("body_b64")),
        "body_size": as_int(obj.get("body_size")),
        "body_sha256": as_str(obj.get("body_sha256")),
        "body_truncated": as_bool(obj.get("body_truncated")),
    }
