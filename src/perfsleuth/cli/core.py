"""The core commands: ``run``, ``ingest``, ``top``, ``traces``, ``trace``, ``sql`` and ``demo``.

Registered on the shared Typer ``app`` of :mod:`perfsleuth.cli.app`."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Annotated, Any

import typer
from rich.text import Text

from perfsleuth.cli import render
from perfsleuth.cli.app import NoIngestOpt, app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
    EXIT_DAMAGED,
    EXIT_STATE,
    EXIT_USAGE,
    CLIError,
    DataOpt,
    JsonOpt,
    SinceOpt,
    check_endpoint,
    damage_sentences,
    ensure_not_empty,
    err_console,
    handle_errors,
    one_line,
    opened,
    out_console,
    parse_since,
    positive,
    print_json,
    spool_bytes,
    store_for_reading,
)
from perfsleuth.store.base import IngestReport, StoreError, StoreLocked

# ---------------------------------------------------------------------------------- run


@app.command(
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
    },
)
@handle_errors
def run(
    command: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="-- CMD [ARGS]...", help="The command to run, after `--`.", show_default=False
        ),
    ] = None,
    data: DataOpt = DEFAULT_DATA,
    service: Annotated[
        str | None,
        typer.Option("--service", metavar="NAME", help="Service name (default: the program)."),
    ] = None,
) -> None:
    """Run CMD with the agent installed (in it and in the workers it forks).

    Example: perfsleuth run --service shop -- uvicorn shop:app --workers 4
    """
    argv = list(command or [])
    if argv and argv[0] == "--":  # `perfsleuth run --data d -- --weird-prog` edge cases
        argv = argv[1:]
    if not argv:
        raise CLIError(
            "nothing to run: give the command after `--`, e.g. `perfsleuth run -- python app.py`"
        )
    try:
        from perfsleuth.agent.launch import run_command
    except ImportError as e:
        raise CLIError(f"the agent launcher is not available ({e})", EXIT_STATE) from e
    try:
        run_command(argv, os.path.abspath(data), service)
    except FileNotFoundError as e:
        raise CLIError(f"cannot run {argv[0]!r}: command not found", 127) from e
    except OSError as e:
        raise CLIError(f"cannot run {argv[0]!r}: {e.strerror or e}", 126) from e


# ---------------------------------------------------------------------------------- ingest


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _report_dict(report: IngestReport) -> dict[str, Any]:
    d = None
    try:
        d = report.to_dict()
    except Exception:
        d = None
    if not isinstance(d, dict):
        d = dataclasses.asdict(report)
    return d


@app.command()
@handle_errors
def ingest(data: DataOpt = DEFAULT_DATA, json: JsonOpt = False) -> None:
    """Load the spool (segments written by agents) into the database."""
    err = err_console()
    total = spool_bytes(data)
    with opened(data) as store:
        if sys.stderr.isatty() and total > 0:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            with Progress(
                TextColumn("ingesting"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=err,
                transient=True,
            ) as bar:
                task = bar.add_task("ingest", total=total)

                def progress(done: int, tot: int) -> None:
                    bar.update(task, completed=done, total=max(tot, 1))

                report = store.ingest(progress)
        else:
            report = store.ingest()
    sentences = damage_sentences(report, data)
    if json:
        print_json(_report_dict(report))
    else:
        out = out_console()
        if report.segments_read == 0 and not sentences:
            out.print(Text(f"Nothing new to ingest in {os.path.join(data, 'spool')}."))
        else:
            out.print(
                Text(
                    f"Ingested {_n(report.requests, 'request')} and {_n(report.calls, 'call')} "
                    f"from {_n(report.segments_read, 'segment')} "
                    f"({report.segments_done:,} finished "
                    f"{'segment' if report.segments_done == 1 else 'segments'} "
                    "removed from the spool)."
                )
            )
    for s in sentences:
        typer.echo(f"perfsleuth: warning: {s}", err=True)
    if sentences:
        raise typer.Exit(EXIT_DAMAGED)


# ---------------------------------------------------------------------------------- top


GROUPS = ("endpoint", "user", "tenant", "service", "host", "kind", "method", "status")


def _parse_by(by: str) -> tuple[str, ...]:
    parts = tuple(p.strip().lower() for p in by.split(",") if p.strip())
    bad = [p for p in parts if p not in GROUPS]
    if not parts or bad or len(set(parts)) != len(parts):
        raise CLIError(
            f"invalid --by {by!r}: use one of {', '.join(GROUPS)}, or a comma-separated "
            "combination such as endpoint,user"
        )
    return parts


def _check_kind(kind: str | None) -> str | None:
    if kind is None:
        return None
    k = kind.strip().lower()
    if k not in ("web", "background"):
        raise CLIError(f"invalid --kind {kind!r}: use web or background")
    return k


def _window(since: str | None) -> str:
    return f"in the last {since}" if since else "in all recorded data"


@app.command()
@handle_errors
def top(
    data: DataOpt = DEFAULT_DATA,
    since: SinceOpt = None,
    by: Annotated[
        str,
        typer.Option(
            "--by",
            help="Group by endpoint, user, tenant (also service, host, kind, method, status), "
            "or a combination such as endpoint,user.",
        ),
    ] = "endpoint",
    kind: Annotated[
        str | None, typer.Option("--kind", help="Only web requests or background tasks.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Rows to show.")] = 20,
    host: Annotated[
        str | None, typer.Option("--host", help="Only the requests of this host (the fleet).")
    ] = None,
    service: Annotated[
        str | None, typer.Option("--service", help="Only the requests of this service.")
    ] = None,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """The busiest endpoints (or users, tenants) with latency percentiles and where time goes."""
    window = parse_since(since)
    groups = _parse_by(by)
    k = _check_kind(kind)
    positive(limit, "--limit")
    with store_for_reading(data, ingest=not no_ingest) as store:
        only = {c: v for c, v in (("host", host), ("service", service)) if v is not None}
        rows = store.top(since=window, by=groups, kind=k, only=only)
        drops = store.agent_drops()
        if not rows and not drops.get("dropped_total"):
            ensure_not_empty(store, data)  # nothing stored and nothing lost: say how to start
    shown = rows[:limit]
    if json:
        print_json({"rows": shown, "drops": drops})
        return
    out = out_console()
    scope = "".join(f" of {c} {v!r}" for c, v in only.items())
    if not rows:
        what = (f"{k} requests" if k else "requests") + scope
        out.print(Text(f"No {what} {_window(since)} in {data}; try a longer --since."))
    else:
        count = sum(int(r.get("count") or 0) for r in rows)
        title = f"{count:,} requests{scope} {_window(since)}, by {', '.join(groups)}"
        if len(rows) > len(shown):
            title += f" (top {len(shown)} of {len(rows)}; --limit shows more)"
        out.print(render.top_table(shown, groups, title))
    sentence = render.drops_sentence(drops or {})
    if sentence:
        out.print(Text(sentence, style="yellow"))


# ---------------------------------------------------------------------------------- traces


@app.command()
@handle_errors
def traces(
    data: DataOpt = DEFAULT_DATA,
    endpoint: Annotated[
        str | None,
        typer.Option("--endpoint", "-e", help='Exact endpoint, e.g. "GET /users/{id}".'),
    ] = None,
    slowest: Annotated[
        int | None, typer.Option("--slowest", metavar="N", help="The N slowest requests.")
    ] = None,
    since: SinceOpt = None,
    limit: Annotated[int, typer.Option("--limit", help="Rows to show (newest first).")] = 20,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Individual requests, newest first (or the slowest N)."""
    window = parse_since(since)
    positive(slowest, "--slowest")
    positive(limit, "--limit")
    with store_for_reading(data, ingest=not no_ingest) as store:
        if endpoint is not None:
            check_endpoint(store, endpoint, data)
        try:
            rows = store.traces(endpoint=endpoint, since=window, slowest=slowest, limit=limit)
        except StoreLocked:
            raise
        except StoreError as e:
            raise CLIError(one_line(e), EXIT_USAGE) from e
        if not rows:
            ensure_not_empty(store, data)
    if json:
        print_json(rows)
        return
    out = out_console()
    where = f" of {endpoint}" if endpoint else ""
    if not rows:
        out.print(Text(f"No requests{where} {_window(since)}."))
        return
    if slowest:
        title = f"The {len(rows)} slowest requests{where} {_window(since)}"
    else:
        title = f"The {len(rows)} newest requests{where} {_window(since)}"
    out.print(render.traces_table(rows, title))
    slow = max(rows, key=lambda r: float(r.get("duration_ms") or 0))
    out.print(Text(f"Look inside one: perfsleuth trace {slow.get('trace_id')}", style="dim"))


