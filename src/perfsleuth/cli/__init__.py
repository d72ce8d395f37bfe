"""The ``perfsleuth`` command line (Typer + Rich).

Modules: :mod:`~perfsleuth.cli.app` (the Typer ``app`` every command module registers on),
:mod:`~perfsleuth.cli.main` (imports the command modules: ``core``, ``analysis``, ``compare``,
``evidence``, ``load``, ``replay``, ``startup``, ``ui``; ``main()`` runs the app),
:mod:`~perfsleuth.cli.common` (errors, options, parsing, output helpers),
:mod:`~perfsleuth.cli.render` (tables and the trace waterfall) and
:mod:`~perfsleuth.cli.demo` (the ``perfsleuth demo`` walk-through).

Exit codes: 0 ok; 1 the store cannot be used right now (locked, empty, I/O); 2 bad input
(usage, --since, unknown endpoint or trace, refused or invalid SQL); 3 ``ingest`` found damaged
spool data (after ingesting everything readable); 126/127 ``run`` could not start the command;
130 interrupted.
"""
