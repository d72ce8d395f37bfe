"""Where a template was when it made a call: Django and Jinja2 rendering frames.

A query triggered from a template (``{{ check.url }}`` inside ``{% for %}``) runs under the
template engine's Python frames, which name only the engine's code. This module reads, from
those frames only, the template file and line being rendered:

* Django: every node is rendered through ``Node.render_annotated`` (``django/template/
  base.py``), whose ``self`` is the node, with ``token.lineno``, ``token.contents`` and
  ``origin.name``. Each such frame gives one template position (the loop's own node gives the
  ``{% for %}`` line, the variable's node inside it the ``{{ ... }}`` line).
* Jinja2: a compiled template's functions run with the template's file as their code's file
  and ``__jinja_template__`` in their globals; the Python line maps to the template line
  through the template's ``debug_info`` (as ``jinja2.debug`` does for tracebacks), and the
  ``{% for %}`` loops around the current instruction are found in the code's bytecode
  (their ``FOR_ITER`` spans), once per code object.

Positions are ``(file, line, label)``, the label a short text such as ``{% for c in checks
%}`` or ``{{ c.url }}``. Nothing here raises: an engine whose objects look different gives
no position. Stdlib only; ``dis`` and ``linecache`` are imported when a Jinja2 template is
first seen.
"""

from __future__ import annotations

import os
import sys
from types import CodeType, FrameType
from typing import Any

NONE, DJANGO, JINJA = 0, 1, 2
MAX_LABEL = 80
_DJANGO_BASE = os.sep + os.path.join("django", "template", "base.py")
_modules = sys.modules

# id(code) -> (code, NONE | DJANGO | JINJA); the code object is kept so its id stays unique
_engine: dict[int, tuple[CodeType, int]] = {}
# id(code) -> (code, [(python line, template line)], [(start, end, template line)] of its
# for loops, {f_lasti: template line})
_JinjaInfo = tuple[CodeType, list[tuple[int, int]], list[tuple[int, int, int]], dict[int, int]]
_jinja: dict[int, _JinjaInfo] = {}
# (file, line) -> label of a Jinja2 template line
_labels: dict[tuple[str, int], str] = {}
_MAX_CACHE = 50_000


def engines_loaded() -> bool:
    """Whether Django's or Jinja2's template engine has been imported in this process."""
    return "django.template.base" in _modules or "jinja2.runtime" in _modules


def engine_of(f: FrameType) -> int:
    """Which template engine's rendering frame ``f`` is (NONE for any other frame)."""
    code = f.f_code
    hit = _engine.get(id(code))
    if hit is not None:
        return hit[1]
    kind = NONE
    fn = code.co_filename
    try:
        if code.co_name == "render_annotated" and fn.endswith(_DJANGO_BASE):
            kind = DJANGO
        elif not fn.endswith(".py") and "__jinja_template__" in f.f_globals:
            kind = JINJA
    except Exception:
        kind = NONE
    if len(_engine) > _MAX_CACHE:
        _engine.clear()
    _engine[id(code)] = (code, kind)
    return kind


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 3] + "..."


def django_position(f: FrameType) -> tuple[str, int, str] | None:
    """(template file, line, label) of the node a ``render_annotated`` frame renders."""
    try:
        node = f.f_locals.get("self")
        token = node.token  # type: ignore[union-attr]
        line = token.lineno
        if not isinstance(line, int):
            return None
        name = node.origin.name  # type: ignore[union-attr]
        contents = token.contents
        kind = getattr(token.token_type, "value", token.token_type)
        if kind == 1:  # TokenType.VAR
            label = "{{ " + contents + " }}"
        elif kind == 2:  # TokenType.BLOCK
            label = "{% " + contents + " %}"
        else:
            label = contents
        return str(name), line, _short(str(label))
    except Exception:
        return None


def django_key(f: FrameType) -> tuple[str, int] | None:
    """(template file, line) of :func:`django_position`, without the label."""
    try:
        node = f.f_locals.get("self")
        return str(node.origin.name), int(node.token.lineno)  # type: ignore[union-attr]
    except Exception:
        return None


def _jinja_info(code: CodeType, f: FrameType) -> _JinjaInfo:
    hit = _jinja.get(id(code))
    if hit is not None:
        return hit
    pairs: list[tuple[int, int]] = []
    loops: list[tuple[int, int, int]] = []
    try:
        template = f.f_globals["__jinja_template__"]
        pairs = sorted((py, tpl) for tpl, py in template.debug_info)
        import dis

        for ins in dis.get_instructions(code):
            if ins.opname == "FOR_ITER" and isinstance(ins.argval, int):
                pos = ins.positions
                pyline = pos.lineno if pos is not None else None
                if pyline is not None:
                    loops.append((ins.offset, ins.argval, _template_line(pairs, pyline)))
    except Exception:
        pass
    loops.sort(reverse=True)  # innermost (latest start) first
    info: _JinjaInfo = (code, pairs, loops, {})
    if len(_jinja) > _MAX_CACHE:
        _jinja.clear()
    _jinja[id(code)] = info
    return info


def _template_line(pairs: list[tuple[int, int]], pyline: int) -> int:
    """The template line of a Python line (jinja2's Template.get_corresponding_lineno)."""
    line = 1
    for py, tpl in pairs:
        if py > pyline:
            break
        line = tpl
    return line


def _python_line(code: CodeType, lasti: int) -> int:
    for start, end, lineno in code.co_lines():
        if start <= lasti < end:
            return lineno if lineno is not None else code.co_firstlineno
    return code.co_firstlineno


def _jinja_line(f: FrameType) -> tuple[Any, int]:
    code = f.f_code
    info = _jinja_info(code, f)
    lasti = f.f_lasti
    lines = info[3]
    line = lines.get(lasti)
    if line is None:
        line = lines[lasti] = _template_line(info[1], _python_line(code, lasti))
    return info, line


def jinja_key(f: FrameType) -> tuple[str, int] | None:
    """(template file, line) a Jinja2 template frame is at."""
    try:
        return f.f_code.co_filename, _jinja_line(f)[1]
    except Exception:
        return None


def _label(fn: str, line: int, loop: bool) -> str:
    key = (fn, line) if not loop else (fn, -line)
    label = _labels.get(key)
    if label is not None:
        return label
    import linecache
    import re

    text = linecache.getline(fn, line) if not fn.startswith("<") else ""
    if loop:
        m = re.search(r"\{%-?\s*for\s.*?-?%\}", text)
        label = _short(m.group(0)) if m else "{% for %}"
    else:
        tags = re.findall(r"\{\{.*?\}\}|\{%.*?%\}", text)
        # the line's tags (which of several made the call is not known), else its text
        label = _short(" ".join(tags) if tags else text.strip() or f"line {line}")
    if len(_labels) > _MAX_CACHE:
        _labels.clear()
    _labels[key] = label
    return label


def jinja_positions(f: FrameType) -> list[tuple[str, int, str]]:
    """The template line a Jinja2 template frame is at, then the ``{% for %}`` lines around it
    (innermost first), as (file, line, label)."""
    try:
        info, line = _jinja_line(f)
        fn = f.f_code.co_filename
        out = [(fn, line, _label(fn, line, False))]
        lasti = f.f_lasti
        for start, end, loop_line in info[2]:
            if start < lasti < end:
                out.append((fn, loop_line, _label(fn, loop_line, True)))
        return out
    except Exception:
        return []
