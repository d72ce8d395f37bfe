"""Coercion of record values into column values: one rule for every table.

Records come from agents, hand-written tools and OTLP exporters, so any field may hold any JSON
value. Each function here takes whatever came and returns the column's type or None (a bad
field becomes NULL); none raises. Times are ns since the epoch; anything at or before the epoch
or after :data:`TS_MAX` is a broken clock and is replaced by the time of ingest.
"""

from __future__ import annotations

import json
from datetime import date, timedelta
from typing import Any

NS_PER_DAY = 86_400 * 10**9
EPOCH = date(1970, 1, 1)
INT64_MAX = (1 << 63) - 1
ID_MASK = INT64_MAX  # ids are 63-bit; anything wider is folded so references still match
TS_MAX = 7_258_118_400 * 10**9  # 2200-01-01


def loads(payload: bytes) -> Any:
    """``json.loads``; ValueError for anything it refuses, nesting too deep included."""
    try:
        return json.loads(payload)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def text(s: str) -> str:
    """``s`` as valid UTF-8 text: a lone surrogate (JSON's ``"\\ud800"``) becomes ``?``
    (Arrow and DuckDB refuse such a string)."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return s.encode("utf-8", "replace").decode("utf-8")
    return s


def as_str(v: Any) -> str | None:
    """A string column's value: strings as they are, numbers and booleans as their JSON text,
    lists and objects as JSON."""
    if v is None:
        return None
    if isinstance(v, str):
        return text(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    try:
        return text(json.dumps(v, default=str, ensure_ascii=False))
    except (RecursionError, ValueError):
        return None


def as_int(v: Any) -> int | None:
    """An int64 from a JSON value (bool, int, float or numeric string), else None."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v if -INT64_MAX - 1 <= v <= INT64_MAX else None
    if isinstance(v, float) and v == v and abs(v) < 9.2e18:
        return int(v)
    if isinstance(v, str):
        try:
            return as_int(int(v))
        except ValueError:
            return None
    return None


def as_int32(v: Any) -> int | None:
    """:func:`as_int` within int32 (statuses, counts, line numbers), else None."""
    i = as_int(v)
    return i if i is not None and -(2**31) <= i < 2**31 else None


def as_id(v: Any) -> int | None:
    """A dictionary id (fingerprint, location, stack): an int, or its decimal or hex text;
    non-negative ids wider than 63 bits are folded by :data:`ID_MASK`."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v & ID_MASK if v >= 0 else (v if v >= -INT64_MAX - 1 else None)
    if isinstance(v, str):
        try:
            return as_id(int(v, 16) if not v.isdigit() else int(v))
        except ValueError:
            return None
    return None


def as_bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return bool(v)
    return None


def as_float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return float(v)
    except OverflowError:  # an int beyond a double
        return None


def ns_to_ms(v: Any) -> float | None:
    n = as_int(v)
    return n / 1e6 if n is not None else None


def sane_ts(v: Any, now_ns: int) -> int:
    """A timestamp in ns: ``v`` when it is one within (epoch, TS_MAX), else ``now_ns``."""
    t = as_int(v)
    return t if t is not None and 0 < t < TS_MAX else now_ns


def day_of(ts_ns: int) -> date:
    return EPOCH + timedelta(days=ts_ns // NS_PER_DAY)
