"""The store's Arrow tables for a mapped payload: requests (with their calls' counts and time by
kind), calls, link attributes, loop blocks and the dictionary rows, split by day."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import records, schema, values
from perfsleuth.store.evidence import tables as evidence_tables
from perfsleuth.store.otlp.calls import MAX_CACHED, Dictionary
from perfsleuth.store.otlp.links import LINK
from perfsleuth.store.tables import Tables
from perfsleuth.wire import FINGERPRINT, LOCATION, STACK, internal_sql


def to_tables(
    batch: records.Batch,
    reqs: dict[str, list[Any]],
    times: tuple[np.ndarray, np.ndarray],
    cols: dict[str, Any],
    crow: np.ndarray,
    seq: np.ndarray,
    links: list[tuple[int, str, str, int | None]],
    dictionary: Dictionary,
    new: list[tuple[bytes, int]],
) -> Tables:
    """The store's tables for the mapped rows: requests (with their calls' counts and time by
    kind), calls, the link attributes, dictionaries and loop blocks, split by day."""
    now_ns = time.time_ns()
    out = Tables()
    n, m = len(reqs["id"]), len(crow)
    segs = batch.segments
    seg = np.asarray(reqs["seg"], dtype=np.int64)
    ts_ns, end_ns = times
    dur = np.maximum(end_ns - ts_ns, 0).astype(np.float64) / 1e6
    bad = (ts_ns <= 0) | (ts_ns >= values.TS_MAX)
    ts_ns = np.where(bad, now_ns, ts_ns)
    day = ts_ns // values.NS_PER_DAY
    ts = pa.array(ts_ns // 1000, pa.timestamp("us"))
    service = pa.array([(segs[i].service or "unknown") for i in seg.tolist()], pa.string())
    endpoint = pa.array(reqs["endpoint"], pa.string())
    trace_id = pa.array(reqs["id"], pa.string())

    internal = {
        fid
        for (rtype, fid), obj in dictionary.items()
        if rtype == FINGERPRINT and obj["kind"] == "db" and _internal(obj["text"])
    }
    ckind = [
        internal_sql.INTERNAL_KIND if k == "db" and fp in internal else k
        for k, fp in zip(cols["kind"], cols["fp"], strict=True)
    ]
    cdur = np.asarray(cols["dur"], dtype=np.float64) / 1e6
    agg: dict[str, pa.Array] = {}
    kinds = np.array(ckind, dtype=object)
    for k in ("db", "http", "cache"):
        mask = kinds == k if m else np.zeros(0, dtype=bool)
        agg[f"{k}_calls"] = pa.array(np.bincount(crow[mask], minlength=n).astype(np.int32))
        agg[f"{k}_ms"] = pa.array(np.bincount(crow[mask], weights=cdur[mask], minlength=n))
    req = pa.table(
        {
            "ts": ts,
            "trace_id": trace_id,
            "service": service,
            "host": pa.array([segs[i].host or None for i in seg.tolist()], pa.string()),
            "pid": pa.array([segs[i].pid for i in seg.tolist()], pa.int32()),
            "kind": pa.array(reqs["kind"], pa.string()),
            "method": pa.array(reqs["method"], pa.string()),
            "endpoint": endpoint,
            "path": pa.array(reqs["path"], pa.string()),
            "status": pa.array(reqs["status"], pa.int32()),
            "error": pa.array(reqs["error"], pa.string()),
            "duration_ms": pa.array(dur),
            "cpu_ms": pa.nulls(n, pa.float64()),
            "req_bytes": pa.array(reqs["req_bytes"], pa.int64()),
            "resp_bytes": pa.array(reqs["resp_bytes"], pa.int64()),
            "user": pa.array(reqs["user"], pa.string()),
            "tenant": pa.array(reqs["tenant"], pa.string()),
            **agg,
            "calls_dropped": pa.array(np.zeros(n, dtype=np.int32)),
            "gc_ms": pa.nulls(n, pa.float64()),
            "gc_count": pa.nulls(n, pa.int32()),
            "version": pa.array([segs[i].version or None for i in seg.tolist()], pa.string()),
        },
        schema=schema.REQUESTS.arrow_schema(),
    )
    crow_pa = pa.array(crow, pa.int64())
    call = pa.table(
        {
            "ts": pc.take(ts, crow_pa),
            "trace_id": pc.take(pc.dictionary_encode(trace_id), crow_pa),
            "service": pc.take(pc.dictionary_encode(service), crow_pa),
            "endpoint": pc.take(pc.dictionary_encode(endpoint), crow_pa),
            "seq": pa.array(seq.astype(np.int32)),
            "kind": pa.array(ckind, pa.string()),
            "system": pa.array(cols["system"], pa.string()),
            "fingerprint_id": pa.array(cols["fp"], pa.int64()),
            "offset_ms": pa.array(np.asarray(cols["off"], dtype=np.float64) / 1e6),
            "duration_ms": pa.array(cdur),
            "rows": pa.array(cols["rows"], pa.int64()),
            "bytes": pa.nulls(m, pa.int64()),
            "params_hash": pa.array(cols["ph"], pa.int64()),
            "stack_id": pa.array(cols["stack"], pa.int64()),
            "site_id": pa.array(cols["site"], pa.int64()),
            "host": pa.array(cols["host"], pa.string()),
            "status": pa.array(cols["status"], pa.int32()),
            "hit": pa.nulls(m, pa.bool_()),
            "wait_ms": pa.nulls(m, pa.float64()),
            "error": pa.array(cols["error"], pa.string()),
            "unfinished": pa.nulls(m, pa.bool_()),
        }
    )
    lrow = pa.array([r for r, *_ in links], pa.int64())
    attrs = pa.table(
        {
            "ts": pc.take(ts, lrow),
            "trace_id": pc.take(trace_id, lrow),
            "service": pc.take(service, lrow),
            "endpoint": pc.take(endpoint, lrow),
            "kind": pa.array([LINK] * len(links), pa.string()),
            "key": pa.array([k for _, k, _, _ in links], pa.string()),
            "value": pa.array([v for _, _, v, _ in links], pa.string()),
            "num": pa.array([s for *_, s in links], pa.float64()),
        },
        schema=schema.ATTRIBUTES.arrow_schema(),
    )
    out.requests, out.calls = n, m
    days = np.unique(day)
    for d in days.tolist():
        key = values.EPOCH + timedelta(days=d)
        if len(days) == 1:
            out.days[key] = {"requests": req, "calls": call, "attributes": attrs}
            continue
        in_day = day == d
        out.days[key] = {
            "requests": req.filter(pa.array(in_day)),
            "calls": call.filter(pa.array(in_day[crow])),
            "attributes": attrs.filter(
                pa.array(in_day[np.asarray([r for r, *_ in links], np.int64)])
            ),
        }
    if batch.events:
        for d, parts in evidence_tables(batch, now_ns).items():
            out.days.setdefault(d, {}).update(parts)
    _dictionary_tables(out, {k: dictionary[k] for k in new}, internal)
    return out


def _dictionary_tables(out: Tables, dictionary: Dictionary, internal: set[int]) -> None:
    fps = [o for (t, _), o in dictionary.items() if t == FINGERPRINT]
    locs = [o for (t, _), o in dictionary.items() if t == LOCATION]
    stacks = [o for (t, _), o in dictionary.items() if t == STACK]
    if fps:
        out.fingerprints = pa.table(
            {
                "id": [o["id"] for o in fps],
                "kind": [
                    internal_sql.INTERNAL_KIND if o["id"] in internal else o["kind"] for o in fps
                ],
                "op": [o["op"] for o in fps],
                "text": [values.text(o["text"]) for o in fps],
            },
            schema=schema.FINGERPRINTS.arrow_schema(),
        )
    if locs:
        out.locations = pa.table(
            {
                "id": [o["id"] for o in locs],
                "file": [values.text(o["file"]) for o in locs],
                "line": [o["line"] for o in locs],
                "function": [values.text(o["func"]) for o in locs],
                "app": [True] * len(locs),
            },
            schema=schema.LOCATIONS.arrow_schema(),
        )
    if stacks:
        out.stacks = pa.table(
            {"id": [o["id"] for o in stacks], "frames": [o["frames"] for o in stacks]},
            schema=schema.STACKS.arrow_schema(),
        )


_internals: dict[str, bool] = {}


def _internal(text: str) -> bool:
    hit = _internals.get(text)
    if hit is None:
        if len(_internals) >= MAX_CACHED:
            _internals.clear()
        hit = _internals[text] = internal_sql.is_internal(text)
    return hit
