"""``perfsleuth load``: replay traffic against one target or two (A/B) with a verdict.

Registered on the shared Typer ``app`` of :mod:`perfsleuth.cli.app`; :mod:`perfsleuth.cli.main`
imports this module.
The analysis module (asyncio, httpx) is imported when the command runs, not with the CLI.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from perfsleuth.cli.app import NoIngestOpt, app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
    CLIError,
    DataOpt,
    JsonOpt,
    SinceOpt,
    err_console,
    handle_errors,
    out_console,
    parse_since,
    print_json,
    store_for_reading,
)

_COLOURS = {"faster": "green", "slower": "red", "same": "", "too_few": "dim"}


def _captures(data: str, endpoints: list[str], since: str | None, ingest: bool) -> list[Any]:
    from perfsleuth.analysis import load as ld

    window = parse_since(since)
    where = ["coalesce(body_truncated, false) = false"]
    params: list[Any] = []
    if endpoints:
        where.append(f"endpoint IN ({', '.join('?' for _ in endpoints)})")
        params += endpoints
    if window is not None:
        where.append("ts >= ?")
        params.append(datetime.now(UTC).replace(tzinfo=None) - window)
    with store_for_reading(data, ingest=ingest) as store:
        if "captures" not in {r["name"] for r in store.query("SHOW TABLES")}:
            return []
        rows = store.query(
            f"SELECT * FROM captures WHERE {' AND '.join(where)} ORDER BY ts", params
        )
    return ld.from_captures(rows)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0%}"


def _progress_view(p: Any) -> Table:
    t = Table(box=box.SIMPLE, title=f"{p.done}/{p.planned} ticks, {p.elapsed_s:.1f} s")
    for col in ("side", "requests", "p50 ms", "p95 ms", "errors"):
        t.add_column(col, justify="right" if col != "side" else "left")
    for side, s in p.sides.items():
        t.add_row(side, str(s["count"]), _ms(s["p50_ms"]), _ms(s["p95_ms"]), str(s["errors"]))
    done = int(30 * p.done / max(1, p.planned))
    t.caption = "[" + "#" * done + "." * (30 - done) + "]"
    return t


@app.command()
@handle_errors
def load(
    a: Annotated[
        str | None,
        typer.Option("--a", metavar="URL", help="Target (side a), e.g. http://127.0.0.1:8000."),
    ] = None,
    b: Annotated[
        str | None, typer.Option("--b", metavar="URL", help="Second target (side b): an A/B run.")
    ] = None,
    har: Annotated[
        str | None, typer.Option("--har", metavar="FILE", help="Replay the requests of a HAR file.")
    ] = None,
    urls: Annotated[
        str | None,
        typer.Option(
            "--urls", metavar="FILE", help="Replay a URL list ('URL' or 'METHOD URL' a line)."
        ),
    ] = None,
    endpoint: Annotated[
        list[str] | None,
        typer.Option("--endpoint", help="Captured traffic of this endpoint only (repeatable)."),
    ] = None,
    since: SinceOpt = None,
    rate: Annotated[
        float | None,
        typer.Option("--rate", help="Requests a second sent to each target (open loop)."),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", help="Workers, each sending its next request when one ends."),
    ] = None,
    requests: Annotated[
        int, typer.Option("--requests", help="Measured requests per target (at most).")
    ] = 500,
    duration: Annotated[
        float, typer.Option("--duration", help="Stop after this many seconds (warm-up included).")
    ] = 60.0,
    warmup: Annotated[
        int, typer.Option("--warmup", help="Requests per target sent first and not measured.")
    ] = 20,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per request.")] = 30.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the side order.")] = None,
    allow_remote: Annotated[
        bool, typer.Option("--allow-remote", help="Allow targets that are not loopback addresses.")
    ] = False,
    data: DataOpt = DEFAULT_DATA,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Send traffic to one target or two (--a URL --b URL) and say which is faster, per endpoint.

    Traffic: the store's captured requests (--endpoint, --since), a HAR file (--har) or a URL
    list (--urls); only their path and query are sent, to the targets given. Pace: --rate N a
    second to each target, or --concurrency N workers. The sides are interleaved (each request
    goes to both, in a random order) and every request carries the header
    `X-Perfsleuth-Load: <run>;<side>`, which the agent records as the tags load_run and
    load_side: `perfsleuth compare --by tag:load_side` then explains the difference. The
    report is kept in DIR/runs/load/ (the web UI's Load page).
    """
    from rich.live import Live

    from perfsleuth.analysis import load as ld

    if not a:
        raise CLIError("give a target: --a URL (and --b URL to compare two)")
    if har and urls:
        raise CLIError("give one traffic source: --har or --urls (or neither: the captures)")
    try:
        targets = {"a": ld.check_target(a, allow_remote=allow_remote)}
        if b:
            targets["b"] = ld.check_target(b, allow_remote=allow_remote)
        if har:
            items = ld.from_har(har)
        elif urls:
            items = ld.from_urls(urls)
        else:
            items = _captures(data, endpoint or [], since, not no_ingest)
            if not items:
                raise CLIError(
                    f"no replayable captures in {data}"
                    + (f" for {', '.join(endpoint)}" if endpoint else "")
                    + ": give --har FILE or --urls FILE, or capture traffic under `perfsleuth run`"
                )
        plan = ld.Plan(
            targets=targets,
            items=items,
            rate=rate,
            concurrency=concurrency,
            requests=requests,
            duration=duration,
            warmup=warmup,
            timeout=timeout,
            seed=seed,
        )
        if json:
            report = ld.run(plan)
        else:
            with Live(console=err_console(), refresh_per_second=4, transient=True) as live:
                report = ld.run(plan, lambda p: live.update(_progress_view(p)))
    except ld.LoadError as e:
        raise CLIError(str(e)) from e
    try:
        report["name"] = ld.save_run(data, report)
    except OSError as e:
        raise CLIError(f"cannot keep the report in {data}: {e}") from e
    if json:
        print_json(report)
        return
    _render(report)


