"""Library instrumentation, installed when a library is imported (or at once if it already is).

Each entry maps a module name to "module:function" of a patch function taking the imported
module. Patch functions must be idempotent and must never let an exception escape: a failed
patch leaves the library untouched (and is counted), it never breaks the import.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any

from perfsleuth.agent import recorder

# module imported by the app -> patch function (imported lazily, so unused ones cost nothing)
PATCHES: dict[str, str] = {}

_installed = False
_done: set[str] = set()
_lock = threading.RLock()


def register(module: str, target: str) -> None:
    PATCHES[module] = target


def _apply(name: str, module: ModuleType) -> None:
    with _lock:
        if name in _done:
            return
        _done.add(name)
    target = PATCHES.get(name)
    if not target:
        return
    try:
        mod_name, func_name = target.split(":")
        func = getattr(importlib.import_module(mod_name), func_name)
        func(module)
    except Exception:
        recorder.internal_error()


# The finder and loader follow importlib's protocols without subclassing importlib.abc, whose
# import (importlib.resources, tempfile, shutil...) cost milliseconds at the agent's start.
class _Loader:
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, item: str) -> Any:  # get_code, get_source, ... for tools that ask
        return getattr(self._loader, item)


class _Finder:
    """Finds watched modules through the other finders and wraps their loader."""

    _busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in PATCHES or fullname in _done or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None:
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, fullname)  # type: ignore[assignment]
        return spec


def install() -> None:
    """Patch what is imported already; hook the rest. Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    from perfsleuth.agent.instrument import registry  # noqa: F401 - fills PATCHES

    sys.meta_path.insert(0, _Finder())
    for name in list(PATCHES):
        mod = sys.modules.get(name)
        if mod is not None:
            _apply(name, mod)
