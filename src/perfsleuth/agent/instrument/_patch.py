"""The plugin API every library instrumentation uses to replace a library's functions.

A wrapper carries its original under :data:`MARK` (``wrapper._perfsleuth_orig``): that makes
patching idempotent (a marked attribute is never wrapped again) and lets tests and tools find
the original. Patch functions never raise into the application: a failed patch leaves the
library untouched (the registry counts the error).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

MARK = "_perfsleuth_orig"


def mark(wrapper: Any, orig: Any) -> Any:
    """``wrapper`` made to look like ``orig`` (name, docstring, ``__wrapped__``) and marked as
    ours; returns it."""
    try:
        functools.update_wrapper(wrapper, orig)
    except Exception:  # a callable without the usual attributes: the mark is what matters
        pass
    setattr(wrapper, MARK, orig)
    return wrapper


def is_ours(value: Any) -> bool:
    """Whether ``value`` is one of our wrappers."""
    return hasattr(value, MARK)


def is_patched(owner: Any, name: str) -> bool:
    """Whether ``owner`` (a class or a module) has our wrapper as its own attribute ``name``."""
    return hasattr(vars(owner).get(name), MARK)


def patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace ``owner.name`` (an attribute of the class or module itself, not inherited) by
    ``wrap(original)``, and every alias of it in ``owner`` (``Redis.set`` and ``Redis.__setitem__``
    are one function), unless it is ours already. Returns whether it replaced anything."""
    attrs = vars(owner)
    orig = attrs.get(name)
    if orig is None or hasattr(orig, MARK):
        return False
    wrapped = wrap(orig)
    for attr, value in list(attrs.items()):
        if value is orig:
            setattr(owner, attr, wrapped)
    return True