def _render(report: dict[str, Any]) -> None:
    con = out_console()
    rate = report["achieved_rate"]
    con.print(
        f"run {report['run_id']}: {report['measured_ticks']} measured requests per target"
        + (f" at {rate:.1f}/s" if rate else "")
        + f" (asked {report['rate']:g}/s)" * bool(report["rate"])
        + f", {report['warmup']} warm-up"
    )
    for side, s in report["sides"].items():
        con.print(
            f"  {side}: {s['target']}  p50 {_ms(s['p50_ms'])} ms  p95 {_ms(s['p95_ms'])} ms  "
            f"errors {s['errors']}"
        )
    two = len(report["sides"]) == 2
    t = Table(box=box.SIMPLE_HEAD)
    t.add_column("endpoint")
    if two:
        for col in (
            "a n",
            "a p50",
            "a p95",
            "b n",
            "b p50",
            "b p95",
            "p50 Δ",
            "p95 Δ",
            "q",
            "verdict",
        ):
            t.add_column(col, justify="right")
        for r in report["endpoints"]:
            colour = _COLOURS[r["verdict"]]
            t.add_row(
                r["endpoint"],
                str(r["a"]["count"]), _ms(r["a"]["p50_ms"]), _ms(r["a"]["p95_ms"]),
                str(r["b"]["count"]), _ms(r["b"]["p50_ms"]), _ms(r["b"]["p95_ms"]),
                _pct(r["p50_change"]), _pct(r["p95_change"]),
                "-" if r["q_value"] is None else f"{r['q_value']:.3g}",
                Text(r["verdict"], style=colour),
            )  # fmt: skip
    else:
        for col in ("n", "p50 ms", "p95 ms"):
            t.add_column(col, justify="right")
        for r in report["endpoints"]:
            t.add_row(r["endpoint"], str(r["count"]), _ms(r["p50_ms"]), _ms(r["p95_ms"]))
    con.print(t)
    if two:
        con.print(report["verdict"])
        con.print(
            f"Under the agent the targets tagged these requests load_run={report['run_id']}: "
            "`perfsleuth compare --by tag:load_side` shows what moved with the latency."
        )
