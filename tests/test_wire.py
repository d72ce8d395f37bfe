"""The segment format: round trips, incremental reads, torn tails and damage recovery."""

from __future__ import annotations

from perfsleuth.wire import FINGERPRINT, HEADER, LOCATION
from perfsleuth.wire.segment import (
    FILE_MAGIC,
    HEAD_SIZE,
    encode_payload,
    encode_record,
    read_segment,
)


def _segment(n: int) -> tuple[bytes, list[int]]:
    """A segment with a header and n location records; returns bytes and record end offsets."""
    data = bytearray(FILE_MAGIC + encode_record(HEADER, {"v": 1, "pid": 1}))
    ends = []
    for i in range(n):
        data += encode_record(LOCATION, {"id": i, "file": "app/views.py", "line": i})
        ends.append(len(data))
    return bytes(data), ends


def test_round_trip_keeps_every_record_in_order() -> None:
    data, _ = _segment(50)
    res = read_segment(data)
    assert [t for t, _ in res.records] == [HEADER] + [LOCATION] * 50
    assert [o["line"] for t, o in res.records if t == LOCATION] == list(range(50))
    assert res.end == len(data) and not res.damaged and res.incomplete_tail == 0


def test_incremental_read_resumes_at_end_offset_without_duplicates() -> None:
    data, ends = _segment(20)
    cut = ends[9] + 5  # the 11th record is half written
    first = read_segment(data[:cut])
    assert first.end == ends[9] and first.incomplete_tail == 5
    second = read_segment(data, first.end)
    ids = [o["id"] for t, o in first.records + second.records if t == LOCATION]
    assert ids == list(range(20))


def test_flipped_byte_loses_only_the_damaged_record() -> None:
    data, ends = _segment(30)
    buf = bytearray(data)
    buf[ends[10] + HEAD_SIZE + 3] ^= 0xFF  # inside the payload of record 11
    res = read_segment(bytes(buf))
    ids = {o["id"] for t, o in res.records if t == LOCATION}
    assert len(ids) == 29 and 11 not in ids
    assert len(res.damaged) == 1
    assert res.damaged[0].offset == ends[10] and res.damaged[0].reason == "checksum mismatch"


def test_garbage_and_bad_magic_are_reported_not_raised() -> None:
    res = read_segment(b"this is not a segment at all" * 10)
    assert res.bad_magic and res.records == [] and res.damaged
    data, _ = _segment(3)
    res = read_segment(b"XXXXXXXX" + data[len(FILE_MAGIC) :])
    assert res.bad_magic and len([1 for t, _ in res.records if t == LOCATION]) == 3


def test_odd_values_are_encoded_as_text() -> None:
    obj = {"attrs": {"when": object()}, "n": 1}
    ((rtype, back),) = read_segment(FILE_MAGIC + encode_record(FINGERPRINT, obj)).records
    assert rtype == FINGERPRINT and back["n"] == 1 and back["attrs"]["when"].startswith("<object")


def test_records_are_the_json_text_json_dumps_writes() -> None:
    # The writer encodes through a C encoder made once (wire.segment._dumps); its text must
    # stay what json.dumps writes with the same options, byte for byte.
    import json
    import math

    from perfsleuth.wire.segment import encode_json

    obj = {
        "id": "00ff",
        "endpoint": "GET /café/{id}",
        "quote": 'a "b"\n\t\\',
        "big": -(1 << 63),
        "f": 0.1,
        "inf": math.inf,
        "nested": {"l": [1, None, True, {"x": "ü"}], "t": (1, 2)},
        "odd": object(),
    }
    want = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=str)
    assert encode_json(obj) == want.encode("utf-8")


def test_the_retired_one_request_records_are_damage() -> None:
    """R and Q (one request a record, before REQUESTS) are no record type any more: a segment
    holding one loses that record only."""
    data, ends = _segment(2)
    retired = encode_payload(b"R", b'{"id": "0000000000000001", "calls": []}')
    res = read_segment(data[: ends[0]] + retired + data[ends[0] :])
    assert [o["id"] for t, o in res.records if t == LOCATION] == [0, 1]
    assert [(d.offset, d.reason) for d in res.damaged] == [(ends[0], "unknown record type b'R'")]


def test_a_record_of_payload_parts_is_the_record_of_their_join() -> None:
    from perfsleuth.wire.segment import encode_payload, encode_payload_parts

    for parts in [(b"",), (b"{}",), (b'{"n":1}', b"\0", bytes(range(256)) * 9, b"")]:
        assert encode_payload_parts(b"R", parts) == encode_payload(b"R", b"".join(parts))
