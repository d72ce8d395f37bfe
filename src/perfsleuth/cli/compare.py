"""``perfsleuth compare``: two time ranges, releases, or tag/attribute values, per endpoint,
with a verdict line on top.

Registered on the shared Typer ``app`` of :mod:`perfsleuth.cli.app`; :mod:`perfsleuth.cli.main`
imports this module.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from perfsleuth.analysis import compare as cmp
from perfsleuth.analysis.config import ConfigError, load_config
from perfsleuth.cli.app import NoIngestOpt, app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
    EXIT_USAGE,
    CLIError,
    DataOpt,
    JsonOpt,
    ensure_not_empty,
    handle_errors,
    out_console,
    print_json,
    store_for_reading,
)


@app.command()
@handle_errors
def compare(
    a: Annotated[
        str | None,
        typer.Option(
            "--a",
            metavar="SIDE",
            help="Side a: a time range START/END (2026-11-20T10:00/2026-11-20T11:00, UTC) or "
            "last-1h; with --by, a value (default: the two most common values).",
        ),
    ] = None,
    b: Annotated[
        str | None,
        typer.Option("--b", metavar="SIDE", help="Side b, as --a; b is compared against a."),
    ] = None,
    by: Annotated[
        str | None,
        typer.Option(
            "--by",
            metavar="tag:NAME|attr:NAME|release",
            help="Compare the values of a tag or attribute (--by tag:checkout_v2), or releases.",
        ),
    ] = None,
    window: Annotated[
        str | None,
        typer.Option(
            "--window",
            metavar="RANGE",
            help="With --by: only requests in this time range (START/END or last-1h).",
        ),
    ] = None,
    alpha: Annotated[
        float, typer.Option("--alpha", help="False discovery rate across endpoints.")
    ] = cmp.ALPHA,
    min_change: Annotated[
        float,
        typer.Option("--min-change", help="Smallest p50/p95 change called a change (fraction)."),
    ] = cmp.MIN_CHANGE,
    min_requests: Annotated[
        int, typer.Option("--min-requests", help="Requests needed on each side.")
    ] = cmp.MIN_REQUESTS,
    no_findings: Annotated[
        bool, typer.Option("--no-findings", help="Skip the findings of each side (faster).")
    ] = False,
    data: DataOpt = DEFAULT_DATA,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Did the change help? Per endpoint: requests and p50/p95/p99 of each side with intervals,
    the change, a rank test (false discovery rate controlled across endpoints), and what moved
    with it (calls, rows, CPU, GC, findings appeared or gone)."""
    try:
        cfg = load_config()
    except ConfigError as e:
        raise CLIError(str(e), EXIT_USAGE) from e
    with store_for_reading(data, ingest=not no_ingest) as store:
        ensure_not_empty(store, data)
        try:
            if by is not None:
                scope = cmp.time_side(window) if window else None
                side_a, side_b = cmp.value_sides(store, by, a, b, scope)
            else:
                if not a or not b:
                    raise CLIError(
                        "give two sides: --a START/END --b last-1h, or --by tag:NAME", EXIT_USAGE
                    )
                side_a, side_b = cmp.time_side(a), cmp.time_side(b)
            result = cmp.compare(
                store,
                side_a,
                side_b,
                config=cfg,
                alpha=alpha,
                min_change=min_change,
                min_requests=min_requests,
                findings=not no_findings,
            )
        except cmp.CompareError as e:
            raise CLIError(str(e), EXIT_USAGE) from e
    if json:
        print_json(result)
        return
    out = out_console()
    out.print(Text(result["verdict"], style="bold"))
    out.print(_table(result))
    f = result["findings"]
    for title, items, style in (("Findings gone", f["gone"], "green"),
                                ("Findings appeared", f["appeared"], "red")):  # fmt: skip
        if items:
            out.print(Text(f"{title} in {result['b']}:", style=style))
            for item in items:
                note = (
                    " (too few requests on a side to tell)"
                    if item.get("endpoint_verdict") == "too_few"
                    else ""
                )
                out.print(Text(f"  {item['kind']} {item['endpoint']}{note}: {item['title']}"))


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _ci(side: dict[str, Any], name: str) -> str:
    v = side.get(f"{name}_ms")
    ci = side.get("ci", {}).get(f"{name}_ms")
    if v is None or not ci:
        return "-"
    return f"{v:,.1f} [{ci[0]:,.1f}-{ci[1]:,.1f}]"


def _change(ch: Any, pm: Any) -> str:
    if ch is None:
        return "-"
    s = f"{ch * 100:+.0f} %"
    return s + (f" ±{pm * 100:.0f}" if pm is not None else "")


_MOVED_SHOWN = (("db_calls", "db"), ("http_calls", "http"), ("cache_calls", "cache"),
                ("rows", "rows"), ("cpu_ms", "cpu ms"), ("gc_ms", "gc ms"))  # fmt: skip


def _moved(r: dict[str, Any]) -> str:
    parts = []
    for key, label in _MOVED_SHOWN:
        m = r["moved"].get(key, {})
        va, vb = m.get("a"), m.get("b")
        if va is None or vb is None or abs(vb - va) < max(0.5, 0.1 * abs(va)):
            continue
        parts.append(f"{label} {va:,.1f}→{vb:,.1f}")
    for f in r.get("findings_gone", []):
        parts.append(f"gone: {f['kind']}")
    for f in r.get("findings_appeared", []):
        parts.append(f"new: {f['kind']}")
    return ", ".join(parts)


def _table(result: dict[str, Any]) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title=f"{result['b']} against {result['a']}")
    for col in ("endpoint", "verdict", "n a", "n b", "p50 a", "p50 b", "p95 a [95% CI]",
                "p95 b [95% CI]", "p95 change", "q", "moved with it"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("endpoint", "verdict", "moved with it")
                     else "right")  # fmt: skip
    style = {"slower": "red", "faster": "green", "same": "", "too_few": "dim"}
    for r in result["endpoints"]:
        q = r["q_value"]
        t.add_row(
            r["endpoint"],
            Text(r["verdict"], style=style[r["verdict"]]),
            f"{r['a']['count']:,}",
            f"{r['b']['count']:,}",
            _ms(r["a"]["p50_ms"]),
            _ms(r["b"]["p50_ms"]),
            _ci(r["a"], "p95"),
            _ci(r["b"], "p95"),
            _change(r["p95_change"], r["p95_change_pm"]),
            "-" if q is None else f"{q:.2g}",
            _moved(r),
        )
    return t
