"""``perfsleuth demo``: seed the demo database, start the demo services under the agent, drive
mixed traffic, stop the services (the agent flushes at exit), ingest, and show what was found
with the commands to dig further."""

from __future__ import annotations

import os
import shlex
import sys
import time
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.text import Text

from perfsleuth.cli import render
from perfsleuth.cli.common import (
    EXIT_STATE,
    CLIError,
    damage_sentences,
    err_console,
    opened,
    out_console,
    print_json,
)

READY_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 25
N_PLUS_ONE_HINT = "GET /customers/{customer_id}/orders"


def _status(console: Console, message: str) -> None:
    console.print(Text(f"» {message}", style="bold cyan"))


def _tail(path: str, n: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().splitlines()[-n:]
    except OSError:
        return []


def _show_logs(console: Console, servers: Any, only: str | None = None) -> None:
    for name, path in servers.logs.items():
        if only is not None and name != only:
            continue
        lines = _tail(path)
        console.print(Text(f"--- last {len(lines)} lines of the {name} log ({path}) ---"))
        for line in lines:
            console.print(Text(line), soft_wrap=True)


def _drive(
    traffic: Any, servers: Any, seconds: float, err: Console, *, interactive: bool
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"concurrency": 8, "seed": 7}
    if not interactive:
        return traffic.drive(servers.shop_url, servers.legacy_url, seconds, **kwargs)
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("driving traffic"),
        BarColumn(),
        TextColumn("{task.fields[requests]} requests"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("traffic", total=seconds, requests=0)

        def on_progress(elapsed: float, requests: int) -> None:
            bar.update(task, completed=min(float(elapsed), seconds), requests=f"{requests:,}")

        kwargs["on_progress"] = on_progress
        return traffic.drive(servers.shop_url, servers.legacy_url, seconds, **kwargs)


def run_demo(data: str, seconds: float, *, as_json: bool, ui: bool = False) -> int:
    try:
        from perfsleuth.demo import servers as demo_servers
        from perfsleuth.demo import traffic
    except ImportError as e:
        raise CLIError(
            f"the demo needs its extra packages ({e.name or e}); install perfsleuth[demo]",
            EXIT_STATE,
        ) from e

    err = err_console()
    interactive = sys.stderr.isatty()
    data = os.path.abspath(data)
    os.makedirs(data, exist_ok=True)
    began = time.time()
    db_path = os.path.join(data, "demo.sqlite3")

    _status(err, f"Seeding the demo database ({db_path})")
    from perfsleuth.demo import db as demo_db

    demo_db.seed(db_path)

    def wrap(service: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "perfsleuth",
            "run",
            "--data",
            data,
            "--service",
            service,
            "--",
        ]

    _status(err, "Starting the demo services under the agent (`perfsleuth run`)")
    servers = demo_servers.start_servers(db_path, data, wrap=wrap)
    traffic_stats: dict[str, Any] = {}
    try:
        try:
            ready = servers.wait_ready(READY_TIMEOUT_S)
        except Exception as e:  # a server that died or never listened
            _show_logs(err, servers)
            raise CLIError(f"a demo server failed to start: {e}", EXIT_STATE) from e
        if ready is False:
            _show_logs(err, servers)
            raise CLIError(
                f"the demo servers were not ready after {READY_TIMEOUT_S:.0f} s", EXIT_STATE
            )
        _status(
            err,
            f"Driving mixed traffic for {seconds:g} s at {servers.shop_url} and "
            f"{servers.legacy_url}",
        )
        traffic_stats = _drive(traffic, servers, seconds, err, interactive=interactive)
    finally:
        _status(err, "Stopping the services (the agent flushes at exit)")
        try:
            servers.stop()
        except Exception as e:
            err.print(Text(f"perfsleuth: warning: stopping the demo servers failed: {e}"))

    _status(err, "Ingesting what the agent recorded")
    with opened(data) as store:
        report = store.ingest()
        for damage in damage_sentences(report, data):
            err.print(Text(f"perfsleuth: warning: {damage}"), soft_wrap=True)
        window = timedelta(seconds=time.time() - began + 60)
        rows = store.top(since=window)
        drops = store.agent_drops()
        if not rows:
            _show_logs(err, servers)
            raise CLIError(
                f"the demo recorded no requests in {data}; see the server logs above", EXIT_STATE
            )
        steps = _next_steps(store, rows, data, window)

    if as_json:
        print_json(
            {
                "data": data,
                "traffic": traffic_stats,
                "rows": rows,
                "drops": drops,
                "next": [s["command"] for s in steps],
            }
        )
        return 0

    out = out_console()
    total = sum(int(r.get("count") or 0) for r in rows)
    out.print()
    out.print(render.top_table(rows, ("endpoint",), f"{total:,} requests recorded during the demo"))
    sentence = render.drops_sentence(drops)
    if sentence:
        out.print(Text(sentence, style="yellow"))
    out.print()
    out.print(Text("What to look at next", style="bold underline"))
    for s in steps:
        out.print(Text(f"  {s['why']}"))
        out.print(Text(f"    {s['command']}", style="bold green"))
    if ui:
        from perfsleuth.cli.ui import DEFAULT_PORT, free_port, start_ui

        out.print()
        out.print(Text("The same, and more, in the browser:", style="bold underline"))
        # Read-only: the commands above keep working while the UI is served.
        start_ui(data, "127.0.0.1", free_port("127.0.0.1", DEFAULT_PORT), None, ingest=False)
    return 0


def _cmd(*args: str) -> str:
    return " ".join(shlex.quote(a) for a in args)


def _next_steps(
    store: Any, rows: list[dict[str, Any]], data: str, window: timedelta
) -> list[dict[str, str]]:
    rel = os.path.relpath(data) if not os.path.relpath(data).startswith("..") else data
    d = ("--data", rel)
    steps: list[dict[str, str]] = []

    # What the detectors say comes first: the point of perfsleuth is naming the problem.
    from perfsleuth.analysis import find

    found = find(store, since=window)
    if found:
        top = found[0]
        steps.append(
            {
                "why": (
                    f"{len(found)} problems found, ranked by the time they cost; the first: "
                    f"{top.title}"
                ),
                "command": _cmd("perfsleuth", "findings", *d),
            }
        )
        steps.append(
            {
                "why": "its evidence, the line of code and example requests",
                "command": _cmd("perfsleuth", "explain", top.id, *d),
            }
        )

    # The N+1 endpoint: the most DB calls per request (the demo's customer orders page).
    endpoints = {str(r.get("endpoint")): r for r in rows}
    n1 = endpoints.get(N_PLUS_ONE_HINT) or max(
        rows, key=lambda r: float(r.get("db_calls_per_request") or 0)
    )
    n1_name = str(n1.get("endpoint"))
    steps.append(
        {
            "why": (
                f"{n1_name} makes {render.num(n1.get('db_calls_per_request'))} DB calls per "
                "request: see its slowest requests"
            ),
            "command": _cmd("perfsleuth", "traces", "--endpoint", n1_name, "--slowest", "5", *d),
        }
    )
    slow = store.traces(endpoint=n1_name, since=window, slowest=1)
    if slow:
        t = slow[0]
        steps.append(
            {
                "why": (
                    f"the slowest of them ({render.ms(t.get('duration_ms'))} ms, "
                    f"{t.get('db_calls')} DB calls), call by call, with the line that loops"
                ),
                "command": _cmd("perfsleuth", "trace", str(t.get("trace_id")), *d),
            }
        )
    # The slowest endpoint at p95, if it is a different one.
    worst = max(rows, key=lambda r: float(r.get("p95_ms") or 0))
    if worst.get("endpoint") != n1_name:
        slow = store.traces(endpoint=str(worst.get("endpoint")), since=window, slowest=1)
        if slow:
            steps.append(
                {
                    "why": (
                        f"{worst.get('endpoint')} has the worst p95 "
                        f"({render.ms(worst.get('p95_ms'))} ms): look at its slowest request"
                    ),
                    "command": _cmd("perfsleuth", "trace", str(slow[0].get("trace_id")), *d),
                }
            )
    # The agent kept replayable captures of slow, failed and loop-blocking requests.
    captured = store.query(
        "SELECT trace_id, endpoint, reason FROM captures ORDER BY duration_ms DESC LIMIT 1"
    )
    if captured:
        c = captured[0]
        steps.append(
            {
                "why": (
                    f"replay the slowest captured request ({c['endpoint']}, kept as "
                    f"{c['reason']}): as curl, or re-sent with --to URL to a running server"
                ),
                "command": _cmd("perfsleuth", "replay", str(c["trace_id"]), "--curl", *d),
            }
        )
    steps.append(
        {
            "why": "which statements cost the most time, across all requests (read-only SQL)",
            "command": _cmd(
                "perfsleuth",
                "sql",
                "SELECT f.text AS statement, count(*) AS calls, round(sum(c.duration_ms), 1) "
                "AS total_ms FROM calls c JOIN fingerprints f ON f.id = c.fingerprint_id "
                "GROUP BY 1 ORDER BY total_ms DESC LIMIT 5",
                *d,
            ),
        }
    )
    steps.append(
        {
            "why": "who is slow: the same table by user and endpoint",
            "command": _cmd("perfsleuth", "top", "--by", "endpoint,user", "--limit", "10", *d),
        }
    )
    return steps
