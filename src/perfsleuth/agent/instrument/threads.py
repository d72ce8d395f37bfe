"""Thread-pool hand-offs: mark the worker thread that runs a request's sync code.

FastAPI/Starlette run sync endpoints and dependencies with ``anyio.to_thread.run_sync``;
``asyncio.to_thread`` does the same for plain asyncio code. The request is in the copied
context, so the wrapper only notes ``req.worker`` (the thread ident) while the function runs:
the sampler then samples that thread instead of the loop, where the request only awaits. It
also adds the worker thread's CPU time across the run to ``req.cpu_ns`` when the request counts
CPU that way (an ASGI request in the CPU sample starts it at 0; one outside it, and a WSGI
request, which reads its own thread's clock at its end, leave it None: no clock is read).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from perfsleuth.agent import accel, recorder
from perfsleuth.agent.instrument import handoff

_get_ident = threading.get_ident
_thread_time = time.thread_time_ns
_current_get = recorder.current_get


def _run_marked(
    req: recorder.ActiveRequest, func: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """Run ``func`` in the worker thread, noting that thread on the request meanwhile, and
    its CPU time."""
    prev, req.worker = req.worker, _get_ident()
    if req.cpu_ns is None:  # not counted this way, or not in the CPU sample: no clock read
        try:
            return func(*args, **kwargs)
        finally:
            req.worker = prev
    t0 = _thread_time()
    try:
        return func(*args, **kwargs)
    finally:
        req.worker = prev
        used = _thread_time() - t0
        if req.cpu_ns is not None:
            # read, add and store with no call in between: no other thread runs inside it
            req.cpu_ns += used


def _marking(func: Callable[..., Any], req: recorder.ActiveRequest) -> Callable[..., Any]:
    # A C partial, not a closure: cheaper to make and to call (measured: ~3 µs a request
    # less in a FastAPI sync endpoint), and no functools.wraps: nothing downstream reads the
    # wrapper's metadata (the thread pool only calls it).
    return functools.partial(_run_marked, req, func)


def _wrap_async(original: Callable[..., Any]) -> Callable[..., Any]:
    hand_off = accel.pick("HandOff", None)
    if hand_off is not None:  # the same in C (agent/_speedups.c): no Python frame per hand-off
        try:
            return hand_off(original)  # type: ignore[no-any-return]
        except Exception:
            recorder.internal_error()
    return _python_wrapper(original)


def _python_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    # A plain function handing back the original's coroutine, not a coroutine awaiting it:
    # an extra coroutine layer is resumed at every step of the hand-off (8 per request in
    # FastAPI), which cost more than the marking itself.
    @functools.wraps(original)
    def wrapper(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        req = _current_get()
        if req is not None:
            func = _marking(func, req)
        return original(func, *args, **kwargs)

    mark = getattr(inspect, "markcoroutinefunction", None)  # 3.12+: still looks async
    if mark is not None:
        wrapper = mark(wrapper)
    wrapper.__perfsleuth__ = True  # type: ignore[attr-defined]
    return wrapper


def _hand_off(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a run_sync) marking the worker (above) and stitching the caller's stack
    to the worker's (agent.instrument.handoff). Where Python has no
    ``inspect.markcoroutinefunction`` (3.11: a wrapper does not look async there either), the
    C accelerator's HandOff does both, with no Python frame per hand-off; else the Python
    stitching wrapper (marked async) goes around the marking one."""
    hand_off = accel.pick("HandOff", None)
    if hand_off is not None and getattr(inspect, "markcoroutinefunction", None) is None:
        try:
            return hand_off(original, handoff.stitched)  # type: ignore[no-any-return]
        except Exception:
            recorder.internal_error()
    return handoff.wrap(_wrap_async(original))


def patch_anyio(module: ModuleType) -> None:
    run_sync = getattr(module, "run_sync", None)
    if run_sync is not None and not getattr(run_sync, "__perfsleuth__", False):
        # handoff: the worker's stacks carry the caller's
        module.run_sync = _hand_off(run_sync)  # type: ignore[attr-defined]


def patch_asyncio_threads(module: ModuleType) -> None:
    to_thread = getattr(module, "to_thread", None)
    if to_thread is None or getattr(to_thread, "__perfsleuth__", False):
        return
    wrapped = _hand_off(to_thread)
    module.to_thread = wrapped  # type: ignore[attr-defined]
    import asyncio

    if getattr(asyncio, "to_thread", None) is to_thread:
        asyncio.to_thread = wrapped  # type: ignore[attr-defined]
