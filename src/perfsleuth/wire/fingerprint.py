"""Fingerprints: the normalised form of a SQL statement, an outbound URL or a cache key.

Runs on the agent's writer thread (never on the request path) and in the collector, so both
produce identical fingerprints. Literal values never survive normalisation: a statement with a
password in a string literal fingerprints to the same text as one with ``?``.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Callable
from typing import Any

__all__ = [
    "cache_key_template",
    "finish_sql",
    "normalize_sql",
    "params_hash",
    "sql_fingerprint_id",
    "sql_operation",
    "sql_tokens",
    "sql_tokens_many",
    "stable_id",
    "url_template",
]

MAX_SQL = 4000
MASK63 = (1 << 63) - 1

# One scanner over the statement; the first matching alternative wins.
_SQL_TOKEN = re.compile(
    r"""
      (?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
    | (?P<dollar>\$(?P<tag>[A-Za-z_]\w*)?\$.*?(?:\$(?P=tag)?\$|\Z))
    | (?P<string>[EeBbXxNn]?'(?:[^']|'')*(?:'|\Z))
    | (?P<quoted>"(?:[^"]|"")*(?:"|\Z)|`[^`]*(?:`|\Z)|\[[^\]\s]*\])
    | (?P<param>%\([^)]*\)s|%s|\$\d+|\?|(?<![:\w]):[A-Za-z_]\w*)
    | (?P<ident>[A-Za-z_][\w$]*)
    | (?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?))
    | (?P<space>\s+)
    """,
    re.DOTALL | re.VERBOSE,
)
_LIST = re.compile(r"\(\s*\?(?:\s*,\s*\?)*\s*\)")
_IN_LIST = re.compile(r"(?i)\bIN\s*\(\s*\?(?:\s*,\s*\?)*\s*\)")
_VALUES = re.compile(r"(?i)\bVALUES\s*\([^()]*\)(?:\s*,\s*\([^()]*\))*")
# A minus before a placeholder: "-" first (a literal prefix the scanner finds fast), then the
# character before it.
_NEG = re.compile(r"-(?<=[=<>(,\s]-)\s*\?")


def _load_c_tokens_many() -> Callable[[list[Any]], tuple[list[str | None], int]] | None:
    """The C tokenizer's batch form (scans with the interpreter lock released), or None."""
    if _c_tokens is None:
        return None
    try:
        from perfsleuth.wire._fingerprint import tokens_many
    except ImportError:
        return None
    return tokens_many  # type: ignore[no-any-return]


