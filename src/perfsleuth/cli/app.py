"""The shared Typer ``app`` every command module registers on, and the options only commands
use (the general ones are in :mod:`perfsleuth.cli.common`). :mod:`perfsleuth.cli.main` imports the
command modules, so importing it gives the whole command line."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from perfsleuth import __version__

app = typer.Typer(
    name="perfsleuth",
    help="perfsleuth: a self-hosted performance detective for Python web services.\n\n"
    "Run your app under `perfsleuth run -- CMD`, then ask `perfsleuth top`, `traces`, "
    "`trace ID` and `sql`. New here? Try `perfsleuth demo`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

NoIngestOpt = Annotated[
    bool, typer.Option("--no-ingest", help="Do not ingest the spool first (faster, maybe stale).")
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"perfsleuth {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            envvar="PERFSLEUTH_STORE",
            metavar="URL",
            show_envvar=True,
            help="Where requests are stored: duckdb (default: a file in the data directory), "
            "clickhouse://host:8123/db, or chdb:///dir (needs perfsleuth[clickhouse]).",
        ),
    ] = None,
) -> None:
    """perfsleuth: a self-hosted performance detective."""
    # Every command opens its store through perfsleuth.store.open_store, which reads
    # $PERFSLEUTH_STORE itself: only a URL given on the command line is set here.
    if store and store != os.environ.get("PERFSLEUTH_STORE"):
        import perfsleuth.store

        perfsleuth.store.cli_url = store
