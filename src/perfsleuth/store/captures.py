"""Replayable request captures (wire.CAPTURE records, agent.capture) -> rows of ``captures``.

One row per trace id (the table's key: a record ingested twice is ignored). Values are coerced
like requests are: a bad field becomes NULL, a record without an id is skipped, nothing raises.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from perfsleuth.store import schema
from perfsleuth.store.ingest import _TS_MAX, Batch, _bool, _int32, _str, as_int
from perfsleuth.wire import CAPTURE


def table(batch: Batch, now_ns: int) -> pa.Table:
    rows: dict[str, dict[str, Any]] = {}
    segs = batch.segments
    for seg_i, obj in batch.events.get(CAPTURE, ()):
        tid = _str(obj.get("id"))
        if not tid:
            continue
        ts = as_int(obj.get("ts"))
        dur = as_int(obj.get("dur"))
        headers = obj.get("headers")
        pairs = [
            [str(p[0]), str(p[1])]
            for p in (headers if isinstance(headers, list) else ())
            if isinstance(p, list) and len(p) == 2
        ]
        redacted = obj.get("redacted")
        rows[tid.lower()] = {
            "trace_id": tid.lower(),
            "ts": (ts if ts is not None and 0 < ts < _TS_MAX else now_ns) // 1000,
            "service": segs[seg_i].service or "unknown",
            "endpoint": _str(obj.get("endpoint")),
            "method": _str(obj.get("method")),
            "status": _int32(obj.get("status")),
            "duration_ms": dur / 1e6 if dur is not None else None,
            "reason": _str(obj.get("reason")),
            "url": _str(obj.get("url")),
            "headers": json.dumps(pairs, ensure_ascii=False),
            "redacted": ",".join(map(str, redacted)) if isinstance(redacted, list) else None,
            "body_b64": _str(obj.get("body_b64")),
            "body_size": as_int(obj.get("body_size")),
            "body_sha256": _str(obj.get("body_sha256")),
            "body_truncated": _bool(obj.get("body_truncated")),
        }
    return pa.Table.from_pylist(list(rows.values()), schema=schema.CAPTURES.arrow_schema())
