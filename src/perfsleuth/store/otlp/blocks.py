"""Event-loop blocks (spans carrying ``perfsleuth.block.ms``, from the perfsleuth-node package)
as the agent's BLOCKER records: the request whose code held the loop, and the last call it
finished before."""

from __future__ import annotations

from typing import Any

from perfsleuth.store import values
from perfsleuth.store.otlp.spans import BLOCK_DELAYED, Pending, Served, Span


def served_request(block: Span, pending: Pending) -> Served | None:
    """The stored request of a block's trace and service: the one whose span holds the block,
    else the trace's only request of that service."""
    mine = [r for r in pending.servers.get(block.trace, ()) if r.source == block.source]
    inside = [r for r in mine if r.start <= block.start <= r.end]
    if inside:
        return inside[-1]
    return mine[0] if len(mine) == 1 else None


def blocker(b: Span, req: Served | None, last_call: dict[str, Any] | None) -> dict[str, Any]:
    """A loop block as the agent's BLOCKER record (store.evidence): the request whose code
    held the loop and the last call it finished before the block (a large result parsed next).
    No stack: the span does not say which line blocked."""
    out: dict[str, Any] = {
        "ts": b.start,
        "dur": max(b.end - b.start, 0),
        "delayed": values.as_int(b.attrs.get(BLOCK_DELAYED)),
        "stacks": [],
    }
    if req is not None:
        out.update(id=req.id, endpoint=req.endpoint, method=req.method, path=req.path)
        if last_call is not None:
            out["last_call"] = last_call
    return out
