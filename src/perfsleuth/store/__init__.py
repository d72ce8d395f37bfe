"""Where requests and calls live, behind the small interface in :mod:`perfsleuth.store.base`
(a writer half and a reader half): DuckDB in the data directory (embedded, the default), or
ClickHouse (a server, or chDB in-process) with the same logical schema
(:mod:`perfsleuth.store.schema`), chosen by a store URL (``--store`` / ``PERFSLEUTH_STORE``)."""

from __future__ import annotations

import os

from perfsleuth.store.base import IngestReport, Store, StoreError, StoreLocked

__all__ = ["STORE_ENV", "IngestReport", "StoreError", "StoreLocked", "open_store"]

STORE_ENV = "PERFSLEUTH_STORE"
# The store URL the command line named (``--store``); None: ``$PERFSLEUTH_STORE``. A module
# default, not the environment: processes the command starts (apps under the agent) keep theirs.
cli_url: str | None = None


def open_store(data_dir: str, *, read_only: bool = False, url: str | None = None) -> Store:
    """Open the store of ``data_dir`` (its spool, agents' status; created if needed): DuckDB in
    that directory, unless ``url`` (default: ``$PERFSLEUTH_STORE``) names a ClickHouse one,
    ``clickhouse://host:8123/db`` or ``chdb:///dir`` (see :mod:`.clickhouse_client`)."""
    if url is None:
        url = cli_url if cli_url is not None else os.environ.get(STORE_ENV, "")
    if url and url != "duckdb":
        if url.partition("://")[0] not in ("clickhouse", "clickhouses", "chdb"):
            raise StoreError(
                f"unknown store {url!r}: use duckdb (the default), clickhouse://host:8123/db "
                "or chdb:///path/to/dir"
            )
        try:
            from perfsleuth.store.clickhouse_store import ClickHouseStore
        except ImportError as e:  # the wheel without the extra
            raise StoreError(
                "a ClickHouse store needs the clickhouse extra: pip install "
                f"'perfsleuth[clickhouse]' ({e.name or e} is not installed)"
            ) from e

        return ClickHouseStore(data_dir, url, read_only=read_only)
    from perfsleuth.store.duckdb_store import DuckDBStore

    return DuckDBStore(data_dir, read_only=read_only)
