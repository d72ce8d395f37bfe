"""Spool segment byte layout: a file magic, then length-prefixed, checksummed records.

    file   := FILE_MAGIC record*
    record := REC_MAGIC(2) type(1) length(u32 LE) crc32(u32 LE) payload(length bytes)

A payload is JSON (UTF-8), or for REQUESTS records JSON followed by binary columns and call
rows (:mod:`perfsleuth.wire.batch`).

The crc covers type + payload. REC_MAGIC lets a reader resynchronise after a damaged record
instead of losing the rest of the file. A record cut short at the end of a file is either
still being written (open segment) or the tail of a crashed writer (closed segment): readers
stop before it and report where.
"""

from __future__ import annotations

import bisect
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from perfsleuth.wire import (
    CLOSED_SUFFIX,
    FORMAT_VERSION,
    OPEN_SUFFIX,
    RECORD_TYPES,
    REQUESTS,
    batch,
)

FILE_MAGIC = b"PSLSEG" + bytes([0, FORMAT_VERSION])
REC_MAGIC = b"\xa5\x5a"
_HEAD = struct.Struct("<2scII")  # magic, type, length, crc
HEAD_SIZE = _HEAD.size  # 11
MAX_RECORD = 64 * 1024 * 1024  # anything longer is a damaged length field

_make_encoder = getattr(json.encoder, "c_make_encoder", None)
if _make_encoder is not None:
    # JSON text as ``json.dumps(separators=(",", ":"), ensure_ascii=False, default=str)``
    # writes it, through a C encoder made once: ``JSONEncoder.encode`` makes a new one at
    # every call, a third of the cost of a request record's JSON. No cycle check
    # (markers=None): a cyclic value raises RecursionError instead of ValueError.
    _encode = _make_encoder(
        None, str, json.encoder.encode_basestring, None, ":", ",", False, False, True
    )

    def _dumps(obj: Any) -> str:
        return "".join(_encode(obj, 0))

else:  # an interpreter without the _json accelerator
    _dumps = json.JSONEncoder(  # type: ignore[assignment]
        separators=(",", ":"), ensure_ascii=False, default=str
    ).encode


def encode_record(rtype: bytes, obj: Any) -> bytes:
    """One record as bytes. ``default=str`` keeps odd attribute values from failing the write."""
    return encode_payload(rtype, _dumps(obj).encode("utf-8"))


def encode_json(obj: Any) -> bytes:
    return _dumps(obj).encode("utf-8")


CRC_PIECE = 5 * 1024  # zlib.crc32 lets the interpreter lock go for anything longer


def crc32(data: bytes | memoryview, crc: int = 0) -> int:
    """zlib.crc32 in pieces that keep the interpreter lock: the agent's writer thread, once it
    lets the lock go, gets it back only tens of milliseconds later on a busy app
    (agent/_speedups.c, "agent threads and the GIL")."""
    if len(data) <= CRC_PIECE:
        return zlib.crc32(data, crc)
    view = memoryview(data)
    for k in range(0, len(view), CRC_PIECE):
        crc = zlib.crc32(view[k : k + CRC_PIECE], crc)
    return crc


def encode_payload(rtype: bytes, payload: bytes) -> bytes:
    """One record from an already encoded payload."""
    crc = crc32(payload, zlib.crc32(rtype))
    return _HEAD.pack(REC_MAGIC, rtype, len(payload), crc) + payload


def encode_payload_parts(rtype: bytes, parts: tuple[bytes, ...]) -> bytes:
    """:func:`encode_payload` of ``b"".join(parts)``, the parts copied once, into the record."""
    crc = zlib.crc32(rtype)
    for part in parts:
        crc = crc32(part, crc)
    return b"".join((_HEAD.pack(REC_MAGIC, rtype, sum(map(len, parts)), crc), *parts))


class SegmentName(NamedTuple):
    """A spool file's name read: ``<host>-<pid>-<started_ns>-<seq>`` (the *base*) followed by
    OPEN_SUFFIX while its writer appends, CLOSED_SUFFIX once complete. ``host`` to ``seq`` are
    None when the base does not follow that pattern (a file named by someone else, or a
    collector's ``<agent>~<base>``-style name whose host part holds more than a host)."""

    base: str
    closed: bool
    host: str | None
    pid: int | None
    started_ns: int | None
    seq: int | None


