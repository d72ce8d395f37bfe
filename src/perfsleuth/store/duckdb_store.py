"""The embedded store: one DuckDB file, DATA/perfsleuth.duckdb.

Ingest reads the spool (DATA/spool/*.seg, *.open) from the offsets committed in
``ingest_offsets`` and commits rows together with the new offsets in one transaction per batch,
so a crash anywhere neither loses nor doubles a request. Only after the commit are finished
segments deleted (or, when they held damage, moved to DATA/spool/corrupt/); a segment the
offsets mark as finished is never read again.

Event rows live in one table per day (``requests_d20261123``, ``calls_d…``, ``attributes_d…``)
behind views named like the logical tables; retention drops whole days.
"""

from __future__ import annotations

import difflib
import glob
import json
import mmap
import os
import re
import time
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

import duckdb
import pyarrow as pa

from perfsleuth.store import ingest as ing
from perfsleuth.store import schema
from perfsleuth.store.base import (
    Damage,
    IngestReport,
    Progress,
    StoreError,
    StoreLocked,
    disk_full,
)
from perfsleuth.store.schema import quote

DB_NAME = "perfsleuth.duckdb"
GROUP_COLUMNS = ("endpoint", "user", "tenant", "service", "host", "kind", "method", "status")
KINDS = ("web", "background")
_LOCK_PID = re.compile(r"\(PID (\d+)\)")
_EXPLAIN = re.compile(r"^\s*explain\s+(?:analyze\s+|analyse\s+)?(?:\([^)]*\)\s*)?", re.I)
_READ_ONLY_TYPES = {duckdb.StatementType.SELECT}


# DuckDB's file starts with three 4 KiB headers: a shorter file is a creation that failed
_HEADERS_SIZE = 3 * 4096


def _is_stub(path: str) -> bool:
    """Whether ``path`` is a store file whose creation never completed (an earlier version
    created it in place: a full disk left a few KiB that every open refused), with no log."""
    try:
        if os.path.getsize(path) >= _HEADERS_SIZE:
            return False
        return not os.path.exists(path + ".wal") or os.path.getsize(path + ".wal") == 0
    except OSError:
        return False


def _remove(*paths: str) -> None:
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def _utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.replace(tzinfo=UTC).isoformat()


