"""The store engines the store, detector and API tests run on: DuckDB always, and ClickHouse's
engine through chDB (in this process) where the ``clickhouse`` extra is installed.

One point of parametrization: a test that takes the ``store_engine`` fixture (``synth`` does)
runs once per engine when its module is in :data:`CHDB_MODULES` (chosen so that together they
run every query of the reader, the detectors, ``top``, ``compare`` and the API) or when
``PERFSLEUTH_TEST_ENGINES`` names the engines (``duckdb,chdb`` everywhere; ``duckdb`` only).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any

ENGINES_ENV = "PERFSLEUTH_TEST_ENGINES"

CHDB_MODULES = frozenset(
    {
        "test_clickhouse",
        "test_detectors",
        "test_compare",
        "test_regression",
        "test_outlier_tenant",
        "test_slow_query_rows",
        "test_confidence",
        "test_server_api",
    }
)

_counter = itertools.count()
_chdb_dir: str | None = None


def chdb_available() -> bool:
    try:
        import chdb  # noqa: F401
    except ImportError:
        return False
    return True


def engines_for(module: str) -> list[str]:
    asked = os.environ.get(ENGINES_ENV)
    if asked:
        return [e.strip() for e in asked.split(",") if e.strip()]
    if module in CHDB_MODULES and chdb_available():
        return ["duckdb", "chdb"]
    return ["duckdb"]


def chdb_url(name: str | None = None) -> str:
    """A store URL of a new database in this process's chDB directory (chDB holds one
    directory per process)."""
    global _chdb_dir
    if _chdb_dir is None:
        _chdb_dir = tempfile.mkdtemp(prefix=f"perfsleuth-chdb-{os.getpid()}-")
    db = name or f"t{next(_counter)}"
    return f"chdb://{_chdb_dir}?database={db}"


def open_engine(engine: str, data_dir: str, **kw: Any) -> Any:
    """A writable store of ``data_dir`` on ``engine``. On chDB, ``PERFSLEUTH_STORE`` names its
    database from then on (until :func:`reset`), so that the CLI and the API the test runs in
    this process open the same store."""
    from perfsleuth.store import STORE_ENV, open_store

    if engine == "duckdb":
        return open_store(data_dir, url="duckdb", **kw)
    if engine == "chdb":
        url = chdb_url()
        _saved.setdefault(STORE_ENV, os.environ.get(STORE_ENV))
        os.environ[STORE_ENV] = url
        return open_store(data_dir, url=url, **kw)
    raise ValueError(f"unknown store engine {engine!r}")


_saved: dict[str, str | None] = {}


def reset() -> None:
    """Put back the environment :func:`open_engine` changed."""
    for k, v in _saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _saved.clear()
