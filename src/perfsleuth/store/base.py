"""The store interface used by the CLI, the analysis code and the server: what writes
(:class:`StoreWriter`: ingest, retention) and what reads (:class:`StoreReader`: the queries of
``top``, traces, findings and the API). An engine implements both (:class:`Store`); DuckDB is
the one there is (:mod:`perfsleuth.store.duckdb_store`), opened by
:func:`perfsleuth.store.open_store`.

Time arguments: ``since`` is a ``datetime.timedelta`` looking back from now, or None (all).
Rows are plain dicts with the documented keys (JSON-ready: str, int, float, bool, None).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from perfsleuth.wire.segment import Damage

if TYPE_CHECKING:
    import pyarrow as pa

    from perfsleuth.store.records import Batch
    from perfsleuth.store.tables import Tables

__all__ = [
    "Damage",
    "IngestReport",
    "Progress",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreLocked",
    "StoreReader",
    "StoreWriter",
    "disk_full",
]


class StoreError(Exception):
    """A problem the user can act on; the message is one clear sentence."""


class StoreLocked(StoreError):
    """Another process holds the database for writing."""


class StoreFull(StoreError):
    """The filesystem holding the store has no room left (or the user's quota is spent)."""


_FULL = ("no space left on device", "disk quota exceeded")


def disk_full(where: str, exc: BaseException) -> StoreFull | None:
    """A StoreFull saying what is full, when ``exc`` (an OSError or an engine's error) comes
    from a full filesystem; None otherwise."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        pass
    elif not any(s in str(exc).lower() for s in _FULL):
        return None
    return StoreFull(
        f"the disk holding {where} is full (no space left on device): free some space there, "
        "then run the command again; nothing was lost (the spool keeps what was not stored)"
    )


@dataclass
class IngestReport:
    segments_read: int = 0  # segments with new data
    segments_done: int = 0  # closed segments fully ingested and removed from the spool
    requests: int = 0
    calls: int = 0
    damaged: list[Damage] = field(default_factory=list)  # each with its segment's file name
    quarantined: list[str] = field(default_factory=list)  # moved to DATA/spool/corrupt/
    truncated_tails: list[str] = field(default_factory=list)  # closed segments cut short

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: counts, and damage as {offset, length, reason, segment} dicts."""
        return asdict(self)


# progress(done, total) for progress bars, both in bytes of spool
Progress = Callable[[int, int], None]


class StoreWriter(Protocol):
    def ingest(self, progress: Progress | None = None) -> IngestReport:
        """Ingest everything new in the spool, exactly once (see :mod:`perfsleuth.store.ingest`)."""
        ...

    def insert_tables(self, batch: Batch, tables: Tables) -> None:
        """Store tables built outside the spool (store.otlp's), with the segments of
        ``batch``, in one transaction as ingest commits a batch: requests already held are
        left out."""
        ...

    def apply_retention(self, days: int) -> list[str]:
        """Drop whole days older than ``days``; returns the dropped day names."""
        ...

    def record_received(self, rows: list[dict[str, Any]]) -> None:
        """Record segments a collector received (``segments_received``): dicts with segment,
        token, agent, host, service, pid, received_ns, started_ns; a segment already recorded
        keeps its first row."""
        ...

    def close(self) -> None: ...


class StoreReader(Protocol):
    def top(
        self,
        since: timedelta | None = None,
        by: tuple[str, ...] = ("endpoint",),
        kind: str | None = None,
        only: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """One row per group (``by`` among endpoint, user, tenant), busiest first, of the
        requests whose host / service are those in ``only`` (the fleet filters), with keys:
        the group columns, count, rate_per_min, p50_ms, p95_ms, p99_ms, max_ms, error_rate,
        db_calls_per_request, http_calls_per_request, cache_calls_per_request, db_share,
        http_share, cache_share, gc_share (share of request time, 0..1), total_ms."""
        ...

    def top_answered(
        self,
        since: timedelta | None = None,
        by: tuple[str, ...] = ("endpoint",),
        kind: str | None = None,
        only: dict[str, str] | None = None,
        *,
        percentiles_for: str | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """:meth:`top`, and what answered it: {source: "raw" | "rollups", resolution_s (the
        finest rollup period read; None for raw rows), start (ISO 8601; None for all)}. With
        ``percentiles_for`` (an endpoint, ``by`` the endpoint), only that row's percentiles are
        computed (the others' are None; their totals are all there)."""
        ...

    def traces(
        self,
        endpoint: str | None = None,
        since: timedelta | None = None,
        slowest: int | None = None,
        limit: int = 20,
        only: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Requests (newest first, or the ``slowest`` N) with keys: trace_id, ts (ISO 8601),
        endpoint, method, path, status, duration_ms, db_calls, db_ms, http_calls, http_ms,
        cache_calls, cache_ms, user, tenant. Raises StoreError for an unknown endpoint."""
        ...

    def trace(self, trace_id: str) -> dict[str, Any]:
        """One request (id or unique prefix) with its attributes, tags and ``calls``: list of
        {seq, kind, system, offset_ms, duration_ms, fingerprint, op, rows, bytes, host, status,
        hit, wait_ms, error, site: {file, line, function} | None,
        stack: [{file, line, function, app}] outermost first}, and ``samples`` / ``blockers``:
        how many stack samples and loop blockers it has. StoreError if not found."""
        ...

    def samples(self, trace_id: str) -> list[dict[str, Any]]:
        """Stack samples of one slow request (id or unique prefix), in time order:
        {offset_ms, state ('cpu' | 'wait'), stack: [{file, line, function, app}] outermost
        first}."""
        ...

    def blockers(
        self,
        since: timedelta | None = None,
        endpoint: str | None = None,
        trace_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Event-loop blockers, longest first: {ts, trace_id, endpoint, duration_ms, delayed,
        stack_samples, samples, last_kind, last_call, last_rows, last_bytes, last_ms, pid,
        stack: [...] (the most common stack while blocked)}."""
        ...

    def capture(self, trace_id: str) -> dict[str, Any] | None:
        """The replayable capture of a trace (id or unique prefix): {trace_id, ts, service,
        endpoint, method, status, duration_ms, reason, url, headers [(name, value)], redacted
        [names], body_b64, body_size, body_sha256, body_truncated}; None when the trace exists
        but was not captured; StoreError for an unknown or ambiguous trace."""
        ...

    def endpoints(self) -> list[str]: ...

    def sql(self, query: str, limit: int = 10_000) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only statement; StoreError with the engine's message otherwise."""
        ...

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Rows (as dicts) of one parameterised statement over the logical tables; for the
        analysis layer, which writes its SQL against the schema in ``store.schema``."""
        ...

    def query_arrow(self, sql: str, params: Sequence[Any] = ()) -> pa.Table:
        """:meth:`query`'s result as an Arrow table (columns for numpy, no dict per row)."""
        ...

    def agent_drops(self) -> dict[str, Any]:
        """Agent counters summed over processes (from DATA/agents/*.json and STATS records):
        requests_recorded, requests_written, dropped_* by reason, write_errors, last_error."""
        ...

    def close(self) -> None: ...


class Store(StoreWriter, StoreReader, Protocol):
    """An engine: both halves."""
