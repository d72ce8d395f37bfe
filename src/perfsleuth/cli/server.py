"""``perfsleuth server``: the collector a fleet ships to, with the API and the web UI, in one
process on one port. Remote agents (``PERFSLEUTH_COLLECTOR``) send their spool segments to
``POST /api/ingest/segment``, OpenTelemetry exporters to ``/v1/traces``; the server ingests
them into its data directory's store as ``perfsleuth ui`` does a local spool.

Tokens: ``--tokens FILE`` (or ``PERFSLEUTH_TOKENS_FILE``), one ``name kind token`` a line
(``#`` comments), kind ``ingest`` (may only send data) or ``read`` (may only read: the API and
the UI); ``--token`` is one token that may do both. A bind other than loopback needs tokens.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from perfsleuth.cli.app import NoIngestOpt, app
from perfsleuth.cli.common import (
    DEFAULT_DATA,
    EXIT_STATE,
    CLIError,
    DataOpt,
    JsonOpt,
    PortOpt,
    SinceOpt,
    handle_errors,
    out_console,
    parse_since,
    print_json,
    split_hosts,
    store_for_reading,
)
from perfsleuth.cli.ui import DEFAULT_PORT, port_free

KINDS = ("ingest", "read")


def read_tokens(path: str) -> dict[str, tuple[str, str]]:
    """token -> (name, kind) from a tokens file; CLIError naming the line when malformed."""
    from perfsleuth.server.deps import check_token

    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise CLIError(f"--tokens: cannot read {path}: {e.strerror or e}") from e
    out: dict[str, tuple[str, str]] = {}
    names: set[str] = set()
    for i, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        where = f"--tokens {path}, line {i}"
        if len(parts) != 3:
            raise CLIError(f"{where}: expected 'name kind token', got {len(parts)} words")
        name, kind, token = parts
        if kind not in KINDS:
            raise CLIError(f"{where}: kind {kind!r}: use one of {', '.join(KINDS)}")
        try:
            check_token(token)
        except ValueError as e:
            raise CLIError(f"{where}: {e}") from e
        if token in out:
            raise CLIError(f"{where}: the token of {name!r} is also {out[token][0]!r}'s")
        if name in names:
            raise CLIError(f"{where}: the name {name!r} is used twice")
        names.add(name)
        out[token] = (name, kind)
    if not out:
        raise CLIError(f"--tokens {path}: no tokens in the file")
    return out


def start_server(
    data: str,
    host: str,
    port: int,
    token: str | None,
    tokens: dict[str, tuple[str, str]],
    allowed_hosts: list[str],
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> None:
    """Check the settings, print the URL once listening, serve until Ctrl-C."""
    from perfsleuth.server import LOOPBACK, check_token, serve, url_for

    try:
        check_token(token)
    except ValueError as e:
        raise CLIError(f"--token / PERFSLEUTH_SERVER_TOKEN: {e}") from e
    if host not in LOOPBACK and not token and not tokens:
        raise CLIError(
            f"binding to {host} makes the collector reachable from other machines: give "
            "tokens with --tokens FILE (or one token with --token)"
        )
    if bool(tls_cert) != bool(tls_key):
        raise CLIError("give both --tls-cert and --tls-key (PEM files), or neither")
    for flag, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path and not os.path.isfile(path):
            raise CLIError(f"{flag}: no such file {path}")
    if not port_free(host, port):
        raise CLIError(f"port {port} on {host} is in use; choose another with --port", EXIT_STATE)

    def ready(p: int) -> None:
        shown = url_for(host, p, None, tls=bool(tls_cert))
        typer.echo(f"perfsleuth server: {shown}  (data: {os.path.abspath(data)})")
        typer.echo(f"agents: PERFSLEUTH_COLLECTOR={shown.rstrip('/')}")
        typer.echo("Ctrl-C stops it.")

    try:
        serve(
            data,
            host=host,
            port=port,
            token=token,
            tokens=tokens,
            ingest_every=1.0,
            on_ready=ready,
            allowed_hosts=allowed_hosts,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
    except KeyboardInterrupt:
        pass


@app.command()
@handle_errors
def server(
    data: DataOpt = DEFAULT_DATA,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (other than loopback needs tokens).")
    ] = "127.0.0.1",
    port: PortOpt = DEFAULT_PORT,
    tokens: Annotated[
        str | None,
        typer.Option(
            "--tokens",
            metavar="FILE",
            envvar="PERFSLEUTH_TOKENS_FILE",
            show_envvar=True,
            help="Tokens per service or team: lines 'name kind token', kind ingest (may only "
            "send data) or read (may only read).",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="PERFSLEUTH_SERVER_TOKEN",
            show_envvar=True,
            help="One token that may send and read (at least 16 characters).",
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            metavar="NAME",
            envvar="PERFSLEUTH_ALLOWED_HOSTS",
            show_envvar=True,
            help="Also answer requests naming this host (repeat, or '*' for any): agents and "
            "browsers reach the server by this name.",
        ),
    ] = None,
    tls_cert: Annotated[
        str | None,
        typer.Option(
            "--tls-cert",
            metavar="FILE",
            envvar="PERFSLEUTH_TLS_CERT",
            show_envvar=True,
            help="Serve HTTPS with this certificate (PEM, with its chain); needs --tls-key.",
        ),
    ] = None,
    tls_key: Annotated[
        str | None,
        typer.Option(
            "--tls-key",
            metavar="FILE",
            envvar="PERFSLEUTH_TLS_KEY",
            show_envvar=True,
            help="The certificate's private key (PEM).",
        ),
    ] = None,
) -> None:
    """Run the collector: remote agents and OTLP exporters send here; API and UI included."""
    hosts = split_hosts(allow_host)
    table = read_tokens(tokens) if tokens else {}
    start_server(data, host, port, token, table, hosts, tls_cert, tls_key)


@app.command()
@handle_errors
def fleet(
    data: DataOpt = DEFAULT_DATA,
    since: SinceOpt = None,
    no_ingest: NoIngestOpt = False,
    json: JsonOpt = False,
) -> None:
    """Hosts and services that sent requests, and which token sent what (agents and OTLP)."""
    from rich.table import Table

    from perfsleuth.server.fleet import fleet as fleet_of
    from perfsleuth.server.window import window

    parse_since(since)  # the CLI's own message for a bad --since
    with store_for_reading(data, ingest=not no_ingest) as store:
        got = fleet_of(store, window(since))
    if json:
        print_json(got)
        return
    out = out_console()
    hosts = Table(title=f"{len(got['sources'])} host/service pairs", title_justify="left")
    for col in ("host", "service", "requests", "processes", "last request", "tokens", "via"):
        hosts.add_column(col, justify="right" if col in ("requests", "processes") else "left")
    for r in got["sources"]:
        hosts.add_row(
            r["host"] or "-",
            r["service"] or "-",
            f"{r['requests']:,}",
            "-" if r["processes"] is None else str(r["processes"]),
            "-" if r["last"] is None else str(r["last"])[:19],
            ", ".join(r["tokens"]) or "-",
            ", ".join(r["via"]) or "local spool",
        )
    out.print(hosts)
    if got["tokens"]:
        toks = Table(title="received, by token", title_justify="left")
        for col in ("token", "via", "segments", "hosts", "services", "last received"):
            toks.add_column(col, justify="right" if col == "segments" else "left")
        for r in got["tokens"]:
            toks.add_row(
                r["token"] or "(no token)",
                r["via"],
                f"{r['segments']:,}",
                ", ".join(r["hosts"]),
                ", ".join(r["services"]),
                str(r["last_received"])[:19],
            )
        out.print(toks)
