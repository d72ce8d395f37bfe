"""``compare``: did the change help? Two sides of the recorded requests, per endpoint.

A side is a time range (``2026-11-20T10:00/2026-11-20T11:00``, ``last-1h``), a release (the
``version`` the agent records, when the store has that column), or a value of a tag or attribute
(``tag:variant`` compares ``variant=a`` with ``variant=b``). Per endpoint: requests, p50/p95/p99
of each side with distribution-free order-statistic confidence intervals, the change, a two-sided
Mann-Whitney rank test on the two latency distributions with the false discovery rate controlled
across endpoints (Benjamini-Hochberg), and what moved with it (calls and their time per request,
rows, CPU, GC, errors, findings that appeared or went away).

An endpoint is ``slower``/``faster`` when its q-value is at most ``alpha`` and its p50 or p95
moved by ``min_change`` or more in the direction the ranks say; ``same`` otherwise;
``too_few`` with fewer than ``min_requests`` requests on a side.

It is one module because it is one pipeline read top to bottom (the sides, the statistics per
endpoint, the verdict and what moved with it) that the CLI, the API and ``perfsleuth load``
call through a few functions; split, each part would only make sense next to the others.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from perfsleuth.analysis import stats
from perfsleuth.analysis.config import Config, load_config
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, assess
from perfsleuth.store.base import Store

ALPHA = 0.01  # the false discovery rate accepted among the endpoints called changed
MIN_CHANGE = 0.05  # p50 or p95 must move this much (a fraction) to be called changed
MIN_REQUESTS = 20  # per side, for quantiles and a rank test to mean something
MAX_VALUES = 50_000  # durations kept per endpoint and side (an even subsample beyond)

VERDICTS = ("faster", "slower", "same", "too_few")


class CompareError(ValueError):
    """A side that cannot be understood or selects nothing; the message is one sentence."""


@dataclass
class Side:
    label: str
    where: str  # a condition on the requests view
    params: list[Any] = field(default_factory=list)
    start: datetime | None = None  # naive UTC, for detectors reading evidence tables by time
    end: datetime | None = None


# ---------------------------------------------------------------------------------- sides

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)\s*$", re.IGNORECASE)
_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    m = _DURATION.match(text)
    if not m:
        raise CompareError(f"invalid duration {text!r}: use e.g. 30m, 1h, 2d")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_time(text: str) -> datetime:
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError as e:
        raise CompareError(f"invalid time {text!r}: use ISO 8601, e.g. 2026-11-20T10:00") from e
    if t.tzinfo is not None:
        t = t.astimezone(UTC).replace(tzinfo=None)
    return t


def time_side(spec: str, now: datetime | None = None) -> Side:
    """``START/END`` (ISO 8601, UTC unless an offset is given) or ``last-DURATION`` (up to now)."""
    s = spec.strip()
    if s.lower().startswith("last-"):
        end = now or datetime.now(UTC).replace(tzinfo=None)
        start = end - parse_duration(s[5:])
    else:
        first, sep, second = s.partition("/")
        if not sep:
            raise CompareError(
                f"invalid time range {spec!r}: use START/END (2026-11-20T10:00/2026-11-20T11:00) "
                "or last-1h"
            )
        start, end = _parse_time(first), _parse_time(second)
    if end <= start:
        raise CompareError(f"the time range {spec!r} ends before it starts")
    return Side(s, "ts >= ? AND ts < ?", [start, end], start, end)


def parse_by(by: str) -> tuple[str, str]:
    """``tag:NAME``, ``attr:NAME`` or ``release`` -> (kind, name)."""
    b = by.strip()
    if b.lower() == "release":
        return "release", ""
    kind, sep, name = b.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in ("tag", "attr") or not name.strip():
        raise CompareError(f"invalid --by {by!r}: use tag:NAME, attr:NAME or release")
    return kind, name.strip()


def has_version(store: Store) -> bool:
    rows = store.query(
        "SELECT count(*) AS n FROM information_schema.columns "
        "WHERE table_name = 'requests' AND column_name = 'version'"
    )
    return bool(rows and rows[0]["n"])


def values_of(store: Store, by: str, window: Side | None = None) -> list[dict[str, Any]]:
    """The values of a tag, attribute or release with their request counts and first times,
    oldest first."""
    kind, name = parse_by(by)
    scope, params = ("true", []) if window is None else (window.where, list(window.params))
    if kind == "release":
        if not has_version(store):
            raise CompareError("this store records no release (requests have no version column)")
        sql = (
            f"SELECT version AS value, count(*) AS n, min(ts) AS first FROM requests "
            f"WHERE version IS NOT NULL AND {scope} GROUP BY 1 ORDER BY first, value"
        )
        return store.query(sql, params)
    sql = (
        "SELECT value, count(*) AS n, min(ts) AS first FROM attributes "
        f"WHERE kind = ? AND key = ? AND value IS NOT NULL AND {scope} "
        "GROUP BY 1 ORDER BY first, value"
    )
    return store.query(sql, [kind, name, *params])


def value_sides(
    store: Store,
    by: str,
    a: str | None = None,
    b: str | None = None,
    window: Side | None = None,
) -> tuple[Side, Side]:
    """Two sides by the values of a tag, attribute or release. Without ``a``/``b``: the two
    most common values (releases: the older one is a; tags and attributes: in name order)."""
    kind, name = parse_by(by)
    values = values_of(store, by, window)
    if a is None or b is None:
        known = [str(v["value"]) for v in values]
        if len(known) < 2 and (a is None and b is None):
            what = "releases" if kind == "release" else f"values of {kind} {name!r}"
            raise CompareError(f"need two {what} to compare, found {len(known)}: {known}")
        top = sorted(values, key=lambda v: -int(v["n"]))[:2]
        pair = [str(v["value"]) for v in top]
        if kind != "release":
            pair.sort()
        else:
            pair = [v for v in known if v in pair]
        a = a if a is not None else next(v for v in pair if v != b)
        b = b if b is not None else next(v for v in pair if v != a)
    extra, extra_params = ("", []) if window is None else (f" AND {window.where}", window.params)
    sides = []
    for value in (a, b):
        if kind == "release":
            where, params = "version = ?", [value]
        else:
            where = (
                "trace_id IN (SELECT trace_id FROM attributes "
                "WHERE kind = ? AND key = ? AND value = ?)"
            )
            params = [kind, name, value]
        label = f"{value}" if kind == "release" else f"{name}={value}"
        start = window.start if window else None
        end = window.end if window else None
        sides.append(Side(label, where + extra, [*params, *extra_params], start, end))
    return sides[0], sides[1]


# ---------------------------------------------------------------------------- per endpoint

# What moved with the latency: per request on each side.
_MOVED = """
SELECT endpoint, count(*) AS n,
    avg(db_calls) AS db_calls, avg(db_ms) AS db_ms,
    avg(http_calls) AS http_calls, avg(http_ms) AS http_ms,
    avg(cache_calls) AS cache_calls, avg(cache_ms) AS cache_ms,
    avg(cpu_ms) AS cpu_ms, avg(coalesce(gc_ms, 0)) AS gc_ms,
    avg(CASE WHEN coalesce(status, 0) >= 500 OR error IS NOT NULL THEN 1.0 ELSE 0.0 END)
        AS error_rate
