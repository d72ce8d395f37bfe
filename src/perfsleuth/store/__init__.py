"""Where requests and calls live: DuckDB (embedded, default) behind the small interface in
:mod:`perfsleuth.store.base`; a ClickHouse backend can follow with the same logical schema."""

from perfsleuth.store.base import IngestReport, StoreError, StoreLocked, open_store

__all__ = ["IngestReport", "StoreError", "StoreLocked", "open_store"]