def _load_c_tokens() -> Callable[[str], str] | None:
    """The C tokenizer (wire/_fingerprint.c, built at install when a compiler is there);
    PERFSLEUTH_SPEEDUPS=0 or no build: the Python one, which gives the same text."""
    if os.environ.get("PERFSLEUTH_SPEEDUPS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from perfsleuth.wire._fingerprint import tokens
    except ImportError:
        return None
    return tokens  # type: ignore[no-any-return]


_c_tokens = _load_c_tokens()
_c_tokens_many = _load_c_tokens_many()

try:  # the agent imports this module at start: hashlib (and OpenSSL) cost milliseconds
    from _blake2 import blake2b as _blake2b
except ImportError:  # pragma: no cover - a Python built without it
    from hashlib import blake2b as _blake2b


def normalize_sql(sql: str) -> str:
    """Literals and placeholders -> ``?``, IN-lists and VALUES rows collapsed, comments
    removed, whitespace folded. Never raises."""
    try:
        return _normalize(sql)
    except Exception:  # odd input: mask anything that could be a value
        return re.sub(r"'[^']*'?|\d+", "?", " ".join(str(sql).split()))[:MAX_SQL]


def _normalize(sql: str) -> str:
    if isinstance(sql, bytes):
        sql = sql.decode("utf-8", "replace")
    return finish_sql(sql_tokens(sql))


def sql_tokens(sql: str) -> str:
    """The tokenizer pass of :func:`normalize_sql` (literals and placeholders -> ``?``,
    comments removed, whitespace folded): ``normalize_sql(sql) == finish_sql(sql_tokens(sql))``
    for a str that does not make either raise. Statements differing only in their literals
    mostly share their tokens (IN lists and VALUES rows of other lengths aside): the agent
    caches the rest of the work by them."""
    return _c_tokens(sql) if _c_tokens is not None and type(sql) is str else _tokens(sql)


def sql_tokens_many(statements: list[Any]) -> tuple[list[str | None], int] | None:
    """:func:`sql_tokens` of each statement (None for one that is not a str) and the thread CPU
    nanoseconds spent, the statements scanned in C with the interpreter lock released (other
    threads run meanwhile); None without the C tokenizer. Each statement takes up to four bytes
    a character of scratch memory while scanned (one for a Latin-1 text): callers bound the
    list's total length."""
    many = _c_tokens_many if _c_tokens is not None else None
    return None if many is None else many(statements)


def finish_sql(text: str) -> str:
    """The rest of :func:`normalize_sql` after :func:`sql_tokens`: negative placeholders, IN
    lists and VALUES rows collapsed, trailing semicolons off, the length capped."""
    # Each rewrite only where its pattern can match: the text's whitespace is folded to single
    # spaces, and only "V" and "v" match V without regard to case.
    if "-" in text:
        text = _NEG.sub("?", text)
    if "(?" in text or "( ?" in text:
        text = _collapse_in_lists(text)
    if "V" in text or "v" in text:
        text = _VALUES.sub(
            lambda m: m.group()[:6] + " (...)" if _all_rows_params(m.group()) else m.group(),
            text,
        )
    text = text.rstrip("; ").strip()
    return text[:MAX_SQL]


def _collapse_in_lists(text: str) -> str:
    """``_IN_LIST.sub`` (each ``IN (?, ?)`` -> ``IN (...)``) on folded text, anchored at the
    lists' openings, which str.find reaches faster than the case-insensitive scan would."""
    parts: list[str] = []
    done = 0
    at = text.find("(", 0)
    while at >= 0:
        after = at + 2 if text.startswith(" ?", at + 1) else at + 1
        if text.startswith("?", after) or text.startswith("?", at + 1):
            start = at - 3 if at >= 1 and text[at - 1] == " " else at - 2
            m = _IN_LIST.match(text, start) if start >= done else None
            if m is not None:
                parts.append(text[done:start])
                parts.append(text[start : start + 2] + " (...)")
                done = m.end()
                at = text.find("(", done)
                continue
        at = text.find("(", at + 1)
    if not parts:
        return text
    parts.append(text[done:])
    return "".join(parts)


def _tokens(sql: str) -> str:
    """The tokenizer pass: literals and placeholders -> ``?``, comments removed, whitespace
    folded. The reference for the C version (``_fingerprint.tokens``), which gives the same."""
    out: list[str] = []
    pos = 0
    n = len(sql)
    while pos < n:
        m = _SQL_TOKEN.match(sql, pos)
        if m is None:  # operators and punctuation: one character at a time
            out.append(sql[pos])
            pos += 1
            continue
        pos = m.end()
        kind = m.lastgroup
        if kind == "tag":
            kind = "dollar"
        if kind == "comment" or kind == "space":
            out.append(" ")
        elif kind in ("string", "dollar", "param", "number"):
            out.append("?")
        else:
            out.append(m.group())
    return " ".join("".join(out).split())


def _all_rows_params(values_clause: str) -> bool:
    rows = re.findall(r"\(([^()]*)\)", values_clause)
    return all(all(p.strip() in ("?", "DEFAULT", "NULL") for p in r.split(",")) for r in rows)


def sql_operation(normalized: str) -> str:
    head = normalized.lstrip("( ").split(None, 1)
    word = head[0].upper() if head else ""
    return word if word.isalpha() else "OTHER"


def stable_id(*parts: str | int) -> int:
    """A 63-bit id that is the same in every process and on every machine."""
    h = _blake2b("\x1f".join(map(str, parts)).encode("utf-8", "replace"), digest_size=8)
    return int.from_bytes(h.digest(), "big") & MASK63


def sql_fingerprint_id(normalized: str) -> int:
    return stable_id(normalized)


_UUID = re.compile(r"^[0-9a-fA-F]{8}(?:-?[0-9a-fA-F]{4}){3}-?[0-9a-fA-F]{12}$")
_HEX = re.compile(r"^[0-9a-fA-F]{16,}$")
_EMAIL = re.compile(r"^[^@/\s]+@[^@/\s]+$")


def _segment(seg: str) -> str:
    if not seg:
        return seg
    if seg.isdigit():
        return "{id}"
    if _UUID.match(seg):
        return "{uuid}"
    if _HEX.match(seg):
        return "{hex}"
    if _EMAIL.match(seg):
        return "{email}"
    if len(seg) >= 20 and any(c.isdigit() for c in seg) and any(c.isalpha() for c in seg):
        return "{token}"
    return seg


def url_template(path: str) -> str:
    """Route-ish template of an outbound URL path: ``/users/123/avatar?x=1`` ->
    ``/users/{id}/avatar``. The query string is dropped (it may carry secrets)."""
    try:
        path = path.split("?", 1)[0].split("#", 1)[0]
        if not path:
            return "/"
        return "/".join(_segment(s) for s in path.split("/"))
    except Exception:
        return "/"


def cache_key_template(key: str) -> str:
    """``user:123:profile`` -> ``user:{id}:profile``: the same rules as URL segments, applied
    to the parts of a key split on ``:``, ``/``, ``.`` and ``_``-free separators."""
    try:
        return re.sub(r"[^:/|.]+", lambda m: _segment(m.group()), str(key))[:200]
    except Exception:
        return "?"


def params_hash(params: object) -> int | None:
    """A hash of bound parameters, to spot the same statement run twice with the same values.
    Only ever compared between the calls of one request (one process): Python's own ``hash``
    (randomised per process for strings) is then enough and costs ~0.1 µs where hashing a
    ``repr`` cost ~1 µs. The values themselves are never returned or stored. None for no
    parameters."""
    if params is None:
        return None
    try:
        if isinstance(params, dict):
            if not params:
                return None
            return hash(tuple(sorted(params.items(), key=lambda kv: str(kv[0])))) & MASK63
        if isinstance(params, list):
            params = tuple(params)
        if isinstance(params, tuple) and not params:
            return None
        return hash(params) & MASK63
    except Exception:
        pass  # unhashable values (lists inside, arrays): fall back to their text
    try:
        text = repr(params)
    except Exception:
        text = type(params).__name__
    return zlib.crc32(text.encode("utf-8", "replace"))