FROM requests WHERE {where} GROUP BY 1
"""

_ROWS = """
WITH s AS (SELECT trace_id, endpoint FROM requests WHERE {where})
SELECT s.endpoint, sum(c.rows) AS rows
FROM calls c JOIN s USING (trace_id) WHERE c.rows IS NOT NULL GROUP BY 1
"""

_DURATIONS = """
SELECT endpoint, list(duration_ms) AS d
FROM requests WHERE duration_ms IS NOT NULL AND {where} GROUP BY 1
"""

MOVED_FIELDS = (
    "db_calls",
    "db_ms",
    "http_calls",
    "http_ms",
    "cache_calls",
    "cache_ms",
    "rows",
    "cpu_ms",
    "gc_ms",
    "error_rate",
)


def _durations(store: Store, side: Side) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for r in store.query(_DURATIONS.format(where=side.where), side.params):
        d = np.sort(np.asarray(r["d"], dtype=np.float64))
        if len(d) > MAX_VALUES:  # every k-th of the sorted values keeps the distribution
            d = d[np.linspace(0, len(d) - 1, MAX_VALUES).round().astype(np.int64)]
        out[r["endpoint"]] = d
    return out


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


def _side_stats(d: np.ndarray | None) -> dict[str, Any]:
    if d is None or len(d) == 0:
        return {"count": 0, "p50_ms": None, "p95_ms": None, "p99_ms": None, "ci": {}}
    out: dict[str, Any] = {"count": len(d), "ci": {}}
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        qi = stats.quantile_ci(d, q)
        out[f"{name}_ms"] = qi.value
        out["ci"][f"{name}_ms"] = [qi.low, qi.high]
    out["mean_ms"] = float(d.mean())
    return out


def _change(a: dict[str, Any], b: dict[str, Any], name: str) -> tuple[float | None, float | None]:
    """(b / a - 1, its half-width): the two intervals' relative half-widths in quadrature."""
    va, vb = a.get(f"{name}_ms"), b.get(f"{name}_ms")
    if va is None or vb is None or va <= 0:
        return None, None
    ha = (a["ci"][f"{name}_ms"][1] - a["ci"][f"{name}_ms"][0]) / 2.0 / va
    hb = (b["ci"][f"{name}_ms"][1] - b["ci"][f"{name}_ms"][0]) / 2.0 / max(vb, 1e-9)
    ratio = vb / va
    return ratio - 1.0, ratio * math.hypot(ha, hb)


