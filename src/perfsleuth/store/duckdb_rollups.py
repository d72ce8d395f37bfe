"""Rollups in the DuckDB store (see :mod:`perfsleuth.store.rollups`): one table per day and
rollup table (``rollup_stats_d20261123``, ``rollup_hist_d…``) behind views named like the
logical tables, written in each ingest transaction, compacted, dropped by whole days, and read
by ``top`` for windows where raw rows would be slow or are gone.

Compaction: every batch adds its own rows for its minutes, hours and day, so a day ingested in
many small batches holds many rows per key. A day's rollup tables are rebuilt with the rows of
equal key summed (CREATE TABLE AS ... GROUP BY, then the old table dropped and the new one
renamed, in one transaction; no row is deleted) once the rows added since their last
compaction that may merge are as many as the rows that compaction left, and once more when
the day is over: the cost stays linear in what is ingested, and a finished day is read as one
row per key and bucket. A row may merge when a row of its resolution and time is stored
already: a server's rounds within a minute add such rows, a backlog of later minutes adds
mostly new ones, whose rebuilds merged next to nothing (benchmarks/README.md, "Checkpoints").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import date, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import rollups, schema
from perfsleuth.store.duckdb_file import DuckDBFile, utcnow
from perfsleuth.store.filters import only_where
from perfsleuth.store.schema import quote
from perfsleuth.store.tables import Tables

# Compact a day's rollups once the rows added that may merge are as many as the compacted
# rows, and this many.
COMPACT_MIN_ROWS = 20_000

log = logging.getLogger("perfsleuth.store")


class DuckDBRollups(DuckDBFile):
    compactions_failed = 0  # compactions after a commit that raised (logged, not raised)
    _rollup_one_batch: set[date]  # days whose rollup tables hold one batch's rows, as made

    # ------------------------------------------------------------------------------ writing

    def _insert_rollups(self, tables: Tables) -> None:
        """Insert the rollups of ``tables`` (inside the caller's transaction)."""
        # the days this transaction makes; a rolled-back one must not count as made
        self._rollup_new_days: set[date] = set()
        rows = rollups.rollups_of(tables.days)
        if not rows:
            return
        # Days whose tables existed at the last commit (a small transaction, an OTLP payload,
        # asks the catalog only for a new day); a rolled-back day is not in it.
        known: set[date] = getattr(self, "_rollup_days", set())
        have = self._day_tables() if set(rows) - known else None
        created = False
        added = 0
        made: set[date] = set()  # days whose tables this transaction creates
        for d, parts in rows.items():
            for t in schema.ROLLUP_TABLES:
                name = schema.day_table(t, d)
                if have is not None and d not in have[t.name]:
                    self._con.execute(schema.duckdb_create(t, name))
                    created = True
                    made.add(d)
            mergeable = self._mergeable_rows(d, parts[schema.ROLLUP_HIST.name], d in made)
            self._rollup_mergeable[d] = self._rollup_mergeable.get(d, 0) + mergeable
            added += mergeable
            for t in schema.ROLLUP_TABLES:
                self._insert_arrow(schema.day_table(t, d), parts[t.name])
        if created:
            self._create_rollup_views()
        self._rollup_new_days = set(rows)
        # A day table made by this transaction holds one batch's rows, grouped by key by
        # rollups_of: compact as it is, until another batch adds to it.
        self._rollup_one_batch = (getattr(self, "_rollup_one_batch", set()) - set(rows)) | made
        self._rollup_touched = getattr(self, "_rollup_touched", set()) | set(rows)
        self._rollup_added = getattr(self, "_rollup_added", 0) + added

    @property
    def _rollup_mergeable(self) -> dict[date, int]:
        """Per day, the histogram rows added since its last compaction (in this process) that
        may merge with a row stored before them."""
        if not hasattr(self, "_mergeable"):
            self._mergeable: dict[date, int] = {}
        return self._mergeable

    def _mergeable_rows(self, d: date, hist: pa.Table, made: bool) -> int:
        """How many of the histogram rows ``hist``, about to be added to day ``d``, have a
        resolution and time (``res``, ``ts``) at or before the latest of that resolution
        stored: those may merge with a stored row. Counted against the latest times known to
        this process (a day first touched here reads them from its table; one this
        transaction makes holds none); a rolled-back batch leaves them later than stored,
        which counts more rows, never fewer."""
        latest: dict[date, dict[int, int]] = getattr(self, "_rollup_latest", {})
        self._rollup_latest = latest
        if d not in latest:
            name = quote(schema.day_table(schema.ROLLUP_HIST, d))
            sql = f"SELECT res, epoch_us(max(ts)) FROM {name} GROUP BY res"
            latest[d] = {} if made else {int(r): int(t) for r, t in self._con.sql(sql).fetchall()}
        seen = latest[d]
        if not hist.num_rows:
            return 0
        res = hist["res"].to_numpy(zero_copy_only=False)
        ts = pc.cast(hist["ts"], pa.int64()).to_numpy(zero_copy_only=False)
        n = 0
        for r in np.unique(res).tolist():
            at = ts[res == r]
            top = seen.get(r)
            hi = int(at.max())
            if top is not None:
                n += int(np.count_nonzero(at <= top))
                hi = max(hi, top)
            seen[r] = hi
        return n

    def _insert_arrow(self, table: str, data: pa.Table) -> None:
        if not data.num_rows:
            return
        self._con.register("_ps_rollup", data)
        try:
            self._con.execute(f"INSERT INTO {quote(table)} BY NAME SELECT * FROM _ps_rollup")
        finally:
            self._con.unregister("_ps_rollup")

    def _create_rollup_views(self) -> None:
        have = self._day_tables()
        for t in schema.ROLLUP_TABLES:
            self._con.execute(schema.duckdb_view(t, sorted(have[t.name])))

    def compact_committed(self, *, final: bool = False) -> None:
        """:meth:`compact_rollups` after a commit that stored rows and offsets: a compaction
        that fails (a full disk) rolled itself back and leaves correct, uncompacted rows, so
        it is logged and counted, not raised (the commit did store); a later look retries."""
        try:
            self.compact_rollups(final=final)
        except Exception:
            self.compactions_failed += 1
            log.exception("rollup compaction failed; the rows stay as stored, uncompacted")

    def compact_rollups(self, *, final: bool = False, force: bool = False) -> list[date]:
        """Compact the rollups of the days that are due: those touched since the last call
        to which rows that may merge were added, as many as their compacted rows (and
        COMPACT_MIN_ROWS; see _mergeable_rows); with ``final`` (at
        the end of an ingest run) also the days that are over and changed since compacted;
        with ``force`` every day not compact. Returns the days compacted."""
        # called after a commit: the days it wrote exist
        self._rollup_days = getattr(self, "_rollup_days", set()) | getattr(
            self, "_rollup_new_days", set()
        )
        self._rollup_new_days = set()
        self._rollup_one_batch = getattr(self, "_rollup_one_batch", set())
        if not (final or force) and getattr(self, "_rollup_added", 0) < COMPACT_MIN_ROWS // 2:
            return []  # no day can be due since the last look: skip the catalog queries
        self._rollup_added = 0
        touched: set[date] = getattr(self, "_rollup_touched", set())
        self._rollup_touched = set()
        have = self._day_tables()
        days = sorted(have["rollup_hist"] & have["rollup_stats"])
        if not (final or force):
            days = [d for d in days if d in touched]
        if not force:  # rebuilt, these would come out as they are (the first batch's compaction
            # cost ~0.15 s per 50k requests and merged nothing)
            days = [d for d in days if d not in self._rollup_one_batch]
        if not days:
            return []
        done: dict[date, tuple[int, int]] = {
            r[0].date(): (r[1], r[2])
            for r in self._con.execute(
                "SELECT day, stats_rows, hist_rows FROM rollup_compacted"
            ).fetchall()
        }
        today = utcnow().date()
        sizes = self._table_rows()
        out = []
        for d in days:
            n_stats, n_hist = (sizes.get(schema.day_table(t, d), 0) for t in schema.ROLLUP_TABLES)
            last = done.get(d)
            if last == (n_stats, n_hist):
                continue  # compact since
            mergeable = self._rollup_mergeable.get(d, 0)
            due = mergeable >= max(COMPACT_MIN_ROWS, last[1] if last else 0)
            if force or due or (final and d < today):
                self._compact_day(d)
                self._rollup_mergeable[d] = 0
                out.append(d)
        return out

    def _table_rows(self) -> dict[str, int]:
        """Rows of each table (DuckDB's count, exact for tables no row was deleted from)."""
        return {
            r[0]: int(r[1])
            for r in self._con.execute(
                "SELECT table_name, estimated_size FROM duckdb_tables() "
                "WHERE schema_name = 'main' AND database_name = current_database()"
            ).fetchall()
        }

    def _compact_day(self, d: date) -> None:
        con = self._con
        con.begin()
        try:
            self._rebuild_day(d)
            con.commit()
        except BaseException:
            con.rollback()
            raise

    def _rebuild_day(self, d: date, where: str = "true") -> None:
        """Rebuild a day's rollup tables with the rows of equal key summed and only the rows
        ``where`` keeps (inside the caller's transaction): a new table made, the old one
        dropped, the new one renamed; no row is deleted."""
        con = self._con
        counts = []
        for t in schema.ROLLUP_TABLES:
            name = schema.day_table(t, d)
            keys = [c.name for c in t.columns if c.name in (*rollups.KEY, "bucket")]
            aggs = ", ".join(
                f"{'max' if c.name == 'max_ms' else 'sum'}({quote(c.name)}) AS {quote(c.name)}"
                for c in t.columns
                if c.name not in keys
            )
            k = ", ".join(quote(c) for c in keys)
            order = ", ".join(quote(c) for c in t.order_by)
            tmp = name + "_compact"
            con.execute(f"DROP TABLE IF EXISTS {quote(tmp)}")
            con.execute(schema.duckdb_create(t, tmp))
            con.execute(
                f"INSERT INTO {quote(tmp)} BY NAME SELECT {k}, {aggs} FROM {quote(name)} "
                f"WHERE {where} GROUP BY {k} ORDER BY {order}"
            )
            # the views name the day table: drop them first, make them again after
            con.execute(f"DROP VIEW IF EXISTS {quote(t.name)}")
            con.execute(f"DROP TABLE {quote(name)}")
            con.execute(f"ALTER TABLE {quote(tmp)} RENAME TO {quote(name)}")
            n = con.execute(f"SELECT count(*) FROM {quote(name)}").fetchone()
            counts.append(int(n[0]) if n else 0)
        con.execute(
            "INSERT OR REPLACE INTO rollup_compacted VALUES (?, ?, ?)",
            [datetime.combine(d, datetime.min.time()), *counts],
        )
        self._create_rollup_views()

    def _has_minutes(self, d: date) -> bool:
        """Whether the rollups of day ``d`` still hold minute rows (retention keeps those only
        as long as raw rows)."""
        name = schema.day_table(schema.ROLLUP_STATS, d)
        if name not in self._table_names():
            return False
        r = self._con.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM {quote(name)} WHERE res = ? LIMIT 1)",
            [rollups.MINUTE],
        ).fetchone()
        return bool(r and r[0])

    def _drop_rollup_days(self, keep_days: int, minute_days: int | None = None) -> list[str]:
        """Drop the rollup days that ended more than ``keep_days`` days ago, and the minute
        rows of those that ended more than ``minute_days`` ago (hours and days answer for
        them), inside the caller's transaction; returns the days dropped (YYYY-MM-DD)."""
        cutoff = utcnow() - timedelta(days=keep_days)
        self._rollup_days = set()  # days are dropped: ask the catalog again
        have = self._day_tables()
        days = sorted(have["rollup_stats"] & have["rollup_hist"])

        def ended_before(d: date, t: datetime) -> bool:
            return datetime.combine(d + timedelta(days=1), datetime.min.time()) <= t

        old = sorted(
            d for d in have["rollup_stats"] | have["rollup_hist"] if ended_before(d, cutoff)
        )
        if minute_days is not None:
            minutes_cutoff = utcnow() - timedelta(days=minute_days)
            for d in days:
                if d not in old and ended_before(d, minutes_cutoff) and self._has_minutes(d):
                    self._rebuild_day(d, f"res > {rollups.MINUTE}")
        for t in schema.ROLLUP_TABLES:
            self._con.execute(f"DROP VIEW IF EXISTS {quote(t.name)}")
        for d in old:
            for t in schema.ROLLUP_TABLES:
                self._con.execute(f"DROP TABLE IF EXISTS {quote(schema.day_table(t, d))}")
        self._con.execute(
            "DELETE FROM rollup_compacted WHERE day < ?",
            [datetime.combine(cutoff.date(), datetime.min.time())],
        )
        self._create_rollup_views()
        return [d.isoformat() for d in old]

    # ------------------------------------------------------------------------------ reading

    def rollup_top(
        self,
        start: datetime | None,
        by: tuple[str, ...],
        kind: str | None,
        minutes: float | None,
        *,
        force: bool = False,
        only: dict[str, str] | None = None,
        percentiles_for: str | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """``top`` from rollups over [start, now) (start None: all), with what answered; None
        when raw rows should answer (:func:`rollups.choose`), or when the window's raw rows
        are all kept and few (RAW_MAX_REQUESTS), unless ``force``. The same steps on every
        engine (:func:`rollups.top_from`); what differs is read by :meth:`_rollup_inputs`,
        :meth:`_rollup_sources`, :meth:`_rollup_coded` and :meth:`_rollup_minutes`."""
        days, raw_first, has_minutes = self._rollup_inputs()
        choice = rollups.choose(start, by, days, raw_first, has_minutes, utcnow(), force=force)
        if choice is None:
            return None
        cond, cond_params = "true", []
        if kind is not None:
            cond += " AND kind = ?"
            cond_params.append(kind)
        only_sql, only_params = only_where(only)  # the fleet filters: rollups are keyed by them
        cond += f" AND {only_sql}"
        cond_params.extend(only_params)
        stats, hist, where, params = self._rollup_sources(choice, days, cond, cond_params)
        lo = choice.lo

        def minutes_read() -> float:
            if minutes is not None:
                return minutes
            return self._rollup_minutes(days, lo, cond, cond_params)

        return rollups.top_from(
            choice,
            stats,
            hist,
            by,
            where,
            params,
            percentiles_for,
            execute=self._con.execute,
            rows=self._rows,
            coded=lambda keys: self._rollup_coded(hist, where, params, keys),
            minutes=minutes_read,
        )

    def _rollup_inputs(self) -> tuple[list[date], date | None, Callable[[date], bool]]:
        """What :func:`rollups.choose` decides on: the days holding rollups (sorted), the
        first day of raw requests (None: none) and whether a day's rollups hold minutes."""
        have = self._day_tables()
        raw_days = self._days()
        days = sorted(have["rollup_stats"] & have["rollup_hist"])
        return days, raw_days[0] if raw_days else None, self._has_minutes

    def _rollup_sources(
        self, choice: rollups.Choice, days: list[date], cond: str, params: list[Any]
    ) -> tuple[str, str, str, list[Any]]:
        """The stats and histogram rows of ``choice``'s spans (FROM-able SQL) and the
        condition (with its parameters) that keeps those ``cond`` selects: here the spans'
        day tables, each cut to its span (:meth:`_span_source`)."""
        stats = self._span_source(schema.ROLLUP_STATS, choice.spans, days)
        hist = self._span_source(schema.ROLLUP_HIST, choice.spans, days)
        return stats, hist, cond, params

    def _rollup_coded(
        self, hist: str, where: str, params: list[Any], keys: list[Any]
    ) -> pa.Table | None:
        """:func:`rollups.coded_hist_query`'s rows of ``hist`` for the endpoints ``keys``
        (None: the engine cannot code them; top_sql's GROUP BY answers)."""
        return self.query_arrow(*rollups.coded_hist_query(hist, where, params, keys))

    def _rollup_minutes(
        self, days: list[date], lo: datetime, cond: str, params: list[Any]
    ) -> float:
        """Minutes from the first to the last period of the requests ``cond`` selects from
        ``lo`` on, plus one (:meth:`_finest_span`)."""
        return self._finest_span(days, lo, cond, params).total_seconds() / 60 + 1

    def _finest_span(
        self, days: list[date], lo: datetime, where: str, params: list[Any]
    ) -> timedelta:
        """From the first to the last minute (or hour, where retention left hours) of the
        requests ``where`` selects from ``lo`` on: read from the finest rows of the first and
        the last day holding any (a day row's ts is its midnight, not its first request)."""

        def finest(d: date, edge: str) -> datetime | None:
            name = quote(schema.day_table(schema.ROLLUP_STATS, d))
            r = self._con.execute(
                f"SELECT {edge}(ts) FROM {name} WHERE ts >= ? AND {where} "
                "GROUP BY res ORDER BY res LIMIT 1",
                [lo, *params],
            ).fetchone()
            return r[0] if r else None

        in_window = [d for d in days if d >= lo.date()]
        first = next((t for d in in_window if (t := finest(d, "min")) is not None), None)
        last = next((t for d in reversed(in_window) if (t := finest(d, "max")) is not None), None)
        if first is None or last is None:
            return timedelta(0)
        return max(last - first, timedelta(0))

    @staticmethod
    def _span_source(t: schema.Table, spans: list[rollups.Span], days: list[date]) -> str:
        """FROM-able SQL over the rows of ``spans``: per span, the day tables it touches, each
        with a plain ``res`` and ``ts`` range (a day table is sorted by res, so its zone maps
        skip the other resolutions; one OR of the spans over the view scanned every row)."""
        have = set(days)
        selects = []
        # only what top reads: the histogram's ts and res are not
        keep = [c for c in t.column_names if t is not schema.ROLLUP_HIST or c not in ("ts", "res")]
        cols = ", ".join(quote(c) for c in keep)
        for sp in spans:
            d, last = sp.lo.date(), (sp.hi - timedelta(microseconds=1)).date()
            while d <= last:
                if d in have:
                    selects.append(
                        f"SELECT {cols} FROM {quote(schema.day_table(t, d))}"
                        f" WHERE res = {int(sp.res)}"
                        f" AND ts >= TIMESTAMP '{sp.lo.isoformat(sep=' ')}'"
                        f" AND ts < TIMESTAMP '{sp.hi.isoformat(sep=' ')}'"
                    )
                d += timedelta(days=1)
        if not selects:
            return f"(SELECT {cols} FROM ({schema.duckdb_empty(t)}))"
        return "(" + " UNION ALL ".join(selects) + ")"

    def query_arrow(self, sql: str, params: Sequence[Any] = ()) -> pa.Table:
        """The rows of a query as an Arrow table: for the many rows numpy sums (rollup
        histograms), where a dict per row would cost more than the query."""
        return self._con.sql(sql, params=list(params)).to_arrow_table()

    def _rows(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        cur = self._con.execute(sql, list(params))
        cols = [d[0] for d in cur.description or ()]
        return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]
