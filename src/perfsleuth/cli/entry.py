"""The ``perfsleuth`` console script.

``perfsleuth run [--data DIR] [--service NAME] -- CMD...`` goes straight to the agent's
launcher, which replaces this process with CMD: everything this process does delays the
application's start, so it imports neither the command line (typer, rich, the store) nor
anything but os and sys. Anything else (other commands, help, unusual options, a command that
cannot run) goes to perfsleuth.cli.main, which parses and reports as always.
"""

from __future__ import annotations

import os
import sys


def run_args(args: list[str]) -> tuple[str, str | None, list[str]] | None:
    """(data dir, service, command) of ``run``'s arguments when they are plain (known options
    before a ``--``, a command after it), else None."""
    data = os.environ.get("PERFSLEUTH_DATA") or ".perfsleuth"
    service = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            command = args[i + 1 :]
            return (data, service, command) if command else None
        name, eq, value = a.partition("=")
        if name not in ("--data", "--service"):
            return None
        if not eq:
            if i + 1 >= len(args):
                return None
            i += 1
            value = args[i]
        if name == "--data":
            data = value
        else:
            service = value
        i += 1
    return None


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["run"]:
        plain = run_args(args[1:])
        if plain is not None:
            from perfsleuth.agent.launch import run_command

            data, service, command = plain
            try:
                run_command(command, os.path.abspath(data), service)
            except (OSError, ValueError):
                pass  # the full command line says why, in its words
    from perfsleuth.cli.main import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
