"""wire.inflate: the collector's and OTLP's gzip / zlib bodies, by ISA-L and by zlib alike."""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Any

import pytest

from perfsleuth.wire import inflate as inflate_mod
from perfsleuth.wire.inflate import GZIP, ZLIB, InflateError, inflate

DATA = os.urandom(3000) + b"perfsleuth " * 50_000  # 553,000 bytes: a body of several blocks


@pytest.fixture(params=["isal", "zlib"])
def engine(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once with each engine (the installed default is ISA-L)."""
    if request.param == "zlib":
        monkeypatch.setattr(inflate_mod, "_engine", zlib)
        monkeypatch.setattr(inflate_mod, "_ERRORS", (zlib.error,))
    return str(request.param)


def test_the_installed_default_is_isal() -> None:
    # pyproject installs it on this machine's kind (x86_64): the collector's faster inflate
    assert inflate_mod.ENGINE == "isal"


def test_gzip_and_zlib_streams_inflate_whole(engine: str) -> None:
    assert inflate(gzip.compress(DATA, 1), GZIP, len(DATA)) == DATA
    assert inflate(zlib.compress(DATA), ZLIB, len(DATA)) == DATA
    # what follows the stream is left out, as zlib's decompressobj leaves it
    assert inflate(gzip.compress(b"abc") + b"junk", GZIP, 100) == b"abc"


@pytest.mark.parametrize("cut", [1, 9, 5_000])
def test_a_stream_cut_short_is_an_error_not_a_shorter_body(engine: str, cut: int) -> None:
    body = gzip.compress(DATA, 1)[:-cut]
    with pytest.raises(InflateError) as e:
        inflate(body, GZIP, len(DATA))
    assert not e.value.too_large


@pytest.mark.parametrize(
    "body",
    [b"", b"not gzip at all", gzip.compress(DATA)[:10] + b"\xff" * 200, zlib.compress(DATA)],
)
def test_what_is_not_a_gzip_stream_is_refused(engine: str, body: bytes) -> None:
    with pytest.raises(InflateError) as e:
        inflate(body, GZIP, len(DATA))
    assert not e.value.too_large


def test_the_cap_holds_at_one_byte_over(engine: str) -> None:
    body = gzip.compress(DATA, 1)
    assert inflate(body, GZIP, len(DATA)) == DATA
    with pytest.raises(InflateError) as e:
        inflate(body, GZIP, len(DATA) - 1)
    assert e.value.too_large
    # a bomb: 64 MiB of zeros from a body of 64 KB, refused at the cap
    bomb = gzip.compress(bytes(64 << 20), 9)
    with pytest.raises(InflateError) as e:
        inflate(bomb, GZIP, 1 << 20)
    assert e.value.too_large
