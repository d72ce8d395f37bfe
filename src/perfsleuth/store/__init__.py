"""Where requests and calls live: DuckDB (embedded, default) behind the small interface in
:mod:`perfsleuth.store.base` (a writer half and a reader half); a ClickHouse engine can follow
with the same logical schema (:mod:`perfsleuth.store.schema`)."""

from __future__ import annotations

from perfsleuth.store.base import IngestReport, Store, StoreError, StoreLocked

__all__ = ["IngestReport", "StoreError", "StoreLocked", "open_store"]


def open_store(data_dir: str, *, read_only: bool = False) -> Store:
    """Open the default (DuckDB) store in ``data_dir`` (created if needed)."""
    from perfsleuth.store.duckdb_store import DuckDBStore

    return DuckDBStore(data_dir, read_only=read_only)
