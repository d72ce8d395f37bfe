"""Numbers and statements as they appear in finding titles, and time spans as users write
them (``--since 24h``, ``?since=7d``).

The one rule for milliseconds and shares, used by finding titles (:func:`ms`, :func:`pct`), the
CLI's tables (``cli/render.py``) and the web UI (``fmtMs`` and ``fmtPct`` in
``web/src/format.ts``, checked against these functions by tests/test_formats.py):

- milliseconds (:func:`ms_number`): under 1 two decimals (0.35), under 10 one (4.2), else
  whole with thousands separators (63, 1,250); by absolute value;
- a share 0..1 as a percentage (:func:`pct_number`): exactly 0 is "0%", under 10 % one decimal
  (4.2%), else whole (63%), "%" without a space;
- rounding half away from zero on the float's exact value (JavaScript's ``toFixed`` and
  ``Intl.NumberFormat``); no value (None, NaN, infinite) is "-".

Prose adds the unit and writes 10 s and more in seconds with one decimal ("12.3 s"); a missing
value in prose is "?".
"""

from __future__ import annotations

import math
import os
import re
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)


def span_seconds(value: str) -> float | None:
    """'15m', '1h', '24h', '7d' (also s and w, any case) -> seconds; None when ``value`` is
    not a number and one of those units. Seconds, not a timedelta: callers check their bounds
    first ("99999999999d" is beyond what a timedelta holds)."""
    m = _DURATION.match(value)
    if not m:
        return None
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def _fixed(v: float, digits: int) -> str:
    """``v`` with ``digits`` decimals and thousands separators, rounded half away from zero."""
    d = Decimal(v).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
    return f"{d:,.{digits}f}"


def _missing(v: float | None) -> bool:
    return v is None or not math.isfinite(v)


def ms_number(v: float | None) -> str:
    """Milliseconds without the unit, by the module's rule: 0.35, 4.2, 63, 1,250."""
    if v is None or _missing(float(v)):
        return "-"
    a = abs(float(v))
    return _fixed(float(v), 2 if a < 1 else 1 if a < 10 else 0)


def pct_number(share: float | None) -> str:
    """A share 0..1 as a percentage, by the module's rule: 0%, 4.2%, 63%."""
    if share is None or _missing(float(share)):
        return "-"
    p = float(share) * 100
    if p == 0:
        return "0%"
    return _fixed(p, 1 if abs(p) < 10 else 0) + "%"


def ms(v: float | None) -> str:
    """Milliseconds in a sentence: "4.2 ms", "1,250 ms", "12.3 s"."""
    if v is None or _missing(float(v)):
        return "?"
    if abs(v) >= 10_000:
        return f"{_fixed(v / 1000, 1)} s"
    return f"{ms_number(v)} ms"


def pct(share: float | None) -> str:
    """A share in a sentence: "4.2%"."""
    return "?" if share is None else pct_number(share)


def count(v: float | None) -> str:
    if v is None:
        return "?"
    return f"{v:,.0f}" if float(v).is_integer() or v >= 100 else f"{v:,.1f}"


def size(b: float | None) -> str:
    if b is None:
        return "?"
    if b >= 1_000_000:
        return f"{b / 1_000_000:.1f} MB"
    if b >= 1_000:
        return f"{b / 1_000:.0f} KB"
    return f"{b:.0f} bytes"


def statement(text: str | None, n: int = 80) -> str:
    t = " ".join(str(text or "?").split())
    return t if len(t) <= n else t[: n - 1] + "…"


def where(site: dict[str, Any] | None) -> str:
    if not site:  # e.g. OpenTelemetry spans without code.* attributes: no site is invented
        return "an unknown call site (no code location was recorded)"
    f = os.path.basename(site.get("file") or "?")
    return f"{site.get('function') or '?'} ({f}:{site.get('line') or '?'})"
