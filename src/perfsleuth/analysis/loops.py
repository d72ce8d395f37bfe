"""Which line of a function runs in a loop: the frame of an N+1 that does the looping.

The call site the agent records is the innermost application frame, often a helper
(``_items_of``) called once per iteration from elsewhere. To say which line to change, the N+1
detector walks the call's application frames from the innermost outwards and asks
:func:`in_loop` of each; the first frame whose line sits inside a ``for``/``while`` loop or a
comprehension of its own function is the looping one.

:func:`call_lines` finds the lines of a function that lead to a given callee (directly or
through other functions of the same file): where the repeats of one statement from a helper
part ways in the caller's code. :func:`template_loop` finds the ``{% for %}`` enclosing a line
of a Django or Jinja2 template.

Sources are parsed with :mod:`ast` once per file (cached by path and modification time).
Paths recorded by the agent may be relative to the application's working directory, so
:func:`resolve` tries the path as is, relative to our working directory and to any ``roots``
given (directories of absolute paths recorded for the same app).
"""

from __future__ import annotations

import ast
import os
import re
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
    # lines shared by a comprehension's repeated part and its first iterable (run once):
    # from the line alone it cannot be told which of the two a call came from
    shared: tuple[tuple[_Span, int], ...] = ()
    # function name -> (its span, the names it calls with the line of each call)
    calls: tuple[tuple[str, _Span, tuple[tuple[str, int], ...]], ...] = ()


def _span(node: ast.AST) -> _Span:
    first = getattr(node, "lineno", 0)
    return _Span(first, getattr(node, "end_lineno", None) or first)


def _body_span(stmts: list[ast.stmt]) -> _Span | None:
    if not stmts:
        return None
    return _Span(_span(stmts[0]).first, _span(stmts[-1]).last)


_Spans = tuple[tuple[_Span, int], ...]


def _index(tree: ast.AST) -> tuple[_Spans, _Spans, _Spans]:
    """Function spans and loop spans, each tagged with the function (scope) it belongs to,
    scope 0 being the module. Only the parts of a loop that run once per iteration count:
    a ``for`` loop's body (not its iterable, evaluated once, nor its ``else``), a ``while``
    loop's test and body, a comprehension's element, conditions and inner iterables. Lines
    where a comprehension's repeated part shares a line with its first iterable (evaluated
    once) come third."""
    funcs: list[tuple[_Span, int]] = []
    loops: list[tuple[_Span, int]] = []
    shared: list[tuple[_Span, int]] = []

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
                once = _span(child.generators[0].iter)
                for p in parts:
                    span = _span(p)
                    first, last = max(span.first, once.first), min(span.last, once.last)
                    if first > last:
                        loops.append((span, scope))
                        continue
                    # The lines shared with the first iterable are only maybe in the loop.
                    shared.append((_Span(first, last), scope))
                    if span.first < first:
                        loops.append((_Span(span.first, first - 1), scope))
                    if last < span.last:
                        loops.append((_Span(last + 1, span.last), scope))
            visit(child, child_scope)

    visit(tree, 0)
    return tuple(funcs), tuple(loops), tuple(shared)


@lru_cache(maxsize=512)
def _parse(path: str, mtime_ns: int) -> _Source | None:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        tree = ast.parse(raw, filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    funcs, loops, shared = _index(tree)
    text = raw.decode("utf-8", "replace")
    return _Source(tuple(text.splitlines()), funcs, loops, shared, _calls(tree))


def _callee(node: ast.Call) -> str | None:
    """The name a call calls: ``f(...)`` -> f, ``obj.f(...)`` -> f."""
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _calls(tree: ast.AST) -> tuple[tuple[str, _Span, tuple[tuple[str, int], ...]], ...]:
    """Every named function with the calls made in its own body (not in nested functions)."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        made: list[tuple[str, int]] = []
        todo: list[ast.AST] = list(ast.iter_child_nodes(fn))
        while todo:
            node = todo.pop()
            if isinstance(node, _FUNCS):
                continue
            if isinstance(node, ast.Call):
                name = _callee(node)
                if name is not None:
                    made.append((name, node.lineno))
            todo.extend(ast.iter_child_nodes(node))
        out.append((fn.name, _span(fn), tuple(sorted(made, key=lambda c: c[1]))))
    return tuple(out)


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
    the function it is in (or may: see :func:`loop_certainty`); False when it does not; None
    when the source cannot be read."""
    c = loop_certainty(file, line, roots)
    return None if c is None else c != "no"


def loop_certainty(file: str | None, line: int | None, roots: Iterable[str] = ()) -> str | None:
    """ "yes" when ``line`` of ``file`` runs once per iteration of a loop or comprehension of
    the function it is in; "maybe" when it is in a loop only by sharing its line with a
    comprehension's first iterable, which runs once (``[b.title for b in a.books.all()]``:
    the line alone does not tell the query from the loop); "no"; None when the source cannot
    be read."""
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
    if any(line in span and s == scope for span, s in src.loops):
        return "yes"
    if any(line in span and s == scope for span, s in src.shared):
        return "maybe"
    return "no"


def source_line(file: str | None, line: int | None, roots: Iterable[str] = ()) -> str | None:
    """The text of one source line (stripped), or None when it cannot be read."""
    path = resolve(file, roots)
    if path is None or not line:
        return None
    src = _source(path)
    lines = src.lines if src is not None else _lines(path)  # a template is not Python
    if lines is None or not 0 < line <= len(lines):
        return None
    return lines[line - 1].strip()


def call_lines(
    file: str | None, line: int | None, callee: str | None, roots: Iterable[str] = ()
) -> list[int] | None:
    """The lines of the function around ``line`` of ``file`` that lead to a call of
    ``callee``: lines calling it, or calling a function of the same file that (at any depth)
    calls it. None when the source cannot be read or ``line`` is in no function."""
    path = resolve(file, roots)
    if path is None or not line or not callee:
        return None
    src = _source(path)
    if src is None:
        return None
    here = [(span, made) for _, span, made in src.calls if line in span]
    if not here:
        return None
    # The innermost function around the line is the one starting last.
    _, made = max(here, key=lambda h: h[0].first)
    # Functions of this file that reach the callee, directly or through each other.
    reach = {callee}
    grew = True
    while grew:
        grew = False
        for name, _, inner in src.calls:
            if name not in reach and any(n in reach for n, _ in inner):
                reach.add(name)
                grew = True
    return sorted({ln for name, ln in made if name in reach})


_TEMPLATE_FOR = re.compile(r"\{%-?\s*(for|endfor)\b[^%]*?-?%\}", re.DOTALL)


@lru_cache(maxsize=128)
def _text(path: str, mtime_ns: int) -> tuple[str, ...] | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return tuple(fh.read().splitlines())
    except OSError:
        return None


def _lines(path: str) -> tuple[str, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _text(path, st.st_mtime_ns)


def template_loop(
    file: str | None, line: int | None, roots: Iterable[str] = ()
) -> tuple[int, str] | None:
    """(line, tag) of the innermost ``{% for %}`` of a Django or Jinja2 template whose body
    holds ``line`` (a tag on an earlier line, not closed before it), or None."""
    path = resolve(file, roots)
    if path is None or not line:
        return None
    lines = _lines(path)
    if lines is None or line > len(lines):
        return None
    text = "\n".join(lines[: line - 1]) + "\n"
    open_fors: list[tuple[int, str]] = []
    for m in _TEMPLATE_FOR.finditer(text):
        if m.group(1) == "for":
            open_fors.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split())))
        elif open_fors:
            open_fors.pop()
    return open_fors[-1] if open_fors else None
