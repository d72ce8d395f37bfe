"""The collector's segment ingest: ``POST /api/ingest/segment``, what remote agents send
(:mod:`perfsleuth.agent.spool.forward`).

An agent ships the bytes of its spool segments as they are on its disk, from an offset. They
are stored under this server's spool as ``DATA/spool/<agent>~<segment>.open`` at that offset,
and the spool ingest the server already runs reads them with its exactly-once offsets: nothing
in the store differs from a local agent's data. The reply is the acknowledgement, (agent,
segment, offset held):

- bytes this server already holds are acknowledged again without being written, so a segment
  sent twice (a lost reply, a restart of either side) is stored once;
- a chunk starting past the bytes held is refused, 409 with ``held``: the agent resends from
  there;
- the chunk that ends a segment (``final=1``) renames the file to ``.seg``; a marker in
  ``DATA/incoming/done/`` remembers its size after the ingest has read and removed it.

The token's name (``--tokens`` of ``perfsleuth server``) is recorded per segment in the
store's ``segments_received`` table (segment, token, agent, host, service, pid, first
received, the segment's start from its header), and in ``DATA/incoming/received.jsonl``. A
request's origin is the segment of its host and pid started last before it (an ASOF JOIN: see
README "Fleet"): one row per request, and a reused pid names the later process only from
its first segment on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import zlib
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from perfsleuth.server.body import TooLarge, read_body
from perfsleuth.server.deps import ApiError, ok
from perfsleuth.wire import CLOSED_SUFFIX, HEADER, OPEN_SUFFIX
from perfsleuth.wire.inflate import GZIP, ZLIB, InflateError, inflate
from perfsleuth.wire.segment import FILE_MAGIC, read_segment

log = logging.getLogger("perfsleuth.server")
router = APIRouter(tags=["ingest"])

MAX_BODY = 16 << 20  # bytes of one request, as sent and after decompression
AGENT_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")
SEGMENT_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}-\d{1,10}-\d{1,20}-\d{1,10}$")
SEP = "~"
DONE_KEEP_S = 30 * 86400  # a done marker answers an agent that missed the last reply this long
_pruned_at = 0.0

# One segment's chunks are written under one lock: a fixed array keyed by a hash of the name,
# so a name's lock never changes however many segments come and go (two segments may share one).
_LOCKS = tuple(threading.Lock() for _ in range(256))
_ledger_lock = threading.Lock()


def _lock(name: str) -> threading.Lock:
    return _LOCKS[zlib.crc32(name.encode()) % len(_LOCKS)]


class Place:
    """Where one agent segment is kept on this server."""

    def __init__(self, data_dir: str, agent: str, segment: str) -> None:
        self.name = f"{agent}{SEP}{segment}"
        spool = os.path.join(data_dir, "spool")
        self.open_path = os.path.join(spool, self.name + OPEN_SUFFIX)
        self.closed_path = os.path.join(spool, self.name + CLOSED_SUFFIX)
        self.done_path = os.path.join(data_dir, "incoming", "done", self.name)

    def held(self) -> tuple[int, bool]:
        """(bytes held, whether the segment is complete)."""
        try:
            with open(self.done_path, encoding="ascii") as fh:
                return int(fh.read().strip() or 0), True
        except (OSError, ValueError):
            pass
        for path, closed in ((self.open_path, False), (self.closed_path, True)):
            try:
                return os.stat(path).st_size, closed
            except OSError:
                continue
        return 0, False

    def finish(self, size: int) -> None:
        """Mark complete (the marker first: it is what :meth:`held` trusts), then rename."""
        os.makedirs(os.path.dirname(self.done_path), exist_ok=True)
        tmp = self.done_path + ".tmp"
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(str(size))
        os.replace(tmp, self.done_path)
        if os.path.exists(self.open_path):
            os.replace(self.open_path, self.closed_path)


def prune_done(data_dir: str, now: float) -> int:
    """Remove done markers older than DONE_KEEP_S (at most once an hour); how many."""
    global _pruned_at
    if now - _pruned_at < 3600:
        return 0
    _pruned_at = now
    done = os.path.join(data_dir, "incoming", "done")
    n = 0
    try:
        for e in os.scandir(done):
            try:
                if now - e.stat().st_mtime > DONE_KEEP_S:
                    os.unlink(e.path)
                    n += 1
            except OSError:
                continue
    except OSError:
        pass
    return n


def _decode(body: bytes, encoding: str | None) -> bytes:
    enc = (encoding or "identity").strip().lower()
    if enc in ("identity", ""):
        return body
    if enc not in ("gzip", "deflate"):
        raise ApiError(415, f"Content-Encoding {enc!r}: send gzip, deflate or none")
    try:
        return inflate(body, GZIP if enc == "gzip" else ZLIB, MAX_BODY)
    except InflateError as e:
        if e.too_large:
            raise ApiError(413, f"the chunk is over {MAX_BODY} bytes once decompressed") from None
        raise ApiError(400, f"the body is not valid {enc}: {e}") from None


def _header(data: bytes) -> dict[str, Any]:
    """The segment's header record (host, pid, service), or {}."""
    try:
        for rtype, obj in read_segment(data[: 64 << 10], 0).records:
            if rtype == HEADER and isinstance(obj, dict):
                return obj
            break
    except Exception:  # a damaged header is the store's to report; nothing to record here
        pass
    return {}


