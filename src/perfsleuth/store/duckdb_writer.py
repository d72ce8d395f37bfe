"""The DuckDB store's writing half: ingest (the engine side of :mod:`perfsleuth.store.ingest`:
offsets, one transaction per batch) and retention (whole days dropped)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import rollups, schema, spool, values
from perfsleuth.store.base import IngestReport, Progress, StoreError, disk_full
from perfsleuth.store.duckdb_file import utcnow
from perfsleuth.store.duckdb_rollups import DuckDBRollups
from perfsleuth.store.ingest import (
    KNOWN_TRACE_MARGIN_US,
    Limits,
    Offset,
    ingest_spool,
)
from perfsleuth.store.records import Batch
from perfsleuth.store.schema import quote
from perfsleuth.store.tables import (
    ROW_KEYS,
    Tables,
    copied_requests,
    copy_window,
    drop_known_traces,
    offsets_table,
    request_keys,
    ts_spans,
)

# A received segment's row goes once the days it could name a request's origin for are gone:
# received before the cutoff, started before the first day kept, and either another segment of
# its host and pid started after it, still before that day (the README's ASOF JOIN picks that
# one for every request kept), or no request kept is of its host and pid.
_SEGMENTS_RECEIVED_RETENTION = """
DELETE FROM segments_received s
WHERE s.received < ? AND (s.started IS NULL OR s.started < ?)
  AND (EXISTS (SELECT 1 FROM segments_received n
               WHERE n.host IS NOT DISTINCT FROM s.host AND n.pid IS NOT DISTINCT FROM s.pid
                 AND n.started > s.started AND n.started <= ?)
       OR NOT EXISTS (SELECT 1 FROM requests r
                      WHERE coalesce(r.host, '') = coalesce(s.host, '')
                        AND r.pid IS NOT DISTINCT FROM s.pid))
