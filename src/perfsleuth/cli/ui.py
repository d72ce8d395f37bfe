"""``perfsleuth ui``: serve the web UI and its API on a data directory, ingesting the spool
continuously. Registered on the shared Typer ``app`` of :mod:`perfsleuth.cli.app` (cli.main
imports this module)."""

from __future__ import annotations

import os
import socket
from typing import Annotated

import typer

from perfsleuth.cli.app import app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
    EXIT_STATE,
    CLIError,
    DataOpt,
    PortOpt,
    handle_errors,
    split_hosts,
)

DEFAULT_PORT = 8321


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str, preferred: int) -> int:
    """``preferred`` if it is free (and not 0), else one the OS picks."""
    if preferred > 0 and port_free(host, preferred):
        return preferred
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_ui(
    data: str,
    host: str,
    port: int,
    token: str | None,
    ingest: bool = True,
    allowed_hosts: list[str] | tuple[str, ...] = (),
) -> None:
    """Check the settings, print the URL once listening, serve until Ctrl-C."""
    from perfsleuth.server import LOOPBACK, check_token, serve, url_for

    try:
        check_token(token)
    except ValueError as e:
        raise CLIError(f"--token / PERFSLEUTH_TOKEN: {e}") from e
    if host not in LOOPBACK and not token:
        raise CLIError(
            f"binding to {host} makes the UI reachable from other machines: give a token "
            "with --token or PERFSLEUTH_TOKEN (every API call must then carry it)"
        )
    if not port_free(host, port):
        raise CLIError(f"port {port} on {host} is in use; choose another with --port", EXIT_STATE)

    def ready(p: int) -> None:
        typer.echo(f"perfsleuth UI: {url_for(host, p, token)}  (data: {os.path.abspath(data)})")
        typer.echo("Ctrl-C stops it.")

    try:
        serve(
            data,
            host=host,
            port=port,
            token=token,
            on_ready=ready,
            ingest=ingest,
            allowed_hosts=allowed_hosts,
        )
    except KeyboardInterrupt:
        pass


@app.command()
@handle_errors
def ui(
    data: DataOpt = DEFAULT_DATA,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (other than loopback needs a token).")
    ] = "127.0.0.1",
    port: PortOpt = DEFAULT_PORT,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="PERFSLEUTH_TOKEN",
            show_envvar=True,
            help="Require this token on every API call (Bearer header or ?token=); at least "
            "16 characters.",
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            metavar="NAME",
            envvar="PERFSLEUTH_ALLOWED_HOSTS",
            show_envvar=True,
            help="Also answer requests naming this host (the name in the browser's address "
            "bar; repeat for several, '*' for any). Loopback names and the bound address are "
            "always answered; other names are refused, against DNS rebinding.",
        ),
    ] = None,
    no_ingest: Annotated[
        bool,
        typer.Option(
            "--no-ingest",
            help="Serve what is ingested, read-only: other perfsleuth commands can then use "
            "the data at the same time.",
        ),
    ] = False,
) -> None:
    """Serve the web UI and its JSON API (/api/), ingesting the spool as it grows."""
    hosts = split_hosts(allow_host)
    start_ui(data, host, port, token, ingest=not no_ingest, allowed_hosts=hosts)
