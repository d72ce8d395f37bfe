"""Findings: what the detectors report, and :func:`find`, which runs them.

A finding names one problem (kind, endpoint, and where applicable the call site and the
statement) with the numbers behind it. Its ``impact_ms_per_min`` is the time the problem
costs per minute of traffic, for ranking: the time attributable to it (say, the repeated calls
beyond the first) divided by the minutes the data window spans (at least one).

Every finding also says how sure it is (``confidence``: high, medium or low), graded in one
place, :func:`assess`, from the evidence counts it rests on (requests, samples, calls...)
against its detector's floors (:data:`perfsleuth.analysis.config.EVIDENCE_FLOORS`); a finding
under a floor is not raised.

Detectors work in SQL over the logical views (``requests``, ``calls``, ...) through
:class:`Context`, which scopes every query to the window and endpoint asked for; only per-group
aggregates ever come back to Python.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from perfsleuth.analysis import frames
from perfsleuth.analysis.config import (
    DEFAULTS,
    EVIDENCE_FLOORS,
    SOFT_FLOORS,
    Config,
    ConfigError,
    load_config,
)
from perfsleuth.store.base import Store

__all__ = [
    "DEFAULTS",
    "Config",
    "ConfigError",
    "Context",
    "Finding",
    "assess",
    "find",
    "load_config",
    "stable_id",
]


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


def _utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Context:
    """What a detector sees: the store, its settings, and the scope of the question.

    :meth:`query` runs SQL in which ``r`` (requests) and ``c`` (calls) are already restricted
    to the window and the endpoint asked for.
    """

    def __init__(
        self,
        store: Store,
        config: Config,
        since: timedelta | None = None,
        endpoint: str | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.endpoint = endpoint
        self.cutoff = None if since is None else _utcnow() - since
        conds: list[str] = []
        params: list[Any] = []
        if self.cutoff is not None:
            conds.append("ts >= ?")
            params.append(self.cutoff)
        if endpoint is not None:
            conds.append("endpoint = ?")
            params.append(endpoint)
        where = " AND ".join(conds) or "true"
        self._with = (
            f"r AS (SELECT * FROM requests WHERE {where}), c AS (SELECT * FROM calls WHERE {where})"
        )
        self._params = params * 2
        span = self.query("SELECT count(*) AS n, min(ts) AS first, max(ts) AS last FROM r")[0]
        self.requests = int(span["n"])
        self.first_seen: datetime | None = span["first"]
        self.last_seen: datetime | None = span["last"]
        # Minutes of traffic, at least one (a 10-second demo is not "6 x" a minute).
        seconds = 0.0
        if self.first_seen is not None and self.last_seen is not None:
            seconds = (self.last_seen - self.first_seen).total_seconds()
        self.minutes = max(seconds / 60.0, 1.0)
        self.cwd = os.getcwd()

    def t(self, kind: str, name: str) -> Any:
        """A detector setting."""
        return self.config.get(kind, name)

    def query(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        sql = sql.strip()
        if sql[:4].upper() == "WITH":
            sql = f"WITH {self._with}, {sql[4:].lstrip()}"
        else:
            sql = f"WITH {self._with} {sql}"
        return self.store.query(sql, [*self._params, *params])

    def per_min(self, ms: float | None) -> float:
        return float(ms or 0.0) / self.minutes

    def fingerprints(self, ids: set[int]) -> dict[int, str]:
        ids = {i for i in ids if i is not None}
        if not ids:
            return {}
        rows = self.store.query(
            "SELECT id, text FROM fingerprints WHERE list_contains(?, id)", [sorted(ids)]
        )
        return {r["id"]: r["text"] for r in rows}

    def with_statements(
        self, rows: list[dict[str, Any]]
    ) -> list[tuple[dict[str, Any], str | None, dict[str, Any] | None]]:
        """(row, statement text, call site) of detector rows keyed by fingerprint_id and
        site_id: the two dictionary lookups every per-statement detector makes."""
        sites = frames.locations(self.store, (r["site_id"] for r in rows))
        fps = self.fingerprints({r["fingerprint_id"] for r in rows})
        out = []
        for r in rows:
            site = sites.get(r["site_id"])
            out.append((r, fps.get(r["fingerprint_id"]), site.site() if site is not None else None))
        return out


def find(
    store: Store,
    since: timedelta | None = None,
    endpoint: str | None = None,
    config: Config | None = None,
    kinds: list[str] | None = None,
) -> list[Finding]:
    """Run the enabled detectors (or only ``kinds``); findings sorted by impact, highest
    first (ties by kind, endpoint and id, so the order is stable)."""
    from perfsleuth.analysis.detectors import DETECTORS

    cfg = config or load_config()
    ctx = Context(store, cfg, since=since, endpoint=endpoint)
    out: list[Finding] = []
    if ctx.requests == 0:
        return out
    for kind, detect in DETECTORS.items():
        if kinds is not None and kind not in kinds:
            continue
        if not cfg.enabled.get(kind, True):
            continue
        out.extend(f for f in detect(ctx) if f.id not in cfg.ignore and assess(f, cfg))
    if endpoint is not None:  # service-wide findings (cpu_starved, gc_pressure's) are no one's
        out = [f for f in out if f.endpoint == endpoint]
    out.sort(key=lambda f: (-f.impact_ms_per_min, f.kind, f.endpoint, f.id))
    return out
