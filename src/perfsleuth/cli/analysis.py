"""``perfsleuth findings``, ``explain`` and ``calltree``: the analysis commands.

Registered on the shared Typer ``app`` of :mod:`perfsleuth.cli.app`; :mod:`perfsleuth.cli.main`
imports this module.
"""

from __future__ import annotations

import json as _json
import shlex
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from perfsleuth.analysis import calltree as ct
from perfsleuth.analysis import frames, loops
from perfsleuth.analysis.config import DEFAULTS, Config, ConfigError, load_config
from perfsleuth.analysis.finding import Finding
from perfsleuth.analysis.findings import find
from perfsleuth.cli import render
from perfsleuth.cli.app import NoIngestOpt, app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
    EXIT_USAGE,
    CLIError,
    DataOpt,
    JsonOpt,
    SinceOpt,
    check_endpoint,
    ensure_not_empty,
    handle_errors,
    out_console,
    parse_since,
    positive,
    print_json,
    store_for_reading,
)

SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="DETECTOR.NAME=VALUE",
        help="Override a detector setting, e.g. n_plus_one.min_repeats=10 or "
        "slow_query.enabled=false (repeatable).",
    ),
]
ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        metavar="FILE",
        help="TOML file with a findings table (default: $PERFSLEUTH_CONFIG, else "
        "./perfsleuth.toml when present).",
    ),
]


def _config(path: str | None, sets: list[str] | None) -> Config:
    try:
        return load_config(path, sets or [])
    except ConfigError as e:
        raise CLIError(str(e), EXIT_USAGE) from e


def _cmd(*args: str) -> str:
    return " ".join(shlex.quote(a) for a in args)


def _data_args(data: str) -> tuple[str, ...]:
    return () if data == DEFAULT_DATA else ("--data", data)


def _run(
    data: str,
    since: str | None,
    endpoint: str | None,
    cfg: Config,
    no_ingest: bool,
) -> list[Finding]:
    window = parse_since(since)
    with store_for_reading(data, ingest=not no_ingest) as store:
        ensure_not_empty(store, data)
        if endpoint is not None:
            check_endpoint(store, endpoint, data)
        return find(store, since=window, endpoint=endpoint, config=cfg)


# ---------------------------------------------------------------------------------- findings


