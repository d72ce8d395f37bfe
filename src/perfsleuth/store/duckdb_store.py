"""The embedded store: one DuckDB file, DATA/perfsleuth.duckdb.

:class:`DuckDBStore` joins the two halves of the store interface
(:class:`perfsleuth.store.base.Store`): the writer (:mod:`.duckdb_writer`: ingest, retention)
and the reader (:mod:`.duckdb_reader`: the queries), both on the file opened by
:mod:`.duckdb_file`.
"""

from __future__ import annotations

from perfsleuth.store.duckdb_file import DB_NAME
from perfsleuth.store.duckdb_reader import DuckDBReader
from perfsleuth.store.duckdb_writer import DuckDBWriter

__all__ = ["DB_NAME", "DuckDBStore"]


class DuckDBStore(DuckDBWriter, DuckDBReader):
    """The default store (see :class:`perfsleuth.store.base.Store` for the contract)."""

    def __enter__(self) -> DuckDBStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
