"""Thread-pool hand-offs: a call made in a worker thread keeps the stack of the code that
handed the work over.

A statement run by a function handed to a thread pool (``anyio.to_thread.run_sync``, which
Starlette's ``run_in_threadpool`` and FastAPI use, ``asyncio.to_thread``, or the ``submit``
of a ``concurrent.futures.ThreadPoolExecutor``, where ``loop.run_in_executor`` goes) has a
worker thread's stack: it starts at the function handed over (a generic executor such as
``_run_query_sync``), and the code that awaited it (the endpoint's loop, the caller of the
executor) is on another thread. So at the hand-off, while the caller's frames are still
linked, the stack above the hand-off is captured once (:func:`perfsleuth.agent.stacks.capture`,
up to where the request entered the application); the function goes to the pool wrapped in
:func:`_run_stitched`, which, once the function returns in the worker, appends that stack to
the sites the function made in the request (their stacks stop at the worker's entry). A site's
stack then runs from the statement through the worker's frames and the hand-off to the
request's entry, so findings that read stacks (an N+1's loop, the lines where a helper's
callers part ways) see the caller's code.

Cost, per hand-off while a request is recorded (the helper's call, not its statements): the
frames above the hand-off compared with the stack last captured at the same line (captured
again only when they differ), a partial, one Python frame in the worker and a look at the
request's new sites when the function returns. A hand-off from a framework's own dispatch
(three library frames above it: FastAPI running a sync endpoint or serialising its
response) is not stitched: the endpoint's stack in the worker starts at the application's
code already. Nothing is done outside a request.

Executor work (``submit``) runs in the worker's own context: only the agent's request
variable is set to the request while the work runs, then reset, so the worker's context
variables (an initializer's per-thread connection) stay visible to it. Work started after its
request ended is not recorded, and the recorder refuses calls into an ended request.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from contextvars import Context
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any

from perfsleuth.agent import recorder, stacks

_getframe = sys._getframe
_current_get = recorder.current_get
_set_current = recorder._current.set
_reset_current = recorder._current.reset
_capture = stacks.capture
_same_from = stacks.same_from
_classify = stacks.classify
_kinds = stacks._kind
_partial = functools.partial
_MAX_FLAT = 2 * stacks.MAX_DEPTH


def _code_of(func: Any) -> CodeType | None:
    """The code object of the frame a worker opens first when it calls ``func`` (a function,
    a bound method, a partial of either, a callable object); None when it has none (a
    builtin)."""
    for _ in range(8):
        code = getattr(func, "__code__", None)
        if type(code) is CodeType:
            return code
        if type(func) is _partial:
            func = func.func
            continue
        inner = getattr(func, "__func__", None)  # a bound method
        if inner is not None:
            func = inner
            continue
        # an instance of a class with a Python __call__
        call = next((vars(k)["__call__"] for k in type(func).__mro__ if "__call__" in vars(k)), 0)
        if type(call) is not FunctionType:
            return None
        func = call
    return None


# (id(site entry), id(origin)) -> (site entry, origin, the entry with the origin appended):
# both kept in the value so that their ids cannot be reused while the key exists
# (a stitched stack is up to 2 * MAX_DEPTH items, ~2 KB: the bound keeps them a few MB, and
# they are forgotten with the recorder's site cache, whose entries they hold)
_stitched: dict[tuple[int, int], tuple[Any, Any, tuple[Any, ...]]] = {}
_MAX_STITCHED = 2_000


def _stitch(
    req: recorder.ActiveRequest, first: int, code: CodeType, origin: tuple[Any, ...]
) -> None:
    """Append ``origin`` to the stacks of the request's sites from index ``first`` on that the
    worker made: those whose stack ends at ``code`` (the function handed over; a site made
    meanwhile by the request's other tasks ends elsewhere)."""
    site_list = req.site_list
    if site_list is None:
        return
    for i in range(first, len(site_list)):
        entry = site_list[i]
        flat = entry[3]
        n = len(flat)
        if n < 2 or n >= _MAX_FLAT or flat[n - 2] is not code:
            continue
        # a new entry: the shared one (recorder._site_cache) keeps the worker's stack, which
        # stacks.same compares with the worker's frames when the next request makes the site.
        # The requests that stitch the same origin to the same shared entry share the result
        # (the writer encodes a site entry once per batch, by identity).
        key = (id(entry), id(origin))
        hit = _stitched.get(key)
        if hit is not None and hit[0] is entry and hit[1] is origin:
            site_list[i] = hit[2]
            continue
        stitched = (entry[0], entry[1], entry[2], flat + origin, entry[4])
        if len(_stitched) >= _MAX_STITCHED:
            _stitched.clear()
        _stitched[key] = (entry, origin, stitched)
        site_list[i] = stitched


def _run_stitched(
    req: recorder.ActiveRequest,
    origin: tuple[Any, ...],
    func: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run ``func`` in the worker; then stitch ``origin`` to the sites it made. (This frame is
    the agent's, so the worker's stacks stop here.)"""
    site_list = req.site_list
    first = len(site_list) if site_list is not None else 0
    try:
        return func(*args, **kwargs)
    finally:
        _stitch_new(req, first, func, origin)


def _stitch_new(
    req: recorder.ActiveRequest, first: int, func: Callable[..., Any], origin: tuple[Any, ...]
) -> None:
    """After ``func`` ran in the worker: stitch ``origin`` to the sites it made from index
    ``first`` on (called once the work returned, so it is no frame of the worker's stacks)."""
    try:
        site_list = req.site_list
        # an ended request is the writer's: its sites are left as they are
        if not req.end and site_list is not None and len(site_list) > first:
            code = _code_of(func)
            if code is not None:
                _stitch(req, first, code, origin)
    except Exception:
        recorder.internal_error()


def _run_in_request(
    req: recorder.ActiveRequest,
    origin: tuple[Any, ...] | None,
    func: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run executor work in the worker's own context with only the agent's request variable
    set to ``req`` meanwhile (reset after): the worker's other context variables (set by the
    executor's initializer or by earlier work) stay as the application left them. Then, as
    :func:`_run_stitched` (not called: one Python frame a hand-off), stitch ``origin`` to the
    sites the work made. Work that starts after the request ended runs unrecorded (the
    recorder also refuses calls into a request that has ended while the work runs)."""
    if req.end:
        return func(*args, **kwargs)
    site_list = req.site_list
    first = len(site_list) if site_list is not None else 0
    token = _set_current(req)
    try:
        return func(*args, **kwargs)
    finally:
        _reset_current(token)  # set above in this thread's context: cannot fail
        if origin is not None:
            _stitch_new(req, first, func, origin)


def _carries_context(fn: Any) -> bool:
    """Whether ``fn`` already runs in a context of its own: ``partial(context.run, ...)``, what
    asyncio.to_thread (wrapped above) hands to the executor."""
    return type(fn) is _partial and type(getattr(fn.func, "__self__", None)) is Context


def patch_futures(module: ModuleType) -> None:
    """``concurrent.futures.ThreadPoolExecutor.submit`` (``loop.run_in_executor`` submits
    there): work submitted while a request is recorded runs with the agent's request variable
    set to that request for its duration (the executor copies no context), so the request's
    calls made there are recorded, with the submitter's stack stitched on (unless the
    submission comes from a framework's dispatch, see :func:`_dispatch`). The worker's own
    context is kept: no other variable changes. Process pools are left alone."""
    cls = getattr(module, "ThreadPoolExecutor", None)
    submit = getattr(cls, "submit", None)
    if submit is None or getattr(submit, "__perfsleuth__", False):
        return

    @functools.wraps(submit)
    def wrapper(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        req = _current_get()
        if req is not None:
            try:
                if not _carries_context(fn):
                    frame = _getframe(1)
                    origin = None if _dispatch(frame) else (_origin(frame) or None)
                    fn = _partial(_run_in_request, req, origin, fn)
            except Exception:
                recorder.internal_error()
        return submit(self, fn, *args, **kwargs)

    wrapper.__perfsleuth__ = True  # type: ignore[attr-defined]
    cls.submit = wrapper  # type: ignore[union-attr]


# (id(code), f_lasti) of the frame that handed work over -> the stacks last captured there
# (a few: one line serves several callers, as Starlette's run_in_threadpool serves FastAPI's
# endpoint and its response serialisation): the next hand-off from that line takes the one
# whose frames are its own (compared, not copied: nothing is allocated; a different stack
# differs a frame or two up), as the recorder reuses a site's stack. A stack holds the
# code objects it is compared by, so a reused id cannot match a stale entry.
_origins: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
_MAX_ORIGINS = 500
_PER_LINE = 4


def _forget() -> None:
    _stitched.clear()
    _origins.clear()


recorder.forget_hooks.append(_forget)


_DISPATCH_DEPTH = 3


def _dispatch(frame: FrameType) -> bool:
    """Whether a framework hands the work over from its own dispatch: the frames just above
    the hand-off are all library code (FastAPI running a sync endpoint, a dependency or the
    response's serialisation). The application's code is then in the worker's stack (the
    endpoint) or nowhere near, and walking the framework's frames up to the request's entry
    (a frame object made for each, every request, and more garbage collections) is what
    the hand-off would cost most. A hand-off from the application's code, or one library
    call below it, is stitched."""
    f: FrameType | None = frame
    kinds = _kinds
    for _ in range(_DISPATCH_DEPTH):
        if f is None:
            return True
        code = f.f_code
        hit = kinds.get(id(code))  # stacks.classify's cache, read in place (no call)
        if (hit[1] if hit is not None else _classify(code)) is not False:
            return False  # the application's (or the agent's) frame
        f = f.f_back
    return True


def _origin(frame: FrameType) -> tuple[Any, ...]:
    """The stack above a hand-off (:func:`perfsleuth.agent.stacks.capture` of ``frame``)."""
    key = (id(frame.f_code), frame.f_lasti)
    known = _origins.get(key)
    if known is not None:
        for flat in known:
            if _same_from(frame, flat):
                return flat
    else:
        if len(_origins) >= _MAX_ORIGINS:
            _origins.clear()
        known = _origins[key] = []
    flat = _capture(frame)
    known.insert(0, flat)
    del known[_PER_LINE:]
    return flat


def stitched(req: recorder.ActiveRequest, frame: FrameType, func: Callable[..., Any]) -> Any:
    """``func`` to hand over from ``frame`` (not a framework's dispatch) for ``req``: wrapped
    with the stack above ``frame``, or as it is when there is none. The C hand-off
    (``_speedups.HandOff(run_sync, stitched)``) calls it after its own dispatch check, as
    :func:`wrap`'s wrapper does."""
    origin = _origin(frame)
    return _partial(_run_stitched, req, origin, func) if origin else func


def wrap(run_sync: Callable[..., Any]) -> Callable[..., Any]:
    """``run_sync(func, *args, **kwargs)`` (anyio's ``to_thread.run_sync``, ``asyncio.to_thread``,
    already marked by :mod:`perfsleuth.agent.instrument.threads`) handing over ``func``
    wrapped with the caller's stack when a request is being recorded."""

    @functools.wraps(run_sync)
    def wrapper(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        req = _current_get()
        if req is not None:
            try:
                frame = _getframe(1)
                if not _dispatch(frame):
                    origin = _origin(frame)
                    if origin:
                        func = _partial(_run_stitched, req, origin, func)
            except Exception:
                recorder.internal_error()
        return run_sync(func, *args, **kwargs)

    mark = getattr(inspect, "markcoroutinefunction", None)  # 3.12+: still looks async
    if mark is not None:
        wrapper = mark(wrapper)
    wrapper.__perfsleuth__ = True  # type: ignore[attr-defined]
    # the library's own function, as the marking layer names it
    wrapper.__wrapped__ = getattr(run_sync, "__wrapped__", run_sync)  # type: ignore[attr-defined]
    return wrapper
