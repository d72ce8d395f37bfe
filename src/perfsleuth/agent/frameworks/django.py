"""Django: a middleware (sync and async) that records requests with their URL route as endpoint.

Explicit use::

    MIDDLEWARE = ["perfsleuth.agent.DjangoMiddleware", ...]
    # or "perfsleuth.agent.frameworks.django.PerfsleuthMiddleware"

Automatic use (``perfsleuth run``, or any process where the agent was started before Django
loads its middleware): ``patch_django`` wraps ``BaseHandler.load_middleware`` so that the
middleware sits *outside* the whole configured chain, with no settings change. It is not added
when the settings already list it (the explicit position wins).

The endpoint is ``request.resolver_match.route`` (``"orders/<int:order_id>/"``, joined across
``include()``), written ``"GET /orders/<int:order_id>/"``; unresolved URLs are
``"<METHOD> <unmatched>"``. Under another recorder (``perfsleuth.agent.wsgi``/``asgi`` around
Django, or Django mounted in Starlette) the middleware only names the endpoint of the request
already in progress: one request is one record.

Errors: Django turns view exceptions into 500 responses inside the chain, so the exception's
class is taken where that happens (``response_for_exception``), for WSGI and ASGI alike.

Statements: ``patch_django`` also has every Django connection recorded through Django's own
execute hook (:mod:`perfsleuth.agent.instrument.django_db`).
"""

from __future__ import annotations

import functools
import importlib
import sys
from types import ModuleType
from typing import Any

from perfsleuth.agent import capture, recorder
from perfsleuth.agent.frameworks.common import content_length, endpoint, read_environ, unmatched

_current = recorder._current

MIDDLEWARE_PATHS = frozenset(
    {
        "perfsleuth.agent.DjangoMiddleware",
        "perfsleuth.agent.frameworks.django.PerfsleuthMiddleware",
    }
)


def _coroutine_helpers() -> tuple[Any, Any]:
    try:
        from asgiref.sync import iscoroutinefunction, markcoroutinefunction  # Django's own dep

        return iscoroutinefunction, markcoroutinefunction
    except ImportError:  # pragma: no cover - Django always ships asgiref
        import inspect

        def mark(func: Any) -> Any:
            return func

        return inspect.iscoroutinefunction, mark


