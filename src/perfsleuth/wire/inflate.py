"""Compressed bodies in transit (the segments a forwarder ships, OTLP payloads): gzip or zlib
streams inflated with a cap on what they inflate to.

ISA-L (the ``isal`` package) inflates when it is installed: 13 ms for one of the collector's
8 MB segments where zlib takes 29-30 ms (benchmarks/README.md, "Checkpoints: a server's
rounds"). Without it, zlib does the same. Not imported by the agent, which stays stdlib-only.
"""

from __future__ import annotations

import zlib
from typing import Any

_engine: Any = zlib
_ERRORS: tuple[Any, ...] = (zlib.error,)
try:
    from isal import isal_zlib

    _engine, _ERRORS = isal_zlib, (isal_zlib.error, zlib.error)
except ImportError:  # a platform without its wheel: zlib
    pass

GZIP = 16 + zlib.MAX_WBITS  # the wbits of a gzip stream
ZLIB = zlib.MAX_WBITS  # ... of a zlib stream (HTTP's "deflate")
ENGINE = "isal" if _engine is not zlib else "zlib"


class InflateError(ValueError):
    """A body that does not inflate; ``too_large``: it inflates to over the cap."""

    def __init__(self, reason: str, *, too_large: bool = False) -> None:
        super().__init__(reason)
        self.too_large = too_large


def inflate(body: bytes, wbits: int, limit: int) -> bytes:
    """The bytes of the one gzip (``GZIP``) or zlib (``ZLIB``) stream ``body`` starts with,
    at most ``limit`` of them. InflateError when the stream is invalid, ends early or
    inflates to more than ``limit`` bytes (``too_large``)."""
    d: Any = _engine.decompressobj(wbits=wbits)
    try:
        out: bytes = d.decompress(body, limit + 1)
    except _ERRORS as e:
        raise InflateError(f"not a valid stream: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise InflateError(f"it is over {limit} bytes once inflated", too_large=True)
    if not d.eof:
        raise InflateError("it ends before its stream does")
    return out
