"""Records gathered for one ingest transaction (:class:`Batch`), with the state of the
segments they come from (:class:`SegmentState`).

Dictionary records (locations, stacks, fingerprints) are decoded here, each once per ingest
run (every segment repeats the ones it uses); request records are kept as they came, to be
converted in bulk (:mod:`perfsleuth.store.decode`); runtime-evidence records are decoded and
kept by type for :mod:`perfsleuth.store.evidence` and :mod:`perfsleuth.store.captures`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from perfsleuth.store.spool import loads_json
from perfsleuth.store.values import as_id, as_int, as_int32, as_str, loads, text
from perfsleuth.wire import (
    EVENT_TYPES,
    FINGERPRINT,
    HEADER,
    LOCATION,
    REQUESTS,
    STACK,
    STATS,
    internal_sql,
)
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire.segment import Damage


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


def internal_fingerprints() -> set[int]:
    """The ids of the internal fingerprints this process has met."""
    return _internal_fps


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
        # REQUESTS records (wire.batch): (segment index, its parts, start, end)
        self.columns: list[tuple[int, wbatch.Batch, int, int]] = []
        self.dict_requests: list[Any] = []
        self.dict_src: list[int] = []
        self.locations: dict[int, tuple[Any, ...]] = {}
        self.stacks: dict[int, list[int]] = {}
        self.fingerprints: dict[int, tuple[Any, ...]] = {}
        self.stats: list[tuple[Any, ...]] = []
        # Runtime-evidence records (wire.EVENT_TYPES) by type: (segment index, object, record
        # start, record end; -1 for records read past damage).
        self.events: dict[bytes, list[tuple[int, dict[str, Any], int, int]]] = {}
        self.damage: list[Damage] = []
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
        self.damage.append(Damage(offset, length, reason, seg.name))

    def add_raw(
        self, seg: SegmentState, rtype: bytes, payload: bytes, start: int, end: int
    ) -> None:
        if rtype == REQUESTS:
            try:
                parts = wbatch.split(payload, loads_json)
            except (ValueError, RecursionError):
                self.add_damage(seg, start, end - start, "undecodable payload")
                return
            self.columns.append((self.touch(seg), parts, start, end))
            self.requests += parts.n
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
        if rtype == REQUESTS:  # wire.batch.decode: a list of requests
            for req in obj if isinstance(obj, list) else (obj,):
                self.dict_requests.append(req)
                self.dict_src.append(self.touch(seg))
                self.requests += 1
            return
        if not isinstance(obj, dict):
            return
        if rtype in EVENT_TYPES:
            self.events.setdefault(rtype, []).append((self.touch(seg), obj, start, end))
        elif rtype == HEADER:
            seg.service = as_str(obj.get("service")) or seg.service
            seg.version = as_str(obj.get("version")) or seg.version
            seg.host = as_str(obj.get("host")) or seg.host
            pid = as_int(obj.get("pid"))
            seg.pid = pid if pid is not None and 0 <= pid < 2**31 else seg.pid
        elif rtype == LOCATION:
            lid = as_id(obj.get("id"))
            if lid is not None:
                app = obj.get("app")
                self.locations[lid] = (
                    as_str(obj.get("file")),
                    as_int32(obj.get("line")),
                    as_str(obj.get("func", obj.get("function"))),
                    app if isinstance(app, bool) else None,
                )
        elif rtype == STACK:
            sid = as_id(obj.get("id"))
            frames = obj.get("frames")
            if sid is not None and isinstance(frames, list):
                self.stacks[sid] = [f for f in (as_id(x) for x in frames) if f is not None]
        elif rtype == FINGERPRINT:
            fid = as_id(obj.get("id"))
            if fid is not None:
                kind, fp_text = as_str(obj.get("kind")), as_str(obj.get("text"))
                if kind == "db" and fp_text is not None and internal_sql.is_internal(fp_text):
                    kind = internal_sql.INTERNAL_KIND
                    _remember_internal(fid)
                self.fingerprints[fid] = (kind, as_str(obj.get("op")), fp_text)
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
        host = as_str(obj.get("host")) or seg.host
        for name, v in counters.items():
            if name in ("ts", "updated_ns", "ts_ns", "pid", "started_ns"):
                continue
            value = as_int(v)
            if value is not None:
                self.stats.append(
                    (ts, seg.service, host, pid if pid is not None else seg.pid, text(name), value)
                )
