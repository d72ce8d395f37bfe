"""The C accelerator (agent/_speedups.c): whether it is on, and its functions.

It is built at install when a compiler is there; ``PERFSLEUTH_SPEEDUPS=0`` leaves it out. Every
function it has also exists in Python, recording the same values: modules take the C version
with :func:`pick` and fall back to theirs. The frameworks' request layers in C (agent/_wsgi.c,
agent/_asgi.c) are loaded by their modules (frameworks/wsgi.py, frameworks/asgi.py) only when
this one is on.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

T = TypeVar("T")


def _load() -> Any:
    if os.environ.get("PERFSLEUTH_SPEEDUPS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from perfsleuth.agent import _speedups
    except ImportError:
        return None
    return _speedups


module: Any = _load()  # the extension module, or None when the accelerator is off
on = module is not None


def pick(name: str, python: T) -> T:
    """The accelerator's ``name`` when it is on and has it (an older build may not), else
    ``python``."""
    if module is None:
        return python
    return getattr(module, name, python)  # type: ignore[no-any-return]
