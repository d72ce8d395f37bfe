"""From spool segments to Arrow tables: listing the spool, reading segments from an offset,
and turning a batch of records into one Arrow table per (event table, day).

Reading. Intact records are framed here without being decoded (magic, length, crc: the
layout of :mod:`perfsleuth.wire.segment`), so request payloads can be parsed in bulk by
Arrow's JSON reader, which is several times faster than ``json.loads`` per record. At the
first anything-but-perfect byte the rest of the segment is handed to
:func:`perfsleuth.wire.segment.read_segment`, which owns damage detection and resync.

Converting. Request records become rows of ``requests``; their calls rows of ``calls`` (with
the request's ts, trace id, service and endpoint copied in) and per-request aggregates
(db/http/cache calls and time) computed once here so ``top`` is one scan. Payloads Arrow
cannot read with the expected types (an odd agent, a hand-written record) go through a slow
path that coerces each value or drops it to NULL: one odd record never fails a batch.

Duplicates. A request is stored once per trace id: a batch keeps the first request of each
(a record repeated in a segment, a segment copied under another name), and the store leaves
out those it holds already (:func:`drop_known_traces`), with their calls and attributes.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import socket
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from perfsleuth.store import schema
from perfsleuth.wire import (
    CAPTURE,
    CLOSED_SUFFIX,
    EVENT_TYPES,
    FINGERPRINT,
    HEADER,
    LOCATION,
    OPEN_SUFFIX,
    RECORD_TYPES,
    REQUEST,
    REQUEST_BIN,
    REQUEST_TYPES,
    REQUESTS,
    STACK,
    STATS,
    internal_sql,
)
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire import calls as wcalls
from perfsleuth.wire.segment import FILE_MAGIC, HEAD_SIZE, MAX_RECORD, REC_MAGIC, read_segment

NS_PER_DAY = 86_400 * 10**9
ID_MASK = (1 << 63) - 1  # ids are 63-bit; anything wider is folded so references still match
_INT64_MAX = (1 << 63) - 1
_TS_MAX = 7_258_118_400 * 10**9  # 2200-01-01: anything later (or <= 0) is a broken clock
_HEAD = struct.Struct("<2scII")  # the record head of perfsleuth.wire.segment
_EPOCH = date(1970, 1, 1)

# The request record as the agent writes it (perfsleuth.agent.shipper._Encoder.request).
_CALL_WIRE = pa.struct(
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
        ("calls", pa.list_(_CALL_WIRE)),
        # batched requests only (wire.batch): the request's start on the process clock, and
        # what its call rows' slots point at
        ("t0", pa.int64()),
        ("sites", pa.list_(pa.list_(pa.int64()))),
    ]
)
_ID_FIELDS = frozenset({"fp", "stack", "site", "ph"})
_JSON_OPTS = pajson.ParseOptions(explicit_schema=REQUEST_WIRE, unexpected_field_behavior="ignore")
_FAST_CHUNK = 2_000  # records per retry when a whole batch cannot be read by Arrow


# ------------------------------------------------------------------------------- the spool


def local_host() -> str:
    """This machine's name as the agent spells it in segment file names."""
    return socket.gethostname().replace("-", "_")[:64] or "host"


@dataclass
class SpoolFile:
    base: str  # name without suffix: the key in ingest_offsets
    name: str
    path: str
    closed: bool  # .seg
    size: int
    mtime: float
    host: str | None  # writer, from "<host>-<pid>-<started_ns>-<seq>"
    pid: int | None


def parse_name(base: str) -> tuple[str | None, int | None]:
    parts = base.rsplit("-", 3)
    if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
        return parts[0], int(parts[1])
    return None, None


def list_spool(spool_dir: str) -> list[SpoolFile]:
    """Segments (``*.seg``, ``*.open``) in the spool, oldest name first (names start with
    host, pid and start time)."""
    out = []
    try:
        entries = list(os.scandir(spool_dir))
    except (FileNotFoundError, NotADirectoryError):  # no spool yet, or no agent could make one
        return []
    for e in entries:
        name = e.name
        if name.endswith(CLOSED_SUFFIX):
            base, closed = name[: -len(CLOSED_SUFFIX)], True
        elif name.endswith(OPEN_SUFFIX):
            base, closed = name[: -len(OPEN_SUFFIX)], False
        else:
            continue
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        host, pid = parse_name(base)
        out.append(SpoolFile(base, name, e.path, closed, st.st_size, st.st_mtime, host, pid))
    # A segment renamed from .open to .seg between two scandir entries shows up twice.
    by_base: dict[str, SpoolFile] = {}
    for f in out:
        if f.base not in by_base or f.closed:
            by_base[f.base] = f
    return sorted(by_base.values(), key=lambda f: f.name)