def segment_base(host: str, pid: int, started_ns: int, seq: int) -> str:
    """The base name a writer gives its segment (``host`` has no "-": see parse_segment_name)."""
    return f"{host}-{pid}-{started_ns}-{seq:06d}"


def parse_segment_name(name: str) -> SegmentName | None:
    """The parts of a spool file name; None when it is no segment (neither suffix).

    The base splits at its last three "-": the writer's host (anything non-empty: the agent
    replaces "-" in it), then its pid, start time (ns) and sequence number, each ASCII digits
    (``str.isdigit`` alone also takes "²", which ``int`` refuses)."""
    if name.endswith(CLOSED_SUFFIX):
        base, closed = name[: -len(CLOSED_SUFFIX)], True
    elif name.endswith(OPEN_SUFFIX):
        base, closed = name[: -len(OPEN_SUFFIX)], False
    else:
        return None
    parts = base.rsplit("-", 3)
    if len(parts) == 4 and parts[0] and all(p.isascii() and p.isdigit() for p in parts[1:]):
        return SegmentName(base, closed, parts[0], int(parts[1]), int(parts[2]), int(parts[3]))
    return SegmentName(base, closed, None, None, None, None)


@dataclass
class Damage:
    """A byte range of a segment that could not be read as records."""

    offset: int
    length: int
    reason: str
    segment: str = ""  # the segment's file name, where the reader knows it (the store's reports)


@dataclass
class ReadResult:
    records: list[tuple[bytes, Any]] = field(default_factory=list)
    end: int = 0  # offset just after the last complete record (where to resume)
    damaged: list[Damage] = field(default_factory=list)
    incomplete_tail: int = 0  # bytes after `end` that do not yet form a whole record
    bad_magic: bool = False  # the file does not start with FILE_MAGIC


def read_segment(data: bytes, start: int = 0) -> ReadResult:
    """Decode records from ``data[start:]``.

    ``start`` is 0 for a new file (the magic is checked) or a previously returned ``end``.
    """
    res = ReadResult(end=start)
    pos = start
    if start == 0:
        if len(data) < len(FILE_MAGIC):
            res.incomplete_tail = len(data)
            return res
        if data[: len(FILE_MAGIC)] != FILE_MAGIC:
            res.bad_magic = True
            nxt = data.find(REC_MAGIC)
            if nxt < 0:
                res.damaged.append(Damage(0, len(data), "not a perfsleuth segment"))
                res.end = len(data)
                return res
            res.damaged.append(Damage(0, nxt, "bad file magic"))
            pos = nxt
        else:
            pos = len(FILE_MAGIC)
        res.end = pos
    n = len(data)
    resync: _Resync | None = None  # made at the first damage
    while pos < n:
        if n - pos < HEAD_SIZE:
            break
        magic, rtype, length, crc = _HEAD.unpack_from(data, pos)
        reason = ""
        if magic != REC_MAGIC:
            reason = "bad record marker"
        elif rtype not in RECORD_TYPES:
            reason = f"unknown record type {rtype!r}"
        elif length > MAX_RECORD:
            reason = "impossible record length"
        if not reason:
            end = pos + HEAD_SIZE + length
            if end > n:
                break  # incomplete: maybe still being written
            payload = data[pos + HEAD_SIZE : end]
            if zlib.crc32(payload, zlib.crc32(rtype)) != crc:
                reason = "checksum mismatch"
            else:
                try:
                    obj = decode_payload(rtype, payload)
                except (ValueError, RecursionError, TypeError, OverflowError, struct.error):
                    reason = "undecodable payload"
                else:
                    res.records.append((rtype, obj))
                    pos = end
                    res.end = pos
                    continue
        # Damaged: skip to the next record marker whose record checks out.
        if resync is None:
            resync = _Resync(data, pos + 1)
        nxt = resync.next(pos + 1)
        res.damaged.append(Damage(pos, (nxt if nxt >= 0 else n) - pos, reason))
        if nxt < 0:
            pos = n
            res.end = n
            break
        pos = nxt
        res.end = pos
    res.incomplete_tail = n - res.end
    return res


