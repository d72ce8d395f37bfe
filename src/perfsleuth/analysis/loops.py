"""Which line of a function runs in a loop: the frame of an N+1 that does the looping.

The call site the agent records is the innermost application frame, often a helper
(``_items_of``) called once per iteration from elsewhere. To say which line to change, the N+1
detector walks the call's application frames from the innermost outwards and asks
:func:`in_loop` of each; the first frame whose line sits inside a ``for``/``while`` loop or a
comprehension of its own function is the looping one.

Sources are parsed with :mod:`ast` once per file (cached by path and modification time).
Paths recorded by the agent may be relative to the application's working directory, so
:func:`resolve` tries the path as is, relative to our working directory and to any ``roots``
given (directories of absolute paths recorded for the same app).
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


@dataclass(frozen=True)
class _Span:
    first: int
    last: int

    def __contains__(self, line: object) -> bool:
        return isinstance(line, int) and self.first <= line <= self.last


@dataclass(frozen=True)
class _Source:
    lines: tuple[str, ...]
    funcs: tuple[tuple[_Span, int], ...]  # every function's span, with a scope number
    loops: tuple[tuple[_Span, int], ...]  # repeated parts of loops, with their scope number


def _span(node: ast.AST) -> _Span:
    first = getattr(node, "lineno", 0)
    return _Span(first, getattr(node, "end_lineno", None) or first)


def _body_span(stmts: list[ast.stmt]) -> _Span | None:
    if not stmts:
        return None
    return _Span(_span(stmts[0]).first, _span(stmts[-1]).last)


def _index(tree: ast.AST) -> tuple[tuple[tuple[_Span, int], ...], tuple[tuple[_Span, int], ...]]:
    """Function spans and loop spans, each tagged with the function (scope) it belongs to,
    scope 0 being the module. Only the parts of a loop that run once per iteration count:
    a ``for`` loop's body (not its iterable, evaluated once, nor its ``else``), a ``while``
    loop's test and body, a comprehension's element, conditions and inner iterables."""
    funcs: list[tuple[_Span, int]] = []
    loops: list[tuple[_Span, int]] = []

    def visit(node: ast.AST, scope: int) -> None:
        for child in ast.iter_child_nodes(node):
            child_scope = scope
            if isinstance(child, _FUNCS):
                funcs.append((_span(child), len(funcs) + 1))
                child_scope = len(funcs)
            elif isinstance(child, ast.For | ast.AsyncFor):
                body = _body_span(child.body)
                if body is not None:
                    loops.append((body, scope))
            elif isinstance(child, ast.While):
                loops.append((_span(child.test), scope))
                body = _body_span(child.body)
                if body is not None:
                    loops.append((body, scope))
            elif isinstance(child, _COMPS):
                # A comprehension is its own scope in Python 3.11, but its frame belongs to
                # the enclosing function for our purpose: record it in the current scope.
                parts: list[ast.AST] = []
                if isinstance(child, ast.DictComp):
                    parts += [child.key, child.value]
                else:
                    parts.append(child.elt)
                for i, gen in enumerate(child.generators):
                    if i > 0:
                        parts.append(gen.iter)
                    parts += gen.ifs
                for p in parts:
                    loops.append((_span(p), scope))
            visit(child, child_scope)

    visit(tree, 0)
    return tuple(funcs), tuple(loops)


@lru_cache(maxsize=512)
def _parse(path: str, mtime_ns: int) -> _Source | None:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        tree = ast.parse(raw, filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    funcs, loops = _index(tree)
    text = raw.decode("utf-8", "replace")
    return _Source(tuple(text.splitlines()), funcs, loops)


def _source(path: str) -> _Source | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _parse(path, st.st_mtime_ns)


def resolve(file: str | None, roots: Iterable[str] = ()) -> str | None:
    """A readable path for a recorded source file, or None (``<frozen ...>``, gone, ...)."""
    if not file or file.startswith("<"):
        return None
    candidates = [file]
    if not os.path.isabs(file):
        candidates.append(os.path.join(os.getcwd(), file))
        candidates += [os.path.join(r, file) for r in roots]
    for c in candidates:
        if os.path.isfile(c):
            return c
    return None


def in_loop(file: str | None, line: int | None, roots: Iterable[str] = ()) -> bool | None:
    """True when ``line`` of ``file`` runs once per iteration of a loop or comprehension of
    the function it is in; False when it does not; None when the source cannot be read."""
    path = resolve(file, roots)
    if path is None or not line:
        return None
    src = _source(path)
    if src is None or line > len(src.lines):
        return None
    # The innermost function containing the line (the latest-starting one that spans it).
    scope, start = 0, 0
    for span, number in src.funcs:
        if line in span and span.first >= start:
            scope, start = number, span.first
    return any(line in span and s == scope for span, s in src.loops)


def source_line(file: str | None, line: int | None, roots: Iterable[str] = ()) -> str | None:
    """The text of one source line (stripped), or None when it cannot be read."""
    path = resolve(file, roots)
    if path is None or not line:
        return None
    src = _source(path)
    if src is None or not 0 < line <= len(src.lines):
        return None
    return src.lines[line - 1].strip()
