"""OTLP/HTTP trace ingest: ``POST /v1/traces`` (protobuf or JSON, maybe gzip), mapped by
:mod:`perfsleuth.store.otlp` and stored in one transaction per payload.

An :class:`fastapi.APIRouter` that :func:`perfsleuth.server.app.create_app` includes; the store
comes from the app's backend (``app.state.backend``), under its lock. Refusals follow OTLP/HTTP:
400 with a reason for a payload that is not OTLP (clients do not retry it), 413 over the size
cap, 415 for another content type or encoding, 503 when this server does not write the store.
User and tenant come from the attribute keys in ``PERFSLEUTH_OTLP_USER_KEYS`` and
``PERFSLEUTH_OTLP_TENANT_KEYS`` (comma-separated, first present wins).
"""

from __future__ import annotations

import logging
import os
import threading

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from perfsleuth.server.body import TooLarge, read_body
from perfsleuth.server.fleet import OtlpOrigins
from perfsleuth.store.otlp.batch import insert, rollback, to_batch
from perfsleuth.store.otlp.payload import MAX_BODY, OtlpError, decode, response
from perfsleuth.store.otlp.spans import Keys, Pending

log = logging.getLogger("perfsleuth.server")
router = APIRouter()
_pending_lock = threading.Lock()


def keys_from_env() -> Keys:
    def split(name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        v = os.environ.get(name, "")
        got = tuple(k.strip() for k in v.split(",") if k.strip())
        return got or default

    d = Keys()
    return Keys(
        user=split("PERFSLEUTH_OTLP_USER_KEYS", d.user),
        tenant=split("PERFSLEUTH_OTLP_TENANT_KEYS", d.tenant),
    )


def _refuse(status: int, reason: str) -> JSONResponse:
    # The OTLP clients log the body of a refusal: the reason, in the API's error shape.
    return JSONResponse({"error": reason, "status": status}, status)


@router.post("/v1/traces", summary="OTLP/HTTP trace ingest (protobuf or JSON, gzip)")
async def traces(request: Request) -> Response:
    backend = request.app.state.backend
    state = request.app.state
    try:
        body = await read_body(request, MAX_BODY, "the payload")
    except TooLarge as e:
        return _refuse(413, str(e))
    ctype = request.headers.get("content-type")
    encoding = request.headers.get("content-encoding")
    token = str(getattr(request.state, "token_name", "") or "")

    def work() -> Response:
        msg = decode(body, ctype, encoding)
        keys = getattr(state, "otlp_keys", None) or keys_from_env()
        with _pending_lock:
            pending = getattr(state, "otlp_pending", None)
            if pending is None:
                pending = state.otlp_pending = Pending()
            mapped = to_batch(msg, keys, pending)
        if mapped.tables is not None:
            try:
                with backend.use() as store:
                    if not hasattr(store, "insert_tables") or getattr(store, "read_only", False):
                        raise OtlpError(
                            503, "this server does not write its store (started without ingest)"
                        )
                    with _pending_lock:
                        insert(store, mapped, pending)
                    origins = getattr(state, "otlp_origins", None)
                    if origins is None:
                        origins = state.otlp_origins = OtlpOrigins()
                    origins.record(store, mapped.tables, token)  # which token sent what
            except BaseException:  # not stored: the exporter's retry maps the payload again
                with _pending_lock:
                    rollback(mapped, pending)
                raise
        data, out_type = response(ctype)
        return Response(data, media_type=out_type)

    try:
        return await run_in_threadpool(work)
    except OtlpError as e:
        return _refuse(e.status, e.reason)
    except Exception as e:  # stored nothing; say why, keep serving
        log.exception("OTLP ingest failed")
        return _refuse(500, f"the payload could not be stored: {type(e).__name__}: {e}"[:500])
