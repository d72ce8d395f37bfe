"""Rollups in the ClickHouse store (see :mod:`perfsleuth.store.rollups`): the same rows as
DuckDB's (``rollups_of`` of each batch's new requests), in the logical tables ``rollup_stats``
and ``rollup_hist``, read by ``top`` and the API pages for windows where raw rows would be slow
or are gone.

Layout (:func:`perfsleuth.store.schema.clickhouse_create`): AggregatingMergeTree sorted by the
whole key (resolution, service, endpoint, period, [bucket,] host, kind), each value a
``SimpleAggregateFunction`` (sum; max for ``max_ms``), so ClickHouse's background merges do
what DuckDB's compaction does (rows of equal key summed) and readers sum whatever is not merged
yet; partitioned by (day, resolution), so retention drops a day's minute rows once raw rows are
gone (default 7 days) and the whole day after ROLLUP_DAYS (90), as partitions, never as
row-by-row DELETE.

Exactly-once: a batch's rollups are made from its requests after those already stored were
left out, and inserted just before the requests with the batch's deduplication token (table,
day): a re-run of the same ranges after a crash between the two inserts is dropped by the
server. Not covered: a crash between the rollups' insert and the requests', then a re-run
over a segment that grew meanwhile (another token): those requests are rolled up twice.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, datetime, timedelta
from typing import Any

import pyarrow as pa

from perfsleuth.store import rollups, schema
from perfsleuth.store.duckdb_file import utcnow
from perfsleuth.store.duckdb_reader import DuckDBReader
from perfsleuth.store.filters import only_where
from perfsleuth.store.tables import Tables

ROLLUP_GROUPS = ("endpoint", "service", "host", "kind")
# top() reads rollups when the window holds more requests than this, or starts before the
# raw rows kept (as on DuckDB: duckdb_rollups.RAW_MAX_REQUESTS).
RAW_MAX_REQUESTS = 5_000_000


def partition_day(partition: str) -> tuple[date, int | None]:
    """(day, res) of a partition id as system.parts writes it: ``2026-11-20`` (event tables)
    or ``('2026-11-20',60)`` (rollup tables)."""
    p = partition.strip("()")
    if "," in p:
        d, res = p.split(",", 1)
        return date.fromisoformat(d.strip().strip("'")), int(res)
    return date.fromisoformat(p.strip("'")), None


class ClickHouseRollups(DuckDBReader):
    """Writing and reading the rollups on ClickHouse; mixed into ClickHouseStore, which gives
    ``_q``, ``_client``, ``cluster`` and ``database``."""

    cluster: str | None
    database: str

    def _q(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:  # pragma: no cover
        raise NotImplementedError

    # ------------------------------------------------------------------------------ writing

    def _insert_rollups_ch(
        self, tables: Tables, insert: Callable[[str, pa.Table | None, str], None]
    ) -> None:
        """Insert the rollups of the batch's (new) requests, one insert per table and day,
        each with the batch's token (``insert``)."""
        for d, parts in sorted(rollups.rollups_of(tables.days).items()):
            for t in schema.ROLLUP_TABLES:
                insert(t.name, parts[t.name], f"-{d:%Y%m%d}")

    # ---------------------------------------------------------------------------- partitions

    def _parts(self, names: list[str]) -> list[tuple[str, str]]:
        """(table, partition) of the active parts of tables ``names`` (every node's on a
        cluster: a node's system.parts lists its own shard's)."""
        source = (
            f"clusterAllReplicas({_lit(self.cluster)}, system.parts)"
            if self.cluster
            else "system.parts"
        )
        return [
            (str(r[0]), str(r[1]))
            for r in self._q(
                f"SELECT DISTINCT table, partition FROM {source} WHERE database = ? AND active "
                "AND has(?, table)",
                [self.database, names],
            )
        ]

    def _local(self, name: str) -> str:
        return f"{name}_local" if self.cluster else name

    def _rollup_days(self) -> tuple[list[date], set[date], date | None]:
        """The days holding rollups, those of them still holding minute rows, and the first
        day of raw requests (None: none)."""
        stats, reqs = self._local("rollup_stats"), self._local("requests")
        days: set[date] = set()
        minutes: set[date] = set()
        raw: list[date] = []
        for table, p in self._parts([stats, reqs]):
            d, res = partition_day(p)
            if table == reqs:
                raw.append(d)
            else:
                days.add(d)
                if res == rollups.MINUTE:
                    minutes.add(d)
        return sorted(days), minutes, min(raw) if raw else None

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
    ) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """``top`` from rollups over [start, now), as on DuckDB
        (:meth:`DuckDBRollups.rollup_top`): None when raw rows should answer."""
        if any(b not in ROLLUP_GROUPS for b in by):
            return None
        days, minute_days, raw_first = self._rollup_days()
        if not days:
            return None
        end = utcnow() + timedelta(minutes=1)
        first = datetime.combine(days[0], datetime.min.time())
        lo = max(start, first) if start is not None else first
        if lo.date() not in minute_days:  # retention left hours: start at a whole hour
            lo = rollups.ceil_to(lo, rollups.HOUR)
        spans = rollups.plan(lo, end)
        span_sql, span_params = rollups.span_where(spans)
        cond, cond_params = "true", []
        if kind is not None:
            cond += " AND kind = ?"
            cond_params.append(kind)
        only_sql, only_params = only_where(only)  # the fleet filters: rollups are keyed by them
        cond += f" AND {only_sql}"
        cond_params.extend(only_params)
        where, params = f"{span_sql} AND {cond}", [*span_params, *cond_params]
        in_window = [d for d in days if d >= lo.date()]
        raw_complete = not in_window or (raw_first is not None and raw_first <= in_window[0])
        if not force and raw_complete:
            n = self._con.execute(
                f"SELECT coalesce(sum(requests), 0) FROM rollup_stats WHERE {where}", params
            ).fetchone()
            if n is None or int(n[0]) <= RAW_MAX_REQUESTS:
                return None
        stats_sql, hist_sql = rollups.top_sql("rollup_stats", "rollup_hist", by, where)
        stats = self._rows(stats_sql, params)
        hist = self._rows(hist_sql, params)
        answer = self._rollup_answer(spans)
        if not stats:
            return [], answer
        if minutes is None:
            minutes = self._finest_minutes(lo, cond, cond_params)
        return rollups.top_rows(stats, hist, by, max(minutes, 1.0)), answer

    def _finest_minutes(self, lo: datetime, where: str, params: list[Any]) -> float:
        """Minutes from the first to the last period of the requests ``where`` selects from
        ``lo`` on, plus one: of the minute rows, or of the hour (day) rows where those begin
        an hour (a day) earlier (retention dropped their minutes)."""
        rows = self._rows(
            f"SELECT res, min(ts) AS a, max(ts) AS b FROM rollup_stats WHERE ts >= ? "
            f"AND {where} GROUP BY res ORDER BY res",
            [lo, *params],
        )
        if not rows:
            return 1.0
        first = rows[0]["a"]
        last = rows[0]["b"]
        for r in rows[1:]:  # a coarser row before the finest rows: their minutes are gone
            if r["a"] < first - timedelta(seconds=int(r["res"])):
                first = r["a"]
        return max((last - first).total_seconds(), 0.0) / 60 + 1


def _lit(v: Any) -> str:
    from perfsleuth.store.clickhouse_dialect import literal

    return str(literal(v).sql(dialect="clickhouse"))
