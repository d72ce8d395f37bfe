"""Ingest: the spool into a store engine, exactly once.

:func:`ingest_spool` reads each segment from the offset the engine committed last, gathers its
records into batches (:class:`perfsleuth.store.records.Batch`), and hands each batch's tables to
the engine, which commits rows and the segments' new offsets in one transaction
(:meth:`IngestTarget.commit`): a crash anywhere neither loses nor doubles a request. Only after
the commit are finished segments removed from the spool (or, when they held damage, moved to
``spool/corrupt/``); a segment the offsets mark as finished is never read again.

A backlog is committed in groups (:class:`GroupTarget`, ``Limits.group_requests`` and
``group_bytes``): each batch's tables, built with the memory of one batch, are added to a
transaction that stays open across batches, with their offsets, and committed once the group
holds ``group_requests`` requests or ``group_bytes`` bytes of request payloads, or the spool
is read. The per-transaction costs (the engine's commit and checkpoint, its half-filled blocks
on disk, the rollups' one insert per day) are paid once a group; a crash
before the group's commit stores none of it, and the next run reads it again.

Everything here is engine-neutral: an engine implements :class:`IngestTarget`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, Protocol, runtime_checkable

import pyarrow as pa

from perfsleuth.store import gc_pause, spool
from perfsleuth.store.base import IngestReport, Progress
from perfsleuth.store.records import Batch, SegmentState, remember_internal_fingerprints
from perfsleuth.store.tables import Tables, build_tables
from perfsleuth.wire import REQUESTS


class Offset(NamedTuple):
    """What an engine committed about a segment (its ``ingest_offsets`` row)."""

    offset: int
    closed: bool  # read to its end and the writer is gone: retire it, never read it again
    damaged: bool
    service: str | None
    host: str | None
    pid: int | None
    version: str | None


class IngestTarget(Protocol):
    """What a store engine provides for ingest."""

    def committed_offsets(self) -> dict[str, Offset]:
        """Per segment base name, what was committed."""
        ...

    def internal_fingerprint_ids(self) -> Iterable[int]:
        """Ids of the stored fingerprints of kind ``db.internal``."""
        ...

    def commit(self, batch: Batch, tables: Tables) -> None:
        """In one transaction: the rows of ``tables`` but the requests (with their calls and
        attributes) already stored (see :func:`perfsleuth.store.tables.drop_known_traces`),
        and the offsets of ``batch.segments``. Raises (having stored nothing) on failure."""
        ...


@runtime_checkable
class GroupTarget(IngestTarget, Protocol):
    """An engine that can keep one transaction open over several batches."""

    def stage(self, batch: Batch, tables: Tables) -> None:
        """Add what :meth:`IngestTarget.commit` would commit to the open group transaction
        (begun by the group's first batch), without committing. Raises on failure, having
        rolled back the whole group (its earlier batches included)."""
        ...

    def commit_group(self) -> None:
        """Commit the group's transaction. Raises (having stored none of it) on failure."""
        ...


class Limits(NamedTuple):
    batch_requests: int  # requests per batch built at once (bounds the Python side's memory)
    batch_bytes: int  # request payload bytes per batch (bounds memory)
    open_idle_seconds: float  # an .open segment whose writer is dead is final once this idle
    # Requests per transaction of a GroupTarget: batches are committed together until their
    # requests reach this (0: a transaction per batch)
    group_requests: int = 0
    # ... or until their request payload bytes reach this (0: no such bound): a transaction
    # of wide requests holds more than the request count says
    group_bytes: int = 0


# A request is a copy of a stored one (a record repeated, a segment copied under another
# name, an exporter's retry: the same ts; a payload made again from the same spans with fresh
# times: ms to seconds later) when a stored request has its trace id and a ts this close to
# its own; further apart it is another request that reuses the trace id, and is stored.
KNOWN_TRACE_MARGIN_US = 60 * 10**6


def commit_batch(target: IngestTarget, spool_dir: str, batch: Batch, report: IngestReport) -> None:
    """Convert and commit one batch, then retire the segments it finished."""
    with gc_pause.paused():
        tables = build_tables(batch, time.time_ns())
    target.commit(batch, tables)
    report.requests += tables.requests
    report.calls += tables.calls
    report.damaged.extend(batch.damage)
    for s in batch.segments:
        if s.final:
            retire(spool_dir, s.base, damaged=s.damaged, report=report)


class Group:
    """The batches staged in a GroupTarget's open transaction, and what their commit owes:
    the segments they finished (retired after the commit) and the report's counts."""

    def __init__(self, target: GroupTarget, spool_dir: str, report: IngestReport) -> None:
        self.target = target
        self.spool_dir = spool_dir
        self.report = report
        self.batches = 0  # staged since the last commit
        self.requests = 0
        self.request_bytes = 0  # their request payloads' bytes in the spool
        self.finished: dict[str, SegmentState] = {}
        self.staged = IngestReport()

    def stage(self, batch: Batch) -> None:
        """Convert ``batch`` and add it to the open transaction."""
        with gc_pause.paused():
            tables = build_tables(batch, time.time_ns())
        self.target.stage(batch, tables)
        self.batches += 1
        self.requests += batch.requests
        self.request_bytes += batch.request_bytes
        self.staged.requests += tables.requests
        self.staged.calls += tables.calls
        self.staged.damaged.extend(batch.damage)
        # A segment is retired only when the offsets row the group commits says it is closed
        # (s.final when its batch was converted: store.tables.offsets_table).
        self.finished.update((s.base, s) for s in batch.segments if s.final)

    def commit(self) -> None:
        """Commit what was staged, count it, then retire the segments it finished."""
        if not self.batches:
            return
        self.target.commit_group()
        self.report.requests += self.staged.requests
        self.report.calls += self.staged.calls
        self.report.damaged.extend(self.staged.damaged)
        finished = list(self.finished.values())
        self.batches = self.requests = self.request_bytes = 0
        self.finished = {}
        self.staged = IngestReport()
        for s in finished:
            retire(self.spool_dir, s.base, damaged=s.damaged, report=self.report)


def retire(spool_dir: str, base: str, *, damaged: bool, report: IngestReport) -> None:
    done, quarantined = spool.retire(spool_dir, base, damaged=damaged)
    report.segments_done += done
    report.quarantined.extend(quarantined)


# malloc_pool's users in flight (ingest runs of several threads overlap): the first one in
# saves the default pool and sets the system one, the last one out restores the saved pool.
_pool_lock = threading.Lock()
_pool_users = 0
_pool_before: pa.MemoryPool | None = None


@contextmanager
def malloc_pool() -> Iterator[None]:
    """Arrow's allocations from the C library's malloc (``pa.system_memory_pool()``) instead
    of its default pool (mimalloc in the wheels) until the block ends; the pool before is
    restored after. A batch's Arrow arrays are megabytes each, made and freed a few dozen
    times a batch: mimalloc gave each such buffer back to the system when freed and took
    fresh, zeroed pages for the next (perf of a 100k-request ingest: 18 % of the process's
    CPU in the kernel's clear_page, page faults of new huge pages); malloc keeps freed
    memory of that size for the next allocation. Buffers made before or after keep the pool
    they came from. Blocks of several threads may overlap: the pool is process-wide, so the
    outermost one (the first in) saves it and the last one out restores it."""
    global _pool_users, _pool_before
    with _pool_lock:
        if _pool_users == 0:
            before = pa.default_memory_pool()
            try:
                pa.set_memory_pool(pa.system_memory_pool())
            except (pa.ArrowException, NotImplementedError):  # pragma: no cover - no such pool
                before = None
            _pool_before = before
        _pool_users += 1
    try:
        yield
    finally:
        with _pool_lock:
            _pool_users -= 1
            if _pool_users == 0 and _pool_before is not None:
                pa.set_memory_pool(_pool_before)
                _pool_before = None


def ingest_spool(
    target: IngestTarget,
    spool_dir: str,
    limits: Limits,
    progress: Progress | None = None,
    seen: set[bytes] | None = None,
) -> IngestReport:
    """Ingest everything new in ``spool_dir`` into ``target`` (see the module docstring).
    ``seen``: the payloads of dictionary records (locations, stacks, fingerprints) ``target``
    holds already, which are not decoded or inserted again; this run adds those it reads. A
    caller that keeps it for its next run keeps it only when this run returns (a run that
    raises may have read records it did not commit)."""
    try:
        with malloc_pool():
            return _ingest_spool(target, spool_dir, limits, progress, seen)
    finally:
        gc_pause.thaw()  # its batches are committed (or given up): their objects are gone


def _ingest_spool(
    target: IngestTarget,
    spool_dir: str,
    limits: Limits,
    progress: Progress | None,
    seen: set[bytes] | None,
) -> IngestReport:
    report = IngestReport()
    offsets = target.committed_offsets()
    files = spool.list_spool(spool_dir)
    now = time.time()
    total = sum(
        max(0, f.size - (offsets[f.base].offset if f.base in offsets else 0)) for f in files
    )
    done_bytes = 0  # of the segments before the current one
    reported = -1
    # A segment continued past its fingerprint records still files their calls apart.
    remember_internal_fingerprints(target.internal_fingerprint_ids())
    if seen is None:
        seen = set()
    batch = Batch(seen)
    touched: set[str] = set()
    group = (
        Group(target, spool_dir, report)
        if limits.group_requests > 0 and isinstance(target, GroupTarget)
        else None
    )

    def full() -> bool:
        return batch.requests >= limits.batch_requests or batch.request_bytes >= limits.batch_bytes

    def flush(current: int = 0) -> None:
        nonlocal batch, reported
        if group is None:
            commit_batch(target, spool_dir, batch, report)
        else:
            group.stage(batch)
            if group.requests >= limits.group_requests or (
                limits.group_bytes > 0 and group.request_bytes >= limits.group_bytes
            ):
                group.commit()
        batch = Batch(seen)
        if progress is not None:
            reported = min(done_bytes + current, total)
            progress(reported, total)

    for f in files:
        prev = offsets.get(f.base)
        if prev is not None and prev.closed:
            # Finished in an earlier run that stopped before removing the file.
            retire(spool_dir, f.base, damaged=bool(prev.damaged), report=report)
            continue
        start = int(prev.offset) if prev is not None else 0
        final = spool.writer_gone(f, limits.open_idle_seconds, now)
        if f.size <= start and not final:
            continue
        seg = SegmentState(f.base, f.name, start)
        if prev is not None:
            seg.damaged = bool(prev.damaged)
            seg.service, seg.host, seg.pid = prev.service or "", prev.host or "", prev.pid
            seg.version = prev.version or ""
        if not seg.host and f.host:
            seg.host = f.host
        if seg.pid is None:
            seg.pid = f.pid
        with gc_pause.paused():
            read = spool.read_file(spool_dir, f, start)
        if read is None:
            continue  # vanished (renamed or removed) since the listing: next run
        data_size, rd = read
        end = rd.end
        damaged = rd.damaged
        if not final and damaged and damaged[-1].offset + damaged[-1].length >= data_size:
            # Damage up to the end of a file still being written may be a record in
            # flight: hold the offset before it until the writer moves on or is gone.
            end = damaged[-1].offset
            damaged = damaged[:-1]
        if end > start or rd.raw or rd.decoded:
            touched.add(f.base)
        raw, i = rd.raw, 0
        while i < len(raw):
            # The records' JSON heads become objects here (most of what a batch allocates):
            # made with the collector off and frozen, as the segment's reading. A full batch
            # is committed outside, with the collector on.
            with gc_pause.paused():
                while i < len(raw):
                    rtype, payload, rstart, rend = raw[i]
                    i += 1
                    batch.add_raw(seg, rtype, payload, rstart, rend)
                    seg.offset = rend
                    if rtype == REQUESTS and full():
                        break
                else:
                    break
            flush(rend - start)
        for rtype, obj in rd.decoded:
            batch.add(seg, rtype, obj)
        for d in damaged:
            batch.add_damage(seg, d.offset, d.length, d.reason)
        seg.offset = max(seg.offset, end)
        done_bytes += data_size - start
        seg.final = final
        if seg.final and rd.incomplete_tail:
            report.truncated_tails.append(f.name)
        batch.touch(seg)
        if full():
            flush()
    if batch.segments:
        flush()
    if group is not None:
        group.commit()
    if progress is not None and reported != total:
        progress(total, total)
    report.segments_read = len(touched)
    return report
