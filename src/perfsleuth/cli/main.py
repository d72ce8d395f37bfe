"""The ``perfsleuth`` command line: the Typer ``app`` (:mod:`perfsleuth.cli.app`) with every
command module registered on it. Every command takes ``--data DIR``; every reporting command takes
``--json``."""

from __future__ import annotations

# Each import registers its commands; the order is the order of ``perfsleuth --help``.
# isort: off
from perfsleuth.cli import core as _core  # noqa: F401  (run, ingest, top, traces, trace, sql, demo)

# isort: on
from perfsleuth.cli import analysis as _analysis  # noqa: F401  (findings, explain, calltree)
from perfsleuth.cli import compare as _compare  # noqa: F401  (compare)
from perfsleuth.cli import evidence as _evidence  # noqa: F401  (profile, blockers)
from perfsleuth.cli import load as _load  # noqa: F401  (load)
from perfsleuth.cli import replay as _replay  # noqa: F401  (replay, heap)
from perfsleuth.cli import server as _server  # noqa: F401  (server)
from perfsleuth.cli import startup as _startup  # noqa: F401  (startup)
from perfsleuth.cli import ui as _ui  # noqa: F401  (ui)
from perfsleuth.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app(prog_name="perfsleuth")
