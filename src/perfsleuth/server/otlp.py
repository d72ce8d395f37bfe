"""OTLP/HTTP trace ingest: ``POST /v1/traces`` (protobuf or JSON, maybe gzip), mapped by
:mod:`perfsleuth.store.otlp` and stored in one transaction, shared by the payloads that arrive
while another commits (:class:`Commits`).

An :class:`fastapi.APIRouter` that :func:`perfsleuth.server.app.create_app` includes; the store
comes from the app's backend (``app.state.backend``), under its lock. Refusals follow OTLP/HTTP:
400 with a reason for a payload that is not OTLP (clients do not retry it), 413 over the size
cap, 415 for another content type or encoding, 503 when this server does not write the store,
and 503 with ``Retry-After`` when the disk holding it is full (exporters send a 503 again, a 500
they drop).
User and tenant come from the attribute keys in ``PERFSLEUTH_OTLP_USER_KEYS`` and
``PERFSLEUTH_OTLP_TENANT_KEYS`` (comma-separated, first present wins).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from perfsleuth.server.body import TooLarge, read_body
from perfsleuth.server.fleet import OtlpOrigins
from perfsleuth.store.base import StoreFull
from perfsleuth.store.otlp.batch import Mapped, insert_many, rollback, to_batch
from perfsleuth.store.otlp.payload import MAX_BODY, OtlpError, decode, response
from perfsleuth.store.otlp.spans import Keys, Pending

# Seconds an exporter is asked to wait before sending a payload the full disk refused again.
FULL_RETRY_AFTER_S = 30

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


@dataclass
class _Payload:
    mapped: Mapped
    token: str
    done: bool = False
    error: BaseException | None = None


class Commits:
    """Mapped payloads waiting for the store, committed together: a payload's thread queues
    it, and whichever thread holds the commit lock next commits every payload queued by then
    in one transaction (a DuckDB commit costs milliseconds whatever its size), while the
    others map theirs. Each thread answers its exporter once its payload is committed or
    refused (a group whose commit fails is committed payload by payload, so only the payload
    that fails on its own is refused: :func:`_commit`)."""

    def __init__(self) -> None:
        self._commit = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue: list[_Payload] = []

    def store(self, payload: _Payload, commit: Callable[[list[_Payload]], None]) -> None:
        """Return once ``payload`` is committed; raise what failed its commit."""
        with self._queue_lock:
            self._queue.append(payload)
        with self._commit:
            if not payload.done:
                with self._queue_lock:
                    group, self._queue = self._queue, []
                try:
                    commit(group)
                except BaseException as e:
                    for p in group:
                        p.error = e
                finally:
                    for p in group:
                        p.done = True
        failed = payload.error
        if isinstance(failed, OtlpError):  # a fresh one for each thread that raises it
            raise OtlpError(failed.status, failed.reason)
        if failed is not None:
            raise failed


def _commit(state: Any, pending: Pending, group: list[_Payload]) -> None:
    """Store a group of payloads in one transaction, record which token sent each. When that
    fails for a group of several, each payload is committed on its own and only those that
    fail alone are refused (``error`` set): one bad payload does not cost the others' spans,
    which OTLP exporters do not send again after a 500. A payload not stored has its changes
    to ``pending`` undone (its exporter's retry, if any, maps it again)."""
    stored: list[_Payload] = []
    try:
        with state.backend.use() as store:
            if not hasattr(store, "insert_tables") or getattr(store, "read_only", False):
                raise OtlpError(
                    503, "this server does not write its store (started without ingest)"
                )
            try:
                insert_many(store, [p.mapped for p in group], pending, _pending_lock, undo=False)
                stored = list(group)
            except Exception as e:
                if len(group) == 1:
                    raise
                log.warning("OTLP commit of %d payloads failed (%s): one by one", len(group), e)
                for p in group:
                    try:
                        insert_many(store, [p.mapped], pending, _pending_lock, undo=False)
                        stored.append(p)
                    except Exception as alone:
                        p.error = alone
            origins = getattr(state, "otlp_origins", None)
            if origins is None:
                origins = state.otlp_origins = OtlpOrigins()
            for p in stored:
                origins.record(store, p.mapped.tables, p.token)  # which token sent what
    finally:
        kept = {id(p) for p in stored}
        with _pending_lock:
            for p in reversed(group):
                if id(p) not in kept:
                    rollback(p.mapped, pending)


def _refuse(status: int, reason: str) -> JSONResponse:
    # The OTLP clients log the body of a refusal: the reason, in the API's error shape.
    return JSONResponse({"error": reason, "status": status}, status)


@router.post("/v1/traces", summary="OTLP/HTTP trace ingest (protobuf or JSON, gzip)")
async def traces(request: Request) -> Response:
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
            commits = getattr(state, "otlp_commits", None)
            if commits is None:
                commits = state.otlp_commits = Commits()
            mapped = to_batch(msg, keys, pending)
        if mapped.tables is not None:
            commits.store(_Payload(mapped, token), lambda group: _commit(state, pending, group))
        data, out_type = response(ctype)
        return Response(data, media_type=out_type)

    try:
        return await run_in_threadpool(work)
    except OtlpError as e:
        return _refuse(e.status, e.reason)
    except StoreFull as e:  # stored nothing: a 503 the exporters send again (a 500 they drop)
        log.warning("OTLP payload refused: %s", e)
        reason = f"the disk holding the store is full: not stored, send it again ({e})"
        refusal = _refuse(503, reason)
        refusal.headers["Retry-After"] = str(FULL_RETRY_AFTER_S)
        return refusal
    except Exception as e:  # stored nothing; say why, keep serving
        log.exception("OTLP ingest failed")
        return _refuse(500, f"the payload could not be stored: {type(e).__name__}: {e}"[:500])
