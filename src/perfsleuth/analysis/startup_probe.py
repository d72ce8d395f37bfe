"""Start-up probe for ``perfsleuth startup``: run as ``sitecustomize`` (after the agent's, which
chains to it) in every Python process of the measured command. Stdlib only; loaded from its
file, never through the ``perfsleuth.analysis`` package (whose imports would be measured).

It records, with wall-clock nanoseconds comparable across processes:
- every import (``importlib._bootstrap._find_and_load``, which the interpreter looks up on each
  import of a module not yet loaded): name, start, end, nesting depth, self time, thread, file;
- spans of known start-up steps, by wrapping them when their module is imported: uvicorn's
  app load, lifespan startup and server startup; gunicorn's arbiter start, worker spawn,
  worker init and app load; Django's ``setup()`` and app registry; ``Flask()`` and
  ``FastAPI()``.

Records go to ``$PERFSLEUTH_STARTUP_DIR/<pid>.jsonl`` (the first line describes the process),
written by a daemon thread every 50 ms and at the end of each span; a forked child starts its
own file and thread. Nothing here raises into the application.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

_DIR = os.environ.get("PERFSLEUTH_STARTUP_DIR", "")
_now = time.time_ns
_get_ident = threading.get_ident
_lock = threading.Lock()
_pending: list[str] = []
_stacks: dict[int, list[list[Any]]] = {}
_main = _get_ident()
_flusher: threading.Thread | None = None
_probe_ns = _now()
_CO_COROUTINE = 0x80
_modules = sys.modules


def _proc_start_ns() -> int | None:
    """When this process started (from /proc: 10 ms resolution), or None."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return int((btime + ticks / os.sysconf("SC_CLK_TCK")) * 1e9)
    except Exception:
        return None


def _emit(obj: dict[str, Any]) -> None:
    line = json.dumps(obj, separators=(",", ":"))
    with _lock:
        _pending.append(line)


def _flush() -> None:
    with _lock:
        lines = _pending[:]
        del _pending[:]
    if not lines or not _DIR:
        return
    try:
        with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    except OSError:
        pass


def _flush_loop() -> None:
    while True:
        time.sleep(0.05)
        _flush()


def _start_flusher() -> None:
    global _flusher
    _flusher = threading.Thread(target=_flush_loop, name="perfsleuth-startup-probe", daemon=True)
    _flusher.start()


def _header(kind: str, forked_ns: int | None = None) -> None:
    _emit(
        {
            "type": "process",
            "kind": kind,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "argv": list(getattr(sys, "orig_argv", None) or sys.argv),
            "cwd": os.getcwd(),
            "probe_ns": _probe_ns if forked_ns is None else forked_ns,
            "proc_start_ns": _proc_start_ns() if forked_ns is None else forked_ns,
            "prefixes": sorted({sys.prefix, sys.base_prefix, sys.exec_prefix}),
            "app_packages": os.environ.get("PERFSLEUTH_APP_PACKAGES", ""),
        }
    )


def _after_fork() -> None:
    global _main
    with _lock:
        del _pending[:]
    _stacks.clear()
    _main = _get_ident()
    _header("fork", _now())
    _start_flusher()


# ---------------------------------------------------------------------------------- imports

_bootstrap: Any = sys.modules.get("importlib._bootstrap")
_original_find_and_load: Any = getattr(_bootstrap, "_find_and_load", None)


def _find_and_load(name: str, import_: Any) -> Any:
    if name in _modules:  # importlib.import_module of a loaded module comes here too
        return _original_find_and_load(name, import_)
    tid = _get_ident()
    stack = _stacks.get(tid)
    if stack is None:
        stack = _stacks[tid] = []
    rec = [_now(), 0]  # start, time spent in nested imports
    stack.append(rec)
    try:
        return _original_find_and_load(name, import_)
    finally:
        end = _now()
        stack.pop()
        total = end - rec[0]
        if stack:
            stack[-1][1] += total
        try:
            mod = sys.modules.get(name)
            _emit(
                {
                    "type": "import",
                    "name": name,
                    "start": rec[0],
                    "end": end,
                    "depth": len(stack),
                    "self": total - rec[1],
                    "main": tid == _main,
                    "file": getattr(mod, "__file__", None),
                }
            )
            patch = _PATCHES.get(name)
            if patch is not None and mod is not None:
                patch(mod)
        except Exception:
            pass


