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

Exactly-once, without a transaction: a batch's requests are inserted first, then the rollups
of those new in this attempt, with a deduplication token made of their day, trace ids and
times (the same requests make the same token whatever batch or payload brought them; a trace
id reused later is another request, rolled up again). A later attempt
that finds some of its requests already stored (a crash or a failed insert between the two
inserts: the spool re-read, an OTLP group committed again payload by payload, an exporter's
retry) writes their rollups too where they are missing: per rollup table and minute key
(service, host, kind, endpoint, minute), when that table's minute rows count at least as many
requests fewer than the requests table holds (with a duration, for ``rollup_hist``) as this
batch found stored there, asked before this attempt's own requests go in
(:meth:`_missing_rollups`). They go in with the new requests' rollups under one token (of all
their requests), so the same attempt repeated is dropped by the server. Not covered (README,
ClickHouse): another writer's requests of the same minute key stored with their rollups not
yet written when this check runs (this batch's stored requests are then rolled up again);
requests whose rollups failed and that no later attempt brings again (they stay without
rollups: an OTLP exporter that gives up); a minute key missing fewer requests than this batch
found stored there (left as it is).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import date, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import rollups, schema
from perfsleuth.store.duckdb_reader import DuckDBReader
from perfsleuth.store.tables import Tables

# Characters of the coded histogram statement's literals (and its inner SELECT) up to
# which top by endpoint codes the rows with transform(): ClickHouse refuses a statement over
# max_query_size (256 KiB by default); longer lists read the GROUP BY statement.
CODED_LITERAL_BYTES = 100_000


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
    # its top-N of traces(slowest=n) reads the sort column first by itself: 30 days, 30M
    # requests, one endpoint's 20 slowest 0.13 s CPU, 0.21 s with DuckDB's two steps
    _slowest_in_two_steps = False

    def _q(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:  # pragma: no cover
        raise NotImplementedError

    # ------------------------------------------------------------------------------ writing

    def _missing_rollups_ch(
        self, stored: dict[date, pa.Table]
    ) -> dict[tuple[date, str], pa.Table | None]:
        """Per (day, rollup table), the requests of ``stored`` (the batch's requests a previous
        attempt stored) whose rows in that table are missing: asked before this attempt
        inserts its own requests (:meth:`_missing_rollups`)."""
        return {
            (d, t.name): self._missing_rollups(d, req, t.name)
            for d, req in stored.items()
            for t in schema.ROLLUP_TABLES
        }

    def _insert_rollups_ch(
        self,
        tables: Tables,
        missing: dict[tuple[date, str], pa.Table | None],
        insert: Callable[[str, pa.Table | None, str, str], None],
    ) -> None:
        """Insert the rollups of the batch's new requests (``tables``, after those stored were
        left out) and of the stored ones whose rollups are ``missing``
        (:meth:`_missing_rollups_ch`): one insert per table and day, with a token of the day
        and the requests rolled up (``insert``'s last argument; :func:`_request_ids`)."""
        for d in sorted(set(tables.days) | {d for d, _ in missing}):
            new = tables.days.get(d, {}).get("requests")
            made: dict[tuple[str, ...], tuple[str, dict[str, pa.Table]]] = {}
            for t in schema.ROLLUP_TABLES:
                parts = [new, missing.get((d, t.name))]
                req = [
                    p.drop_columns(["rid"]) if "rid" in p.column_names else p
                    for p in parts
                    if p is not None and p.num_rows
                ]
                if not req:
                    continue
                rows = pa.concat_tables(req, promote_options="permissive")
                ids = _request_ids(rows)
                if ids not in made:  # the same requests for both tables: rolled up once
                    text = f"{d}|{len(ids)}|{','.join(ids)}"
                    token = "r" + hashlib.sha256(text.encode()).hexdigest()[:32]
                    made[ids] = token, rollups.rollups_of({d: {"requests": rows}}).get(d, {})
                token, tbls = made[ids]
                insert(t.name, tbls.get(t.name), f"-{d:%Y%m%d}", token)

    def _missing_rollups(self, d: date, req: pa.Table | None, table: str) -> pa.Table | None:
        """Of ``req`` (requests of day ``d`` found stored), those whose rows in rollup table
        ``table`` are missing: the requests of each minute key (service, host, kind,
        endpoint, minute) where the table's minute rows count at least as many fewer requests
        than the requests table holds (with a duration, for ``rollup_hist``) as ``req`` has
        there (rollups are written after their requests, so a previous attempt whose rollup
        insert failed left that many out)."""
        if req is None or not req.num_rows:
            return None
        dims = ("service", "host", "kind", "endpoint")
        hist = table == "rollup_hist"
        minute = pc.divide(pc.cast(req["ts"], pa.int64()), 60_000_000).to_pylist()
        cols = [req[c].to_pylist() for c in dims]
        keys = [(m * 60, *k) for m, *k in zip(minute, *cols, strict=True)]
        timed = req["duration_ms"].is_valid().to_pylist() if hist else [True] * len(keys)
        ours: dict[tuple[Any, ...], int] = {}
        for k, counted in zip(keys, timed, strict=True):
            ours[k] = ours.get(k, 0) + int(bool(counted))
        lo = datetime(1970, 1, 1) + timedelta(seconds=min(k[0] for k in keys))
        hi = datetime(1970, 1, 1) + timedelta(seconds=max(k[0] for k in keys) + 60)
        span = f"ts >= {_lit(lo)} AND ts < {_lit(hi)}"
        group = ", ".join(schema.quote(c) for c in dims)
        n = "countIf(duration_ms IS NOT NULL)" if hist else "count()"
        raw = self._q(
            f"SELECT toUnixTimestamp(toStartOfMinute(ts)) AS m, {group}, {n} "
            f"FROM {self._tbl('requests')} WHERE toDate(ts) = {_lit(d)} AND {span} "
            f"GROUP BY m, {group}"
        )
        rolled = self._q(
            f"SELECT toUnixTimestamp(ts) AS m, {group}, sum(requests) "
            f"FROM {self._tbl(table)} WHERE res = {rollups.MINUTE} AND {span} "
            f"GROUP BY m, {group}"
        )
        have = {tuple(r[:-1]): int(r[-1]) for r in rolled}
        short = {tuple(r[:-1]): int(r[-1]) - have.get(tuple(r[:-1]), 0) for r in raw}
        missing = {k for k, c in ours.items() if short.get(k, 0) >= c}
        if not missing:
            return None
        return req.filter(pa.array([k in missing for k in keys], pa.bool_()))

    def _tbl(self, name: str) -> str:
        return f"{schema.quote(self.database)}.{schema.quote(name)}"

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

    def _rollup_inputs(self) -> tuple[list[date], date | None, Callable[[date], bool]]:
        """See :meth:`DuckDBRollups._rollup_inputs` (from the tables' partitions)."""
        days, minute_days, raw_first = self._rollup_days()
        return days, raw_first, minute_days.__contains__

    def _rollup_sources(
        self, choice: rollups.Choice, days: list[date], cond: str, params: list[Any]
    ) -> tuple[str, str, str, list[Any]]:
        """See :meth:`DuckDBRollups._rollup_sources`: here the logical tables, the spans in
        the condition (:func:`rollups.span_where`)."""
        span_sql, span_params = rollups.span_where(choice.spans)
        return "rollup_stats", "rollup_hist", f"{span_sql} AND {cond}", [*span_params, *params]

    def _rollup_coded(
        self, hist: str, where: str, params: list[Any], keys: list[Any]
    ) -> pa.Table | None:
        """rollups.coded_hist_query's rows for the endpoints ``keys``, each coded by
        ``transform`` (a hash look-up); None when the keys' literals would pass
        CODED_LITERAL_BYTES (the statement must stay under max_query_size). 30 days of 300
        endpoints after retention, CPU median of 8 paired: GROUP BY endpoint, bucket 0.39 s,
        this and numpy 0.31 s, coded and grouped by ClickHouse 0.36 s; the portable LEFT JOIN
        of the keys' VALUES (300 UNION ALL selects here) 0.72 s."""
        from perfsleuth.store.clickhouse_dialect import to_clickhouse

        inner = to_clickhouse(
            f"SELECT endpoint, bucket, requests FROM {hist} WHERE {where}",
            params,
            self.database,
        )
        named = [(_lit(k), i) for i, k in enumerate(keys) if k is not None]
        values = "[" + ", ".join(v for v, _ in named) + "]"
        codes = "[" + ", ".join(str(i) for _, i in named) + "]"
        if len(values) + len(codes) + len(inner) > CODED_LITERAL_BYTES:
            return None
        # a NULL endpoint is coded len(keys) (or NULL): coded_hist_rows reads it as the NULL key
        return self._arrow_ch(
            f"SELECT transform(endpoint, {values}, {codes}, {len(keys)}) AS code, bucket, "
            f"requests FROM ({inner})"
        )

    def _rollup_minutes(
        self, days: list[date], lo: datetime, cond: str, params: list[Any]
    ) -> float:
        """See :meth:`DuckDBRollups._rollup_minutes` (:meth:`_finest_minutes`)."""
        return self._finest_minutes(lo, cond, params)

    def _arrow_ch(self, sql: str) -> pa.Table:  # pragma: no cover
        """Rows of ClickHouse SQL as Arrow (ClickHouseStore)."""
        raise NotImplementedError

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


def _request_ids(req: pa.Table) -> tuple[str, ...]:
    """The requests of ``req``, sorted, for a rollup insert's deduplication token: each its
    trace id and ts (microseconds), as the copy rule tells requests apart
    (tables.copied_requests): a trace id reused later in the day is another request, whose
    rollups the server must not take for the first one's."""
    us = req["ts"].cast(pa.timestamp("us")).cast(pa.int64()).to_pylist()
    return tuple(sorted(f"{i}@{t}" for i, t in zip(req["trace_id"].to_pylist(), us, strict=True)))
