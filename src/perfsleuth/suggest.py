"""Close names for "unknown endpoint ...; did you mean ...?" messages: one rule for the CLI,
the API and the store.

Stdlib only and importing nothing of perfsleuth, so that every layer (store included, which
may not import analysis) can use it.

The rule: names that contain the given one (case-insensitive) come first, in the order known;
then the others difflib rates at least CUTOFF alike, closest first; at most ``n``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

CUTOFF = 0.6  # difflib.SequenceMatcher.ratio(); below it, suggestions are mostly noise


def close_names(name: str, known: Sequence[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``known`` that ``name`` was probably meant to be (see the module)."""
    if n <= 0:
        return []
    low = name.strip().lower()
    out = [k for k in known if low and low in k.lower()][:n]
    if len(out) < n:
        rest = [k for k in known if k not in out]
        out += difflib.get_close_matches(name, rest, n=n - len(out), cutoff=CUTOFF)
    return out


def did_you_mean(name: str, known: Sequence[str], n: int = 3) -> str:
    """``"; did you mean 'a', 'b'?"`` for the close names of ``name``, or "" when none is."""
    close = close_names(name, known, n)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
