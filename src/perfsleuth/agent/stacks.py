"""Cheap stack capture for the request path.

The hot path collects (code object, line) pairs only; turning them into file/line/function
records happens on the writer thread. Frames of perfsleuth's agent itself are skipped.
A frame is an *application* frame when its file is outside the standard library and
site-packages (perfsleuth's own demo counts as application code).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Any

MAX_DEPTH = 64
_AGENT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_WIRE_DIR = os.path.join(os.path.dirname(_AGENT_DIR.rstrip(os.sep)), "wire") + os.sep
_DEMO_MARK = os.sep + os.path.join("perfsleuth", "demo") + os.sep


def _library_prefixes() -> tuple[str, ...]:
    paths = set()
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(name)
        if p:
            paths.add(os.path.realpath(p) + os.sep)
            paths.add(os.path.abspath(p) + os.sep)
    for p in sys.path:
        if p and ("site-packages" in p or "dist-packages" in p):
            paths.add(os.path.abspath(p) + os.sep)
    return tuple(sorted(paths))


_LIB = _library_prefixes()
# id(code) -> (code, kind): kind True (application), False (library), None (perfsleuth agent:
# skip; also the frame of a thread pool's worker that runs a request's function, marked by the
# C hand-off, agent/_speedups.c, where the Python one has a frame of the agent's). Keyed by id
# because hashing a code object is not cached by CPython (80-700 ns); the code object is kept
# in the value so its id cannot be reused while the entry exists.
_kind: dict[int, tuple[CodeType, bool | None]] = {}


def classify(code: CodeType) -> bool | None:
    hit = _kind.get(id(code))
    if hit is not None:
        return hit[1]
    fn = code.co_filename
    kind: bool | None
    if fn.startswith((_AGENT_DIR, _WIRE_DIR)):
        kind = None
    elif _DEMO_MARK in fn:
        kind = True
    elif fn.startswith("<") or fn.startswith(_LIB):
        kind = False
    else:
        kind = True
    if len(_kind) > 200_000:  # code objects of exec()'d strings could grow this forever
        _kind.clear()
    _kind[id(code)] = (code, kind)
    return kind


def is_app_file(filename: str) -> bool:
    """Same rule as :func:`classify`, for a file name (used by the writer and the store)."""
    if filename.startswith((_AGENT_DIR, _WIRE_DIR)):
        return False
    if _DEMO_MARK in filename:
        return True
    return not (filename.startswith("<") or filename.startswith(_LIB))


def capture(frame: FrameType | None) -> tuple[Any, ...]:
    """The stack above ``frame``, innermost first, as a flat tuple ``(code, where, code, where,
    ...)`` (flat so the writer can key it with two slices). The agent's own innermost frames
    (its wrappers) are skipped, and the stack stops at the next frame of the agent's: where the
    request entered the application (the ASGI/WSGI layer, a thread-pool hand-off), so the
    server's and the thread's frames above it, the same for every call, are neither walked nor
    stored. At most MAX_DEPTH frames.

    ``where`` is ``~f_lasti`` (negative), not the line: ``f_lineno`` decodes the line table
    at every frame (~40 ns each), the writer does it once per distinct place (:func:`line`).
    Stacks taken off the request path (sampler, watchdog) carry plain line numbers."""
    f = frame
    while f is not None and classify(f.f_code) is None:
        f = f.f_back
    out: list[Any] = []
    kinds = _kind
    n = 0
    while f is not None and n < MAX_DEPTH:
        code = f.f_code
        hit = kinds.get(id(code))
        if (hit[1] if hit is not None else classify(code)) is None:
            break
        out.append(code)
        out.append(~f.f_lasti)
        f = f.f_back
        n += 1
    return tuple(out)


def same(frame: FrameType | None, flat: tuple[Any, ...]) -> bool:
    """Whether :func:`capture` of ``frame`` would give ``flat``, found without building it."""
    f = frame
    while f is not None and classify(f.f_code) is None:
        f = f.f_back
    n = len(flat)
    i = 0
    while f is not None and i < n:
        if f.f_code is not flat[i] or ~f.f_lasti != flat[i + 1]:
            return False
        f = f.f_back
        i += 2
    if i != n:
        return False
    # it must also end where capture would stop: the root, MAX_DEPTH or an agent frame
    return f is None or n >= 2 * MAX_DEPTH or classify(f.f_code) is None


def line(code: CodeType, where: int) -> int:
    """The line number of a ``where`` of :func:`capture` (a line number passes through)."""
    if where >= 0:
        return where
    lasti = ~where
    for start, end, lineno in code.co_lines():
        if start <= lasti < end:
            return lineno if lineno is not None else code.co_firstlineno
    return code.co_firstlineno