# ------------------------------------------------------------------------------------ spans


def _span(name: str, start: int, phase: str) -> None:
    _emit(
        {
            "type": "span",
            "name": name,
            "phase": phase,
            "start": start,
            "end": _now(),
            "main": _get_ident() == _main,
        }
    )
    _flush()


def _mark(name: str, phase: str) -> None:
    _emit({"type": "mark", "name": name, "phase": phase, "at": _now()})
    _flush()


def _wrap(owner: Any, attr: str, name: str, phase: str, *, mark_only: bool = False) -> None:
    fn = getattr(owner, attr, None)
    if fn is None or getattr(fn, "_perfsleuth_startup", False):
        return
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_flags & _CO_COROUTINE:

        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            start = _now()
            try:
                return await fn(*args, **kwargs)
            finally:
                _span(name, start, phase)

        wrapper: Any = awrapper
    elif mark_only:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _mark(name, phase)
            return fn(*args, **kwargs)

    else:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                _span(name, start, phase)

    wrapper._perfsleuth_startup = True
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", attr)
    wrapper.__qualname__ = getattr(fn, "__qualname__", attr)
    setattr(owner, attr, wrapper)


def _patch_uvicorn_config(mod: Any) -> None:
    _wrap(mod.Config, "load_app", "uvicorn Config.load_app (import the app)", "app")
    _wrap(mod.Config, "load", "uvicorn Config.load", "app")


def _patch_uvicorn_lifespan(mod: Any) -> None:
    _wrap(mod.LifespanOn, "startup", "lifespan startup", "lifespan")


def _patch_uvicorn_server(mod: Any) -> None:
    _wrap(mod.Server, "startup", "uvicorn Server.startup", "server")


def _patch_gunicorn_arbiter(mod: Any) -> None:
    _wrap(mod.Arbiter, "start", "gunicorn Arbiter.start (bind)", "server")
    _wrap(mod.Arbiter, "spawn_worker", "gunicorn spawn_worker", "worker")


def _patch_gunicorn_worker(mod: Any) -> None:
    _wrap(mod.Worker, "init_process", "gunicorn worker init", "worker", mark_only=True)
    _wrap(mod.Worker, "load_wsgi", "gunicorn Worker.load_wsgi (import the app)", "app")


def _patch_django(mod: Any) -> None:
    _wrap(mod, "setup", "django.setup()", "framework")


def _patch_django_apps(mod: Any) -> None:
    _wrap(mod.Apps, "populate", "Django apps registry (apps ready)", "framework")


def _patch_flask(mod: Any) -> None:
    _wrap(mod.Flask, "__init__", "Flask()", "framework")


def _patch_fastapi(mod: Any) -> None:
    _wrap(mod.FastAPI, "__init__", "FastAPI()", "framework")


_PATCHES = {
    "uvicorn.config": _patch_uvicorn_config,
    "uvicorn.lifespan.on": _patch_uvicorn_lifespan,
    "uvicorn.server": _patch_uvicorn_server,
    "gunicorn.arbiter": _patch_gunicorn_arbiter,
    "gunicorn.workers.base": _patch_gunicorn_worker,
    "django": _patch_django,
    "django.apps.registry": _patch_django_apps,
    "flask.app": _patch_flask,
    "fastapi.applications": _patch_fastapi,
}


def install() -> None:
    if not _DIR or _original_find_and_load is None:
        return
    try:
        _header("exec")
        for name, patch in _PATCHES.items():  # already imported (by the agent, say)
            mod = sys.modules.get(name)
            if mod is not None:
                patch(mod)
        _bootstrap._find_and_load = _find_and_load
        os.register_at_fork(after_in_child=_after_fork)
        _start_flusher()
    except Exception:
        pass
