"""A finding: what a detector reports, and how sure it is.

A finding names one problem (kind, endpoint, and where applicable the call site and the
statement) with the numbers behind it. Its ``impact_ms_per_min`` is the time the problem
costs per minute of traffic, for ranking: the time attributable to it (say, the repeated calls
beyond the first) divided by the minutes the data window spans (at least one).

Every finding also says how sure it is (``confidence``: high, medium or low), graded in one
place, :func:`assess`, from the evidence counts it rests on (requests, samples, calls...)
against its detector's floors (:data:`perfsleuth.analysis.config.EVIDENCE_FLOORS`); a finding
under a floor is not raised.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from perfsleuth.analysis.config import EVIDENCE_FLOORS, SOFT_FLOORS, Config

__all__ = ["Finding", "assess", "confidence_note", "file_key", "iso", "stable_id"]


@dataclass
class Finding:
    id: str
    kind: str
    endpoint: str
    title: str  # one plain sentence with the numbers
    impact_ms_per_min: float
    callsite: dict[str, Any] | None = None  # {file, line, function}
    fingerprint: str | None = None
    count_per_request: float | None = None
    example_trace_ids: list[str] = field(default_factory=list)
    first_seen: str | None = None  # ISO 8601, UTC
    last_seen: str | None = None
    suggestion: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)  # detector-specific numbers
    # How sure: "high", "medium" or "low" (set by assess(); None before).
    confidence: str | None = None
    # What it rests on: evidence count name -> {"count": n, "floor": its detector's floor}.
    confidence_basis: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def confidence_note(self) -> str:
        """The grade and its counts in words: 'low: 2 slow requests (floor 2), 34 samples
        (floor 20)'."""
        return confidence_note(self.confidence, self.confidence_basis)


# A count at its floor makes a finding "low"; MEDIUM_AT times the floor "medium"; HIGH_AT times
# "high". The weakest count decides: 400 samples from 2 requests are still 2 requests.
MEDIUM_AT = 2.0
HIGH_AT = 4.0
LEVELS = ("low", "medium", "high")


def confidence_note(level: str | None, basis: dict[str, dict[str, float]]) -> str:
    counts = ", ".join(
        f"{_num(b['count'])} {name.replace('_', ' ')} (floor {_num(b['floor'])})"
        for name, b in basis.items()
    )
    return f"{level or 'unrated'}: {counts}" if counts else (level or "unrated")


def _num(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.1f}"


def assess(f: Finding, config: Config) -> bool:
    """Grade ``f`` from its evidence counts against its detector's floors (sets ``confidence``
    and ``confidence_basis``); False when a count is under a floor that holds findings back.

    A kind with no floors, or a finding carrying none of its counts, is left unrated (None).
    """
    floors = EVIDENCE_FLOORS.get(f.kind, {})
    basis: dict[str, dict[str, float]] = {}
    grade = len(LEVELS) - 1
    for name, setting in floors.items():
        count = f.evidence.get(name)
        if isinstance(count, bool) or not isinstance(count, int | float):
            continue
        floor = float(config.get(f.kind, setting))
        basis[name] = {"count": count, "floor": floor}
        if count < floor and (f.kind, name) not in SOFT_FLOORS:
            return False
        times = count / max(floor, 1.0)
        grade = min(grade, 2 if times >= HIGH_AT else 1 if times >= MEDIUM_AT else 0)
    f.confidence_basis = basis
    f.confidence = LEVELS[grade] if basis else None
    return True


def stable_id(kind: str, endpoint: str, key: Any = "") -> str:
    """The same problem gets the same id in every run and every data directory: a hash of
    what identifies it (never of row ids, timestamps or absolute paths)."""
    text = "\x1f".join((kind, endpoint, repr(key)))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=6).hexdigest()


def file_key(path: str | None) -> str:
    """The machine-independent part of a source path (for ids): its last two components."""
    if not path:
        return ""
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.replace(tzinfo=UTC).isoformat()
