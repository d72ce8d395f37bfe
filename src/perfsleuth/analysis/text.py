"""Numbers and statements as they appear in finding titles, and time spans as users write
them (``--since 24h``, ``?since=7d``)."""

from __future__ import annotations

import os
import re
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


def ms(v: float | None) -> str:
    if v is None:
        return "?"
    if v >= 10_000:
        return f"{v / 1000:,.1f} s"
    if v >= 10:
        return f"{v:,.0f} ms"
    if v >= 1:
        return f"{v:.1f} ms"
    return f"{v:.2f} ms"


def pct(share: float | None) -> str:
    if share is None:
        return "?"
    v = share * 100
    return f"{v:.1f}%" if v < 10 else f"{v:.0f}%"


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
