"""Tables and the trace waterfall, as Rich renderables (user data is never parsed as markup)."""

from __future__ import annotations

import math
import os
from collections import Counter
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from perfsleuth.analysis import text

KIND_STYLE = {"db": "cyan", "http": "magenta", "cache": "yellow"}
BAR_WIDTH = 32
FOLD_KEEP = 3  # calls shown per repeated call site before folding the rest
FOLD_MIN = 6  # fold a call site only when it repeats at least this often
FINGERPRINT_CHARS = 70


# ---------------------------------------------------------------------------------- formats


def ms(value: Any) -> str:
    """Milliseconds without the unit (the rule of :mod:`perfsleuth.analysis.text`)."""
    return text.ms_number(None if value is None else float(value))


def pct(value: Any, *, zero: str = "0%") -> str:
    """A share 0..1 as a percentage (the rule of :mod:`perfsleuth.analysis.text`); ``zero``:
    how a table shows exactly 0 ("-" where 0 means none)."""
    if value is None:
        return "-"
    return zero if float(value) == 0 else text.pct_number(float(value))


def num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    v = float(value)
    if v == int(v):
        return f"{int(v):,}"
    return f"{v:,.{digits}f}"


def when(ts: Any) -> str:
    """An ISO 8601 timestamp as local time: HH:MM:SS today, else with the date."""
    if not ts:
        return "-"
    try:
        t = datetime.fromisoformat(str(ts))
    except ValueError:
        return str(ts)
    if t.tzinfo is not None:
        t = t.astimezone()
    if t.date() == datetime.now().date():
        return t.strftime("%H:%M:%S")
    return t.strftime("%Y-%m-%d %H:%M:%S")


def short_path(path: str | None) -> str:
    """A source path relative to the working directory when inside it, else after
    site-packages, else relative to the home directory, else as is."""
    if not path:
        return "?"
    if path.startswith("<"):
        return path
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = ""
    p = os.path.abspath(path) if os.path.isabs(path) else path
    if cwd and p.startswith(cwd.rstrip(os.sep) + os.sep):
        return os.path.relpath(p, cwd)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        i = p.rfind(marker)
        if i >= 0:
            return p[i + len(marker) :]
    home = os.path.expanduser("~")
    if home not in ("", "/") and p.startswith(home.rstrip(os.sep) + os.sep):
        return "~" + p[len(home.rstrip(os.sep)) :]
    return p


def site_text(site: dict[str, Any] | None) -> str:
    if not site:
        return "-"
    where = f"{short_path(site.get('file'))}:{site.get('line', '?')}"
    func = site.get("function") or site.get("func")
    return f"{where} {func}" if func else where


