"""Synthetic data with a service-wide finding, for the tests of how one is shown (the API's
endpoint=<service>, the UI's "the whole service"): gc_pressure's, every endpoint paying about
the same share of its time to collections of one big heap."""

from __future__ import annotations

from collections.abc import Callable

from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import SegmentWriter

GC_SHARES = {"GET /a": 0.2, "GET /b": 0.25, "POST /c": 0.3, "GET /d": 0.22}


def fill_gc_pressure(w: SegmentWriter) -> None:
    """Ten 100 ms requests per endpoint of GC_SHARES, each paying its share to collections,
    and the big heap's STATS."""
    for endpoint, share in GC_SHARES.items():
        for _ in range(10):
            w.request(endpoint, dur_ms=100, gc_ns=int(share * 100e6), gc_count=3)
    w.stats({"gc_heap_objects": 2_400_000, "gc_collections": 120})


def gc_pressure_data(synth: Callable[[Callable[[SegmentWriter], None]], DuckDBStore]) -> str:
    """The data directory of a store (conftest's ``synth``) filled by fill_gc_pressure, closed."""
    store = synth(fill_gc_pressure)
    data = store.data_dir
    store.close()
    return data
