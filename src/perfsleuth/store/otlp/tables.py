"""The store's Arrow tables for a mapped payload: the request columns and their calls, shaped as
the store's wire table (:data:`perfsleuth.store.decode.REQUEST_WIRE`), go through the builder
the spool ingest uses (:func:`perfsleuth.store.tables.event_tables`: requests with their calls'
counts and time by kind, calls, split by day); the link attributes, loop blocks and
dictionary rows are added here."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import records, schema, values
from perfsleuth.store.decode import CALL_WIRE, REQUEST_WIRE
from perfsleuth.store.evidence import tables as evidence_tables
from perfsleuth.store.otlp.calls import MAX_CACHED, Dictionary
from perfsleuth.store.otlp.links import LINK
from perfsleuth.store.tables import Tables, event_tables
from perfsleuth.wire import FINGERPRINT, LOCATION, STACK, internal_sql

# The wire's request fields the mapping fills as they are (the others but ts, dur and calls are
# null: no CPU time, GC or agent row data in OTLP).
_REQUEST_FIELDS = (
    "kind", "method", "endpoint", "path", "status", "error", "user", "tenant", "req_bytes",
    "resp_bytes",
)  # fmt: skip


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
    """The store's tables for the mapped rows (``crow``: each call's request row, ascending):
    requests (with their calls' counts and time by kind), calls, the link attributes,
    dictionaries and loop blocks, split by day."""
    now_ns = time.time_ns()
    out = Tables()
    n, m = len(reqs["id"]), len(crow)
    internal = {
        fid
        for (rtype, fid), obj in dictionary.items()
        if rtype == FINGERPRINT and obj["kind"] == "db" and _internal(obj["text"])
    }
    if n:
        ts_ns, end_ns = times
        calls = _calls(cols, internal, m)
        counts = np.bincount(crow, minlength=n)
        offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
        given = {
            "id": pa.array(reqs["id"], pa.string()),
            "ts": pa.array(ts_ns, pa.int64()),
            "dur": pa.array(np.maximum(end_ns - ts_ns, 0), pa.int64()),
            "calls": pa.ListArray.from_arrays(pa.array(offsets), calls),
            **{k: pa.array(reqs[k], REQUEST_WIRE.field(k).type) for k in _REQUEST_FIELDS},
        }
        wire = pa.table(
            {f.name: given.get(f.name, pa.nulls(n, f.type)) for f in REQUEST_WIRE},
            schema=REQUEST_WIRE,
        )
        event_tables(out, wire, np.asarray(reqs["seg"], np.int64), [], batch, now_ns)
        if links:
            _link_tables(out, links, ts_ns, now_ns)
    if batch.events:
        for d, parts in evidence_tables(batch, now_ns).items():
            out.days.setdefault(d, {}).update(parts)
    _dictionary_tables(out, {k: dictionary[k] for k in new}, internal)
    return out


def _calls(cols: dict[str, Any], internal: set[int], m: int) -> pa.StructArray:
    """The calls as the wire's call struct (``db.internal`` for framework statements)."""
    kind = [
        internal_sql.INTERNAL_KIND if k == "db" and fp in internal else k
        for k, fp in zip(cols["kind"], cols["fp"], strict=True)
    ]
    given = {
        "kind": kind,
        "system": cols["system"],
        "fp": cols["fp"],
        "off": cols["off"],
        "dur": cols["dur"],
        "stack": cols["stack"],
        "site": cols["site"],
        "ph": cols["ph"],
        "rows": cols["rows"],
        "status": cols["status"],
        "error": cols["error"],
        "host": cols["host"],
    }
    arrays = [
        pa.array(given[f.name], f.type) if f.name in given else pa.nulls(m, f.type)
        for f in CALL_WIRE
    ]
    return pa.StructArray.from_arrays(arrays, fields=list(CALL_WIRE))


def _link_tables(
    out: Tables, links: list[tuple[int, str, str, int | None]], ts_ns: np.ndarray, now_ns: int
) -> None:
    """The link attributes (kind LINK) with their request's ts, trace id, service and endpoint
    (from the requests table just built), added to each day's attributes."""
    lrow = np.fromiter((r for r, *_ in links), np.int64, len(links))
    bad = (ts_ns <= 0) | (ts_ns >= values.TS_MAX)
    day = np.where(bad, now_ns, ts_ns) // values.NS_PER_DAY
    key = pa.array([k for _, k, _, _ in links], pa.string())
    value = pa.array([v for _, _, v, _ in links], pa.string())
    num = pa.array([s for *_, s in links], pa.float64())
    for d in np.unique(day[lrow]).tolist():
        parts = out.days[values.EPOCH + timedelta(days=d)]
        req = parts["requests"]
        # The day's requests are the batch's of that day, in order: a link's row among them.
        in_day = np.nonzero(day == d)[0]
        mine = day[lrow] == d
        at = pa.array(np.searchsorted(in_day, lrow[mine]), pa.int64())
        pick = pa.array(mine)
        link = pa.table(
            {
                "ts": pc.take(req["ts"], at),
                "trace_id": pc.take(req["trace_id"], at),
                "service": pc.take(req["service"], at),
                "endpoint": pc.take(req["endpoint"], at),
                "kind": pa.array([LINK] * len(at), pa.string()),
                "key": key.filter(pick),
                "value": value.filter(pick),
                "num": num.filter(pick),
            },
            schema=schema.ATTRIBUTES.arrow_schema(),
        )
        parts["attributes"] = pa.concat_tables([parts["attributes"], link])


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