def truncate(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


# ---------------------------------------------------------------------------------- top


GROUP_TITLES = {"endpoint": "endpoint", "user": "user", "tenant": "tenant"}


def top_table(rows: list[dict[str, Any]], by: tuple[str, ...], title: str | None) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    for g in by:
        t.add_column(GROUP_TITLES.get(g, g), overflow="fold")
    for name in ("count", "rate/min", "p50 ms", "p95 ms", "p99 ms", "max ms", "err %"):
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column("DB/req", justify="right", no_wrap=True)
    t.add_column("DB time", justify="right", no_wrap=True)
    t.add_column("HTTP time", justify="right", no_wrap=True)
    t.add_column("cache time", justify="right", no_wrap=True)
    t.add_column("GC time", justify="right", no_wrap=True)
    for r in rows:
        cells: list[RenderableType] = []
        for g in by:
            v = r.get(g)
            cells.append(Text(str(v)) if v not in (None, "") else Text("(none)", style="dim"))
        err = r.get("error_rate") or 0
        dbq = r.get("db_calls_per_request") or 0
        cells += [
            Text(f"{int(r.get('count') or 0):,}"),
            Text(num(r.get("rate_per_min"))),
            Text(ms(r.get("p50_ms"))),
            Text(ms(r.get("p95_ms")), style="bold"),
            Text(ms(r.get("p99_ms"))),
            Text(ms(r.get("max_ms"))),
            Text(pct(err, zero="0"), style="red" if err > 0 else ""),
            Text(num(dbq), style="yellow" if dbq >= 20 else ""),
            Text(pct(r.get("db_share"), zero="-")),
            Text(pct(r.get("http_share"), zero="-")),
            Text(pct(r.get("cache_share"), zero="-")),
            Text(pct(r.get("gc_share"), zero="-")),
        ]
        t.add_row(*cells)
    return t


def drops_sentence(drops: dict[str, Any]) -> str | None:
    """ "The agent dropped N requests (...)" or None when nothing was dropped."""

    def n(key: str) -> int:
        v = drops.get(key)
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0

    known = (
        "dropped_queue_full",
        "dropped_write_error",
        "dropped_writer_dead",
        "dropped_spool_full",
    )
    other = sum(
        n(k) for k in drops if k.startswith("dropped_") and k not in (*known, "dropped_total")
    )
    total = n("dropped_total") or sum(n(k) for k in known) + other
    if total <= 0:
        return None
    parts = (
        f"queue full: {n('dropped_queue_full'):,}, write errors: {n('dropped_write_error'):,}, "
        f"writer dead: {n('dropped_writer_dead'):,}"
    )
    if n("dropped_spool_full"):
        parts += f", spool full: {n('dropped_spool_full'):,}"
    if other:
        parts += f", other: {other:,}"
    s = f"The agent dropped {total:,} requests ({parts})"
    last = drops.get("last_error")
    if last:
        s += f"; last error: {last}"
    return s + "."


# ---------------------------------------------------------------------------------- traces


def traces_table(rows: list[dict[str, Any]], title: str | None) -> Table:
    has_user = any(r.get("user") for r in rows)
    has_tenant = any(r.get("tenant") for r in rows)
    has_http = any(r.get("http_calls") for r in rows)
    has_cache = any(r.get("cache_calls") for r in rows)
    t = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    t.add_column("trace id", no_wrap=True, style="bold")
    t.add_column("time", no_wrap=True)
    t.add_column("endpoint", overflow="fold")
    t.add_column("status", justify="right", no_wrap=True)
    t.add_column("duration ms", justify="right", no_wrap=True)
    t.add_column("DB calls", justify="right", no_wrap=True)
    t.add_column("DB ms", justify="right", no_wrap=True)
    if has_http:
        t.add_column("HTTP calls", justify="right", no_wrap=True)
        t.add_column("HTTP ms", justify="right", no_wrap=True)
    if has_cache:
        t.add_column("cache calls", justify="right", no_wrap=True)
        t.add_column("cache ms", justify="right", no_wrap=True)
    if has_user:
        t.add_column("user", overflow="fold")
    if has_tenant:
        t.add_column("tenant", overflow="fold")
    for r in rows:
        status = r.get("status")
        cells: list[RenderableType] = [
            Text(str(r.get("trace_id", ""))),
            Text(when(r.get("ts"))),
            Text(str(r.get("endpoint", ""))),
            Text(
                "-" if status is None else str(status),
                style="red" if isinstance(status, int) and status >= 500 else "",
            ),
            Text(ms(r.get("duration_ms")), style="bold"),
            Text(num(r.get("db_calls") or 0)),
            Text(ms(r.get("db_ms") or 0)),
        ]
        if has_http:
            cells += [Text(num(r.get("http_calls") or 0)), Text(ms(r.get("http_ms") or 0))]
        if has_cache:
            cells += [Text(num(r.get("cache_calls") or 0)), Text(ms(r.get("cache_ms") or 0))]
        if has_user:
            cells.append(Text(str(r.get("user") or "")))
        if has_tenant:
            cells.append(Text(str(r.get("tenant") or "")))
        t.add_row(*cells)
    return t


# ---------------------------------------------------------------------------------- trace


def _call_key(c: dict[str, Any]) -> tuple[Any, ...]:
    site = c.get("site") or {}
    return (c.get("kind"), c.get("fingerprint"), site.get("file"), site.get("line"))


def _bar(offset: float, dur: float, total: float, style: str) -> Text:
    if total <= 0:
        total = max(offset + dur, 1e-9)
    start = min(BAR_WIDTH - 1, max(0, math.floor(offset / total * BAR_WIDTH)))
    end = min(BAR_WIDTH, max(start + 1, math.ceil((offset + dur) / total * BAR_WIDTH)))
    bar = Text("·" * start, style="dim")
    bar.append("█" * (end - start), style=style)
    bar.append("·" * (BAR_WIDTH - end), style="dim")
    return bar


def _detail(c: dict[str, Any]) -> str:
    """rows for DB, status for HTTP, hit/miss for cache."""
    kind = c.get("kind")
    if kind == "http":
        return "-" if c.get("status") is None else str(c["status"])
    if kind == "cache":
        hit = c.get("hit")
        if hit is None:
            return "-" if c.get("rows") is None else str(c["rows"])
        return "hit" if hit else "miss"
    return "-" if c.get("rows") is None else f"{c['rows']:,}"


def trace_header(t: dict[str, Any]) -> RenderableType:
    status = t.get("status")
    head = Text()
    head.append("trace ", style="dim")
    head.append(str(t.get("trace_id", "?")), style="bold")
    head.append("  ")
    head.append(str(t.get("endpoint") or "?"), style="bold")
    head.append("  ")
    head.append(
        "-" if status is None else str(status),
        style="bold red" if isinstance(status, int) and status >= 500 else "bold green",
    )
    head.append(f"  {ms(t.get('duration_ms'))} ms", style="bold")
    lines: list[RenderableType] = [head]

    facts = []
    if t.get("method") or t.get("path"):
        facts.append(f"{t.get('method') or ''} {t.get('path') or ''}".strip())
    if t.get("ts"):
        facts.append(f"at {when(t.get('ts'))}")
    for key in ("service", "kind"):
        if t.get(key):
            facts.append(f"{key} {t[key]}")
    facts.append(f"user {t.get('user') or '-'}")
    facts.append(f"tenant {t.get('tenant') or '-'}")
    if t.get("cpu_ms") is not None:
        facts.append(f"cpu {ms(t['cpu_ms'])} ms")
    lines.append(Text("  " + " · ".join(facts)))
    if t.get("error"):
        lines.append(Text(f"  error: {t['error']}", style="red"))
    for label, keys in (("attrs", ("attributes", "attrs")), ("tags", ("tags",))):
        d: dict[str, Any] = {}
        for key in keys:
            d.update(t.get(key) or {})
        if d:
            body = ", ".join(f"{k}={v}" for k, v in sorted(d.items()))
            lines.append(Text(f"  {label}: {body}"))
    if t.get("links"):  # other services' requests linked by OTLP span ids
        from perfsleuth.store.otlp.links import link_lines

        for link in link_lines(t["links"], t.get("calls") or []):
            lines.append(Text(f"  {link}"))

    calls = t.get("calls") or []
    total = float(t.get("duration_ms") or 0)
    summary = []
    for kind, label in (("db", "DB"), ("http", "HTTP"), ("cache", "cache")):
        ks = [c for c in calls if c.get("kind") == kind]
        if ks:
            spent = sum(float(c.get("duration_ms") or 0) for c in ks)
            share = f" ({spent / total:.0%} of the request)" if total > 0 else ""
            summary.append(f"{label} {len(ks):,} calls, {ms(spent)} ms{share}")
    if summary:
        lines.append(Text("  " + " · ".join(summary)))
    evidence = []
    if t.get("gc_ms"):
        evidence.append(f"GC {ms(t['gc_ms'])} ms in {t.get('gc_count') or 0} collections")
    if t.get("samples"):
        evidence.append(f"{t['samples']} stack samples")
    if t.get("blockers"):
        evidence.append(f"blocked the event loop {t['blockers']} time(s)")
    if evidence:
        lines.append(Text("  " + " · ".join(evidence)))
    if t.get("capture"):
        lines.append(
            Text(
                f"  captured ({t['capture']}): perfsleuth replay {t.get('trace_id')} --curl, "
                "or --to http://HOST:PORT to re-send it",
                style="dim",
            )
        )
    if t.get("calls_dropped"):
        lines.append(
            Text(f"  {t['calls_dropped']:,} more calls were only counted (limit)", style="dim")
        )
    counts = Counter(_call_key(c) for c in calls)
    if counts:
        top_key, n = counts.most_common(1)[0]
        if n >= FOLD_MIN:
            first = next(c for c in calls if _call_key(c) == top_key)
            line = Text("  repeated: ", style="yellow")
            line.append(f"{n:,} × {truncate(str(first.get('fingerprint') or '?'), 60)}")
            line.append(f" from {site_text(first.get('site'))}")
            if first.get("kind") == "db":
                line.append("  (an N+1 query pattern?)", style="yellow")
            lines.append(line)
    return Group(*lines)


def waterfall(t: dict[str, Any], *, fold: bool = True) -> Table | Text:
    calls = sorted(t.get("calls") or [], key=lambda c: (c.get("offset_ms") or 0, c.get("seq", 0)))
    if not calls:
        return Text("  (no DB, HTTP or cache calls recorded in this request)", style="dim")
    total = float(t.get("duration_ms") or 0)
    last_end = max(float(c.get("offset_ms") or 0) + float(c.get("duration_ms") or 0) for c in calls)
    total = max(total, last_end)

    counts = Counter(_call_key(c) for c in calls)
    seen: Counter[tuple[Any, ...]] = Counter()
    tbl = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    tbl.add_column("offset ms", justify="right", no_wrap=True)
    tbl.add_column("dur ms", justify="right", no_wrap=True)
    tbl.add_column("timeline", no_wrap=True)
    tbl.add_column("kind", no_wrap=True)
    tbl.add_column("statement / request", no_wrap=True, overflow="ellipsis")
    tbl.add_column("rows", justify="right", no_wrap=True)
    tbl.add_column("call site", overflow="fold")
    for c in calls:
        key = _call_key(c)
        seen[key] += 1
        folding = fold and counts[key] >= FOLD_MIN
        if folding and seen[key] > FOLD_KEEP:
            continue
        kind = str(c.get("kind") or "?")
        style = KIND_STYLE.get(kind, "white")
        off = float(c.get("offset_ms") or 0)
        dur = float(c.get("duration_ms") or 0)
        what = Text(truncate(str(c.get("fingerprint") or c.get("op") or "?"), FINGERPRINT_CHARS))
        if c.get("error"):
            what.append(f"  ✗ {c['error']}", style="red")
        if c.get("wait_ms"):
            what.append(f"  (waited {ms(c['wait_ms'])} ms for a connection)", style="yellow")
        tbl.add_row(
            Text(ms(off)),
            Text(ms(dur)),
            _bar(off, dur, total, style),
            Text(kind, style=style),
            what,
            Text(_detail(c)),
            Text(site_text(c.get("site")), style="dim"),
        )
        if folding and seen[key] == FOLD_KEEP:
            rest = [x for x in calls if _call_key(x) == key][FOLD_KEEP:]
            spent = sum(float(x.get("duration_ms") or 0) for x in rest)
            first = float(rest[0].get("offset_ms") or 0)
            last = float(rest[-1].get("offset_ms") or 0)
            tbl.add_row(
                Text(""),
                Text(ms(spent)),
                Text(""),
                Text(""),
                Text(
                    f"⋮ x{len(rest):,} more of the same (at {ms(first)}–{ms(last)} ms, "
                    f"{ms(spent)} ms in all; --all shows them)",
                    style="italic yellow",
                ),
                Text(""),
                Text(""),
            )
    return tbl


def stacks(t: dict[str, Any], *, library: bool = False) -> RenderableType:
    """The stack of each distinct call site (most time first), outermost frame first;
    application frames only unless ``library``."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for c in t.get("calls") or []:
        groups.setdefault(_call_key(c), []).append(c)
    order = sorted(
        groups.values(), key=lambda cs: -sum(float(c.get("duration_ms") or 0) for c in cs)
    )
    parts: list[RenderableType] = []
    for cs in order:
        first = next((c for c in cs if c.get("stack")), cs[0])
        spent = sum(float(c.get("duration_ms") or 0) for c in cs)
        head = Text()
        head.append(f"{len(cs):,} × ", style="bold")
        head.append(truncate(str(first.get("fingerprint") or "?"), FINGERPRINT_CHARS))
        head.append(f"  ({ms(spent)} ms)", style="dim")
        parts.append(head)
        frames = [f for f in first.get("stack") or [] if library or f.get("app")]
        if not frames:
            parts.append(Text(f"    at {site_text(first.get('site'))}", style="dim"))
        for f in frames:
            parts.append(Text(f"    {site_text(f)}", style="" if f.get("app") else "dim"))
    if not parts:
        return Text("  (no calls)", style="dim")
    return Group(Text("Call stacks (outermost frame first):", style="bold"), *parts)


# ---------------------------------------------------------------------------------- sql


def cell(value: Any) -> Text:
    if value is None:
        return Text("NULL", style="dim")
    if isinstance(value, float):
        return Text(f"{value:,.3f}".rstrip("0").rstrip(".") if value != int(value) else f"{value}")
    return Text(str(value))


def sql_table(columns: list[str], rows: list[tuple[Any, ...]]) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for i, c in enumerate(columns):
        numeric = bool(rows) and all(
            isinstance(r[i], int | float) and not isinstance(r[i], bool)
            for r in rows
            if r[i] is not None
        )
        t.add_column(Text(str(c)), justify="right" if numeric else "left", overflow="fold")
    for r in rows:
        t.add_row(*(cell(v) for v in r))
    return t