"""


RAW_DAYS = 7  # raw rows are kept this long by default (rollups: rollups.ROLLUP_DAYS)

EPOCH_NAIVE = datetime(1970, 1, 1)  # the stored ts are naive UTC timestamps

# Dictionary record payloads remembered between ingest runs, at most (~100-300 bytes each)
DICTIONARY_SEEN_MAX = 100_000

# Columns of the requests rows that rollups_of does not read: not held until a group's commit
_NOT_ROLLED_UP = ("trace_id", "path", "user", "tenant", "method", "version", "rid")


@dataclass
class _Group:
    """An open group transaction (DuckDBWriter.stage): the day tables it made, and per day
    its requests (for the rollups made at its commit)."""

    new_days: set[date] = field(default_factory=set)
    requests: dict[date, list[pa.Table]] = field(default_factory=dict)


class DuckDBWriter(DuckDBRollups):
    # Requests per batch converted at once (ClickHouse-sized batches: 10k-100k rows per insert).
    batch_requests = 50_000
    # ... and payload bytes, which bounds memory when requests are large.
    batch_bytes = 256 * 1024 * 1024
    # Requests per ingest transaction: a backlog's batches are committed in groups of this
    # many (store.ingest.GroupTarget). One transaction of 100k requests x 10 calls stores them
    # in 150 bytes a request, two of 50k in 176 (half-filled and freed blocks, per commit).
    # A group holds its requests' rollup columns until its commit: ~16 MB per 100k requests.
    group_requests = 200_000
    # ... and request payload bytes (the spool's), which bounds a group's memory when requests
    # are wide: benchmarks/ingest.py's requests (10 calls) are ~1,080 bytes each, so its
    # groups still close at 200k requests (~215 MB); requests of 10 KB close at ~27k.
    group_bytes = 256 * 1024 * 1024
    # An .open segment whose writer is dead is final once unchanged this long.
    open_idle_seconds = 60.0
    _known_days: set[date]  # the days whose tables exist, while ingesting
    _compact_calls: set[date]  # ... and of those, the days whose calls have the compact layout
    _group: _Group | None = None  # the open group transaction, if any
    # payloads of the dictionary records stored by this process's runs (ingest_spool's seen)
    _dictionary_seen: set[bytes] | None = None

    def ingest(self, progress: Progress | None = None) -> IngestReport:
        """Ingest everything new in the spool (see :mod:`perfsleuth.store.ingest`)."""
        self._writable("ingest")
        names = self._table_names()
        self._known_days = self._day_tables(names)["requests"]
        self._compact_calls = self._compact_call_days(names)
        limits = Limits(
            self.batch_requests,
            self.batch_bytes,
            self.open_idle_seconds,
            self.group_requests,
            self.group_bytes,
        )
        # Every segment repeats the dictionary records its requests use: those of the store
        # are known from this process's earlier runs (a collector ingests every few seconds:
        # ~1,500 records a segment of benchmarks/ingest.py were decoded and inserted again each
        # round). Kept only after a run that committed all it read, without damage, and while
        # not too many.
        seen = self._dictionary_seen if self._dictionary_seen is not None else set()
        self._dictionary_seen = None
        try:
            report = ingest_spool(self, self.spool_dir, limits, progress, seen)
        finally:
            if self._group is not None:  # failed between two batches of a group: none of it
                self._abort_group(None)
        if len(seen) <= DICTIONARY_SEEN_MAX and not report.damaged:
            self._dictionary_seen = seen  # (damage: a dictionary record may be unconverted)
        self.compact_committed(final=True)
        return report

    def insert_tables(self, batch: Batch, tables: Tables) -> None:
        """Store tables built outside the spool ingest (OTLP's columnar mapping, store.otlp)
        with the segments of ``batch``, in one transaction: requests already held are left
        out."""
        self._writable("ingest")
        names = self._table_names()
        self._known_days = self._day_tables(names)["requests"]
        self._compact_calls = self._compact_call_days(names)
        self.commit(batch, tables)

    def committed_offsets(self) -> dict[str, Offset]:
        rows = self._con.execute(
            'SELECT segment, "offset", closed, damaged, service, host, pid, version'
            " FROM ingest_offsets"
        ).fetchall()
        return {r[0]: Offset(*r[1:]) for r in rows}

    def internal_fingerprint_ids(self) -> Iterable[int]:
        return (
            r[0]
            for r in self._con.execute(
                "SELECT id FROM fingerprints WHERE kind = 'db.internal'"
            ).fetchall()
        )

    def commit(self, batch: Batch, tables: Tables) -> None:
        """See :meth:`perfsleuth.store.ingest.IngestTarget.commit`: new day tables (and the
        views over them) are made in the same transaction."""
        if self._group is not None:
            raise StoreError("a batch committed alone while a group transaction is open")
        self.stage(batch, tables)
        self.commit_group()

    def stage(self, batch: Batch, tables: Tables) -> None:
        """See :meth:`perfsleuth.store.ingest.GroupTarget.stage`: the rows and offsets go in
        at once; the rollups of the group's requests are made and inserted at its commit, one
        insert per day (a day's rollup table made by one insert needs no compaction)."""
        con = self._con
        group = self._group
        if group is None:
            con.begin()
            group = self._group = _Group()
        try:
            days = self._known_days | group.new_days
            self._drop_known_traces(tables, days)
            new_days = [d for d in tables.days if d not in days]
            for d in new_days:
                for t in schema.EVENT_TABLES:
                    physical = schema.duckdb_physical(t)
                    con.execute(schema.duckdb_create(physical, schema.day_table(t, d)))
                self._next_rid[d] = 0
            if new_days:
                self._create_views(sorted(days | set(new_days)))
                group.new_days.update(new_days)
            compact = self._compact_calls | group.new_days
            for d, parts in tables.days.items():
                self._insert_requests(d, parts, compact=d in compact)
                for t in schema.EVENT_TABLES:
                    if t.name in parts and t.name not in ("requests", "calls"):
                        # rows of a day table made by this batch cannot be stored already
                        keys = ROW_KEYS.get(t.name, ()) if d in days else ()
                        self._insert(schema.day_table(t, d), parts[t.name], keys=keys)
                req = parts.get("requests")
                if req is not None and req.num_rows:
                    # what rollups_of reads: the wide columns it does not are left out
                    group.requests.setdefault(d, []).append(
                        req.drop_columns([c for c in _NOT_ROLLED_UP if c in req.column_names])
                    )
            for name, tbl in (
                ("fingerprints", tables.fingerprints),
                ("locations", tables.locations),
                ("stacks", tables.stacks),
            ):
                if tbl is not None:
                    self._insert(name, tbl, conflict="OR IGNORE")
            if tables.agent_stats is not None:
                self._insert("agent_stats", tables.agent_stats, keys=ROW_KEYS["agent_stats"])
            if tables.captures is not None:
                self._insert("captures", tables.captures, conflict="OR IGNORE")
            offs = offsets_table(batch, utcnow())
            self._insert("ingest_offsets", offs, conflict="OR REPLACE")
        except BaseException as e:
            self._abort_group(e)
            raise

    def commit_group(self) -> None:
        """See :meth:`perfsleuth.store.ingest.GroupTarget.commit_group`."""
        group = self._group
        if group is None:
            return
        try:
            days = {d: {"requests": pa.concat_tables(t)} for d, t in group.requests.items()}
            self._insert_rollups(Tables(days=days))
            self._commit()
        except BaseException as e:
            self._abort_group(e)
            raise
        self._group = None
        self._known_days.update(group.new_days)
        self._compact_calls.update(group.new_days)
        self.compact_committed()

    def _abort_group(self, e: BaseException | None) -> None:
        """Roll the open group's transaction back (raising ``e`` as a full disk if it is
        one)."""
        self._group = None
        self._rollup_new_days = set()  # their tables are rolled back
        self._next_rid = {}  # ... and their rows: asked again (max(rid)) when next needed
        try:
            self._con.rollback()
        except duckdb.Error:
            pass
        full = disk_full(self.data_dir, e) if e is not None else None
        if full is not None:  # the offsets were not advanced: the spool keeps it all
            raise full from e

    def _insert_requests(self, d: date, parts: dict[str, pa.Table], *, compact: bool) -> None:
        """A day's requests and calls. Their ``rid`` (the batch's numbers) become the day
        table's: the next after the largest stored, in the requests' order, and a compact
        calls table stores each call with its request's; a day of the logical layout (written
        by an older version) takes the rows as they are, without them."""
        req, calls = parts.get("requests"), parts.get("calls")
        req_name = schema.day_table(schema.REQUESTS, d)
        calls_name = schema.day_table(schema.CALLS, d)
        if req is None or not req.num_rows:
            return  # no calls without their request
        if not compact:  # a day of the logical layout: calls name their request by trace id
            self._insert(req_name, _without_rid(req))
            if calls is not None:
                self._insert(calls_name, _without_rid(calls))
            return
        req, calls = _with_rid(req, calls)
        local = req["rid"]
        n = req.num_rows
        base = self._next_rid.get(d)
        if base is None:  # the first rows of this day since the store opened (or a rollback)
            top = self._con.execute(f"SELECT max(rid) FROM {quote(req_name)}").fetchall()[0][0]
            base = 0 if top is None else int(top) + 1
        self._next_rid[d] = base + n
        rid_at = req.schema.get_field_index("rid")
        req = req.set_column(rid_at, "rid", pa.array(np.arange(base, base + n, dtype=np.int64)))
        self._insert(req_name, req)
        if calls is None or not calls.num_rows:
            return
        pos = pc.index_in(calls["rid"], value_set=local)
        if pos.null_count:
            calls, pos = calls.filter(pc.is_valid(pos)), pos.drop_null()
        rid = pc.add(pc.cast(pos, pa.int64()), pa.scalar(base, pa.int64()))
        calls = calls.set_column(calls.schema.get_field_index("rid"), "rid", rid)
        ph_at = calls.schema.get_field_index("params_hash")
        calls = calls.set_column(ph_at, "params_hash", params_numbers(rid, calls["params_hash"]))
        self._con.register("_ps_batch", calls)
        try:
            self._con.execute(schema.duckdb_insert_calls(calls_name, "_ps_batch"))
        finally:
            self._con.unregister("_ps_batch")

    def _drop_known_traces(self, tables: Tables, stored_days: set[date]) -> None:
        """Requests already in the store are not added again: each one that a stored request
        of its trace id is within KNOWN_TRACE_MARGIN_US of (tables.copied_requests: per
        request, whatever else the batch holds). The stored requests read are those of the
        batch's trace ids in its time span widened by the margin (tables.copy_window), so
        DuckDB reads only the row groups whose ts range meets it (a scan of every stored
        trace id cost ~115 ms CPU per 5M requests, for each batch and OTLP payload), from the
        day tables of that span only: binding the view over every day cost 7-10 ms CPU a
        query with 9 days, the one day's table 2 ms (a server's round of a few requests made
        ~15 % of its time; ``stored_days``: the days whose tables exist). A batch with a ts
        made up at conversion (tables.ts_substituted) is checked against all, at any ts."""
        sent = request_keys(p["requests"] for p in tables.days.values() if "requests" in p)
        if not sent.num_rows:
            return
        margin = None if tables.ts_substituted else KNOWN_TRACE_MARGIN_US
        window = copy_window(sent, margin)
        source = "requests"
        span = ""
        params: list[Any] = []
        if window is not None:
            lo, hi = (EPOCH_NAIVE + timedelta(microseconds=us) for us in window)
            days = sorted(d for d in stored_days if lo.date() <= d <= hi.date())
            if not days:
                return  # no day table of the span: nothing of it is stored
            # the two columns every requests day table has: schema.duckdb_union's SELECT of
            # all columns by name, with its typed empty SELECT, cost twice as much (4.4-5.0
            # against 2.2-2.5 ms CPU on one day of the 100M store)
            tables_of_span = (quote(schema.day_table(schema.REQUESTS, d)) for d in days)
            source = (
                f"({' UNION ALL '.join(f'SELECT trace_id, ts FROM {t}' for t in tables_of_span)})"
            )
            span = "ts BETWEEN ? AND ? AND "
            params = [lo, hi]
        self._con.register("_ps_ids", pa.table({"trace_id": pc.unique(sent["trace_id"])}))
        try:
            stored = self._con.sql(
                f"SELECT trace_id, epoch_us(ts) AS ts FROM {source} WHERE {span}"
                "trace_id IN (SELECT trace_id FROM _ps_ids)",
                params=params,
            ).to_arrow_table()
        finally:
            self._con.unregister("_ps_ids")
        drop_known_traces(tables, copied_requests(sent, stored, margin))

    def _commit(self) -> None:
        self._con.commit()

    def _insert(
        self, table: str, data: pa.Table, conflict: str = "", keys: tuple[str, ...] = ()
    ) -> None:
        """Insert ``data`` into ``table``; with ``keys``, without the rows of which ``table``
        holds a row with the same values of those columns (nulls: see ROW_KEYS) around the
        rows' ts (tables.ts_spans): a copied segment or a batch read again adds none of its
        samples, blockers, GC pauses or agent counters again (tables.ROW_KEYS; requests,
        calls and attributes are left out by _drop_known_traces). The ranges are written
        into the query so DuckDB reads only the row groups whose ts meet them."""
        if data.num_rows == 0:
            return
        rows = "SELECT * FROM _ps_batch"
        if keys:
            span = " OR ".join(
                f"ts BETWEEN {_ts_literal(lo)} AND {_ts_literal(hi)}" for lo, hi in ts_spans(data)
            )
            cols = ", ".join(quote(k) for k in keys)
            on = " AND ".join(f"b.{quote(k)} IS NOT DISTINCT FROM s.{quote(k)}" for k in keys)
            rows = (
                f"SELECT b.* FROM _ps_batch b ANTI JOIN (SELECT {cols} FROM {quote(table)}"
                f" WHERE {span}) s ON {on}"
            )
        self._con.register("_ps_batch", data)
        try:
            self._con.execute(f"INSERT {conflict} INTO {quote(table)} BY NAME {rows}")
        finally:
            self._con.unregister("_ps_batch")

    def record_received(self, rows: list[dict[str, Any]]) -> None:
        """Add ``segments_received`` rows (those it holds already are left alone) in one
        statement: ``executemany`` ran one statement and one transaction a row (~1 ms of CPU
        each, and a commit)."""
        self._writable("recording received segments")
        if not rows:
            return
        data = pa.table(
            {
                "segment": [r["segment"] for r in rows],
                "token": [r.get("token") for r in rows],
                "agent": [r.get("agent") for r in rows],
                "host": [r.get("host") for r in rows],
                "service": [r.get("service") for r in rows],
                # a remote agent's header may say anything: what no column holds is NULL
                "pid": pa.array([values.as_int32(r.get("pid")) for r in rows], pa.int32()),
                "received_ns": pa.array(
                    [values.as_int(r.get("received_ns")) for r in rows], pa.int64()
                ),
                "started_ns": pa.array(
                    [values.as_int(r.get("started_ns")) for r in rows], pa.int64()
                ),
            }
        )
        self._con.register("_ps_received", data)
        try:
            self._con.execute(
                "INSERT OR IGNORE INTO segments_received "
                "(segment, token, agent, host, service, pid, received, started) "
                "SELECT segment, token, agent, host, service, pid, "
                "make_timestamp(received_ns // 1000), make_timestamp(started_ns // 1000) "
                "FROM _ps_received"
            )
        finally:
            self._con.unregister("_ps_received")

    def apply_retention(
        self, days: int = RAW_DAYS, rollup_days: int = rollups.ROLLUP_DAYS
    ) -> list[str]:
        """Drop whole days of raw rows that ended more than ``days`` days ago, and of rollups
        more than ``rollup_days`` ago (the minute rows of rollups go with the raw rows: hours
        and days answer for older days); returns the raw days dropped (YYYY-MM-DD)."""
        self._writable("retention")
        if days < 1 or rollup_days < 1:
            raise StoreError(f"retention must be at least 1 day (got {min(days, rollup_days)})")
        cutoff = utcnow() - timedelta(days=days)
        keep_from = datetime.combine(cutoff.date(), datetime.min.time())  # the first day kept
        existing = self._days()
        old = [
            d
            for d in existing
            if datetime.combine(d + timedelta(days=1), datetime.min.time()) <= cutoff
        ]
        con = self._con
        self._next_rid = {}
        self._layout_cache = None  # a day dropped may be made again, in the compact layout
        con.begin()
        try:
            self._create_views([d for d in existing if d not in old])
            for d in old:
                for t in schema.EVENT_TABLES:
                    con.execute(f"DROP TABLE IF EXISTS {quote(schema.day_table(t, d))}")
            self._drop_rollup_days(rollup_days, minute_days=days)
            con.execute("DELETE FROM agent_stats WHERE ts < ?", [cutoff])
            con.execute("DELETE FROM captures WHERE ts < ?", [cutoff])
            # Offsets of finished segments no longer in the spool can never matter again.
            present = [f.base for f in spool.list_spool(self.spool_dir)]
            con.execute(
                "DELETE FROM ingest_offsets WHERE closed AND updated < ? "
                "AND NOT list_contains(?::VARCHAR[], segment)",
                [cutoff, present],
            )
            con.execute(_SEGMENTS_RECEIVED_RETENTION, [cutoff, keep_from, keep_from])
            con.commit()
        except BaseException:
            con.rollback()
            raise
        return [d.isoformat() for d in old]


def _ts_literal(us: int) -> str:
    """A stored (naive UTC) ts, in microseconds, as a DuckDB literal."""
    ts = EPOCH_NAIVE + timedelta(microseconds=us)
    return f"TIMESTAMP '{ts.isoformat(sep=' ', timespec='microseconds')}'"


def _without_rid(t: pa.Table) -> pa.Table:
    return t.drop_columns(["rid"]) if "rid" in t.column_names else t


def _with_rid(req: pa.Table, calls: pa.Table | None) -> tuple[pa.Table, pa.Table | None]:
    """``req`` and ``calls`` with ``rid`` (store.tables numbers a batch's requests; tables made
    by other code may not): requests without are numbered 0, 1, ... and calls without name
    their request's by its trace id."""
    if "rid" not in req.column_names:
        req = req.append_column("rid", pa.array(np.arange(req.num_rows, dtype=np.int64)))
    if calls is not None and "rid" not in calls.column_names:
        tid = calls["trace_id"]
        if pa.types.is_dictionary(tid.type):
            tid = pc.cast(tid, pa.string())
        pos = pc.index_in(tid, value_set=req["trace_id"])
        calls = calls.append_column("rid", pc.take(req["rid"], pos))
    return req, calls


def params_numbers(rid: pa.Array, params_hash: pa.Array | pa.ChunkedArray) -> pa.Array:
    """What DuckDB's compact calls keep of ``params_hash`` (schema.DUCKDB_CALLS): within each
    request (``rid``), the calls' distinct hashes numbered 0, 1, ... in the order of their
    values; NULL stays NULL. Calls of one request have the same number exactly when they
    have the same hash: repeated_query, the one reader, compares them only within a
    request. A few bits a call, where a 63-bit hash took 8 bytes."""
    ph = params_hash.combine_chunks() if isinstance(params_hash, pa.ChunkedArray) else params_hash
    out = np.zeros(len(ph), np.int32)
    valid = np.flatnonzero(pc.is_valid(ph).to_numpy(zero_copy_only=False))
    if len(valid):
        r = rid.to_numpy(zero_copy_only=False)[valid]
        h = ph.to_numpy(zero_copy_only=False)[valid]
        order = np.lexsort((h, r))
        r, h = r[order], h[order]
        first_of_request = np.empty(len(r), bool)
        first_of_request[0] = True
        np.not_equal(r[1:], r[:-1], out=first_of_request[1:])
        new_value = first_of_request.copy()
        new_value[1:] |= h[1:] != h[:-1]
        n = np.cumsum(new_value)
        out[valid[order]] = n - np.maximum.accumulate(np.where(first_of_request, n, 0))
    return pa.array(out, pa.int32(), mask=pc.is_null(ph).to_numpy(zero_copy_only=False))