def writer_gone(f: SpoolFile, idle_seconds: float, now: float) -> bool:
    """Whether an .open segment will not grow any more: unchanged for ``idle_seconds`` and
    its writer (pid in the name, on this host) is dead, or the name names no writer."""
    if f.closed:
        return True
    if now - f.mtime < idle_seconds:
        return False
    if f.host is None or f.pid is None:
        return True
    if f.host != local_host():
        return False  # cannot tell: it is read incrementally all the same
    try:
        os.kill(f.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by someone else
    return False


# ------------------------------------------------------------------------------- reading


@dataclass
class Damage:
    offset: int
    length: int
    reason: str


@dataclass
class SegmentRead:
    # Intact records before the first anomaly: (type, raw payload, record start, record end).
    raw: list[tuple[bytes, bytes, int, int]] = field(default_factory=list)
    # Records after it, decoded by read_segment (which skipped the damage).
    decoded: list[tuple[bytes, Any]] = field(default_factory=list)
    end: int = 0
    damaged: list[Damage] = field(default_factory=list)
    incomplete_tail: int = 0


def read_from(data: bytes | mmap.mmap, start: int) -> SegmentRead:
    """Records of ``data`` from ``start`` (0, or an ``end`` returned before)."""
    n = len(data)
    res = SegmentRead(end=start)
    if start > n:  # the file shrank: nothing to read (writers only append)
        return res
    pos = start
    anomaly = False
    if start == 0:
        if n < len(FILE_MAGIC):
            res.incomplete_tail = n
            return res
        if data[: len(FILE_MAGIC)] != FILE_MAGIC:
            anomaly = True
        else:
            pos = len(FILE_MAGIC)
    crc32 = zlib.crc32
    unpack = _HEAD.unpack_from
    raw = res.raw
    while not anomaly and n - pos >= HEAD_SIZE:
        magic, rtype, length, crc = unpack(data, pos)
        if magic != REC_MAGIC or rtype not in RECORD_TYPES or length > MAX_RECORD:
            anomaly = True
            break
        end = pos + HEAD_SIZE + length
        if end > n:
            break
        payload = data[pos + HEAD_SIZE : end]
        if crc32(payload, crc32(rtype)) != crc:
            anomaly = True
            break
        raw.append((rtype, payload, pos, end))
        pos = end
    if not anomaly:
        res.end = pos
        res.incomplete_tail = n - pos
        return res
    rest = read_segment(data if isinstance(data, bytes) else data[:], pos)
    res.decoded = rest.records
    res.end = rest.end
    res.damaged = [Damage(d.offset, d.length, d.reason) for d in rest.damaged]
    res.incomplete_tail = rest.incomplete_tail
    return res


# -------------------------------------------------------------------------------- batches


@dataclass
class SegmentState:
    """One segment's progress; shared by the batches that carry parts of it."""

    base: str
    name: str
    offset: int
    service: str = ""
    host: str = ""
    pid: int | None = None
    version: str = ""  # the release the agent reported (PERFSLEUTH_VERSION or a git commit)
    damaged: bool = False  # any damage so far: quarantined instead of deleted once done
    final: bool = False  # everything read and the segment will not grow: retire after commit


@dataclass
class BatchDamage:
    segment: SegmentState
    offset: int
    length: int
    reason: str


_DICTIONARY_TYPES = frozenset({LOCATION, STACK, FINGERPRINT})

# Ids of the fingerprints of framework-internal statements (wire.internal_sql) met by this
# process: their calls are filed under "db.internal". A fingerprint record comes once per
# segment, before the calls that use it; a batch that continues a segment where an earlier
# batch of this process stopped finds it here. (Ids are hashes of the text: valid for any store.)
_internal_fps: set[int] = set()
_MAX_INTERNAL_FPS = 100_000


def _remember_internal(fid: int) -> None:
    if len(_internal_fps) >= _MAX_INTERNAL_FPS:
        _internal_fps.clear()
    _internal_fps.add(fid)


def remember_internal_fingerprints(ids: Iterable[int]) -> None:
    """Take the ids of internal fingerprints a store already holds (its ``fingerprints`` rows
    of kind ``db.internal``): a process that continues a segment another process began reads
    calls whose fingerprint records came before its offset."""
    for fid in ids:
        _remember_internal(int(fid))


class Batch:
    """Records gathered for one transaction. ``seen`` holds the dictionary record payloads
    already taken in this ingest run (every segment repeats the ones it uses)."""

    def __init__(self, seen: set[bytes] | None = None) -> None:
        self.seen: set[bytes] = set() if seen is None else seen
        self.segments: list[SegmentState] = []
        self._seg_index: dict[int, int] = {}
        self.raw_requests: list[bytes] = []  # JSON objects, one per request
        self.raw_calls: list[bytes | None] = []  # their binary call rows (REQUEST_BIN)
        # REQUESTS records (wire.batch): (segment index, its parts, start, end)
        self.columns: list[tuple[int, wbatch.Batch, int, int]] = []
        self.raw_meta: list[tuple[int, int, int]] = []  # (segment index, start, end)
        self.dict_requests: list[Any] = []
        self.dict_src: list[int] = []
        self.locations: dict[int, tuple[Any, ...]] = {}
        self.stacks: dict[int, list[int]] = {}
        self.fingerprints: dict[int, tuple[Any, ...]] = {}
        self.stats: list[tuple[Any, ...]] = []
        # Runtime-evidence records (wire.EVENT_TYPES) by type: (segment index, object, record
        # start, record end; -1 for records read past damage).
        self.events: dict[bytes, list[tuple[int, dict[str, Any], int, int]]] = {}
        self.damage: list[BatchDamage] = []
        self.requests = 0
        self.request_bytes = 0

    def touch(self, seg: SegmentState) -> int:
        i = self._seg_index.get(id(seg))
        if i is None:
            i = self._seg_index[id(seg)] = len(self.segments)
            self.segments.append(seg)
        return i

    def add_damage(self, seg: SegmentState, offset: int, length: int, reason: str) -> None:
        seg.damaged = True
        self.touch(seg)
        self.damage.append(BatchDamage(seg, offset, length, reason))

    def add_raw(
        self, seg: SegmentState, rtype: bytes, payload: bytes, start: int, end: int
    ) -> None:
        if rtype == REQUESTS:
            try:
                parts = wbatch.split(payload)
            except (ValueError, RecursionError):
                self.add_damage(seg, start, end - start, "undecodable payload")
                return
            self.columns.append((self.touch(seg), parts, start, end))
            self.requests += parts.n
            self.request_bytes += len(payload)
            return
        if rtype in REQUEST_TYPES:
            call_rows = None
            if rtype == REQUEST_BIN:
                try:
                    payload, call_rows = wcalls.split(payload)
                except ValueError:
                    self.add_damage(seg, start, end - start, "undecodable payload")
                    return
            self.raw_requests.append(payload)
            self.raw_calls.append(call_rows)
            self.raw_meta.append((self.touch(seg), start, end))
            self.requests += 1
            self.request_bytes += len(payload)
            return
        if rtype in _DICTIONARY_TYPES:
            if payload in self.seen:
                return
            self.seen.add(payload)
        try:
            obj = loads(payload)
        except ValueError:
            self.add_damage(seg, start, end - start, "undecodable payload")
            return
        self.add(seg, rtype, obj, start, end)

    def add(
        self, seg: SegmentState, rtype: bytes, obj: Any, start: int = -1, end: int = -1
    ) -> None:
        """A decoded record (``start``, ``end``: where it lies in its segment, if known)."""
        if rtype == REQUESTS and isinstance(obj, list):  # wire.batch.decode: its requests
            for req in obj:
                self.add(seg, REQUEST, req)
            return
        if rtype in REQUEST_TYPES:
            self.dict_requests.append(obj)
            self.dict_src.append(self.touch(seg))
            self.requests += 1
            return
        if not isinstance(obj, dict):
            return
        if rtype in EVENT_TYPES:
            self.events.setdefault(rtype, []).append((self.touch(seg), obj, start, end))
        elif rtype == HEADER:
            seg.service = _str(obj.get("service")) or seg.service
            seg.version = _str(obj.get("version")) or seg.version
            seg.host = _str(obj.get("host")) or seg.host
            pid = as_int(obj.get("pid"))
            seg.pid = pid if pid is not None and 0 <= pid < 2**31 else seg.pid
        elif rtype == LOCATION:
            lid = _id(obj.get("id"))
            if lid is not None:
                app = obj.get("app")
                self.locations[lid] = (
                    _str(obj.get("file")),
                    _int32(obj.get("line")),
                    _str(obj.get("func", obj.get("function"))),
                    app if isinstance(app, bool) else None,
                )
        elif rtype == STACK:
            sid = _id(obj.get("id"))
            frames = obj.get("frames")
            if sid is not None and isinstance(frames, list):
                self.stacks[sid] = [f for f in (_id(x) for x in frames) if f is not None]
        elif rtype == FINGERPRINT:
            fid = _id(obj.get("id"))
            if fid is not None:
                kind, text = _str(obj.get("kind")), _str(obj.get("text"))
                if kind == "db" and text is not None and internal_sql.is_internal(text):
                    kind = internal_sql.INTERNAL_KIND
                    _remember_internal(fid)
                self.fingerprints[fid] = (kind, _str(obj.get("op")), text)
        elif rtype == STATS:
            self._add_stats(seg, obj)

    def _add_stats(self, seg: SegmentState, obj: dict[str, Any]) -> None:
        inner = obj.get("counters")
        counters: dict[str, Any] = inner if isinstance(inner, dict) else obj
        ts = None
        for k in ("ts", "updated_ns", "ts_ns"):
            ts = as_int(obj.get(k))
            if ts is not None:
                break
        pid = as_int(obj.get("pid"))
        host = _str(obj.get("host")) or seg.host
        for name, v in counters.items():
            if name in ("ts", "updated_ns", "ts_ns", "pid", "started_ns"):
                continue
            value = as_int(v)
            if value is not None:
                self.stats.append(
                    (ts, seg.service, host, pid if pid is not None else seg.pid, _text(name), value)
                )


# ------------------------------------------------------------------------ value coercion


def loads(payload: bytes) -> Any:
    """``json.loads``; ValueError for anything it refuses, nesting too deep included."""
    try:
        return json.loads(payload)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _text(s: str) -> str:
    """``s`` as valid UTF-8 text: a lone surrogate (JSON's ``"\\ud800"``) becomes ``?``
    (Arrow and DuckDB refuse such a string)."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return s.encode("utf-8", "replace").decode("utf-8")
    return s


def _str(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, str):
        return _text(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    try:
        return _text(json.dumps(v, default=str, ensure_ascii=False))
    except (RecursionError, ValueError):
        return None


def as_int(v: Any) -> int | None:
    """An int64 from a JSON value (bool, int, float or numeric string), else None."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v if -_INT64_MAX - 1 <= v <= _INT64_MAX else None
    if isinstance(v, float) and v == v and abs(v) < 9.2e18:
        return int(v)
    if isinstance(v, str):
        try:
            return as_int(int(v))
        except ValueError:
            return None
    return None


def _int32(v: Any) -> int | None:
    i = as_int(v)
    return i if i is not None and -(2**31) <= i < 2**31 else None


def _id(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v & ID_MASK if v >= 0 else (v if v >= -_INT64_MAX - 1 else None)
    if isinstance(v, str):
        try:
            return _id(int(v, 16) if not v.isdigit() else int(v))
        except ValueError:
            return None
    return None


def _bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return bool(v)
    return None


_COERCE = {pa.int64(): as_int, pa.string(): _str, pa.bool_(): _bool}


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
            cf.name: (_id if cf.name in _ID_FIELDS else _COERCE[cf.type])(c.get(cf.name))
            for cf in _CALL_WIRE
        }
        for c in (calls if isinstance(calls, list) else ())
        if isinstance(c, dict)
    ]
    return out