def _record_origin(request: Request, place: Place, agent: str, token: str, data: bytes) -> None:
    """Remember which token sent this segment: the ledger file now, the store's table when
    its lock is free (never waiting for an ingest round)."""
    head = _header(data)
    row = {
        "segment": place.name,
        "token": token,
        "agent": agent,
        "host": str(head.get("host") or ""),
        "service": str(head.get("service") or ""),
        "pid": head.get("pid") if isinstance(head.get("pid"), int) else None,
        "received_ns": time.time_ns(),
        "started_ns": head.get("started_ns") if isinstance(head.get("started_ns"), int) else None,
    }
    be = request.app.state.backend
    with _ledger_lock:
        try:
            os.makedirs(os.path.join(be.data_dir, "incoming"), exist_ok=True)
            with open(os.path.join(be.data_dir, "incoming", "received.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
        except OSError as e:
            log.warning("could not write the received-segments ledger: %s", e)
    with be.received_lock:
        be.received.append(row)


def flush_origins(request: Request) -> None:
    """Insert the pending origin rows into ``segments_received`` if the store is free (else
    the next chunk, or the next ingest round, does)."""
    be = request.app.state.backend
    if not be.received or not be.lock.acquire(blocking=False):
        return
    try:
        be.record_received()
    finally:
        be.lock.release()


def _store(place: Place, offset: int, data: bytes, final: bool) -> tuple[int, bool, bool]:
    """Write ``data`` at ``offset`` (what is held already is skipped). Returns (held, complete,
    whether the file was started now). ApiError 409 on a gap."""
    with _lock(place.name):
        held, complete = place.held()
        if offset > held:
            raise ApiError(
                409, f"this server holds {held} bytes of the segment; send from there", held=held
            )
        if complete:
            return held, True, False
        new = data[held - offset :] if offset + len(data) > held else b""
        started = held == 0 and bool(new)
        if started and not new.startswith(FILE_MAGIC[: len(new)]):
            raise ApiError(400, "a segment must start with the spool file magic")
        if new:
            os.makedirs(os.path.dirname(place.open_path), exist_ok=True)
            with open(place.open_path, "ab") as fh:
                if fh.tell() != held:  # another writer? never write at the wrong place
                    raise ApiError(409, "the segment changed meanwhile", held=fh.tell())
                fh.write(new)
                fh.flush()
                os.fsync(fh.fileno())
            held += len(new)
        if final and held == offset + len(data):
            place.finish(held)
            complete = True
        return held, complete, started


@router.post(
    "/api/ingest/segment",
    summary="Receive spool segment bytes from a remote agent (perfsleuth server)",
)
async def segment(
    request: Request,
    agent: Annotated[str, Query(description="The agent's name (its host).")],
    segment: Annotated[str, Query(description="The segment's name, without suffix.")],
    offset: Annotated[int, Query(ge=0, description="Where the body starts in the segment.")],
    final: Annotated[int, Query(ge=0, le=1, description="1: the body ends the segment.")] = 0,
) -> Response:
    if not AGENT_RE.match(agent):
        raise ApiError(400, "agent: letters, digits, '_' and '.' only, at most 64")
    if not SEGMENT_RE.match(segment):
        raise ApiError(400, "segment: a spool segment name, <host>-<pid>-<ns>-<seq>")
    be = request.app.state.backend
    if getattr(be.store, "read_only", False) or be.ingest_every <= 0:
        raise ApiError(503, "this server does not ingest (started with --no-ingest)")
    try:
        body = await read_body(request, MAX_BODY, "the chunk")
    except TooLarge as e:
        raise ApiError(413, str(e)) from None
    token = str(getattr(request.state, "token_name", "") or "")
    place = Place(be.data_dir, agent, segment)

    def work() -> tuple[int, bool]:
        data = _decode(body, request.headers.get("content-encoding"))
        held, complete, started = _store(place, offset, data, bool(final))
        if started:
            _record_origin(request, place, agent, token, data)
        flush_origins(request)
        prune_done(be.data_dir, time.time())
        return held, complete

    try:
        held, complete = await run_in_threadpool(work)
    except ApiError:
        raise
    except OSError as e:
        log.warning("could not store a segment chunk: %s", e)
        return JSONResponse(
            {"error": f"could not store the chunk: {e}"[:300], "status": 503}, status_code=503
        )
    return ok({"agent": agent, "segment": segment, "held": held, "complete": complete})
