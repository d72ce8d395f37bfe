"""Stacks and code locations from the store, as plain frames (outermost first).

Besides Python frames a stack may hold template frames, which the agent adds where a template
renders: file = the template, line = the template line, function = the tag or expression
(``{% for check in checks %}``, ``{{ check.url }}``). :func:`template_context` names the
expression a call came from and the loop around it; :func:`parting_frames` and
:func:`caller_lines` find where the calls of one statement from one helper part ways in the
code that calls the helper.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
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

TEMPLATE_SUFFIXES = (".html", ".htm", ".jinja", ".jinja2", ".j2", ".txt", ".xml")
_FOR_TAG = re.compile(r"\{%-?\s*for\b")


def is_template(f: Frame) -> bool:
    """A template frame: a template file, or a tag or expression for its function."""
    fn = (f.function or "").lstrip()
    return fn.startswith(("{%", "{{")) or (f.file or "").lower().endswith(TEMPLATE_SUFFIXES)


def is_template_loop(f: Frame) -> bool:
    return is_template(f) and bool(_FOR_TAG.match((f.function or "").lstrip()))


def label(file: str | None, line: int | None, function: str | None) -> str:
    """How a frame is named in trees and flame graphs: ``function (file.py:line)``."""
    base = os.path.basename(file) if file else "?"
    return f"{function or '?'} ({base}:{line or '?'})"


def lines_text(lines: Sequence[Frame]) -> str:
    """Several lines named at once: ``show (views.py:12, 13 and 14)`` when they are in one
    function, else each line's label."""
    if not lines:
        return "?"
    first = lines[0]
    if all(f.file == first.file and f.function == first.function for f in lines):
        nums = [str(f.line or "?") for f in lines]
        joined = nums[0] if len(nums) == 1 else ", ".join(nums[:-1]) + " and " + nums[-1]
        base = os.path.basename(first.file) if first.file else "?"
        return f"{first.function or '?'} ({base}:{joined})"
    return ", ".join(label(f.file, f.line, f.function) for f in lines)


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


def _template_loop_of(frames: Sequence[Frame], i: int, rs: Iterable[str]) -> Frame | None:
    """The ``{% for %}`` around template frame ``frames[i]``: the nearest loop frame outside it
    on the stack, else the enclosing for tag found in the template's source."""
    f = frames[i]
    for outer in reversed(frames[:i]):
        if not is_template(outer):
            break  # the template's own frames end here (the view that rendered it)
        if is_template_loop(outer) and outer.file == f.file:
            return outer
    found = loops.template_loop(f.file, f.line, rs)
    if found is None:
        return None
    return Frame(0, f.file, found[0], found[1], True)


def template_context(
    stack: list[Frame], site: Frame | None = None, extra_roots: Iterable[str] = ()
) -> dict[str, Any] | None:
    """The template part of a call's stack: ``{"expression": site, "loop": site or None}``,
    the innermost template frame and the ``{% for %}`` around it; None without template
    frames."""
    frames = app_frames(stack, site)
    rs = [*roots(frames), *extra_roots]
    for i in range(len(frames) - 1, -1, -1):
        if is_template(frames[i]):
            loop = _template_loop_of(frames, i, rs)
            return {
                "expression": frames[i].site(),
                "loop": loop.site() if loop is not None else None,
            }
    return None


def template_text(tpl: dict[str, Any] | None) -> str:
    """``{{ check.url }} (checks.html:14) in {% for check in checks %} (checks.html:12)``."""
    if not tpl:
        return ""
    e, loop = tpl["expression"], tpl.get("loop")
    out = label(e.get("file"), e.get("line"), e.get("function"))
    if loop:
        out += " in " + label(loop.get("file"), loop.get("line"), loop.get("function"))
    return out


def looping_frame(
    stack: list[Frame], site: Frame | None, extra_roots: Iterable[str] = ()
) -> tuple[Frame | None, bool]:
    """(frame, found): the innermost application frame whose line runs in a loop, found=True;
    else the innermost application frame (the call site), found=False. A template frame runs
    in a loop when a ``{% for %}`` encloses it (on the stack or in the template)."""
    frames = app_frames(stack, site)
    rs = [*roots(frames), *extra_roots]
    maybe: Frame | None = None  # a line shared by a comprehension and its first iterable
    for i in range(len(frames) - 1, -1, -1):
        f = frames[i]
        if is_template(f):
            if _template_loop_of(frames, i, rs) is not None:
                return f, True
            continue
        certainty = loops.loop_certainty(f.file, f.line, rs)
        if certainty == "yes":
            return f, True
        if certainty == "maybe" and maybe is None:
            maybe = f
    if maybe is not None:
        return maybe, True
    return (frames[-1] if frames else site), False


def _key(f: Frame) -> tuple[Any, ...]:
    return (f.file, f.line, f.function)


def parting_frames(paths: Iterable[Sequence[Frame]]) -> list[Frame]:
    """Where the application paths of calls (outermost first) part ways: the frames at the
    first depth at which they differ, one per distinct line, in file and line order. Empty
    when there are fewer than two distinct paths."""
    distinct: dict[tuple[Any, ...], Sequence[Frame]] = {}
    for p in paths:
        distinct.setdefault(tuple(_key(f) for f in p), p)
    if len(distinct) < 2:
        return []
    ps = list(distinct.values())
    depth = 0
    while all(len(p) > depth for p in ps) and len({_key(p[depth]) for p in ps}) == 1:
        depth += 1
    at: dict[tuple[Any, ...], Frame] = {}
    for p in ps:
        if len(p) > depth:
            at.setdefault(_key(p[depth]), p[depth])
    if len(at) < 2:
        return []
    return sorted(at.values(), key=lambda f: (f.file or "", f.line or 0))


def caller_lines(path: Sequence[Frame], extra_roots: Iterable[str] = ()) -> list[Frame]:
    """Where calls of one statement made through a helper come from, read from the source
    when only one of their stacks was recorded: from the helper's caller outwards, the first
    function with two or more lines leading to the helper (the recorded line among them)."""
    rs = [*roots(path), *extra_roots]
    for i in range(len(path) - 2, -1, -1):
        f, callee = path[i], path[i + 1]
        if is_template(f) or is_template(callee):
            return []
        found = loops.call_lines(f.file, f.line, callee.function, rs)
        if found is None:
            return []
        if len(found) >= 2 and f.line in found:
            return [Frame(0, f.file, ln, f.function, True) for ln in found]
    return []


def calling_lines(
    stacks: Iterable[list[Frame]], site: Frame | None, extra_roots: Iterable[str] = ()
) -> tuple[list[Frame], str | None]:
    """(frames, how): the lines in the callers' code where the calls of one statement from
    one site part ways, from their recorded stacks ("stacks") or, with one stack only, from
    the source ("source"); ([], None) when they do not."""
    paths = [app_frames(s, site) for s in stacks if s]
    found = parting_frames(paths)
    if found:
        return found, "stacks"
    if paths:
        found = caller_lines(paths[0], extra_roots)
        if found:
            return found, "source"
    return [], None
