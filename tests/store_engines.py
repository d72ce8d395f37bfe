"""The store engines the store, detector and API tests run on: DuckDB always, and ClickHouse's
engine through chDB (in this process) where the ``clickhouse`` extra is installed.

One point of parametrization: a test that takes the ``store_engine`` fixture (``synth`` does)
runs once per engine when its module is in :data:`CHDB_MODULES` (chosen so that together they
run every query of the reader, the detectors, ``top``, ``compare`` and the API) or when
``PERFSLEUTH_TEST_ENGINES`` names the engines (``duckdb,chdb`` everywhere; ``duckdb`` only).
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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
        "test_large_request_body",
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


def use_dir(path: str) -> None:
    """Where this process's chDB keeps its data (the test session's temporary directory)."""
    global _chdb_dir
    if _chdb_dir is None:
        _chdb_dir = path


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


# The most common value of a group (SQL mode()) when several are as common: DuckDB names the
# first it saw, ClickHouse the smallest (row order differs between the engines).
TIE_PICKS = (".example_request",)


def same(a: Any, b: Any, path: str = "") -> None:
    """``a == b``, floats to 1e-9 relative (sums add up in another order)."""
    if path.endswith(TIE_PICKS):
        return
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None, f"{path}: {a!r} != {b!r}"
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert sorted(a) == sorted(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        assert len(a) == len(b), f"{path}: {len(a)} != {len(b)} items\n{a}\n{b}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def copy_into_chdb(duck: Any) -> Any:
    """A chDB store holding what a DuckDB store holds (table by table, as Arrow)."""
    from perfsleuth.store import schema

    ch = open_engine("chdb", duck.data_dir)
    names = [t.name for t in (*schema.EVENT_TABLES, *schema.GLOBAL_TABLES)]
    for name in names:
        t = schema.TABLES[name]
        cols = ", ".join(schema.quote(c) for c in t.column_names)
        tbl = duck._con.sql(f"SELECT {cols} FROM {schema.quote(name)}").to_arrow_table()
        if tbl.num_rows:
            ch._client.insert_arrow(name, tbl.cast(t.arrow_schema()), {})
    reset()
    return ch


@contextmanager
def serving(engine: str, data_dir: str) -> Iterator[None]:
    """While in the block, the server's backend opens ``data_dir`` on ``engine``: on chDB, a
    copy of the DuckDB store there (other data directories open as usual)."""
    if engine == "duckdb":
        yield
        return
    from perfsleuth.server import backend
    from perfsleuth.store import open_store

    duck = open_store(data_dir, read_only=True, url="duckdb")
    try:
        ch = copy_into_chdb(duck)
    finally:
        duck.close()
    url = ch.url
    ch.close()
    real = backend.open_store
    served = os.path.abspath(data_dir)

    def open_served(d: str, **kw: Any) -> Any:
        if os.path.abspath(d) == served and "url" not in kw:
            kw["url"] = url
        return real(d, **kw)

    backend.open_store = open_served  # type: ignore[assignment]
    try:
        yield
    finally:
        backend.open_store = real
