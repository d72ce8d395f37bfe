"""Small real applications for the framework and server tests (importable as ``apps.*`` from
the tests, or as top-level modules by servers started with this directory as cwd)."""
