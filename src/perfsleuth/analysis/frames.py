"""Stacks and code locations from the store, as plain frames (outermost first)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from perfsleuth.analysis import loops
from perfsleuth.store.base import Store


@dataclass(frozen=True)
class Frame:
    id: int
    file: str | None
    line: int | None
    function: str | None
    app: bool

    def site(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function}


UNKNOWN = Frame(0, None, None, None, False)


def label(file: str | None, line: int | None, function: str | None) -> str:
    """How a frame is named in trees and flame graphs: ``function (file.py:line)``."""
    base = os.path.basename(file) if file else "?"
    return f"{function or '?'} ({base}:{line or '?'})"


def locations(store: Store, ids: Iterable[int | None]) -> dict[int, Frame]:
    wanted = sorted({i for i in ids if i is not None})
    if not wanted:
        return {}
    rows = store.query(
        "SELECT id, file, line, function, app FROM locations WHERE list_contains(?, id)",
        [wanted],
    )
    return {
        r["id"]: Frame(r["id"], r["file"], r["line"], r["function"], bool(r["app"])) for r in rows
    }


def stacks(store: Store, ids: Iterable[int | None]) -> dict[int, list[Frame]]:
    """stack id -> its frames, outermost first (unknown locations kept as UNKNOWN)."""
    wanted = sorted({i for i in ids if i is not None})
    if not wanted:
        return {}
    rows = store.query("SELECT id, frames FROM stacks WHERE list_contains(?, id)", [wanted])
    frames = {r["id"]: list(r["frames"] or ()) for r in rows}
    locs = locations(store, (i for fr in frames.values() for i in fr))
    return {sid: [locs.get(i, UNKNOWN) for i in fr] for sid, fr in frames.items()}


def app_frames(stack: list[Frame], site: Frame | None = None) -> list[Frame]:
    """The application frames of a stack, outermost first, ending at the call site (added
    when the stack is missing or does not reach it)."""
    out = [f for f in stack if f.app]
    if site is not None and (not out or out[-1].id != site.id):
        out.append(site)
    return out


def roots(frames: Iterable[Frame]) -> list[str]:
    """Directories to resolve relative source paths against: those of the absolute paths
    recorded for application frames (an app's relative paths are relative to its cwd, which
    often is the top of the tree its absolute paths point into)."""
    out: list[str] = []
    for f in frames:
        if f.app and f.file and os.path.isabs(f.file):
            d = os.path.dirname(f.file)
            while d and d not in out:
                out.append(d)
                parent = os.path.dirname(d)
                if parent == d:
                    break
                d = parent
    return out


def looping_frame(
    stack: list[Frame], site: Frame | None, extra_roots: Iterable[str] = ()
) -> tuple[Frame | None, bool]:
    """(frame, found): the innermost application frame whose line runs in a loop, found=True;
    else the innermost application frame (the call site), found=False."""
    frames = app_frames(stack, site)
    rs = [*roots(frames), *extra_roots]
    for f in reversed(frames):
        if loops.in_loop(f.file, f.line, rs):
            return f, True
    return (frames[-1] if frames else site), False