@app.command()
@handle_errors
def findings(
    data: DataOpt = DEFAULT_DATA,
    since: SinceOpt = None,
    endpoint: Annotated[
        str | None,
        typer.Option("--endpoint", "-e", help='Only this endpoint, e.g. "GET /users/{id}".'),
    ] = None,
    set_: SetOpt = None,
    config: ConfigOpt = None,
    limit: Annotated[int, typer.Option("--limit", help="Findings to show.")] = 30,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Why endpoints are slow, ranked by the time each problem costs per minute.

    Tune or switch off detectors with --set or a --config file.
    """
    positive(limit, "--limit")
    cfg = _config(config, set_)
    found = _run(data, since, endpoint, cfg, no_ingest)
    if json:
        print_json([f.to_dict() for f in found])
        return
    out = out_console()
    scope = f" for {endpoint}" if endpoint else ""
    window = f"in the last {since}" if since else "in all recorded data"
    if not found:
        out.print(Text(f"No findings{scope} {window}: no detector found a problem."))
        return
    shown = found[:limit]
    title = f"{len(found)} finding{'s' if len(found) != 1 else ''}{scope} {window}"
    if len(found) > len(shown):
        title += f" (top {len(shown)}; --limit shows more)"
    t = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("impact ms/min", justify="right", no_wrap=True)
    t.add_column("kind", no_wrap=True)
    t.add_column("sure", no_wrap=True)
    t.add_column("endpoint", overflow="fold")
    t.add_column("finding", overflow="fold", ratio=1)
    t.add_column("id", no_wrap=True, style="dim")
    for i, f in enumerate(shown, 1):
        t.add_row(
            Text(str(i)),
            Text(render.ms(f.impact_ms_per_min), style="bold"),
            Text(f.kind, style="yellow"),
            Text(f.confidence or "-", style=_SURE.get(f.confidence or "", "")),
            Text(f.endpoint),
            Text(f.title),
            Text(f.id),
        )
    out.print(t)
    hint = _cmd("perfsleuth", "explain", shown[0].id, *_data_args(data))
    out.print(Text(f"Evidence and example traces: {hint}", style="dim"), soft_wrap=True)


_SURE = {"high": "green", "medium": "yellow", "low": "red"}  # a finding's confidence


# ---------------------------------------------------------------------------------- explain


def _value(v: Any) -> str:
    if isinstance(v, float):
        return render.num(v, 3) if abs(v) < 1 else render.num(v, 1)
    if isinstance(v, dict | list):
        return _json.dumps(v, default=str)
    return "-" if v is None else str(v)


@app.command()
@handle_errors
def explain(
    finding_id: Annotated[
        str, typer.Argument(metavar="FINDING-ID", help="A finding id (or a unique prefix).")
    ],
    data: DataOpt = DEFAULT_DATA,
    since: SinceOpt = None,
    set_: SetOpt = None,
    config: ConfigOpt = None,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """One finding in full: its evidence, the line of code, and example traces to open."""
    want = finding_id.strip().lower()
    if not want:
        raise CLIError("give a finding id, as listed by `perfsleuth findings`")
    cfg = _config(config, set_)
    found = _run(data, since, None, cfg, no_ingest)
    matches = [f for f in found if f.id.startswith(want)]
    if not matches:
        raise CLIError(
            f"no finding with id {finding_id!r} in {data}"
            + (f" in the last {since}" if since else "")
            + "; `perfsleuth findings` lists them"
        )
    if len(matches) > 1:
        raise CLIError(
            f"finding id prefix {finding_id!r} is ambiguous: it matches "
            + ", ".join(m.id for m in matches[:5])
        )
    f = matches[0]
    site = f.callsite or {}
    code = loops.source_line(site.get("file"), site.get("line")) if site else None
    tpl = f.evidence.get("template") or None
    tpl_lines = _template_lines(tpl)
    called = [c for c in f.evidence.get("call_lines") or () if isinstance(c, dict)]
    if json:
        doc = {**f.to_dict(), "source_line": code}
        if tpl_lines:
            doc["template_lines"] = tpl_lines
        if called:
            doc["call_lines_source"] = [loops.source_line(c["file"], c["line"]) for c in called]
        print_json(doc)
        return
    d = _data_args(data)
    out = out_console()
    parts: list[RenderableType] = [
        Text(f.title, style="bold"),
        Text(
            f"{f.kind} · {f.endpoint} · id {f.id} · costs {render.ms(f.impact_ms_per_min)} "
            f"ms per minute of traffic · seen {render.when(f.first_seen)} – "
            f"{render.when(f.last_seen)}"
        ),
        Text(f"How sure: {f.confidence_note()}"),
    ]
    if f.callsite:
        line = Text("\nCode: ", style="bold")
        line.append(render.site_text(f.callsite))
        parts.append(line)
        if code:
            parts.append(Text(f"    {site.get('line')} | {code}", style="cyan"))
    if tpl:
        # The template expression the call ran from, and the loop around it (loop first,
        # as in the template).
        line = Text("Template: ", style="bold")
        line.append(frames.template_text(tpl))
        parts.append(line)
        shown = [
            (tpl.get("loop"), tpl_lines.get("loop")),
            (tpl["expression"], tpl_lines.get("expression")),
        ]
        for where, src in shown:
            if where and src:
                parts.append(
                    Text(
                        f"    {render.short_path(where['file'])}:{where['line']} | {src}",
                        style="cyan",
                    )
                )
    if len(called) > 1:
        line = Text("Called from: ", style="bold")
        line.append(
            frames.lines_text(
                [frames.Frame(0, c["file"], c["line"], c["function"], True) for c in called]
            )
        )
        parts.append(line)
        for c in called:
            src = loops.source_line(c["file"], c["line"])
            if src:
                parts.append(Text(f"    {c['line']} | {src}", style="cyan"))
    if f.fingerprint:
        parts.append(Text("\nStatement: ", style="bold").append(f.fingerprint, style=""))
    if f.count_per_request is not None:
        parts.append(Text(f"Per request: {render.num(f.count_per_request)}"))
    ev = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="Evidence", title_justify="left")
    ev.add_column("measure")
    ev.add_column("value", overflow="fold")
    for k, v in f.evidence.items():
        ev.add_row(Text(k.replace("_", " ")), Text(_value(v)))
    parts += [Text(""), ev]
    parts.append(Text("What to do: ", style="bold").append(f.suggestion, style=""))
    out.print(Group(*parts))
    # Commands on lines of their own, never wrapped (they are for copying).
    if f.example_trace_ids:
        out.print(Text("\nExample traces (the worst first):", style="bold"))
        for tid in f.example_trace_ids:
            out.print(
                Text("  " + _cmd("perfsleuth", "trace", tid, *d), style="green"), soft_wrap=True
            )
        _linked_services(data, f.example_trace_ids[0], out)
    # Where to dig next: the runtime-evidence kinds have their own commands.
    nxt = _NEXT.get(f.kind)
    if nxt is not None:
        title, args = nxt
        out.print(Text(title, style="bold"))
        out.print(Text("  " + _cmd("perfsleuth", *args(f), *d), style="green"), soft_wrap=True)
    elif f.callsite or f.kind == "chatty_endpoint":
        kind = _call_kind(f)
        out.print(Text("Where the calls come from:", style="bold"))
        tree_cmd = _cmd("perfsleuth", "calltree", f.endpoint, "--kind", kind, *d)
        out.print(Text("  " + tree_cmd, style="green"), soft_wrap=True)


def _linked_services(data: str, trace_id: str, out: Any) -> None:
    """Where the calls of a trace to other reporting services went (OTLP links), if any."""
    from perfsleuth.store.base import StoreError
    from perfsleuth.store.otlp.links import link_lines

    try:
        with store_for_reading(data, ingest=False) as store:
            t = store.trace(trace_id)
    except StoreError:
        return
    lines = link_lines(t["links"], t.get("calls") or []) if t.get("links") else []
    if lines:
        out.print(Text("Other services in the first example:", style="bold"))
        for line in lines:
            out.print(Text("  " + line), soft_wrap=True)


def _template_lines(tpl: dict[str, Any] | None) -> dict[str, str]:
    """The template's text at the expression and at its loop (those that can be read)."""
    out: dict[str, str] = {}
    for part in ("expression", "loop"):
        where = (tpl or {}).get(part)
        if where:
            src = loops.source_line(where.get("file"), where.get("line"))
            if src:
                out[part] = src
    return out


# Findings about calls of one kind that do not say which in their evidence
_CALL_KIND = {"upstream_latency": "http"}


def _call_kind(f: Finding) -> str:
    """The kind of calls a finding is about, for ``calltree --kind``: its evidence's
    call_kind, else the kind the detector is about, else (chatty_endpoint) the kind with the
    most time."""
    kind = f.evidence.get("call_kind") or _CALL_KIND.get(f.kind)
    if kind is None:
        ms = {k: f.evidence.get(f"{k}_ms") or 0 for k in ct.KINDS}
        kind = max(ms, key=lambda k: ms[k]) if any(ms.values()) else "db"
    return str(kind)


_NEXT: dict[str, tuple[str, Callable[[Finding], tuple[str, ...]]]] = {
    "slow_request_hotspot": (
        "The flame graph of its slow requests:",
        lambda f: ("profile", f.endpoint, "--svg", "flame.svg"),
    ),
    "event_loop_blocker": (
        "Every blocker, longest first:",
        lambda f: ("blockers", "-e", f.endpoint),
    ),
    "gc_pressure": ("GC time per endpoint:", lambda f: ("top",)),
}


# ---------------------------------------------------------------------------------- calltree


def _label(node: ct.Node, root: ct.Node, *, is_root: bool = False) -> Text:
    t = Text()
    if is_root:
        t.append(node.name, style="bold")
    elif node.file is None:
        t.append(node.name, style="dim italic")
    elif node.template:
        t.append(node.function or "?", style="bold magenta")
        t.append(f"  template {render.short_path(node.file)}:{node.line}", style="dim")
    else:
        t.append(node.function or "?", style="bold")
        t.append(f"  {render.short_path(node.file)}:{node.line}", style="dim")
    share = node.ms / root.ms if root.ms else 0.0
    t.append(f"  {node.calls:,} calls, {render.ms(node.ms)} ms", style="cyan")
    if not is_root:
        t.append(f" ({render.pct(share)})", style="cyan")
    return t


def _tree(node: ct.Node, root: ct.Node, into: Tree) -> None:
    for c in node.ordered():
        _tree(c, root, into.add(_label(c, root)))


@app.command()
@handle_errors
def calltree(
    endpoint: Annotated[
        str | None,
        typer.Argument(metavar="[ENDPOINT]", help='Endpoint, e.g. "GET /admin/export.csv".'),
    ] = None,
    data: DataOpt = DEFAULT_DATA,
    kind: Annotated[str, typer.Option("--kind", help="Calls of this kind: db, http or cache.")] = (
        "db"
    ),
    trace_id: Annotated[
        str | None, typer.Option("--trace", metavar="ID", help="Only this trace (or prefix).")
    ] = None,
    min_share: Annotated[
        float,
        typer.Option(
            "--min-share",
            help="Fold paths below this share of the calls and of the time (0 keeps all).",
        ),
    ] = 0.01,
    all_frames: Annotated[
        bool, typer.Option("--all-frames", help="Keep library frames (server, framework).")
    ] = False,
    since: SinceOpt = None,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Where an endpoint's DB (or HTTP, cache) calls come from: the merged call-site tree.

    Every code path with its calls and time; --json gives the nested tree for a treemap.
    """
    k = kind.strip().lower()
    if k not in ct.KINDS:
        raise CLIError(f"invalid --kind {kind!r}: use db, http or cache")
    if not 0 <= min_share < 1:
        raise CLIError(f"invalid --min-share {min_share}: use a fraction from 0 to 1, e.g. 0.01")
    if endpoint is None and trace_id is None:
        raise CLIError('give an endpoint (e.g. "GET /admin/export.csv") or --trace ID')
    window = parse_since(since)
    with store_for_reading(data, ingest=not no_ingest) as store:
        ensure_not_empty(store, data)
        if endpoint is not None:
            check_endpoint(store, endpoint, data)
        try:
            root = ct.build(
                store,
                endpoint,
                kind=k,
                trace_id=trace_id,
                since=window,
                app_only=not all_frames,
                min_share=min_share,
            )
        except ct.NotFound as e:
            raise CLIError(str(e)) from e
    if json:
        print_json(root.to_dict())
        return
    out = out_console()
    if root.calls == 0:
        out.print(Text(f"No {k} calls recorded for {root.name}."))
        return
    tree = Tree(_label(root, root, is_root=True), guide_style="dim")
    _tree(root, root, tree)
    out.print(tree)
    if min_share > 0:
        out.print(
            Text(
                f"Paths under {render.pct(min_share)} of the calls and of the time are folded "
                "(--min-share 0 shows all).",
                style="dim",
            )
        )


__all__ = ["DEFAULTS", "calltree", "explain", "findings"]
