"""Captured requests: ``GET /api/traces/{trace_id}/curl`` (the request as a curl command) and
:func:`replay_of`, the capture summary the trace page shows."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, Response

from perfsleuth.server.deps import ApiError, BackendDep, resolve_trace
from perfsleuth.store.base import Store, StoreError

router = APIRouter()

CURL_INLINE_CHARS = 100_000  # longer commands (big bodies) are fetched when copied


def curl(capture: dict[str, Any], to_url: str | None = None) -> tuple[str, str | None]:
    """(curl command, why it is not an exact replay or None). A truncated body is kept in
    the command, with the reason next to it. Without ``to_url`` the command sends the request
    to $PERFSLEUTH_TARGET, never to the host the captured Host header names."""
    from perfsleuth.analysis import replay

    try:
        return replay.curl_for(capture, to_url), None
    except replay.ReplayError as e:
        if to_url and not capture.get("body_truncated"):
            raise ApiError(400, str(e)) from e
        return replay.curl_for(capture, to_url, allow_truncated=True), str(e)


def replay_of(store: Store, trace_id: str) -> dict[str, Any] | None:
    """The trace's capture as the trace page shows it (None when it was not captured); a
    command longer than CURL_INLINE_CHARS is cut, and ``complete`` is false."""
    cap = store.capture(trace_id)
    if cap is None:
        return None
    command, note = curl(cap)
    inline = len(command) <= CURL_INLINE_CHARS
    return {
        "reason": cap.get("reason"),
        "method": cap.get("method"),
        "url": cap.get("url"),
        "body_size": cap.get("body_size"),
        "body_truncated": cap.get("body_truncated"),
        "redacted": cap.get("redacted") or [],
        "note": note,
        "curl": command if inline else command[:2000] + "\n# ... (copy for the whole command)",
        "complete": inline,
    }


@router.get(
    "/api/traces/{trace_id}/curl",
    summary="The captured request as a curl command (text)",
    response_class=PlainTextResponse,
)
def trace_curl(
    be: BackendDep,
    trace_id: str,
    to: Annotated[
        str | None,
        Query(
            description="The server to send it to, e.g. http://127.0.0.1:8000 (default: "
            "$PERFSLEUTH_TARGET when the command runs)."
        ),
    ] = None,
) -> Response:
    with be.use() as store:
        try:
            cap = store.capture(resolve_trace(store, trace_id))
        except StoreError as e:
            raise ApiError(404, str(e)) from e
    if cap is None:
        raise ApiError(404, f"trace {trace_id} was not captured (no replayable request)")
    return PlainTextResponse(curl(cap, to or None)[0] + "\n")
