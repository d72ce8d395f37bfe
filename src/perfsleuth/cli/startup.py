"""``perfsleuth startup -- CMD``: where a server's start-up time goes, until it first answers.

Registered on the shared Typer ``app`` of :mod:`perfsleuth.cli.app`; :mod:`perfsleuth.cli.main`
imports this module.
"""

from __future__ import annotations

import json as jsonlib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from perfsleuth.cli.app import app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
    CLIError,
    DataOpt,
    JsonOpt,
    handle_errors,
    out_console,
    print_json,
)

_BAR = 30


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@handle_errors
def startup(
    ctx: typer.Context,
    url: Annotated[
        str,
        typer.Option(
            "--url",
            help="Poll this URL until the server answers, e.g. http://127.0.0.1:8000/health.",
        ),
    ],
    timeout: Annotated[
        float, typer.Option("--timeout", help="Give up when it has not answered after this many s.")
    ] = 60.0,
    steady: Annotated[
        int, typer.Option("--steady", help="Requests after the first one, for the steady state.")
    ] = 20,
    save: Annotated[
        str | None, typer.Option("--save", metavar="FILE", help="Write the report to FILE (JSON).")
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option("--compare", metavar="FILE", help="Compare with an earlier --save file."),
    ] = None,
    data: DataOpt = DEFAULT_DATA,
    json: JsonOpt = False,
) -> None:
    """Run a server command under the agent and say where its start-up went, until it first
    answers --url: interpreter start, imports (a ranked tree, your modules marked), settings
    and app factory, framework init, lifespan startup, worker boot, the first request against
    the steady state, and what ran one after another.

    The report is kept in DIR/runs/startup/ (the web UI's Start-up page).

    Example: perfsleuth startup --url http://127.0.0.1:8000/health -- uvicorn app:app --port 8000
    """
    from perfsleuth.analysis import startup as st

    cmd = list(ctx.args)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CLIError("give the server command after --, e.g. -- uvicorn app:app --port 8000")
    before = None
    if compare:
        try:
            before = jsonlib.loads(Path(compare).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read {compare}: {e}") from e
    try:
        report = st.analyze(st.measure(cmd, url, timeout=timeout, steady=steady))
    except st.StartupError as e:
        raise CLIError(str(e)) from e
    if before is not None:
        report["compare"] = st.compare(before, report)
    try:
        report["name"] = st.save_run(data, report)
    except OSError as e:
        raise CLIError(f"cannot keep the report in {data}: {e}") from e
    if save:
        Path(save).write_text(jsonlib.dumps(report, indent=1), encoding="utf-8")
    if json:
        print_json(report)
        return
    render(report)


def render(report: dict[str, Any]) -> None:
    from rich.tree import Tree

    con = out_console()
    con.print(
        f"[bold]{report['total_ms']:,.0f} ms[/] from launch to the first answer of {report['url']}"
    )
    t = Table(box=box.SIMPLE_HEAD)
    for col, just in (("phase", "left"), ("ms", "right"), ("share", "right"), ("", "left"),
                      ("mostly", "left")):  # fmt: skip
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for p in report["phases"]:
        if not p["ms"]:
            continue
        bar = "█" * max(1, round(_BAR * p["share"]))
        top = ", ".join(f"{x['name']} {x['ms']:,.1f}" for x in p["top"][:2])
        t.add_row(p["phase"], f"{p['ms']:,.1f}", f"{p['share']:.0%}", bar, Text(top))
    con.print(t)
    imp = report["imports"]
    tree = Tree(f"imports: {imp['count']} modules, {imp['total_ms']:,.0f} ms (cumulative)")

    def add(node: Tree, items: list[dict[str, Any]], depth: int) -> None:
        for n in items[: 8 if depth == 0 else 4]:
            if n["cum_ms"] < 1 and depth:
                continue
            label = Text(f"{n['name']}  {n['cum_ms']:,.1f} ms (self {n['self_ms']:,.1f})")
            if n["app"]:
                label.append("  [app]", style="bold cyan")
            if depth < 3:
                add(node.add(label), n["children"], depth + 1)
            else:
                node.add(label)

    add(tree, imp["tree"], 0)
    con.print(tree)
    slow = ", ".join(
        f"{n['name']}{' (app)' if n['app'] else ''} {n['self_ms']:,.0f} ms"
        for n in imp["slowest"][:5]
    )
    con.print(Text(f"slowest imports (self time): {slow}"))
    fr = report["first_request"]
    if fr["steady_p50_ms"] is not None:
        con.print(
            f"first request {fr['ms']:,.1f} ms, steady state {fr['steady_p50_ms']:,.1f} ms "
            f"({fr['ratio']}x)"
        )
    for note in report["notes"]:
        con.print(Text(f"- {note}"))
    cmp = report.get("compare")
    if cmp:
        c = Table(box=box.SIMPLE_HEAD, title="against the earlier run")
        for col in ("phase", "before ms", "after ms", "change ms"):
            c.add_column(col, justify="left" if col == "phase" else "right")
        for r in cmp["phases"]:
            if r["before_ms"] or r["after_ms"]:
                c.add_row(r["phase"], f"{r['before_ms']:,.1f}", f"{r['after_ms']:,.1f}",
                          f"{r['change_ms']:+,.1f}")  # fmt: skip
        tot = cmp["total"]
        c.add_row("total", f"{tot['before_ms']:,.1f}", f"{tot['after_ms']:,.1f}",
                  f"{tot['change_ms']:+,.1f}", style="bold")  # fmt: skip
        con.print(c)