def endpoint_rows(
    durations: dict[str, tuple[np.ndarray | None, np.ndarray | None]],
    *,
    alpha: float = ALPHA,
    min_change: float = MIN_CHANGE,
    min_requests: int = MIN_REQUESTS,
) -> list[dict[str, Any]]:
    """Per endpoint (``durations[endpoint]``: the sorted latencies in ms of side a and side
    b), the quantiles of each side with their intervals, the change, the two-sided
    Mann-Whitney test, Benjamini-Hochberg q-values across the endpoints and the verdict; in
    endpoint order. ``compare`` and ``perfsleuth load`` both judge with it."""
    rows: list[dict[str, Any]] = []
    for ep in sorted(durations):
        xa, xb = durations[ep]
        sa, sb = _side_stats(xa), _side_stats(xb)
        row: dict[str, Any] = {"endpoint": ep, "a": sa, "b": sb}
        for name in ("p50", "p95", "p99"):
            ch, pm = _change(sa, sb, name)
            row[f"{name}_change"] = ch
            row[f"{name}_change_pm"] = pm
        row["p_value"] = None
        row["delta"] = None
        if sa["count"] >= min_requests and sb["count"] >= min_requests:
            assert xa is not None and xb is not None
            t = stats.mann_whitney(xa, xb)
            row["p_value"], row["delta"] = t.p_value, t.delta
        rows.append(row)
    tested = [r for r in rows if r["p_value"] is not None]
    for r, q in zip(tested, stats.benjamini_hochberg([r["p_value"] for r in tested]), strict=True):
        r["q_value"] = q
    for r in rows:
        r.setdefault("q_value", None)
        r["significant"] = r["q_value"] is not None and r["q_value"] <= alpha
        r["verdict"] = _verdict(r, min_change)
    return rows


def sort_rows(rows: list[dict[str, Any]]) -> None:
    """Slower first, then faster, then the rest (compare's table order)."""
    rows.sort(key=_order)


