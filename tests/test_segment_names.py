"""Spool file names: the one parser (wire.segment) the agent's forwarder and the store use."""

from __future__ import annotations

from pathlib import Path

from perfsleuth.store.spool import list_spool
from perfsleuth.wire.segment import SegmentName, parse_segment_name, segment_base


def test_a_writers_name_reads_back_as_its_parts() -> None:
    base = segment_base("web_1", 4242, 1_764_000_000_123_456_789, 7)
    assert base == "web_1-4242-1764000000123456789-000007"
    assert parse_segment_name(base + ".open") == SegmentName(
        base, False, "web_1", 4242, 1_764_000_000_123_456_789, 7
    )
    assert parse_segment_name(base + ".seg") == SegmentName(
        base, True, "web_1", 4242, 1_764_000_000_123_456_789, 7
    )


def test_only_the_two_suffixes_are_segments() -> None:
    for name in ("h-1-2-3", "h-1-2-3.seg.tmp", "forward.json", "h-1-2-3.open.1", "seg"):
        assert parse_segment_name(name) is None, name


def test_the_host_is_what_comes_before_the_last_three_dashes() -> None:
    # A collector keeps an agent's segment as "<agent>~<base>"; a host may hold a "-".
    got = parse_segment_name("agent7~my-host-12-34-56.seg")
    assert got is not None
    assert (got.host, got.pid, got.started_ns, got.seq) == ("agent7~my-host", 12, 34, 56)


def test_a_name_off_the_pattern_is_a_segment_without_a_writer() -> None:
    for base in ("upload", "h-1-2", "-1-2-3", "h-x-2-3", "h-1-2-3a", "h- 1-2-3", "h-²-2-3"):
        got = parse_segment_name(base + ".seg")
        assert got == SegmentName(base, True, None, None, None, None), base


def test_the_store_lists_a_spool_holding_a_name_with_unicode_digits(tmp_path: Path) -> None:
    # "²".isdigit() is True but int("²") raises: such a file must not stop the listing.
    (tmp_path / "h-²-2-3.seg").write_bytes(b"")
    (tmp_path / "h-10-2-3.open").write_bytes(b"")
    got = {f.name: (f.host, f.pid, f.closed) for f in list_spool(str(tmp_path))}
    assert got == {"h-²-2-3.seg": (None, None, True), "h-10-2-3.open": ("h", 10, False)}
