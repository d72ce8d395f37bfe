"""OTLP/HTTP trace ingest: ``POST /v1/traces`` (protobuf or JSON, maybe gzip), decoded here and
queued on the server's disk; :mod:`perfsleuth.server.otlp_queue` maps and stores the queue, many
payloads to a transaction.

An :class:`fastapi.APIRouter` that :func:`perfsleuth.server.app.create_app` includes; the queue
is the app's backend's (``app.state.backend.otlp``). Refusals follow OTLP/HTTP: 400 with a
reason for a payload that is not OTLP (clients do not retry it), 413 over the size cap, 415 for
another content type or encoding, 503 for spans a server that does not write its store cannot
keep (an empty payload: 200), and 503 with ``Retry-After`` when the disk holding the queue is
full or too many payloads wait (exporters send a 503 again, a 500 they drop).
User and tenant come from the attribute keys in ``PERFSLEUTH_OTLP_USER_KEYS`` and
``PERFSLEUTH_OTLP_TENANT_KEYS`` (comma-separated, first present wins).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from perfsleuth.server.body import TooLarge, read_body
from perfsleuth.server.otlp_queue import RETRY_AFTER_S, QueueFull, keys_from_env
from perfsleuth.store import gc_pause
from perfsleuth.store.base import StoreFull
from perfsleuth.store.otlp.batch import read_spans
from perfsleuth.store.otlp.payload import MAX_BODY, OtlpError, decode, response

log = logging.getLogger("perfsleuth.server")
router = APIRouter()


def _has_spans(body: bytes, ctype: str | None, encoding: str | None) -> bool:
    """Whether a payload holds spans (OtlpError when it is not OTLP): a server that does not
    write answers an empty payload as stored, as there is nothing to keep."""
    try:
        return bool(read_spans(decode(body, ctype, encoding), keys_from_env()))
    finally:
        gc_pause.thaw()  # its spans are not kept


def _refuse(status: int, reason: str, retry_after: int | None = None) -> JSONResponse:
    # The OTLP clients log the body of a refusal: the reason, in the API's error shape.
    refusal = JSONResponse({"error": reason, "status": status}, status)
    if retry_after is not None:
        refusal.headers["Retry-After"] = str(retry_after)
    return refusal


@router.post("/v1/traces", summary="OTLP/HTTP trace ingest (protobuf or JSON, gzip)")
async def traces(request: Request) -> Response:
    try:
        body = await read_body(request, MAX_BODY, "the payload")
    except TooLarge as e:
        return _refuse(413, str(e))
    ctype = request.headers.get("content-type")
    encoding = request.headers.get("content-encoding")
    token = str(getattr(request.state, "token_name", "") or "")

    queue = request.app.state.backend.otlp

    def work() -> Response:
        if queue is not None:
            queue.accept(body, ctype, encoding, token)
        elif _has_spans(body, ctype, encoding):  # (a bad payload is refused 400 first)
            raise OtlpError(503, "this server does not write its store (started without ingest)")
        data, out_type = response(ctype)
        return Response(data, media_type=out_type)

    try:
        return await run_in_threadpool(work)
    except OtlpError as e:
        return _refuse(e.status, e.reason)
    except StoreFull as e:  # kept nothing: a 503 the exporters send again (a 500 they drop)
        log.warning("OTLP payload refused: %s", e)
        reason = f"the disk holding the store is full: not stored, send it again ({e})"
        return _refuse(503, reason, RETRY_AFTER_S)
    except QueueFull as e:
        log.warning("OTLP payload refused: %s", e)
        return _refuse(503, str(e), RETRY_AFTER_S)
    except Exception as e:  # kept nothing; say why, keep serving
        log.exception("OTLP ingest failed")
        return _refuse(500, f"the payload could not be kept: {type(e).__name__}: {e}"[:500])
