"""A request body read whole, up to a size cap: the ingest endpoints (spool segment chunks,
OTLP payloads) refuse a larger one with 413 before reading it when its Content-Length says
so, else as soon as the bytes streamed in pass the cap."""

from __future__ import annotations

from starlette.requests import Request


class TooLarge(Exception):
    """The body is over the cap (its message says by what); the endpoint answers 413."""


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The body of ``request``, at most ``limit`` bytes, else :class:`TooLarge` naming
    ``what`` ("the chunk", "the payload")."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise TooLarge(f"{what} is {length} bytes; at most {limit}")
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"{what} is over {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