class DuckDBStore:
    """The default store (see :class:`perfsleuth.store.base.Store` for the query contract)."""

    # Requests per ingest transaction (ClickHouse-sized batches: 10k-100k rows per insert).
    batch_requests = 50_000
    # ... and payload bytes, which bounds memory when requests are large.
    batch_bytes = 256 * 1024 * 1024
    # An .open segment whose writer is dead is final once unchanged this long.
    open_idle_seconds = 60.0

    def __init__(self, data_dir: str, read_only: bool = False) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.spool_dir = os.path.join(self.data_dir, "spool")
        self.corrupt_dir = os.path.join(self.spool_dir, "corrupt")
        self.agents_dir = os.path.join(self.data_dir, "agents")
        self.path = os.path.join(self.data_dir, DB_NAME)
        self.read_only = read_only
        os.makedirs(self.data_dir, exist_ok=True)
        if not os.path.exists(self.path) or _is_stub(self.path):
            # Readers too get an empty store, so that they work before anything was ingested.
            self._create_file()
        self._con = self._connect(read_only)
        if not read_only:
            try:
                self._create_schema()
            except duckdb.Error as e:
                self.close()
                raise disk_full(self.data_dir, e) or StoreError(
                    f"cannot prepare the store {self.path}: {e}"
                ) from e
        else:
            # A store written by an older version lacks newer tables (or has views naming
            # day tables it never made): readers get views over what is there, in memory.
            self._create_views(self._days(), temp=True)

    # ----------------------------------------------------------------------- connection

    def _create_file(self) -> None:
        """Create the store with its schema under a temporary name, then link it into place:
        a store whose creation fails (a full disk) leaves no stub that later opens fail on,
        and a store another process created meanwhile is kept."""
        tmp = f"{self.path}.creating-{os.getpid()}"
        _remove(tmp, tmp + ".wal")
        try:
            self._con = self._connect(False, tmp)
            try:
                self._create_schema()
                self._con.execute("CHECKPOINT")
            finally:
                self.close()
            if _is_stub(self.path):
                _remove(self.path)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                pass  # created by another process meanwhile: that one is the store
            except OSError:  # a filesystem without hard links
                if not os.path.exists(self.path):
                    os.replace(tmp, self.path)
        except (duckdb.Error, OSError) as e:
            raise disk_full(self.data_dir, e) or StoreError(
                f"cannot create the store {self.path}: {e}"
            ) from e
        finally:
            _remove(tmp, tmp + ".wal")

    def _connect(self, read_only: bool, path: str | None = None) -> duckdb.DuckDBPyConnection:
        try:
            con = duckdb.connect(path or self.path, read_only=read_only)
        except duckdb.IOException as e:
            msg = str(e)
            full = disk_full(self.data_dir, e)
            if full is not None:
                raise full from e
            if "lock" in msg.lower():
                m = _LOCK_PID.search(msg)
                who = f"PID {m.group(1)}" if m else "see the engine's message: " + msg
                raise StoreLocked(
                    f"the store {self.path} is in use by another perfsleuth process ({who}); "
                    "wait for it to finish or stop it, then try again"
                ) from e
            raise StoreError(f"cannot open the store {self.path}: {msg}") from e
        except duckdb.Error as e:
            raise StoreError(f"cannot open the store {self.path}: {e}") from e
        return con

    def _create_schema(self) -> None:
        con = self._con
        con.begin()
        for t in schema.GLOBAL_TABLES:
            con.execute(schema.duckdb_create(t))
        days = self._days()
        self._migrate(days)
        self._create_views(days)
        con.commit()

    def _migrate(self, days: list[date]) -> None:
        """Bring tables written by an older version up to the schema: missing day tables of
        event tables are created, missing columns added (NULL in old rows)."""
        have: dict[str, set[str]] = {}
        for table, column in self._con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE schema_name = 'main' "
            "AND database_name = current_database()"
        ).fetchall():
            have.setdefault(table, set()).add(column)
        tables = [(t, t.name) for t in schema.GLOBAL_TABLES]
        for d in days:
            for t in schema.EVENT_TABLES:
                name = schema.day_table(t, d)
                if name not in have:
                    self._con.execute(schema.duckdb_create(t, name))
                else:
                    tables.append((t, name))
        for t, name in tables:
            for c in t.columns:
                if c.name not in have.get(name, {c.name}):
                    self._con.execute(
                        f"ALTER TABLE {quote(name)} ADD COLUMN {quote(c.name)} "
                        f"{schema.duckdb_type(c)}"
                    )

    def close(self) -> None:
        con = getattr(self, "_con", None)
        if con is not None:
            con.close()
            self._con = None  # type: ignore[assignment]

    def __enter__(self) -> DuckDBStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"the store was opened read-only; {what} needs a writable store")

    def _day_tables(self) -> dict[str, set[date]]:
        """Days for which each event table exists."""
        rows = self._con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' "
            "AND database_name = current_database()"
        ).fetchall()
        out: dict[str, set[date]] = {t.name: set() for t in schema.EVENT_TABLES}
        for (name,) in rows:
            parsed = schema.parse_day_table(name)
            if parsed is not None:
                out[parsed[0]].add(parsed[1])
        return out

    def _days(self) -> list[date]:
        """Days for which the event tables exist (requests is the reference)."""
        return sorted(self._day_tables()["requests"])

    def _create_views(self, days: list[date], *, temp: bool = False) -> None:
        # A store written by an older version, opened read-only, may lack a newer table on
        # some days: each view covers the days its table exists.
        have = self._day_tables()
        for t in schema.EVENT_TABLES:
            self._con.execute(
                schema.duckdb_view(t, [d for d in days if d in have[t.name]], temp=temp)
            )

    # ---------------------------------------------------------------------------- ingest

    def _offsets(self) -> dict[str, tuple[Any, ...]]:
        rows = self._con.execute(
            'SELECT segment, "offset", closed, damaged, service, host, pid, version'
            " FROM ingest_offsets"
        ).fetchall()
        return {r[0]: r[1:] for r in rows}

    def ingest(self, progress: Progress | None = None) -> IngestReport:
        """Ingest everything new in the spool (see the module docstring for the guarantees)."""
        self._writable("ingest")
        report = IngestReport()
        offsets = self._offsets()
        files = ing.list_spool(self.spool_dir)
        now = time.time()
        total = sum(max(0, f.size - offsets.get(f.base, (0,))[0]) for f in files)
        done_bytes = 0  # of the segments before the current one
        reported = -1
        days = set(self._days())
        # A segment continued past its fingerprint records still files their calls apart.
        ing.remember_internal_fingerprints(
            r[0]
            for r in self._con.execute(
                "SELECT id FROM fingerprints WHERE kind = 'db.internal'"
            ).fetchall()
        )
        seen: set[bytes] = set()
        batch = ing.Batch(seen)
        touched: set[str] = set()

        def flush(current: int = 0) -> None:
            nonlocal batch, reported
            self._flush(batch, days, report)
            batch = ing.Batch(seen)
            if progress is not None:
                reported = min(done_bytes + current, total)
                progress(reported, total)

        for f in files:
            prev = offsets.get(f.base)
            if prev is not None and prev[1]:
                # Finished in an earlier run that stopped before removing the file.
                self._retire(f.base, damaged=bool(prev[2]), report=report)
                continue
            start = int(prev[0]) if prev is not None else 0
            final = ing.writer_gone(f, self.open_idle_seconds, now)
            if f.size <= start and not final:
                continue
            seg = ing.SegmentState(f.base, f.name, start)
            if prev is not None:
                seg.damaged, seg.service, seg.host, seg.pid = bool(prev[2]), *prev[3:6]
                seg.version = prev[6] or ""
            if not seg.host and f.host:
                seg.host = f.host
            if seg.pid is None:
                seg.pid = f.pid
            read = self._read(f, start)
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
            for rtype, payload, rstart, rend in rd.raw:
                batch.add_raw(seg, rtype, payload, rstart, rend)
                seg.offset = rend
                if rtype in ing.REQUEST_TYPES and self._full(batch):
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
            if self._full(batch):
                flush()
        if batch.segments:
            flush()
        if progress is not None and reported != total:
            progress(total, total)
        report.segments_read = len(touched)
        return report

    def insert_batch(self, batch: ing.Batch) -> IngestReport:
        """Store records that came from outside the spool (OTLP, store.otlp) in one
        transaction, as ingest stores a spool batch: requests already held are left out."""
        self._writable("ingest")
        report = IngestReport()
        self._flush(batch, set(self._days()), report)
        return report

    def _full(self, batch: ing.Batch) -> bool:
        return batch.requests >= self.batch_requests or batch.request_bytes >= self.batch_bytes

    def _read(self, f: ing.SpoolFile, start: int) -> tuple[int, ing.SegmentRead] | None:
        """(size, records from ``start``) of a segment, following an .open -> .seg rename."""
        paths = [f.path]
        if not f.closed:
            paths.append(os.path.join(self.spool_dir, f.base + ing.CLOSED_SUFFIX))
        for p in paths:
            try:
                fh = open(p, "rb")  # noqa: SIM115 - mapped below, closed in finally
            except FileNotFoundError:
                continue
            try:
                if os.fstat(fh.fileno()).st_size == 0:
                    return 0, ing.read_from(b"", start)
                # Maps the file as it is now (an open segment may have grown since listing).
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    return len(mm), ing.read_from(mm, start)
            finally:
                fh.close()
        return None

    def _flush(self, batch: ing.Batch, days: set[date], report: IngestReport) -> None:
        """Insert a batch and its segments' offsets in one transaction; then retire the
        segments it finished."""
        tables = ing.build_tables(batch, time.time_ns())
        con = self._con
        con.begin()
        try:
            self._drop_known_traces(tables)
            new_days = [d for d in tables.days if d not in days]
            for d in new_days:
                for t in schema.EVENT_TABLES:
                    con.execute(schema.duckdb_create(t, schema.day_table(t, d)))
            if new_days:
                self._create_views(sorted(days | set(new_days)))
            for d, parts in tables.days.items():
                for t in schema.EVENT_TABLES:
                    if t.name in parts:
                        self._insert(schema.day_table(t, d), parts[t.name])
            for name, tbl in (
                ("fingerprints", tables.fingerprints),
                ("locations", tables.locations),
                ("stacks", tables.stacks),
            ):
                if tbl is not None:
                    self._insert(name, tbl, conflict="OR IGNORE")
            if tables.agent_stats is not None:
                self._insert("agent_stats", tables.agent_stats)
            if tables.captures is not None:
                self._insert("captures", tables.captures, conflict="OR IGNORE")
            now = _utcnow()
            offs = pa.Table.from_pylist(
                [
                    {
                        "segment": s.base,
                        "offset": s.offset,
                        "closed": s.final,
                        "damaged": s.damaged,
                        "service": s.service or None,
                        "host": s.host or None,
                        "pid": s.pid,
                        "updated": now,
                        "version": s.version or None,
                    }
                    for s in batch.segments
                ],
                schema=schema.INGEST_OFFSETS.arrow_schema(),
            )
            self._insert("ingest_offsets", offs, conflict="OR REPLACE")
            self._commit()
        except BaseException as e:
            try:
                con.rollback()
            except duckdb.Error:
                pass
            full = disk_full(self.data_dir, e)
            if full is not None:  # the offsets were not advanced: the spool keeps it all
                raise full from e
            raise
        days.update(new_days)
        report.requests += tables.requests
        report.calls += tables.calls
        report.damaged.extend(
            Damage(d.segment.name, d.offset, d.length, d.reason) for d in batch.damage
        )
        for s in batch.segments:
            if s.final:
                self._retire(s.base, damaged=s.damaged, report=report)

    def _drop_known_traces(self, tables: ing.Tables) -> None:
        """Requests already in the store (a record repeated, a segment copied under another
        name) are not added again: one semi-join of the batch's trace ids."""
        ids = ing.trace_ids(tables)
        if not len(ids):
            return
        self._con.register("_ps_ids", pa.table({"trace_id": ids}))
        try:
            known = self._con.execute(
                "SELECT DISTINCT trace_id FROM requests "
                "WHERE trace_id IN (SELECT trace_id FROM _ps_ids)"
            ).fetchall()
        finally:
            self._con.unregister("_ps_ids")
        ing.drop_known_traces(tables, pa.array([r[0] for r in known], pa.string()))

    def _commit(self) -> None:
        self._con.commit()

    def _insert(self, table: str, data: pa.Table, conflict: str = "") -> None:
        if data.num_rows == 0:
            return
        self._con.register("_ps_batch", data)
        try:
            self._con.execute(
                f"INSERT {conflict} INTO {quote(table)} BY NAME SELECT * FROM _ps_batch"
            )
        finally:
            self._con.unregister("_ps_batch")

    def _retire(self, base: str, *, damaged: bool, report: IngestReport) -> None:
        """Remove a finished segment from the spool: deleted, or moved to corrupt/ when it
        held damage. Failure is harmless: the offsets say it is done."""
        for suffix in (ing.CLOSED_SUFFIX, ing.OPEN_SUFFIX):
            name = base + suffix
            path = os.path.join(self.spool_dir, name)
            if not os.path.exists(path):
                continue
            try:
                if damaged:
                    os.makedirs(self.corrupt_dir, exist_ok=True)
                    dest = os.path.join(self.corrupt_dir, name)
                    n = 1
                    while os.path.exists(dest):
                        n += 1
                        dest = os.path.join(self.corrupt_dir, f"{name}.{n}")
                    os.replace(path, dest)
                    report.quarantined.append(name)
                else:
                    os.remove(path)
                report.segments_done += 1
            except OSError:
                pass

    def apply_retention(self, days: int) -> list[str]:
        """Drop whole days that ended more than ``days`` days ago; returns them (YYYY-MM-DD)."""
        self._writable("retention")
        if days < 1:
            raise StoreError(f"retention must be at least 1 day (got {days})")
        cutoff = _utcnow() - timedelta(days=days)
        existing = self._days()
        old = [
            d
            for d in existing
            if datetime.combine(d + timedelta(days=1), datetime.min.time()) <= cutoff
        ]
        con = self._con
        con.begin()
        try:
            self._create_views([d for d in existing if d not in old])
            for d in old:
                for t in schema.EVENT_TABLES:
                    con.execute(f"DROP TABLE IF EXISTS {quote(schema.day_table(t, d))}")
            con.execute("DELETE FROM agent_stats WHERE ts < ?", [cutoff])
            con.execute("DELETE FROM captures WHERE ts < ?", [cutoff])
            # Offsets of finished segments no longer in the spool can never matter again.
            present = [f.base for f in ing.list_spool(self.spool_dir)]
            con.execute(
                "DELETE FROM ingest_offsets WHERE closed AND updated < ? "
                "AND NOT list_contains(?::VARCHAR[], segment)",
                [cutoff, present],
            )
            con.commit()
        except BaseException:
            con.rollback()
            raise
        return [d.isoformat() for d in old]

    # --------------------------------------------------------------------------- queries

    def _source(self, since: timedelta | None) -> tuple[str, datetime | None]:
        """FROM-able SQL over the requests of the window (only the days it touches)."""
        if since is None:
            return "requests", None
        cutoff = _utcnow() - since
        days = [d for d in self._days() if d >= cutoff.date()]
        return f"({schema.duckdb_union(schema.REQUESTS, days)})", cutoff

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return self._query(sql, params)

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        cur = self._con.execute(sql, list(params))
        cols = [d[0] for d in cur.description or ()]
        return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]

    def top(
        self,
        since: timedelta | None = None,
        by: tuple[str, ...] = ("endpoint",),
        kind: str | None = None,
    ) -> list[dict[str, Any]]:
        """See :meth:`Store.top`. Groups are ordered by total time (busiest first), then count.
        ``rate_per_min`` divides by the ``since`` window, or by the time the selected
        requests span (at least one minute)."""
        by = tuple(dict.fromkeys(by))
        if not by or any(b not in GROUP_COLUMNS for b in by):
            raise StoreError(
                f"cannot group by {', '.join(by) or 'nothing'}; use any of: "
                + ", ".join(GROUP_COLUMNS)
            )
        src, cutoff = self._source(since)
        where, params = self._where(cutoff, kind)
        g = ", ".join(quote(b) for b in by)
        rows = self._query(
            f"""
            SELECT {g}, count(*) AS count,
                quantile_cont(duration_ms, [0.5, 0.95, 0.99]) AS q,
                max(duration_ms) AS max_ms,
                avg(CASE WHEN status >= 500 OR error IS NOT NULL THEN 1.0 ELSE 0.0 END)
                    AS error_rate,
                sum(db_calls) AS db_calls, sum(http_calls) AS http_calls,
                sum(cache_calls) AS cache_calls,
                sum(db_ms) AS db_ms, sum(http_ms) AS http_ms, sum(cache_ms) AS cache_ms,
                coalesce(sum(gc_ms), 0) AS gc_ms,
                coalesce(sum(duration_ms), 0) AS total_ms,
                min(ts) AS first_ts, max(ts) AS last_ts
            FROM {src} WHERE {where}
            GROUP BY {g}
            ORDER BY total_ms DESC, count DESC, {g}
            """,
            params,
        )
        if not rows:
            return []
        if since is not None:
            minutes = since.total_seconds() / 60
        else:
            span = max(r["last_ts"] for r in rows) - min(r["first_ts"] for r in rows)
            minutes = span.total_seconds() / 60
        minutes = max(minutes, 1.0)
        out = []
        for r in rows:
            n = r["count"]
            total = float(r["total_ms"])
            q = r["q"] or [None, None, None]
            row = {b: r[b] for b in by}
            row.update(
                count=n,
                rate_per_min=n / minutes,
                p50_ms=q[0],
                p95_ms=q[1],
                p99_ms=q[2],
                max_ms=r["max_ms"],
                error_rate=float(r["error_rate"]),
                db_calls_per_request=r["db_calls"] / n,
                http_calls_per_request=r["http_calls"] / n,
                cache_calls_per_request=r["cache_calls"] / n,
                db_share=min(1.0, r["db_ms"] / total) if total > 0 else 0.0,
                http_share=min(1.0, r["http_ms"] / total) if total > 0 else 0.0,
                cache_share=min(1.0, r["cache_ms"] / total) if total > 0 else 0.0,
                gc_share=min(1.0, r["gc_ms"] / total) if total > 0 else 0.0,
                total_ms=total,
            )
            out.append(row)
        return out

    @staticmethod
    def _where(
        cutoff: datetime | None, kind: str | None, endpoint: str | None = None
    ) -> tuple[str, list[Any]]:
        conds: list[str] = ["true"]
        params: list[Any] = []
        if cutoff is not None:
            conds.append("ts >= ?")
            params.append(cutoff)
        if kind is not None:
            if kind not in KINDS:
                raise StoreError(f"unknown kind '{kind}'; use one of: {', '.join(KINDS)}")
            conds.append("kind = ?")
            params.append(kind)
        if endpoint is not None:
            conds.append("endpoint = ?")
            params.append(endpoint)
        return " AND ".join(conds), params

    def endpoints(self) -> list[str]:
        rows = self._con.execute("SELECT DISTINCT endpoint FROM requests ORDER BY 1").fetchall()
        return [r[0] for r in rows]

    def _check_endpoint(self, endpoint: str) -> None:
        known = self.endpoints()
        if endpoint in known:
            return
        if not known:
            raise StoreError(f"unknown endpoint '{endpoint}'; no requests have been ingested yet")
        low = endpoint.lower()
        close = [e for e in known if low in e.lower()]
        close += [
            e for e in difflib.get_close_matches(endpoint, known, n=5, cutoff=0.4) if e not in close
        ]
        shown = (close or known)[:5]
        more = "" if len(close or known) <= 5 else ", ..."
        raise StoreError(f"unknown endpoint '{endpoint}'; known: {', '.join(shown)}{more}")

    def traces(
        self,
        endpoint: str | None = None,
        since: timedelta | None = None,
        slowest: int | None = None,
        limit: int = 20,
    ) -> list[dict[str, Any]]:
        if endpoint is not None:
            self._check_endpoint(endpoint)
        src, cutoff = self._source(since)
        where, params = self._where(cutoff, None, endpoint)
        order = "duration_ms DESC NULLS LAST, ts DESC" if slowest else "ts DESC"
        n = slowest if slowest else limit
        rows = self._query(
            f"""
            SELECT trace_id, ts, endpoint, method, path, status, duration_ms,
                db_calls, db_ms, http_calls, http_ms, cache_calls, cache_ms, "user", tenant
            FROM {src} WHERE {where} ORDER BY {order} LIMIT ?
            """,
            [*params, max(0, int(n))],
        )
        for r in rows:
            r["ts"] = _iso(r["ts"])
        return rows

    def trace(self, trace_id: str) -> dict[str, Any]:
        prefix = trace_id.strip().lower()
        if not prefix:
            raise StoreError("give a trace id (or a unique prefix of one)")
        ids = [
            r[0]
            for r in self._con.execute(
                "SELECT DISTINCT trace_id FROM requests WHERE starts_with(trace_id, ?) LIMIT 6",
                [prefix],
            ).fetchall()
        ]
        if not ids:
            raise StoreError(f"no trace with id '{trace_id}'")
        if len(ids) > 1:
            shown = ", ".join(sorted(ids)[:5]) + (", ..." if len(ids) > 5 else "")
            raise StoreError(f"trace id prefix '{trace_id}' is ambiguous: it matches {shown}")
        tid = ids[0]
        req = self._query("SELECT * FROM requests WHERE trace_id = ? LIMIT 1", [tid])[0]
        day = req["ts"].date()
        exists = day in self._days()
        calls_src = quote(schema.day_table(schema.CALLS, day)) if exists else "calls"
        attrs_src = quote(schema.day_table(schema.ATTRIBUTES, day)) if exists else "attributes"
        attrs = self._con.execute(
            f"SELECT kind, key, value, num FROM {attrs_src} WHERE trace_id = ?", [tid]
        ).fetchall()
        calls = self._query(
            f"""
            SELECT c.seq, c.kind, c.system, c.offset_ms, c.duration_ms,
                f.text AS fingerprint, f.op, c.rows, c.bytes, c.host, c.status, c.hit,
                c.wait_ms, c.error, c.params_hash, c.unfinished, c.fingerprint_id,
                c.stack_id, c.site_id, l.file AS site_file, l.line AS site_line,
                l.function AS site_function
            FROM {calls_src} c
            LEFT JOIN fingerprints f ON f.id = c.fingerprint_id
            LEFT JOIN locations l ON l.id = c.site_id
            WHERE c.trace_id = ? ORDER BY c.seq
            """,
            [tid],
        )
        stacks = self._stacks({c["stack_id"] for c in calls if c["stack_id"] is not None})
        for c in calls:
            site_id = c.pop("site_id")
            file, line, func = c.pop("site_file"), c.pop("site_line"), c.pop("site_function")
            c["site"] = (
                {"file": file, "line": line, "function": func}
                if site_id is not None and (file is not None or func is not None)
                else None
            )
            c["stack"] = stacks.get(c.pop("stack_id"), [])
        req["ts"] = _iso(req["ts"])
        req["attributes"] = {k: _attr_value(v, n) for kind, k, v, n in attrs if kind == "attr"}
        req["tags"] = {k: v for kind, k, v, _ in attrs if kind == "tag"}
        req["calls"] = calls
        req["samples"] = self._count("samples", day, tid)
        req["blockers"] = self._count("blockers", day, tid)
        req["capture"] = self._capture_reason(tid)
        return req

    def _capture_reason(self, trace_id: str) -> str | None:
        """Why the trace was captured for replay (None: it was not)."""
        if "captures" not in self._table_names():
            return None
        row = self._con.execute(
            "SELECT coalesce(reason, '?') FROM captures WHERE trace_id = ?", [trace_id]
        ).fetchone()
        return str(row[0]) if row else None

    def _count(self, table: str, day: date, trace_id: str) -> int:
        name = schema.day_table(schema.TABLES[table], day)
        if name not in self._table_names():
            return 0
        row = self._con.execute(
            f"SELECT count(*) FROM {quote(name)} WHERE trace_id = ?", [trace_id]
        ).fetchone()
        return int(row[0]) if row else 0

    def _table_names(self) -> set[str]:
        return {
            r[0]
            for r in self._con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' "
                "AND database_name = current_database()"
            ).fetchall()
        }

    def samples(self, trace_id: str) -> list[dict[str, Any]]:
        """See :meth:`Store.samples`."""
        rows = self._query(
            "SELECT offset_ms, state, stack_id FROM samples WHERE trace_id = ? ORDER BY offset_ms",
            [self._trace_id(trace_id)],
        )
        stacks = self._stacks({r["stack_id"] for r in rows if r["stack_id"] is not None})
        for r in rows:
            r["stack"] = stacks.get(r.pop("stack_id"), [])
        return rows

    def blockers(
        self,
        since: timedelta | None = None,
        endpoint: str | None = None,
        trace_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """See :meth:`Store.blockers`."""
        conds: list[str] = ["true"]
        params: list[Any] = []
        if since is not None:
            conds.append("b.ts >= ?")
            params.append(_utcnow() - since)
        if trace_id is not None:
            conds.append("b.trace_id = ?")
            params.append(self._trace_id(trace_id))
        ep = "coalesce(nullif(b.endpoint, ''), r.endpoint, '<no request>')"
        if endpoint is not None:
            conds.append(f"{ep} = ?")
            params.append(endpoint)
        rows = self._query(
            f"""
            SELECT b.ts, b.trace_id, {ep} AS endpoint, b.duration_ms, b.delayed, b.stack_id,
                b.stack_samples, b.samples, b.last_kind, b.last_call, b.last_rows,
                b.last_bytes, b.last_ms, b.pid
            FROM blockers b LEFT JOIN requests r ON r.trace_id = b.trace_id
            WHERE {" AND ".join(conds)}
            ORDER BY b.duration_ms DESC LIMIT ?
            """,
            [*params, int(limit)],
        )
        stacks = self._stacks({r["stack_id"] for r in rows if r["stack_id"] is not None})
        for r in rows:
            r["ts"] = _iso(r["ts"])
            r["stack"] = stacks.get(r.pop("stack_id"), [])
        return rows

    def capture(self, trace_id: str) -> dict[str, Any] | None:
        """See :meth:`Store.capture`."""
        prefix = trace_id.strip().lower()
        if not prefix:
            raise StoreError("give a trace id (or a unique prefix of one)")
        if "captures" not in self._table_names():  # a read-only store of an older version
            rows = []
        else:
            rows = self._query(
                "SELECT * FROM captures WHERE starts_with(trace_id, ?) ORDER BY trace_id LIMIT 6",
                [prefix],
            )
        if len(rows) > 1:
            shown = ", ".join(r["trace_id"] for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
            raise StoreError(f"trace id prefix '{trace_id}' is ambiguous: it matches {shown}")
        if not rows:
            self.trace(prefix)  # unknown or ambiguous trace: its error; else no capture
            return None
        r = rows[0]
        r["ts"] = _iso(r["ts"])
        try:
            r["headers"] = [tuple(p) for p in json.loads(r["headers"] or "[]")]
        except ValueError:
            r["headers"] = []
        r["redacted"] = [h for h in (r["redacted"] or "").split(",") if h]
        return r

    def _trace_id(self, trace_id: str) -> str:
        """The full id of a trace given by id or unique prefix (as ``trace``), else as given."""
        prefix = trace_id.strip().lower()
        ids = [
            r[0]
            for r in self._con.execute(
                "SELECT DISTINCT trace_id FROM requests WHERE starts_with(trace_id, ?) LIMIT 2",
                [prefix],
            ).fetchall()
        ]
        return ids[0] if len(ids) == 1 else prefix

    def _stacks(self, ids: set[int]) -> dict[int, list[dict[str, Any]]]:
        if not ids:
            return {}
        frames = dict(
            self._con.execute(
                "SELECT id, frames FROM stacks WHERE list_contains(?, id)", [sorted(ids)]
            ).fetchall()
        )
        loc_ids = sorted({i for fr in frames.values() for i in fr or ()})
        locs = {
            r[0]: {"file": r[1], "line": r[2], "function": r[3], "app": r[4]}
            for r in self._con.execute(
                "SELECT id, file, line, function, app FROM locations WHERE list_contains(?, id)",
                [loc_ids],
            ).fetchall()
        }
        unknown = {"file": None, "line": None, "function": None, "app": None}
        return {sid: [dict(locs.get(i, unknown)) for i in fr or ()] for sid, fr in frames.items()}

    def sql(self, query: str, limit: int = 10_000) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One read-only statement (SELECT, or EXPLAIN of one); at most ``limit`` rows."""
        stmt = self._read_only_statement(query)
        try:
            cur = self._con.execute(stmt)
            cols = [d[0] for d in cur.description or ()]
            rows = cur.fetchmany(max(0, int(limit))) if limit > 0 else []
        except duckdb.Error as e:
            raise StoreError(str(e)) from e
        return cols, rows

    def _read_only_statement(self, query: str) -> str:
        try:
            stmts = self._con.extract_statements(query)
        except duckdb.Error as e:
            raise StoreError(str(e)) from e
        if not stmts:
            raise StoreError("the query is empty")
        if len(stmts) > 1:
            raise StoreError(f"run one statement at a time (got {len(stmts)})")
        stmt = stmts[0]
        kind = stmt.type
        text = stmt.query
        if kind == duckdb.StatementType.EXPLAIN:
            inner = _EXPLAIN.sub("", text, count=1)
            try:
                inner_stmts = self._con.extract_statements(inner)
            except duckdb.Error:
                inner_stmts = []
            if len(inner_stmts) == 1 and inner_stmts[0].type in _READ_ONLY_TYPES:
                return text
        elif kind in _READ_ONLY_TYPES:
            return text
        name = str(kind).rsplit(".", 1)[-1]
        raise StoreError(
            f"only read-only queries are allowed (SELECT, or EXPLAIN of a SELECT); "
            f"this is a {name} statement"
        )

    def agent_drops(self) -> dict[str, Any]:
        """Counters summed over agent processes: the newest of each process's status file
        (DATA/agents/*.json) and STATS records, counter by counter."""
        per_proc: dict[tuple[str, int], dict[str, int]] = {}
        last_error, last_error_ns = "", -1
        for path in sorted(glob.glob(os.path.join(self.agents_dir, "*.json"))):
            try:
                with open(path, encoding="utf-8") as fh:
                    body = json.load(fh)
            except (OSError, ValueError):
                continue
            if not isinstance(body, dict):
                continue
            key = (str(body.get("host", path)), ing.as_int(body.get("pid")) or 0)
            counters = per_proc.setdefault(key, {})
            for k, v in body.items():
                if k in ("pid", "updated_ns") or isinstance(v, bool):
                    continue
                if isinstance(v, int):
                    counters[k] = max(counters.get(k, 0), v)
            updated = ing.as_int(body.get("updated_ns")) or 0
            err = body.get("last_error")
            if isinstance(err, str) and err and updated > last_error_ns:
                last_error, last_error_ns = err, updated
        for host, pid, name, value in self._con.execute(
            "SELECT host, pid, name, arg_max(value, ts) FROM agent_stats GROUP BY ALL"
        ).fetchall():
            counters = per_proc.setdefault((host, pid), {})
            counters[name] = max(counters.get(name, 0), value)
        out: dict[str, Any] = {
            "processes": len(per_proc),
            "requests_recorded": 0,
            "requests_written": 0,
            "dropped_queue_full": 0,
            "dropped_write_error": 0,
            "dropped_spool_full": 0,
            "dropped_writer_dead": 0,
            "write_errors": 0,
        }
        skip = {"queued", "service", "host"}
        for counters in per_proc.values():
            for k, v in counters.items():
                if k not in skip and not k.startswith(_SCHED_COUNTERS):
                    out[k] = out.get(k, 0) + v
        out["dropped_total"] = sum(v for k, v in out.items() if k.startswith("dropped_"))
        out["last_error"] = last_error
        return out


# STATS counters the sampler ships about CPU scheduling (cpu_starved reads them): figures of the
# process, not counts of lost data.
_SCHED_COUNTERS = ("sched_", "cgroup_", "cpus_", "load1_")


def _attr_value(value: str | None, num: float | None) -> Any:
    if num is None:
        return value
    if value is not None and re.fullmatch(r"-?\d+", value):
        return int(value)
    return num