# ---------------------------------------------------------------------------------- trace


@app.command()
@handle_errors
def trace(
    trace_id: Annotated[str, typer.Argument(metavar="ID", help="Trace id (or a unique prefix).")],
    data: DataOpt = DEFAULT_DATA,
    all_calls: Annotated[
        bool, typer.Option("--all", help="Show every call (do not fold repeated call sites).")
    ] = False,
    show_stacks: Annotated[
        bool,
        typer.Option("--stacks", help="Also show the code path (stack) of each call site."),
    ] = False,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """One request: its attributes and a waterfall of its DB, HTTP and cache calls."""
    tid = trace_id.strip().lower()
    if not tid:
        raise CLIError("give a trace id, e.g. `perfsleuth trace 3f2a9c1d0e4b5a67`")
    with store_for_reading(data, ingest=not no_ingest) as store:
        try:
            t = store.trace(tid)
        except StoreLocked:
            raise
        except StoreError as e:
            ensure_not_empty(store, data)
            raise CLIError(one_line(e), EXIT_USAGE) from e
    if json:
        print_json(t)
        return
    out = out_console()
    out.print(render.trace_header(t))
    out.print(render.waterfall(t, fold=not all_calls))
    if show_stacks:
        out.print(render.stacks(t, library=all_calls))


# ---------------------------------------------------------------------------------- sql


@app.command()
@handle_errors
def sql(
    query: Annotated[str, typer.Argument(metavar='"QUERY"', help="One read-only SQL statement.")],
    data: DataOpt = DEFAULT_DATA,
    limit: Annotated[int, typer.Option("--limit", help="Maximum rows returned.")] = 1000,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Stop the query after this many seconds.", min=0.1)
    ] = 10.0,
    unsafe: Annotated[
        bool,
        typer.Option(
            "--unsafe",
            help="Lift the sandbox: the query may read files, reach the network and install "
            "extensions, with no time or size limit (for trusted queries only).",
        ),
    ] = False,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Read-only SQL over the store (tables: see `perfsleuth sql "SHOW TABLES"`).

    Sandboxed as the web UI's console: no file, network or extension access, at most
    --timeout seconds and 8 MB of rows; --unsafe lifts all three."""
    from perfsleuth.server import console

    positive(limit, "--limit")
    if not query.strip():
        raise CLIError('give a query, e.g. perfsleuth sql "SELECT count(*) FROM requests"')
    if not no_ingest:
        # Ingest with a writable connection, then query through a read-only one.
        with store_for_reading(data, ingest=True):
            pass
    with opened(data, read_only=True) as store:
        if getattr(store, "engine", "duckdb") != "duckdb":  # ClickHouse: its own read-only SQL
            try:
                res = console.run_on_store(
                    store, query, limit, None if unsafe else console.MAX_BYTES, encode=False
                )
            except console.ConsoleError as e:
                raise CLIError(str(e), EXIT_USAGE) from e
            _print_sql(res, json, limit)
            return
        con = store._con  # type: ignore[attr-defined]
        if not unsafe:
            console.sandbox(con)
        try:
            res = console.run(
                con.cursor(),
                query,
                limit=limit,
                max_bytes=None if unsafe else console.MAX_BYTES,
                time_limit=None if unsafe else timeout,
                encode=False,
                prepare=console.make_views(console.temp_views(con)),
            )
        except console.ConsoleError as e:
            raise CLIError(str(e), EXIT_USAGE) from e
    _print_sql(res, json, limit)


def _print_sql(res: Any, json: bool, limit: int) -> None:
    from perfsleuth.server import console

    columns, rows = res.columns, res.raw
    if json:
        print_json([dict(zip(columns, r, strict=False)) for r in rows])
        return
    out = out_console()
    out.print(render.sql_table(list(columns), list(rows)))
    note = f"{len(rows):,} row{'s' if len(rows) != 1 else ''}"
    if res.truncated_by == "rows":
        note += f" (stopped at --limit {limit:,})"
    elif res.truncated_by == "bytes":
        note += f" (stopped at {console.MAX_BYTES // 2**20} MB; --unsafe lifts it)"
    out.print(Text(note, style="dim"))


# ---------------------------------------------------------------------------------- demo


@app.command()
@handle_errors
def demo(
    seconds: Annotated[
        float, typer.Option("--seconds", help="How long to drive traffic.", min=1)
    ] = 20,
    data: Annotated[
        str, typer.Option("--data", metavar="DIR", help="Data directory for the demo.")
    ] = ".perfsleuth-demo",
    json: JsonOpt = False,
    no_ui: Annotated[
        bool, typer.Option("--no-ui", help="Do not serve the web UI at the end (for scripts).")
    ] = False,
) -> None:
    """Start two demo services under the agent, drive traffic, show what was found, then serve
    the web UI on the demo's data (not with --no-ui or --json)."""
    from perfsleuth.cli.demo import run_demo

    code = run_demo(data, seconds, as_json=json, ui=not (no_ui or json))
    if code:
        raise typer.Exit(code)
