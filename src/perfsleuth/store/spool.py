"""The spool as the store sees it: listing segments, reading one from an offset, retiring it.

Reading. Intact records are framed here without being decoded (magic, length, crc: the
layout of :mod:`perfsleuth.wire.segment`), so request payloads can be converted in bulk. At
the first anything-but-perfect byte the rest of the segment is handed to
:func:`perfsleuth.wire.segment.read_segment`, which owns damage detection and resync.

Nothing here depends on the engine the rows go to.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from perfsleuth.wire import CLOSED_SUFFIX, OPEN_SUFFIX, RECORD_TYPES
from perfsleuth.wire.segment import (
    FILE_MAGIC,
    HEAD_SIZE,
    MAX_RECORD,
    REC_MAGIC,
    Damage,
    parse_segment_name,
    read_segment,
)

_HEAD = struct.Struct("<2scII")  # the record head of perfsleuth.wire.segment

try:  # a declared dependency; the store still reads without it (json alone)
    import msgspec

    _fast_loads: Any = msgspec.json.Decoder().decode
except ImportError:  # pragma: no cover
    _fast_loads = None


def loads_json(payload: bytes) -> Any:
    """What ``json.loads(payload)`` returns, parsed by msgspec's decoder where it can (a
    REQUESTS record's JSON head, ~45 KB of lists and big integers per 64 requests: 2.2-2.6x
    faster); whatever msgspec refuses goes to ``json.loads``, which decides (NaN, Infinity,
    1e400, lone surrogates, a BOM, UTF-16: msgspec raises on each). Where msgspec accepts,
    its result is json's (integers of any size stay ints; orjson turns those past 64 bits
    into floats, so it was not taken). Raises what ``json.loads`` raises."""
    if _fast_loads is not None:
        try:
            return _fast_loads(payload)
        except (ValueError, RecursionError):
            pass
    return json.loads(payload)


def local_host() -> str:
    """This machine's name as the agent spells it in segment file names."""
    return socket.gethostname().replace("-", "_")[:64] or "host"


@dataclass
class SpoolFile:
    base: str  # name without suffix: the key of the store's ingest offsets
    name: str
    path: str
    closed: bool  # .seg
    size: int
    mtime: float
    host: str | None  # writer, from "<host>-<pid>-<started_ns>-<seq>"
    pid: int | None


def list_spool(spool_dir: str) -> list[SpoolFile]:
    """Segments (``*.seg``, ``*.open``) in the spool, oldest name first (names start with
    host, pid and start time)."""
    out = []
    try:
        entries = list(os.scandir(spool_dir))
    except (FileNotFoundError, NotADirectoryError):  # no spool yet, or no agent could make one
        return []
    for e in entries:
        parsed = parse_segment_name(e.name)
        if parsed is None:
            continue
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        out.append(
            SpoolFile(
                parsed.base,
                e.name,
                e.path,
                parsed.closed,
                st.st_size,
                st.st_mtime,
                parsed.host,
                parsed.pid,
            )
        )
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
    res.damaged = rest.damaged
    res.incomplete_tail = rest.incomplete_tail
    return res


def read_file(spool_dir: str, f: SpoolFile, start: int) -> tuple[int, SegmentRead] | None:
    """(size, records from ``start``) of a segment, following an .open -> .seg rename; None
    when it vanished since the listing."""
    paths = [f.path]
    if not f.closed:
        paths.append(os.path.join(spool_dir, f.base + CLOSED_SUFFIX))
    for p in paths:
        try:
            fh = open(p, "rb")  # noqa: SIM115 - mapped below, closed in finally
        except FileNotFoundError:
            continue
        try:
            if os.fstat(fh.fileno()).st_size == 0:
                return 0, read_from(b"", start)
            # Maps the file as it is now (an open segment may have grown since listing).
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return len(mm), read_from(mm, start)
        finally:
            fh.close()
    return None


def retire(spool_dir: str, base: str, *, damaged: bool) -> tuple[int, list[str]]:
    """Remove a finished segment from the spool: deleted, or moved to ``corrupt/`` when it held
    damage. Returns (files removed, names quarantined). Failure is harmless: the store's
    offsets say the segment is done."""
    corrupt_dir = os.path.join(spool_dir, "corrupt")
    done, quarantined = 0, []
    for suffix in (CLOSED_SUFFIX, OPEN_SUFFIX):
        name = base + suffix
        path = os.path.join(spool_dir, name)
        if not os.path.exists(path):
            continue
        try:
            if damaged:
                os.makedirs(corrupt_dir, exist_ok=True)
                dest = os.path.join(corrupt_dir, name)
                n = 1
                while os.path.exists(dest):
                    n += 1
                    dest = os.path.join(corrupt_dir, f"{name}.{n}")
                os.replace(path, dest)
                quarantined.append(name)
            else:
                os.remove(path)
            done += 1
        except OSError:
            pass
    return done, quarantined