def compare(
    store: Store,
    a: Side,
    b: Side,
    *,
    config: Config | None = None,
    alpha: float = ALPHA,
    min_change: float = MIN_CHANGE,
    min_requests: int = MIN_REQUESTS,
    findings: bool = True,
) -> dict[str, Any]:
    """The comparison of side ``b`` against side ``a``: ``{"a", "b", "verdict",
    "summary", "endpoints": [...], "findings": {"appeared": [...], "gone": [...]}}``."""
    da, db = _durations(store, a), _durations(store, b)
    ma, mb = _moved_with_counts(store, a), _moved_with_counts(store, b)
    rows = endpoint_rows(
        {ep: (da.get(ep), db.get(ep)) for ep in set(da) | set(db)},
        alpha=alpha,
        min_change=min_change,
        min_requests=min_requests,
    )
    for r in rows:
        r["moved"] = _moved_diff(ma.get(r["endpoint"], {}), mb.get(r["endpoint"], {}))
    out: dict[str, Any] = {
        "a": a.label,
        "b": b.label,
        "settings": {"alpha": alpha, "min_change": min_change, "min_requests": min_requests},
        "endpoints": rows,
        "findings": {"appeared": [], "gone": []},
    }
    if findings:
        fa, fb = side_findings(store, a, config), side_findings(store, b, config)
        ida, idb = {f.id for f in fa}, {f.id for f in fb}
        out["findings"] = {
            "appeared": [_brief(f) for f in fb if f.id not in ida],
            "gone": [_brief(f) for f in fa if f.id not in idb],
        }
        verdicts = {r["endpoint"]: r["verdict"] for r in rows}
        for item in out["findings"]["appeared"] + out["findings"]["gone"]:
            # With too few requests on a side, a finding may be missing there for lack of evidence.
            item["endpoint_verdict"] = verdicts.get(item["endpoint"])
        for r in rows:
            r["findings_appeared"] = [
                f for f in out["findings"]["appeared"] if f["endpoint"] == r["endpoint"]
            ]
            r["findings_gone"] = [
                f for f in out["findings"]["gone"] if f["endpoint"] == r["endpoint"]
            ]
    sort_rows(rows)
    out["verdict"] = verdict_line(rows, b.label)
    out["summary"] = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    return out


def _moved_with_counts(store: Store, side: Side) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    counts: dict[str, int] = {}
    for r in store.query(_MOVED.format(where=side.where), side.params):
        counts[r["endpoint"]] = int(r["n"])
        out[r["endpoint"]] = {k: _f(r.get(k)) for k in MOVED_FIELDS if k != "rows"}
        out[r["endpoint"]]["rows"] = 0.0
    for r in store.query(_ROWS.format(where=side.where), side.params):
        if r["endpoint"] in out:
            out[r["endpoint"]]["rows"] = float(r["rows"] or 0) / max(counts[r["endpoint"]], 1)
    return out


def _moved_diff(
    a: dict[str, float | None], b: dict[str, float | None]
) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for k in MOVED_FIELDS:
        va, vb = a.get(k), b.get(k)
        out[k] = {"a": va, "b": vb, "change": None if va is None or vb is None else vb - va}
    return out


def _verdict(r: dict[str, Any], min_change: float) -> str:
    if r["p_value"] is None:
        return "too_few"
    if not r["significant"]:
        return "same"
    up = r["delta"] > 0
    moved = [c for c in (r["p50_change"], r["p95_change"]) if c is not None]
    if up and any(c >= min_change for c in moved):
        return "slower"
    if not up and any(c <= -min_change for c in moved):
        return "faster"
    return "same"


def _order(r: dict[str, Any]) -> tuple[int, float, str]:
    rank = {"slower": 0, "faster": 1, "same": 2, "too_few": 3}[r["verdict"]]
    return rank, -abs(r["p95_change"] or 0.0), r["endpoint"]


def _pct(x: float) -> str:
    return f"{x * 100:+.0f} %"


def verdict_line(rows: list[dict[str, Any]], b_label: str) -> str:
    """ "b is faster on 7 endpoints, slower on 1: GET /x p95 +38 % (±9 %), unchanged on 12, too
    few requests on 3"."""
    n = {v: [r for r in rows if r["verdict"] == v] for v in VERDICTS}
    parts: list[str] = []

    def eps(k: int) -> str:
        return f"{k} endpoint" + ("" if k == 1 else "s")

    def detail(rs: list[dict[str, Any]]) -> str:
        shown = []
        for r in rs[:3]:
            # The quantile that moved most (a shift of the bulk can leave the tail in place).
            name = max(("p95", "p50"), key=lambda k: abs(r[f"{k}_change"] or 0.0))
            ch, pm = r[f"{name}_change"], r[f"{name}_change_pm"]
            if ch is None:
                continue
            s = f"{r['endpoint']} {name} {_pct(ch)}"
            if pm is not None and math.isfinite(pm):
                s += f" (±{pm * 100:.0f} %)"
            shown.append(s)
        more = len(rs) - len(shown)
        return ": " + ", ".join(shown) + (f" and {more} more" if more > 0 and shown else "")

    if n["faster"]:
        parts.append(f"faster on {eps(len(n['faster']))}" + detail(n["faster"]))
    if n["slower"]:
        parts.append(f"slower on {eps(len(n['slower']))}" + detail(n["slower"]))
    if n["same"]:
        parts.append(f"unchanged on {eps(len(n['same']))}")
    if n["too_few"]:
        parts.append(f"too few requests on {eps(len(n['too_few']))}")
    if not parts:
        return f"{b_label}: no requests on either side"
    head = f"{b_label} is " if (n["faster"] or n["slower"]) else f"{b_label}: "
    if not (n["faster"] or n["slower"]):
        return head + "no significant change; " + ", ".join(parts)
    return head + ", ".join(parts)