class PerfsleuthMiddleware:
    """Records the request (or names the endpoint of the one already being recorded)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any, *, is_async: bool | None = None) -> None:
        self.get_response = get_response
        iscoroutinefunction, markcoroutinefunction = _coroutine_helpers()
        if is_async is None:
            is_async = bool(iscoroutinefunction(get_response))
        self._async = is_async
        if is_async:
            try:
                markcoroutinefunction(self)
            except Exception:
                recorder.internal_error()

    def __call__(self, request: Any) -> Any:
        if self._async:
            return self.__acall__(request)
        req = _begin(request, cpu=True)
        if req is None:
            response = self.get_response(request)
            _name_current(request, response)
            return response
        try:
            response = self.get_response(request)
        except BaseException as exc:
            _failed(req, exc, request)
            raise
        _complete(req, request, response)
        return response

    async def __acall__(self, request: Any) -> Any:
        req = _begin(request, cpu=False)
        if req is None:
            response = await self.get_response(request)
            _name_current(request, response)
            return response
        try:
            response = await self.get_response(request)
        except BaseException as exc:
            _failed(req, exc, request)
            raise
        _complete(req, request, response)
        return response

    def process_exception(self, request: Any, exception: BaseException) -> None:
        """Listed in settings: Django reports view exceptions here (kept for 5xx only)."""
        try:
            request._perfsleuth_error = type(exception).__name__
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<PerfsleuthMiddleware get_response={self.get_response!r}>"


def _begin(request: Any, cpu: bool) -> recorder.ActiveRequest | None:
    try:
        if _current.get() is not None:
            return None
        req = recorder.begin("web", request.method or "", request.path or "/", cpu=cpu)
        if req is not None:
            try:
                read_environ(req, request.META)
            except Exception:
                recorder.internal_error()
        return req
    except Exception:
        recorder.internal_error()
        return None


def route_template(request: Any) -> str | None:
    """``request.resolver_match.route`` in the form ``/orders/<int:order_id>/``."""
    match = getattr(request, "resolver_match", None)
    route = getattr(match, "route", None) if match is not None else None
    if not isinstance(route, str):
        return None
    if route.startswith("^"):  # re_path(): the regex is the template
        route = route[1:]
    if route.endswith("$") and not route.endswith("\\$"):
        route = route[:-1]
    elif route.endswith("\\Z"):
        route = route[:-2]
    return route if route.startswith("/") else "/" + route


def _name_current(request: Any, response: Any) -> None:
    req = _current.get()
    if req is None:
        return
    try:
        if req.error is None and int(getattr(response, "status_code", 0)) >= 500:
            req.error = getattr(request, "_perfsleuth_error", None)
        if req.endpoint:
            return
        template = route_template(request)
        if template is not None:
            req.endpoint = endpoint(req.method, template)
    except Exception:
        recorder.internal_error()


def _failed(req: recorder.ActiveRequest, exc: BaseException, request: Any = None) -> None:
    try:
        req.status = 500
        req.error = type(exc).__name__
        if not req.endpoint:
            req.endpoint = unmatched(req.method)
    except Exception:
        pass
    recorder.end(req)
    if capture.on and request is not None:
        capture.finish_django(req, request)


def _complete(req: recorder.ActiveRequest, request: Any, response: Any) -> None:
    try:
        req.status = int(response.status_code)
        if getattr(response, "streaming", False):
            # Streamed after we return: the declared size, when there is one.
            req.resp_bytes = content_length(response.get("Content-Length"))
        else:
            req.resp_bytes = len(response.content)
        if req.error is None and req.status >= 500:
            req.error = getattr(request, "_perfsleuth_error", None)
        if not req.endpoint:
            template = route_template(request)
            req.endpoint = (
                endpoint(req.method, template) if template is not None else unmatched(req.method)
            )
    except Exception:
        recorder.internal_error()
    recorder.end(req)
    if capture.on:
        capture.finish_django(req, request)


# ------------------------------------------------------------------------------------ patch

_ORIGINAL = "_perfsleuth_original"


def _explicitly_configured() -> bool:
    try:
        from django.conf import settings

        return any(str(m) in MIDDLEWARE_PATHS for m in (settings.MIDDLEWARE or ()))
    except Exception:
        return False


def patch_django(module: ModuleType) -> None:
    """Put the middleware outside Django's middleware chain, in every handler (WSGI, ASGI,
    test client), unless the settings list it already."""
    cls = getattr(module, "BaseHandler", None)
    if cls is None or getattr(cls.load_middleware, _ORIGINAL, None) is not None:
        return
    original = cls.load_middleware

    @functools.wraps(original)
    def load_middleware(self: Any, is_async: bool = False) -> None:
        original(self, is_async)
        try:
            chain = self._middleware_chain
            if chain is not None and not _explicitly_configured():
                self._middleware_chain = PerfsleuthMiddleware(chain, is_async=is_async)
        except Exception:
            recorder.internal_error()

    setattr(load_middleware, _ORIGINAL, original)
    cls.load_middleware = load_middleware
    _patch_exceptions()
    from perfsleuth.agent.instrument import django_db

    django_db.install()  # statements through Django's execute hook, for every backend


def _patch_exceptions() -> None:
    """Take the class of exceptions Django turns into 500 responses."""
    mod: Any = sys.modules.get("django.core.handlers.exception")
    if mod is None:
        try:
            mod = importlib.import_module("django.core.handlers.exception")
        except Exception:
            return
    original = getattr(mod, "response_for_exception", None)
    if original is None or getattr(original, _ORIGINAL, None) is not None:
        return

    @functools.wraps(original)
    def response_for_exception(request: Any, exc: BaseException) -> Any:
        response = original(request, exc)
        try:
            req = _current.get()
            if req is not None and req.error is None and int(response.status_code) >= 500:
                req.error = type(exc).__name__
        except Exception:
            recorder.internal_error()
        return response

    setattr(response_for_exception, _ORIGINAL, original)
    mod.response_for_exception = response_for_exception


def unpatch_django(module: ModuleType) -> None:
    cls = getattr(module, "BaseHandler", None)
    original = getattr(getattr(cls, "load_middleware", None), _ORIGINAL, None)
    if cls is not None and original is not None:
        cls.load_middleware = original
    mod: Any = sys.modules.get("django.core.handlers.exception")
    original = getattr(getattr(mod, "response_for_exception", None), _ORIGINAL, None)
    if mod is not None and original is not None:
        mod.response_for_exception = original


__all__ = ["PerfsleuthMiddleware", "patch_django", "route_template"]