# ------------------------------------------------------------------------------ converting


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


def build_tables(batch: Batch, now_ns: int) -> Tables:
    """Arrow tables for a batch. Undecodable request payloads are added to ``batch.damage``.

    Should a part of the batch (its requests, its evidence, its captures, its dictionaries
    and counters) fail to convert all the same, on values the checks above do not foresee,
    that part is damage of the segments that sent it: its rows are lost, the rest commits and
    ingest goes on, where an error would fail every later run at the same records."""
    out = Tables()
    try:
        wire, src, attr_objs = _parse_requests(batch)
        wire, src, attr_objs = _once_per_trace(wire, src, attr_objs)
        if wire.num_rows:
            _event_tables(out, wire, src, attr_objs, batch, now_ns)
    except MemoryError:
        raise
    except Exception as e:
        out.days.clear()
        out.requests = out.calls = 0
        sent = {m[0] for m in batch.raw_meta} | {c[0] for c in batch.columns}
        _unconverted(batch, sent | set(batch.dict_src), "requests", e)
    events = {t: evs for t, evs in batch.events.items() if t != CAPTURE}
    if events:
        from perfsleuth.store import evidence  # it builds on this module's coercions

        try:
            for d, parts in evidence.tables(batch, now_ns).items():
                out.days.setdefault(d, {}).update(parts)
        except MemoryError:
            raise
        except Exception as e:
            _unconverted(batch, {ev[0] for evs in events.values() for ev in evs}, "evidence", e)
    if batch.events.get(CAPTURE):
        from perfsleuth.store import captures

        try:
            out.captures = captures.table(batch, now_ns)
        except MemoryError:
            raise
        except Exception as e:
            _unconverted(batch, {ev[0] for ev in batch.events[CAPTURE]}, "captures", e)
    try:
        _dictionaries(out, batch, now_ns)
    except MemoryError:
        raise
    except Exception as e:
        out.fingerprints = out.locations = out.stacks = out.agent_stats = None
        _unconverted(batch, set(range(len(batch.segments))), "dictionary and counter records", e)
    return out


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
        kind, op, text = zip(*batch.fingerprints.values(), strict=True)
        out.fingerprints = _table(schema.FINGERPRINTS, id=ids, kind=kind, op=op, text=text)
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
            ts=pa.array([_sane_ts(t, now_ns) // 1000 for t in ts], pa.timestamp("us")),
            service=[s or "" for s in service],
            host=[h or "" for h in host],
            pid=[p if p is not None and 0 <= p < 2**31 else 0 for p in pid],
            name=name,
            value=value,
        )


def _table(t: schema.Table, **cols: Any) -> pa.Table:
    return pa.Table.from_pydict(cols, schema=t.arrow_schema())


def _sane_ts(ts: int | None, now_ns: int) -> int:
    return ts if ts is not None and 0 < ts < _TS_MAX else now_ns


def _parse_requests(batch: Batch) -> tuple[pa.Table, np.ndarray, list[tuple[int, Any]]]:
    """(requests as REQUEST_WIRE, segment index per row, [(row, decoded object)] of the rows
    that carry attributes or tags)."""
    parts: list[pa.Table] = []
    src: list[int] = []
    blobs: list[bytes | memoryview | None] = []  # binary call rows per row (None: JSON calls)
    agent_rows: list[bool] = []  # whether the blob holds agent rows (wire.batch) or CALL rows
    where: list[tuple[int, int, int] | None] = []  # (segment, start, end) of the row's record
    ext_rows: list[tuple[int, Any]] = []  # (row, object) of rows with per-call extras
    attr_objs: list[tuple[int, Any]] = []
    slow: list[tuple[int, Any, int, int]] = []  # (segment index, object, start, end)
    raw = batch.raw_requests
    meta = batch.raw_meta
    rows = 0

    def fast(lo: int, hi: int) -> bool:
        nonlocal rows
        try:
            t = pajson.read_json(
                io.BytesIO(b"\n".join(raw[lo:hi])),
                read_options=pajson.ReadOptions(
                    use_threads=True, block_size=max(1 << 24, max(map(len, raw[lo:hi])) + 2)
                ),
                parse_options=_JSON_OPTS,
            )
        except (pa.ArrowException, OverflowError):
            return False
        if t.num_rows != hi - lo:  # a payload that was not one JSON object per line
            return False
        parts.append(t.cast(REQUEST_WIRE))
        for i in range(lo, hi):
            p = raw[i]
            if b'"attrs"' in p or b'"tags"' in p:
                attr_objs.append((rows + i - lo, p))
            if b'"cx"' in p:
                ext_rows.append((rows + i - lo, p))
            src.append(meta[i][0])
            blobs.append(batch.raw_calls[i])
            agent_rows.append(False)
            where.append(meta[i])
        rows += hi - lo
        return True

    if raw and not fast(0, len(raw)):
        for lo in range(0, len(raw), _FAST_CHUNK):
            hi = min(lo + _FAST_CHUNK, len(raw))
            if fast(lo, hi):
                continue
            for i in range(lo, hi):
                seg, start, end = meta[i]
                try:
                    blob = batch.raw_calls[i]
                    obj = loads(raw[i]) if blob is None else wcalls.decode_parts(raw[i], blob)
                    slow.append((seg, obj, start, end))
                except (ValueError, RecursionError):
                    batch.add_damage(batch.segments[seg], start, end - start, "undecodable payload")
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
        agent_rows.extend([True] * n)
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
        agent_rows.append(False)
        where.append(None)
    if objs:
        parts.append(pa.Table.from_pylist(objs, schema=REQUEST_WIRE))
    wire = pa.concat_tables(parts) if parts else REQUEST_WIRE.empty_table()
    if any(b is not None for b in blobs):
        rows_ok = _check_agent_rows(wire, blobs, agent_rows)
        for bad in np.flatnonzero(~rows_ok).tolist():
            rec = where[bad]
            if rec is not None:
                seg, start, end = rec
                batch.add_damage(batch.segments[seg], start, end - start, "call rows without sites")
            blobs[bad] = b""
        wire = _with_binary_calls(wire, blobs, agent_rows, ext_rows)
    # Raw payloads of requests with attributes are decoded only now, for those only.
    decoded = []
    for row, p in attr_objs:
        if isinstance(p, bytes):
            try:
                p = loads(p)
            except ValueError:
                continue
        decoded.append((row, p))
    return wire, np.asarray(src, dtype=np.int64), decoded


def _once_per_trace(
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
    keep = _np(pc.equal(ids, ""), True).astype(bool)
    keep[_np(firsts["row_min"], 0).astype(np.int64)] = True
    new_row = np.cumsum(keep) - 1
    attrs = [(int(new_row[row]), obj) for row, obj in attr_objs if keep[row]]
    return wire.filter(pa.array(keep)), src[keep], attrs


def drop_known_traces(tables: Tables, known: pa.Array) -> None:
    """Leave out of ``tables`` the requests (with their calls and attributes) whose trace id
    the store holds already: ingest adds each trace once."""
    if not len(known):
        return
    for parts in tables.days.values():
        for name in ("requests", "calls", "attributes"):
            t = parts.get(name)
            if t is None or not t.num_rows:
                continue
            new = pc.invert(pc.is_in(t["trace_id"], value_set=known))
            kept = t.filter(new)
            if name == "requests":
                tables.requests -= t.num_rows - kept.num_rows
            elif name == "calls":
                tables.calls -= t.num_rows - kept.num_rows
            parts[name] = kept


def trace_ids(tables: Tables) -> pa.Array:
    """The trace ids of the requests in ``tables`` (those without one left out)."""
    ids = [p["requests"]["trace_id"] for p in tables.days.values() if "requests" in p]
    if not ids:
        return pa.array([], pa.string())
    all_ids = pa.chunked_array(ids, pa.string()).combine_chunks()
    return all_ids.filter(pc.not_equal(all_ids, ""))


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


_CALL_DTYPE = np.dtype([(name, "<" + code) for name, code in wcalls.FIELDS])
assert _CALL_DTYPE.itemsize == wcalls.CALL.size
_AGENT_DTYPE = np.dtype([(name, "<i8") for name in wbatch.AGENT_FIELDS])
assert _AGENT_DTYPE.itemsize == wbatch.AGENT_ROW.size


def _check_agent_rows(
    wire: pa.Table, blobs: list[bytes | memoryview | None], agent: list[bool]
) -> np.ndarray:
    """Per row: False for a batched request with call rows but no ``t0``/``sites`` (or sites
    that are not five ids each): its rows cannot be read."""
    n = wire.num_rows
    ok = np.ones(n, dtype=bool)
    has = np.fromiter((a and bool(b) for a, b in zip(agent, blobs, strict=True)), bool, count=n)
    if not has.any():
        return ok
    sites = wire["sites"].combine_chunks()
    inner_ok = pc.equal(pc.list_value_length(pc.list_flatten(sites)), len(wbatch.SITE_FIELDS))
    parents = _np(pc.list_parent_indices(sites), 0).astype(np.int64)
    bad_site = np.zeros(n, dtype=bool)
    bad_site[parents[~_np(inner_ok, False).astype(bool)]] = True
    missing = _np(pc.is_null(wire["t0"]), True) | _np(pc.is_null(sites), True)
    missing |= _np(pc.is_null(wire["dur"]), True)
    ok[has & (missing | bad_site)] = False
    return ok


def _agent_calls(
    wire: pa.Table, blobs: list[bytes | memoryview], rows_of: np.ndarray
) -> np.ndarray:
    """The agent rows (wire.batch) of the requests at wire rows ``rows_of`` (``blobs``, in that
    order) as ``CALL`` rows: offsets from t0, durations (unfinished ones up to the request's
    end), and the fingerprint, stack, site, kind and system of their slot's site."""
    size = wbatch.AGENT_ROW.size
    counts = np.fromiter((len(b) // size for b in blobs), np.int64, len(blobs))
    agent = np.frombuffer(b"".join(blobs), dtype=_AGENT_DTYPE)
    parent = np.repeat(np.arange(len(blobs), dtype=np.int64), counts)
    take = pa.array(rows_of)
    t0 = _np(pc.take(wire["t0"], take), 0).astype(np.int64)[parent]
    req_end = t0 + _np(pc.take(wire["dur"], take), 0).astype(np.int64)[parent]
    sites = pc.take(wire["sites"], take).combine_chunks()
    n_sites = _np(pc.list_value_length(sites), 0).astype(np.int64)
    table = _np(pc.list_flatten(pc.list_flatten(sites)), wcalls.NULL).astype(np.int64)
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


def _with_binary_calls(
    wire: pa.Table,
    blobs: list[bytes | memoryview | None],
    agent_rows: list[bool],
    ext_rows: list[tuple[int, Any]],
) -> pa.Table:
    """``wire`` with its ``calls`` column built from the binary rows of REQUEST_BIN and
    REQUESTS (wire.batch) records, in a few vectorised steps per batch, keeping the JSON calls
    of the other rows in place."""
    n = wire.num_rows
    has = np.fromiter((b is not None for b in blobs), dtype=bool, count=n)
    is_agent = np.fromiter(agent_rows, dtype=bool, count=n)
    size = np.where(is_agent, wbatch.AGENT_ROW.size, wcalls.CALL.size)
    bin_counts = np.fromiter((len(b) if b is not None else 0 for b in blobs), np.int64, n) // size
    arr = np.empty(int(bin_counts.sum()), dtype=_CALL_DTYPE)
    row_is_agent = np.repeat(is_agent, bin_counts)
    if is_agent.any():
        which = np.flatnonzero(is_agent & (bin_counts > 0))
        arr[row_is_agent] = _agent_calls(wire, [blobs[i] or b"" for i in which], which)
    if (has & ~is_agent).any():
        packed = b"".join(b for b, a in zip(blobs, agent_rows, strict=True) if b and not a)
        arr[~row_is_agent] = np.frombuffer(packed, dtype=_CALL_DTYPE)
    bin_starts = np.cumsum(bin_counts) - bin_counts
    bin_flat = _binary_struct(arr, bin_starts, ext_rows)

    json_calls = wire["calls"].combine_chunks()
    json_counts = _np(pc.list_value_length(json_calls), 0).astype(np.int64)
    json_counts[has] = 0  # a binary row's calls are its binary rows, whatever its JSON says
    json_flat = pc.list_flatten(json_calls)
    if len(json_flat):
        parents = _np(pc.list_parent_indices(json_calls), 0).astype(np.int64)
        json_flat = json_flat.filter(pa.array(~has[parents]))
    json_starts = np.cumsum(json_counts) - json_counts

    counts = np.where(has, bin_counts, json_counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    src_start = np.where(has, len(json_flat) + bin_starts, json_starts)
    total = int(offsets[-1])
    idx = np.repeat(src_start - offsets[:-1], counts) + np.arange(total, dtype=np.int64)
    both = pa.concat_arrays([json_flat.cast(_CALL_WIRE), bin_flat])
    merged = pa.ListArray.from_arrays(pa.array(offsets), both.take(pa.array(idx)))
    return wire.set_column(wire.schema.get_field_index("calls"), "calls", merged)


# cx keys that replace an integer of the call's binary row (REQUESTS records carry them
# there; "hit", a bool, is read apart)
_ROW_EXT_INTS = tuple(k for k in wcalls.ROW_EXT_KEYS if k != "hit")


def _binary_struct(
    arr: np.ndarray, row_starts: np.ndarray, ext_rows: list[tuple[int, Any]]
) -> pa.StructArray:
    """Binary call rows as the _CALL_WIRE struct (sentinels to NULL, codes to names)."""
    kinds = np.array([*wcalls.KINDS, None], dtype=object)
    systems = np.array([*wcalls.SYSTEMS, None], dtype=object)
    kind = kinds[np.minimum(arr["kind"], len(wcalls.KINDS))]
    system = systems[np.minimum(arr["system"], len(wcalls.SYSTEMS))]
    error = np.full(len(arr), None, dtype=object)
    host = np.full(len(arr), None, dtype=object)
    if not arr.flags.writeable:
        arr = arr.copy()
    for row, obj in ext_rows:  # rare: errors, HTTP hosts and statuses, cache hits, ...
        if isinstance(obj, bytes):
            try:
                obj = loads(obj)
            except ValueError:
                continue
        cx = obj.get("cx") if isinstance(obj, dict) else None
        if not isinstance(cx, dict) or row >= len(row_starts):
            continue
        base = int(row_starts[row])
        for key, x in cx.items():
            i = as_int(key)
            if i is None or not isinstance(x, dict) or not 0 <= base + i < len(arr):
                continue
            j = base + i
            error[j] = _str(x.get("error"))
            host[j] = _str(x.get("host"))
            if "kind" in x:
                kind[j] = _str(x.get("kind"))
            if "system" in x:
                system[j] = _str(x.get("system"))
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
    return pa.StructArray.from_arrays([cols[f.name] for f in _CALL_WIRE], fields=list(_CALL_WIRE))


def _ms(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """ns -> ms. Unsafe cast: an int64 above 2**53 rounds to the nearest double instead of
    raising (a crafted figure must not fail the batch)."""
    return pc.divide(pc.cast(arr, pa.float64(), safe=False), 1e6)


def _np(arr: pa.Array | pa.ChunkedArray, fill: Any) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, fill).to_numpy(zero_copy_only=False))


def _event_tables(
    out: Tables,
    wire: pa.Table,
    src: np.ndarray,
    attr_objs: list[tuple[int, Any]],
    batch: Batch,
    now_ns: int,
) -> None:
    n = wire.num_rows
    segs = batch.segments
    service = pc.take(pa.array([s.service or "unknown" for s in segs], pa.string()), src)
    host = pc.take(pa.array([s.host or None for s in segs], pa.string()), src)
    pid = pc.take(pa.array([s.pid for s in segs], pa.int32()), src)
    version = pc.take(pa.array([s.version or None for s in segs], pa.string()), src)

    ts_ns = _np(wire["ts"], 0)
    bad = (ts_ns <= 0) | (ts_ns >= _TS_MAX)
    if bad.any():
        ts_ns = np.where(bad, now_ns, ts_ns)
    ts = pa.array(ts_ns // 1000, pa.timestamp("us"))
    day = ts_ns // NS_PER_DAY
    trace_id = pc.fill_null(wire["id"], "")
    endpoint = pc.fill_null(wire["endpoint"], "<unknown>")

    calls = wire["calls"].combine_chunks()
    counts = _np(pc.list_value_length(calls), 0).astype(np.int64)
    flat = pc.list_flatten(calls)
    m = len(flat)
    parent = np.repeat(np.arange(n, dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    seq = np.arange(m, dtype=np.int64) - np.repeat(starts, counts)
    cf = dict(zip([f.name for f in _CALL_WIRE], flat.flatten(), strict=True))
    ckind = _internal_kind(pc.fill_null(cf["kind"], "unknown"), cf["fp"])
    cdur = _ms(cf["dur"])
    cdur_np = _np(cdur, 0.0)
    parent_pa = pa.array(parent)

    agg: dict[str, Any] = {}
    for k in ("db", "http", "cache"):
        mask = _np(pc.equal(ckind, k), False).astype(bool)
        p = parent[mask]
        agg[f"{k}_calls"] = pa.array(np.bincount(p, minlength=n).astype(np.int32))
        agg[f"{k}_ms"] = pa.array(np.bincount(p, weights=cdur_np[mask], minlength=n))

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
    # Repeated per call: dictionary-encoded, DuckDB stores them as plain VARCHAR.
    call = pa.table(
        {
            "ts": pc.take(ts, parent_pa),
            "trace_id": pc.take(pc.dictionary_encode(trace_id), parent_pa),
            "service": pc.take(pc.dictionary_encode(service), parent_pa),
            "endpoint": pc.take(pc.dictionary_encode(endpoint), parent_pa),
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
        key = _EPOCH + timedelta(days=int(d))
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
    if not _internal_fps or not len(kind):
        return kind
    hit = pc.and_(
        pc.equal(kind, "db"),
        pc.is_in(fp, value_set=pa.array(sorted(_internal_fps), pa.int64())),
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
                key.append(_text(str(a)))
                value.append(_str(v))
                num.append(
                    float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
                )
    return rows, {"kind": kind, "key": key, "value": value, "num": num}
