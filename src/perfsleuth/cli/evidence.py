"""``perfsleuth profile`` and ``blockers``: the runtime-evidence commands (stack samples of slow
requests, event-loop blockers).

Registered on the shared Typer ``app`` of :mod:`perfsleuth.cli.app`; :mod:`perfsleuth.cli.main`
imports this module.
"""

from __future__ import annotations

import json as _json
from typing import Annotated

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from perfsleuth.analysis import profile as prof
from perfsleuth.cli import render
from perfsleuth.cli.app import NoIngestOpt, app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
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


def _where(file: str | None, line: int | None) -> str:
    return f"{render.short_path(file)}:{line or '?'}"


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}") from e


@app.command()
@handle_errors
def profile(
    endpoint: Annotated[
        str | None, typer.Argument(help='The endpoint, e.g. "GET /search".')
    ] = None,
    trace_id: Annotated[
        str | None, typer.Option("--trace", metavar="ID", help="Only this trace (or prefix).")
    ] = None,
    data: DataOpt = DEFAULT_DATA,
    since: SinceOpt = None,
    state: Annotated[
        str | None,
        typer.Option(
            "--state",
            help="Only samples in this state: cpu (on the CPU), starved (runnable, waiting for "
            "a CPU), gil (waiting for the GIL), wait (I/O, lock, sleep, await) or call (in a "
            "recorded call).",
        ),
    ] = None,
    svg: Annotated[
        str | None, typer.Option("--svg", metavar="FILE", help="Write a flame graph (SVG).")
    ] = None,
    speedscope: Annotated[
        str | None,
        typer.Option(
            "--speedscope", metavar="FILE", help="Write speedscope JSON (speedscope.app)."
        ),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Functions to list.")] = 15,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Where slow requests of an endpoint spend their time, from stack samples.

    The agent samples the stack of every request running longer than
    PERFSLEUTH_SAMPLE_AFTER_MS (300 ms). Lists top functions by self and total samples;
    --svg / --speedscope write a flame graph.
    """
    positive(limit, "--limit")
    if state is not None and state not in prof.STATES:
        raise CLIError(f"invalid --state {state!r}: use {', '.join(prof.STATES)}")
    if endpoint is None and trace_id is None:
        raise CLIError('give an endpoint (e.g. "GET /search") or --trace ID')
    window = parse_since(since)
    with store_for_reading(data, ingest=not no_ingest) as store:
        ensure_not_empty(store, data)
        full_id = None
        if trace_id is not None:
            tr = store.trace(trace_id)  # StoreError (unknown, ambiguous) -> one sentence
            full_id = tr["trace_id"]
            endpoint = endpoint or tr["endpoint"]
        assert endpoint is not None
        check_endpoint(store, endpoint, data)
        p = prof.load(store, endpoint, since=window, state=state, trace_id=full_id)
    if svg:
        _write(svg, p.svg())
    if speedscope:
        _write(speedscope, _json.dumps(p.speedscope()))
    top = p.top(limit)
    v = p.verdict()
    hot, n = p.hotspot()
    hv = p.hotspot_verdict(hot) if hot is not None else v
    if json:
        print_json(
            {
                "endpoint": endpoint,
                "requests": p.requests,
                "samples": p.samples,
                "states": p.states,
                "class": v.kind,
                "advice": v.advice,
                "hotspot": None
                if hot is None
                else {
                    "function": hot.function,
                    "file": hot.file,
                    "line": hot.line,
                    "samples": n,
                    "class": hv.kind,
                    "advice": hv.advice,
                },
                "top": top,
                "tree": p.tree(),
            }
        )
        return
    out = out_console()
    if p.samples == 0:
        out.print(
            Text(
                f"No stack samples for {endpoint}: none of its requests ran longer than the "
                "sampling threshold (PERFSLEUTH_SAMPLE_AFTER_MS, default 300 ms)."
            )
        )
        return
    states = ", ".join(
        f"{render.pct(k / p.samples)} {prof.STATES.get(s, s)}"
        for s, k in sorted(p.states.items(), key=lambda kv: -kv[1])
    )
    out.print(Text(f"{endpoint}: {p.samples:,} samples of {p.requests:,} slow requests ({states})"))
    if hot is not None:
        out.print(
            Text(
                f"Hotspot: {hot.function} at {_where(hot.file, hot.line)} "
                f"({render.pct(n / p.samples)} of the samples: {hv.summary()})",
                style="bold",
            )
        )
        out.print(Text(hv.advice))
    t = Table(box=box.SIMPLE_HEAD)
    for col in ("self", "total", "function", "where"):
        t.add_column(col, justify="right" if col in ("self", "total") else "left")
    for r in top:
        t.add_row(
            render.pct(r["self_share"]),
            render.pct(r["total_share"]),
            str(r["function"]),
            _where(r["file"], r["line"]),
        )
    out.print(t)
    for path, what in ((svg, "flame graph"), (speedscope, "speedscope profile")):
        if path:
            out.print(Text(f"Wrote the {what} to {path}.", style="dim"))


@app.command()
@handle_errors
def blockers(
    data: DataOpt = DEFAULT_DATA,
    since: SinceOpt = None,
    endpoint: Annotated[
        str | None, typer.Option("--endpoint", "-e", help="Only blockers of this endpoint.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Blockers to list.")] = 20,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Event-loop blockers, longest first: who blocked the loop, where, and for how long."""
    positive(limit, "--limit")
    window = parse_since(since)
    with store_for_reading(data, ingest=not no_ingest) as store:
        ensure_not_empty(store, data)
        if endpoint is not None:
            check_endpoint(store, endpoint, data)
        rows = store.blockers(since=window, endpoint=endpoint, limit=limit)
    if json:
        print_json(rows)
        return
    out = out_console()
    if not rows:
        out.print(Text("No event-loop blockers recorded."))
        return
    t = Table(box=box.SIMPLE_HEAD)
    for col in ("blocked", "delayed", "endpoint", "where", "last call", "trace"):
        t.add_column(col, justify="right" if col in ("blocked", "delayed") else "left")
    for r in rows:
        app_frames = [f for f in r["stack"] if f.get("app")] or r["stack"]
        leaf = app_frames[-1] if app_frames else {}
        last = ""
        if r["last_call"]:
            last = f"{r['last_call'][:40]} ({r['last_rows'] or 0:,} rows)"
        t.add_row(
            render.ms(r["duration_ms"]),
            str(r["delayed"] or 0),
            r["endpoint"],
            f"{leaf.get('function', '?')} {_where(leaf.get('file'), leaf.get('line'))}",
            last,
            (r["trace_id"] or "")[:16],
        )
    out.print(t)
    worst = next((r for r in rows if r["trace_id"]), None)
    if worst is not None:  # the agent keeps a capture of every request that blocked the loop
        tid = worst["trace_id"]
        out.print(Text(f"Replay the longest: perfsleuth replay {tid} --curl", style="dim"))


__all__ = ["blockers", "profile"]