# ------------------------------------------------------------------------------ findings


class SideContext(Context):
    """A detector :class:`Context` whose ``r`` and ``c`` are one side's requests and their
    calls (detectors reading evidence tables by time see the side's start as the cutoff)."""

    def __init__(self, store: Store, config: Config, side: Side) -> None:
        self.store = store
        self.config = config
        self.endpoint = None
        self.cutoff = side.start
        self._with = (
            f"r AS (SELECT * FROM requests WHERE {side.where}), "
            "c AS (SELECT * FROM calls WHERE trace_id IN (SELECT trace_id FROM r))"
        )
        self._params = list(side.params)
        span = self.query("SELECT count(*) AS n, min(ts) AS first, max(ts) AS last FROM r")[0]
        self.requests = int(span["n"])
        self.first_seen = span["first"]
        self.last_seen = span["last"]
        seconds = 0.0
        if self.first_seen is not None and self.last_seen is not None:
            seconds = (self.last_seen - self.first_seen).total_seconds()
        self.minutes = max(seconds / 60.0, 1.0)
        self.cwd = os.getcwd()


def side_findings(store: Store, side: Side, config: Config | None = None) -> list[Finding]:
    """The findings of one side's requests (the regression detector, which needs a history,
    is left out)."""
    from perfsleuth.analysis.detectors import DETECTORS

    cfg = config or load_config()
    ctx = SideContext(store, cfg, side)
    out: list[Finding] = []
    if ctx.requests == 0:
        return out
    for kind, detect in DETECTORS.items():
        if kind == "regression" or not cfg.enabled.get(kind, True):
            continue
        out.extend(f for f in detect(ctx) if f.id not in cfg.ignore and assess(f, cfg))
    out.sort(key=lambda f: (-f.impact_ms_per_min, f.kind, f.endpoint, f.id))
    return out


def _brief(f: Finding) -> dict[str, Any]:
    return {"id": f.id, "kind": f.kind, "endpoint": f.endpoint, "title": f.title}


def histograms(
    store: Store, a: Side, b: Side, bins: int = 40, endpoint: str | None = None
) -> dict[str, dict[str, list[float]]]:
    """Per endpoint, the two sides' latency distributions on shared log-spaced bins (for an
    overlaid chart): ``{"edges": [...], "a": [shares], "b": [shares]}``, shares of each side's
    requests so that sides of different sizes compare."""
    da, db = _durations(store, a), _durations(store, b)
    out: dict[str, dict[str, list[float]]] = {}
    for ep in sorted(set(da) | set(db)):
        if endpoint is not None and ep != endpoint:
            continue
        xa, xb = da.get(ep, np.empty(0)), db.get(ep, np.empty(0))
        both = np.concatenate([xa, xb])
        both = both[both > 0]
        if len(both) == 0:
            continue
        lo, hi = float(both.min()), float(both.max())
        if hi <= lo:
            hi = lo * 1.01 + 1e-3
        edges = np.geomspace(lo, hi, bins + 1)
        ha = np.histogram(np.clip(xa, lo, hi), edges)[0] / max(len(xa), 1)
        hb = np.histogram(np.clip(xb, lo, hi), edges)[0] / max(len(xb), 1)
        out[ep] = {
            "edges": [float(e) for e in edges],
            "a": [float(v) for v in ha],
            "b": [float(v) for v in hb],
        }
    return out