def decode_payload(rtype: bytes, payload: bytes) -> Any:
    """The object a record carries (ValueError when it cannot be decoded)."""
    if rtype == REQUESTS:
        return batch.decode(payload)  # a list of requests
    try:
        return json.loads(payload)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


class _Resync:
    """The offsets of the checksum-valid records of ``data[start:]``, found in time linear in
    its size, for resynchronising after damage.

    Any REC_MAGIC may start a record, so every one is a candidate; checking each candidate's
    crc over its payload is quadratic when candidates overlap (a crafted run of headers, each
    claiming the rest of the file). Instead the crc of the data is computed once, at every
    candidate's payload start and end (one pass), and each candidate's crc follows from the
    two in O(log length): for a payload X of L bytes, ``crc32(X, a) ^ crc32(X, b)`` is the
    register ``a ^ b`` advanced over L zero bytes (CRC is linear), see :func:`_zeros`.
    """

    def __init__(self, data: bytes, start: int) -> None:
        n = len(data)
        found: list[tuple[int, int, int, int, bytes]] = []  # (pos, payload start, end, crc, type)
        pos = data.find(REC_MAGIC, start)
        while 0 <= pos <= n - HEAD_SIZE:
            _, rtype, length, crc = _HEAD.unpack_from(data, pos)
            end = pos + HEAD_SIZE + length
            if rtype in RECORD_TYPES and length <= MAX_RECORD and end <= n:
                found.append((pos, pos + HEAD_SIZE, end, crc, rtype))
            pos = data.find(REC_MAGIC, pos + 1)
        view = memoryview(data)
        at: dict[int, int] = {}  # offset -> crc32(data[start:offset])
        value, prev = 0, start
        for p in sorted({q for c in found for q in (c[1], c[2])}):
            value = zlib.crc32(view[prev:p], value)
            at[p] = value
            prev = p
        self.valid = [
            pos
            for pos, lo, hi, crc, rtype in found
            if at[hi] ^ _zeros(zlib.crc32(rtype) ^ at[lo], hi - lo) == crc
        ]

    def next(self, pos: int) -> int:
        """The first valid record at or after ``pos``, or -1."""
        i = bisect.bisect_left(self.valid, pos)
        return self.valid[i] if i < len(self.valid) else -1


# _ZERO_TABLES[p][d]: byte tables of "advance over d * 16**p zero bytes" (d = 1..15)
_ZERO_TABLES: list[list[list[list[int]]]] = []


def _zeros(v: int, length: int) -> int:
    """The crc register difference ``v`` advanced over ``length`` zero bytes."""
    if not _ZERO_TABLES:
        _make_zero_tables()
    p = 0
    while length:
        d = length & 15
        if d:
            v = _apply(_ZERO_TABLES[p][d], v)
        length >>= 4
        p += 1
    return v


def _apply(tables: list[list[int]], v: int) -> int:
    t0, t1, t2, t3 = tables
    return t0[v & 255] ^ t1[(v >> 8) & 255] ^ t2[(v >> 16) & 255] ^ t3[v >> 24]


def _byte_tables(cols: list[int]) -> list[list[int]]:
    """A linear map of 32-bit values given by its columns, as four byte-indexed tables."""
    out = []
    for i in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b
            t[b] = t[b ^ low] ^ cols[8 * i + low.bit_length() - 1]
        out.append(t)
    return out


def _make_zero_tables() -> None:
    base = zlib.crc32(b"\0", 0)
    cols = [zlib.crc32(b"\0", 1 << j) ^ base for j in range(32)]  # one zero byte
    for _ in range((MAX_RECORD.bit_length() + 3) // 4):
        per_digit: list[list[list[int]]] = [[]]
        power = cols
        for _ in range(15):
            per_digit.append(_byte_tables(power))
            power = [_apply(per_digit[1], c) for c in power]  # one more 16**p zero bytes
        _ZERO_TABLES.append(per_digit)
        cols = power  # 16 * 16**p


def iter_records(data: bytes) -> Iterator[tuple[bytes, Any]]:
    """Convenience for tests and tools: the readable records of a whole segment."""
    yield from read_segment(data).records
