"""``perfsleuth replay`` (re-send a captured request, or print it as curl) and ``perfsleuth
heap`` (a heap histogram of a running process, or what grew between two snapshots).

Registered on the shared Typer ``app`` of :mod:`perfsleuth.cli.app` (cli.main imports this module).
"""

from __future__ import annotations

import os
import statistics
from typing import Annotated

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from perfsleuth.analysis import heap as hp
from perfsleuth.analysis import replay as rp
from perfsleuth.cli import render
from perfsleuth.cli.app import NoIngestOpt, app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
    EXIT_STATE,
    EXIT_USAGE,
    CLIError,
    DataOpt,
    JsonOpt,
    handle_errors,
    one_line,
    out_console,
    positive,
    print_json,
    store_for_reading,
)
from perfsleuth.store.base import StoreError, StoreLocked


@app.command()
@handle_errors
def replay(
    trace_id: Annotated[
        str, typer.Argument(metavar="TRACE", help="Trace id (or a unique prefix).")
    ],
    curl: Annotated[
        bool, typer.Option("--curl", help="Print the request as a curl command.")
    ] = False,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            metavar="URL",
            help="Re-send it to this server, e.g. http://127.0.0.1:8000 (with --curl: the "
            "command's target; without, it sends to $PERFSLEUTH_TARGET when run).",
        ),
    ] = None,
    times: Annotated[int, typer.Option("--times", help="How many times to re-send it.")] = 1,
    allow_truncated: Annotated[
        bool,
        typer.Option("--allow-truncated", help="Send a truncated body's kept bytes anyway."),
    ] = False,
    data: DataOpt = DEFAULT_DATA,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Replay a captured request: as a curl command (--curl) or re-sent to a server (--to URL),
    with the new timings next to the original.

    Captured: slow requests (PERFSLEUTH_CAPTURE_SLOW_MS, 500 ms), 5xx, loop blockers, requests
    flagged with perfsleuth.agent.keep_capture(), and a 1 % sample of the rest. Secret headers
    were redacted at capture time and are not sent. The captured Host header is sent as a
    header, never used as the target: whoever sent the request chose it.
    """
    positive(times, "--times")
    if not curl and not to:
        raise CLIError("say what to do: --curl prints a curl command, --to URL re-sends it")
    tid = trace_id.strip().lower()
    if not tid:
        raise CLIError("give a trace id, e.g. `perfsleuth replay 3f2a9c1d0e4b5a67 --curl`")
    with store_for_reading(data, ingest=not no_ingest) as store:
        try:
            cap = store.capture(tid)
        except StoreLocked:
            raise
        except StoreError as e:
            raise CLIError(one_line(e), EXIT_USAGE) from e
    if cap is None:
        raise CLIError(
            f"trace {tid} has no replayable capture: only slow, failed (5xx), blocking, "
            "flagged and sampled requests are captured (PERFSLEUTH_CAPTURE_*)",
            EXIT_STATE,
        )
    try:
        if curl:
            cmd = rp.curl_for(cap, to, allow_truncated=allow_truncated)
            if json:
                print_json({"trace_id": cap["trace_id"], "curl": cmd, "redacted": cap["redacted"]})
            else:
                typer.echo(cmd)
            return
        assert to is not None
        res = rp.replay(cap, to, times, allow_truncated=allow_truncated)
    except rp.ReplayError as e:
        raise CLIError(str(e), EXIT_STATE) from e
    if json:
        print_json(res)
        return
    out = out_console()
    orig = res["original"]
    out.print(Text(f"{res['method']} {res['url']}  ({cap['endpoint']}, trace {cap['trace_id']})"))
    if res["redacted"]:
        out.print(
            Text(f"Not sent (redacted at capture): {', '.join(res['redacted'])}", style="dim")
        )
    t = Table(box=box.SIMPLE_HEAD)
    for col in ("run", "status", "duration"):
        t.add_column(col, justify="left" if col == "run" else "right")
    t.add_row("original", str(orig["status"]), render.ms(orig["duration_ms"]))
    for i, r in enumerate(res["runs"], 1):
        t.add_row(f"replay {i}", str(r["status"]), render.ms(r["duration_ms"]))
    out.print(t)
    med = statistics.median(r["duration_ms"] for r in res["runs"])
    line = f"Median replay {render.ms(med)} ms"
    if orig["duration_ms"]:
        line += (
            f" ({med / orig['duration_ms']:.2f}x the original {render.ms(orig['duration_ms'])} ms)"
        )
    statuses = {r["status"] for r in res["runs"]}
    if statuses != {orig["status"]}:
        line += f"; status changed: {orig['status']} -> {', '.join(map(str, sorted(statuses)))}"
    out.print(Text(line, style="bold"))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


@app.command()
@handle_errors
def heap(
    targets: Annotated[
        list[str] | None,
        typer.Argument(metavar="PID | A B", help="A process id, or two snapshots with --diff."),
    ] = None,
    diff: Annotated[
        bool, typer.Option("--diff", help="What grew from snapshot A to snapshot B.")
    ] = False,
    top: Annotated[int, typer.Option("--top", help="Types to list.")] = 25,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to wait for the snapshot.")
    ] = 60.0,
    data: DataOpt = DEFAULT_DATA,
    json: JsonOpt = False,
) -> None:
    """A heap histogram of a process running the agent (live objects by type: count, shallow
    size), or with --diff A B what grew between two snapshot files.

    The agent answers SIGUSR2 (when the application does not use it) by writing
    DATA/heap/heap-PID-TIMESTAMP.json; no extra OS permission is needed.
    """
    positive(top, "--top")
    args = targets or []
    try:
        if diff:
            if len(args) != 2:
                raise CLIError("--diff takes two snapshots: perfsleuth heap --diff A.json B.json")
            a = hp.load(hp.resolve(data, args[0]))
            b = hp.load(hp.resolve(data, args[1]))
            rows = hp.diff(a, b)
            if json:
                print_json({"a": args[0], "b": args[1], "types": rows})
                return
            _diff_table(rows[:top], a, b)
            return
        if len(args) != 1 or not args[0].isdigit():
            raise CLIError("give one process id, e.g. `perfsleuth heap 12345` (or --diff A B)")
        path, snap = hp.take(os.path.abspath(data), int(args[0]), timeout=timeout)
    except hp.HeapError as e:
        raise CLIError(str(e), EXIT_STATE) from e
    if json:
        print_json(dict(snap, path=path))
        return
    out = out_console()
    out.print(
        Text(
            f"PID {snap['pid']}: {snap['objects']:,} objects tracked by the GC, "
            f"{_size(int(snap['bytes']))} shallow"
        )
    )
    t = Table(box=box.SIMPLE_HEAD)
    for col in ("count", "bytes", "type"):
        t.add_column(col, justify="left" if col == "type" else "right")
    for r in snap["types"][:top]:
        t.add_row(f"{r['count']:,}", _size(int(r["bytes"])), r["type"])
    out.print(t)
    out.print(Text(f"Snapshot: {path} (compare two with perfsleuth heap --diff A B)", style="dim"))


def _diff_table(rows: list[dict[str, object]], a: dict[str, object], b: dict[str, object]) -> None:
    out = out_console()
    secs = (int(str(b.get("ts") or 0)) - int(str(a.get("ts") or 0))) / 1e9
    out.print(Text(f"What grew in {secs:,.1f} s (PID {a.get('pid')} -> PID {b.get('pid')}):"))
    if not rows:
        out.print(Text("Nothing changed."))
        return
    t = Table(box=box.SIMPLE_HEAD)
    for col in ("+count", "+bytes", "count", "bytes", "type"):
        t.add_column(col, justify="left" if col == "type" else "right")
    for r in rows:
        t.add_row(
            f"{int(str(r['count_delta'])):+,}",
            _size(int(str(r["bytes_delta"]))),
            f"{int(str(r['count'])):,}",
            _size(int(str(r["bytes"]))),
            str(r["type"]),
        )
    out.print(t)


__all__ = ["heap", "replay"]
