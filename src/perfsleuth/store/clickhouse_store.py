"""The ClickHouse store: the same logical schema (:mod:`perfsleuth.store.schema`) in MergeTree
tables of a ClickHouse server (``clickhouse://host:8123/db``) or of chDB in this process
(``chdb:///dir``), behind the store interface (:class:`perfsleuth.store.base.Store`).

Reading: the reader's queries are the DuckDB engine's own (:class:`DuckDBReader`), written once
in DuckDB's dialect; they reach ClickHouse through :class:`_Connection`, which transpiles each
(:mod:`perfsleuth.store.clickhouse_dialect`). What differs in layout is overridden here: one
table per logical table (no day tables), and a console that speaks ClickHouse's SQL.

Writing, exactly once (:class:`perfsleuth.store.ingest.IngestTarget`): ClickHouse has no
transaction over several inserts, so a batch is committed as

1. requests, calls and attributes of requests already stored in that same table are left
   out (the same trace id within a minute, each request judged on its own:
   :func:`perfsleuth.store.tables.copied_requests`; ``trace_id IN (...)`` per table and
   day, the ids sent with the query in chunks, helped by a bloom index), and so are the
   samples, blockers, GC pauses and agent counters already stored (tables.ROW_KEYS): a
   re-run after a crash between two inserts adds only what is missing, even when the
   segment has grown since;
2. every insert carries a deduplication token made of the table, the day and the segment
   ranges of the batch: a re-run of the same ranges (the usual case) is dropped by the
   server for the tables without trace ids (samples, gc pauses, agent counters);
3. the dictionary tables (fingerprints, locations, stacks, captures) get only ids not yet
   stored (ReplacingMergeTree merges any left-over duplicates);
4. requests go after the other event tables, then their rollups
   (:mod:`perfsleuth.store.clickhouse_rollups`), and the segments' offsets last: offsets are
   read back (``FINAL``) before the next batch, so a batch whose offsets were not written is
   read again and steps 1-2 keep it from doubling.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from datetime import date, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import rollups, schema, spool
from perfsleuth.store.base import IngestReport, Progress, StoreError
from perfsleuth.store.clickhouse_client import Client, connect
from perfsleuth.store.clickhouse_dialect import literal, read_only_clickhouse, to_clickhouse
from perfsleuth.store.clickhouse_rollups import ClickHouseRollups, partition_day
from perfsleuth.store.duckdb_file import utcnow
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
    of_copies,
    offsets_table,
    request_keys,
    ts_spans,
)

__all__ = ["ClickHouseStore"]

_QUALIFIED = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\.[A-Za-z_][A-Za-z_0-9]*")

# Tables whose rows all come with their request: a request already in one is not added again.
_PER_TRACE = ("requests", "calls", "attributes")
# Values per ``IN (...)`` literal: a query stays well under max_query_size (256 KiB).
_IN_CHUNK = 4_000


def _chunks(values: list[Any], n: int = _IN_CHUNK) -> Iterable[str]:
    """``values`` as ClickHouse ``(v1, v2, ...)`` lists of at most ``n`` each (strings and
    integers written here: SQLGlot's literals cost ~10x more for lists of thousands)."""
    for i in range(0, len(values), n):
        yield "(" + ", ".join(_value(v) for v in values[i : i + n]) + ")"


def _value(v: Any) -> str:
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return str(literal(v).sql(dialect="clickhouse"))


def _rows(parts: dict[str, pa.Table], name: str) -> int:
    t = parts.get(name)
    return 0 if t is None else t.num_rows


def _concat(tables: list[pa.Table]) -> pa.Table:
    """``tables`` (of one query's columns) as one table; no tables: none of the rows."""
    if not tables:
        return pa.table({"trace_id": pa.array([], pa.string()), "ts": pa.array([], pa.int64())})
    return pa.concat_tables(tables, promote_options="permissive")


class _Cursor:
    """The part of a DuckDB cursor the reader uses, over rows already fetched."""

    def __init__(self, table: pa.Table) -> None:
        # ClickHouse names a join's USING column under ``t.*`` "t.endpoint"; DuckDB "endpoint"
        names = table.column_names
        self.description = [
            (
                n.rpartition(".")[2]
                if _QUALIFIED.fullmatch(n) and n.rpartition(".")[2] not in names
                else n,
            )
            for n in names
        ]
        cols = [c.to_pylist() for c in table.columns]
        self._rows = list(zip(*cols, strict=True)) if cols else []
        self._at = 0

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self._at = self._rows[self._at :], len(self._rows)
        return rows

    def fetchone(self) -> tuple[Any, ...] | None:
        if self._at >= len(self._rows):
            return None
        self._at += 1
        return self._rows[self._at - 1]

    def fetchmany(self, n: int) -> list[tuple[Any, ...]]:
        rows = self._rows[self._at : self._at + n]
        self._at += len(rows)
        return rows


class _Connection:
    """``execute(sql, params)`` in DuckDB's dialect, run on ClickHouse: the tables of the
    logical schema are found in the store's database."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def execute(self, sql: str, params: Sequence[Any] = ()) -> _Cursor:
        text = to_clickhouse(sql, params, self.client.database)
        return _Cursor(self.client.query_arrow(text))

    def close(self) -> None:
        self.client.close()


class ClickHouseStore(ClickHouseRollups):
    """The store on ClickHouse or chDB (see the module docstring); the spool stays in
    ``data_dir``."""

    engine = "clickhouse"
    # Requests per insert: ClickHouse advises 10k-100k rows per insert, ~one per second.
    batch_requests = 50_000
    batch_bytes = 256 * 1024 * 1024
    open_idle_seconds = 60.0

    def __init__(self, data_dir: str, url: str, read_only: bool = False) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.spool_dir = os.path.join(self.data_dir, "spool")
        self.corrupt_dir = os.path.join(self.spool_dir, "corrupt")
        self.agents_dir = os.path.join(self.data_dir, "agents")
        self.read_only = read_only
        self.url = url
        q = parse_qs(urlparse(url).query)
        self.cluster = q.get("cluster", [None])[0]
        self.replicated = q.get("replicated", ["0"])[0] in ("1", "true", "yes")
        ttl = q.get("ttl_days", [None])[0]
        self.ttl_days = int(ttl) if ttl else None
        os.makedirs(self.data_dir, exist_ok=True)
        self._client = connect(url)
        self.path = self._client.where
        self.database = self._client.database
        self._con = _Connection(self._client)  # type: ignore[assignment]
        if read_only:  # a read-only user may not create anything: the tables are there
            return
        try:
            self._create_schema()
        except BaseException:
            self._client.close()
            raise

    # ------------------------------------------------------------------ schema and layout

    def _create_schema(self) -> None:
        for stmt in schema.clickhouse_ddl(
            database=self.database,
            cluster=self.cluster,
            replicated=self.replicated,
            ttl_days=self.ttl_days,
        ):
            self._client.command(stmt)

    def _t(self, name: str) -> str:
        """A table of the store's database, quoted."""
        return f"{quote(self.database)}.{quote(name)}"

    def query_arrow(self, sql: str, params: Sequence[Any] = ()) -> pa.Table:
        """:meth:`DuckDBReader.query_arrow` on ClickHouse (the query transpiled)."""
        return self._client.query_arrow(to_clickhouse(sql, params, self.database))

    def _arrow_ch(self, sql: str) -> pa.Table:
        return self._client.query_arrow(sql)

    def _q(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of ClickHouse SQL (already in its dialect) with ``?`` parameters (without
        parameters, ``sql`` is run as it is)."""
        if not params:
            return _Cursor(self._client.query_arrow(sql)).fetchall()
        parts = sql.split("?")
        if len(parts) - 1 != len(params):
            raise ValueError("parameter count mismatch")
        text = parts[0] + "".join(
            literal(p).sql(dialect="clickhouse") + rest
            for p, rest in zip(params, parts[1:], strict=True)
        )
        return _Cursor(self._client.query_arrow(text)).fetchall()

    def _days(self) -> list[date]:
        return []  # no day tables: the reader reads the logical tables

    def _table_names(self) -> set[str]:
        return set(schema.TABLES)

    def _create_views(self, days: list[date], *, temp: bool = False) -> None:
        pass

    def _source(self, since: timedelta | None) -> tuple[str, datetime | None]:
        return "requests", None if since is None else utcnow() - since

    def _raw_top_rows(
        self,
        src: str,
        where: str,
        params: list[Any],
        by: tuple[str, ...],
        percentiles_for: str | None,
        span: bool,
    ) -> list[dict[str, Any]]:
        """:meth:`DuckDBReader._raw_top_rows`, aggregated in the table's order when ``by``
        holds only service and endpoint (the sort key begins with them): each part's rows
        come grouped, and the aggregates run over each group's run of rows instead of a
        hash look-up a row (``optimize_aggregation_in_order``). By endpoint alone, the
        groups are (service, endpoint), added up here; an endpoint of several services has
        its exact quantiles counted again, over its rows alone. 7 days of 300 endpoints,
        23M rows (``benchmarks/scale.py --engine chdb``): see benchmarks/README.md."""
        if src != "requests" or not set(by) <= {"service", "endpoint"}:
            return super()._raw_top_rows(src, where, params, by, percentiles_for, span)
        grouped = "service" if set(by) == {"service"} else "service, endpoint"
        inner = to_clickhouse(
            "SELECT service, endpoint, ts, duration_ms, status, error, db_calls, http_calls, "
            f"cache_calls, db_ms, http_ms, cache_ms, gc_ms FROM requests WHERE {where}",
            params,
            self.database,
        )
        q_if = "" if percentiles_for is None else "If"
        q_arg = "" if percentiles_for is None else f", endpoint = {_value(percentiles_for)}"
        groups = self._arrow_ch(
            f"SELECT {grouped}, count() AS count, "
            f"quantilesExactInclusive{q_if}(0.5, 0.95, 0.99)(duration_ms{q_arg}) AS q, "
            "max(duration_ms) AS max_ms, countIf(status >= 500 OR error IS NOT NULL) AS errors, "
            "sum(db_calls) AS db_calls, sum(http_calls) AS http_calls, "
            "sum(cache_calls) AS cache_calls, sum(db_ms) AS db_ms, sum(http_ms) AS http_ms, "
            "sum(cache_ms) AS cache_ms, sum(gc_ms) AS gc_ms, sum(duration_ms) AS total_ms"
            + (", min(ts) AS first_ts, max(ts) AS last_ts" if span else "")
            + f" FROM ({inner}) GROUP BY {grouped}"
            " SETTINGS optimize_aggregation_in_order = 1"
        ).to_pylist()
        merged: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in groups:
            key = tuple(r[b] for b in by)
            m = merged.get(key)
            if m is None:
                merged[key] = {**r, "groups": 1}
                continue
            m["groups"] += 1
            for k in ("count", "errors", "db_calls", "http_calls", "cache_calls"):
                m[k] += r[k]
            for k in ("db_ms", "http_ms", "cache_ms", "gc_ms", "total_ms"):
                m[k] = r[k] if m[k] is None else m[k] if r[k] is None else m[k] + r[k]
            for k, pick in (("max_ms", max), ("first_ts", min), ("last_ts", max)):
                if k in r:
                    m[k] = r[k] if m[k] is None else m[k] if r[k] is None else pick(m[k], r[k])
        # by endpoint: an endpoint of several services, its quantiles over all its rows
        again = [k[0] for k, m in merged.items() if m["groups"] > 1]
        for chunk in _chunks(again):
            for r in self._arrow_ch(
                f"SELECT endpoint, quantilesExactInclusive{q_if}(0.5, 0.95, 0.99)"
                f"(duration_ms{q_arg}) AS q FROM ({inner}) WHERE endpoint IN {chunk} "
                "GROUP BY endpoint"
            ).to_pylist():
                merged[(r["endpoint"],)]["q"] = r["q"]
        rows = list(merged.values())
        for r in rows:
            r["error_rate"] = r["errors"] / r["count"]
            r["gc_ms"] = r["gc_ms"] or 0.0
            r["total_ms"] = r["total_ms"] or 0.0
            if percentiles_for is not None and r.get("endpoint") != percentiles_for:
                r["q"] = None
        # the portable query's order: total_ms DESC, count DESC, then the groups' values
        rows.sort(
            key=lambda r: (
                -r["total_ms"],
                -r["count"],
                *((r[b] is None, r[b] or "") for b in by),
            )
        )
        return rows

    def _count(self, table: str, day: date, trace_id: str) -> int:
        rows = self._q(
            f"SELECT count() FROM {self._t(table)} WHERE toDate(ts) = ? AND trace_id = ?",
            [day, trace_id],
        )
        return int(rows[0][0]) if rows else 0

    def sql(
        self,
        query: str,
        limit: int = 10_000,
        time_limit: float | None = None,
        max_bytes: int | None = None,
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One SELECT in ClickHouse's SQL over the store's tables (no table functions; run with
        ``readonly = 2``: the server refuses any write); at most ``limit`` rows, the server
        stopping once it has them (``max_result_rows``, ``result_overflow_mode = 'break'``);
        stopped past ``time_limit`` seconds (the engine's TIMEOUT_EXCEEDED). The server also
        stops past 8x ``max_bytes`` (64 MiB without) of result in its own format: a row takes
        at least a quarter as many bytes as JSON as in ClickHouse's columns, so the caller's
        cap on JSON bytes is reached first."""
        try:
            text = read_only_clickhouse(query, self.database)
        except ValueError as e:
            raise StoreError(str(e)) from e
        limit = max(0, int(limit))
        settings = (
            f"readonly = 2, max_result_rows = {max(1, limit)}, "
            f"max_result_bytes = {8 * max_bytes if max_bytes else 64 * 1024 * 1024}, "
            "result_overflow_mode = 'break'"
        )
        if time_limit:
            settings += f", max_execution_time = {float(time_limit):g}"
        table = self._client.query_arrow(f"{text}\nSETTINGS {settings}")
        # 'break' stops at a block's end: more rows than asked may come back
        cur = _Cursor(table.slice(0, limit))
        return [d[0] for d in cur.description], cur.fetchall()

    def close(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()
            self._client = None  # type: ignore[assignment]

    def __enter__(self) -> ClickHouseStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"the store was opened read-only; {what} needs a writable store")

    # ------------------------------------------------------------------------ writing

    def ingest(self, progress: Progress | None = None) -> IngestReport:
        """Ingest everything new in the spool (see :mod:`perfsleuth.store.ingest`)."""
        self._writable("ingest")
        limits = Limits(self.batch_requests, self.batch_bytes, self.open_idle_seconds)
        return ingest_spool(self, self.spool_dir, limits, progress)

    def insert_tables(self, batch: Batch, tables: Tables) -> None:
        self._writable("ingest")
        self.commit(batch, tables)

    def committed_offsets(self) -> dict[str, Offset]:
        rows = self._q(
            'SELECT segment, "offset", closed, damaged, service, host, pid, version'
            f" FROM {self._t('ingest_offsets')} FINAL"
        )
        return {r[0]: Offset(*r[1:]) for r in rows}

    def internal_fingerprint_ids(self) -> Iterable[int]:
        return [
            r[0]
            for r in self._q(f"SELECT id FROM {self._t('fingerprints')} WHERE kind = 'db.internal'")
        ]

    def commit(self, batch: Batch, tables: Tables) -> None:
        """See the module docstring: one batch, exactly once, without a transaction."""
        # The batch's segments and where it ends in each: the same batch read again after a
        # crash has the same token, so the server drops its inserts that had landed.
        ranges = ";".join(f"{s.base}:{s.offset}:{s.final}" for s in batch.segments)
        token = hashlib.sha256(ranges.encode()).hexdigest()[:32]

        def insert(name: str, data: pa.Table | None, part: str = "", own: str = "") -> None:
            if data is None or data.num_rows == 0:
                return
            if "rid" in data.column_names:  # DuckDB's request numbers (store.tables)
                data = data.drop_columns(["rid"])
            settings: dict[str, Any] = {
                "insert_deduplicate": 1,
                "insert_deduplication_token": f"{own or token}-{name}{part}",
            }
            if not batch.segments and not own:
                # no spool ranges (an OTLP payload): every such batch would have the same
                # token and the server would drop all but the first; the traces already
                # stored are left out above instead
                settings = {"insert_deduplicate": 0}
            self._client.insert_arrow(name, data, settings)

        stored: dict[date, pa.Table] = {}  # the batch's requests a previous attempt stored
        for d, parts in sorted(tables.days.items()):
            sent = {n: _rows(parts, n) for n in ("requests", "calls")}
            copies = self._drop_stored_traces(parts, tables.ts_substituted)
            if copies is not None:
                stored[d] = copies
            # the report counts the rows this attempt adds, as on DuckDB
            tables.requests -= sent["requests"] - _rows(parts, "requests")
            tables.calls -= sent["calls"] - _rows(parts, "calls")
        for name, tbl in (
            ("fingerprints", tables.fingerprints),
            ("locations", tables.locations),
            ("stacks", tables.stacks),
            ("captures", tables.captures),
        ):
            insert(name, self._new_keys(name, tbl))
        insert("agent_stats", self._drop_stored_rows("agent_stats", tables.agent_stats))
        for d, parts in sorted(tables.days.items()):
            for t in schema.EVENT_TABLES:
                if t.name != "requests":
                    insert(t.name, parts.get(t.name), f"-{d:%Y%m%d}")
        # the requests after everything else of their batch, then their rollups (and those
        # of a previous attempt's requests whose rollups are missing: store.clickhouse_rollups)
        missing = self._missing_rollups_ch(stored)  # before this attempt's requests count
        for d, parts in sorted(tables.days.items()):
            insert("requests", parts.get("requests"), f"-{d:%Y%m%d}")
        self._insert_rollups_ch(tables, missing, insert)
        insert("ingest_offsets", offsets_table(batch, utcnow()))

    def _drop_stored_traces(self, parts: dict[str, pa.Table], any_ts: bool) -> pa.Table | None:
        """Leave out of one day's tables the rows already stored: of requests, calls and
        attributes the requests that a row of that table with their trace id is within
        KNOWN_TRACE_MARGIN_US of (tables.copied_requests: per request, whatever else the
        batch holds; ``any_ts``: at any ts, for a batch whose ts were made up at conversion),
        of the others the rows it holds. Returns the requests left out (None: none). The
        stored rows read are those of the trace ids in the rows' time span widened by the
        margin (tables.copy_window: the partitions that meet it); the ids go with the query,
        in chunks (no scratch table: collectors of one pid, or on another node of a cluster,
        would share it)."""
        margin = None if any_ts else KNOWN_TRACE_MARGIN_US
        dropped = None
        request_copies: pa.Table | None = None
        # The day's requests: their calls and attributes carry their trace id and ts
        # (tables.event_tables), so the requests' keys serve every table (grouping the keys
        # of 500k calls rows instead cost ~35 ms CPU per 50k-request batch).
        req = parts.get("requests")
        keys = request_keys([req]) if req is not None else None
        for name in _PER_TRACE:
            t = parts.get(name)
            if t is None or not t.num_rows:
                continue
            sent = keys if keys is not None and keys.num_rows else request_keys([t])
            if not sent.num_rows:
                continue
            window = copy_window(sent, margin)
            span = ""
            if window is not None:
                span = (
                    f"ts >= fromUnixTimestamp64Micro({window[0]}) "
                    f"AND ts <= fromUnixTimestamp64Micro({window[1]}) AND "
                )
            stored = [
                self._client.query_arrow(
                    f"SELECT trace_id, toUnixTimestamp64Micro(ts) AS ts FROM {self._t(name)} "
                    f"WHERE {span}trace_id IN {chunk}"
                )
                for chunk in _chunks(pc.unique(sent["trace_id"]).to_pylist())
            ]
            copies = copied_requests(sent, _concat(stored), margin)
            if name == "requests":
                request_copies = copies
            elif request_copies is not None:  # a copy's calls and attributes go with it
                copies = pa.concat_tables([copies, request_copies])  # of_copies: a row once
            copy = of_copies(t, copies)
            if copy.any():
                parts[name] = t.filter(pa.array(~copy))
                if name == "requests":
                    dropped = t.filter(pa.array(copy))
        for name in ROW_KEYS:
            if name in parts:
                parts[name] = self._drop_stored_rows(name, parts[name])  # type: ignore[assignment]
        return dropped

    def _drop_stored_rows(self, name: str, data: pa.Table | None) -> pa.Table | None:
        """The rows of ``data`` not already in table ``name`` (told apart by its
        tables.ROW_KEYS, looked for around the rows' ts: tables.ts_spans)."""
        if data is None or not data.num_rows:
            return data
        keys = ROW_KEYS[name]
        cols = ", ".join(quote(k) for k in keys)
        where = (
            "("
            + " OR ".join(
                f"ts >= fromUnixTimestamp64Micro({lo}) AND ts <= fromUnixTimestamp64Micro({hi})"
                for lo, hi in ts_spans(data)
            )
            + ")"
        )
        ins: list[str] = [""]
        if "trace_id" in keys:
            ids = pc.unique(pc.drop_null(data["trace_id"])).to_pylist()
            ins = [f" AND trace_id IN {c}" for c in _chunks(ids)] if ids else []
            if data["trace_id"].null_count:
                ins.append(" AND trace_id IS NULL")
        stored: set[tuple[Any, ...]] = set()
        for cond in ins:
            sql = f"SELECT {cols} FROM {self._t(name)} WHERE {where}{cond}"
            stored.update(self._q(sql))
        if not stored:
            return data
        rows = zip(*(data[k].to_pylist() for k in keys), strict=True)
        return data.filter(pa.array([r not in stored for r in rows], pa.bool_()))

    def _new_keys(self, name: str, data: pa.Table | None) -> pa.Table | None:
        """The rows of a keyed table whose key is not stored yet (each key once)."""
        if data is None or data.num_rows == 0:
            return data
        key = schema.TABLES[name].key[0]
        seen: set[Any] = set()
        keep = []  # the first row of each key within the batch
        for v in data[key].to_pylist():
            keep.append(v not in seen)
            seen.add(v)
        data = data.filter(pa.array(keep))
        stored: list[tuple[Any, ...]] = []
        for chunk in _chunks(data[key].to_pylist()):
            stored += self._q(
                f"SELECT {quote(key)} FROM {self._t(name)} WHERE {quote(key)} IN {chunk}"
            )
        if not stored:
            return data
        have = pa.array([r[0] for r in stored], data.schema.field(key).type)
        return data.filter(pc.invert(pc.is_in(data[key], value_set=have)))

    def record_received(self, rows: list[dict[str, Any]]) -> None:
        self._writable("recording received segments")
        if not rows:
            return

        def ts(ns: Any) -> datetime | None:
            return None if ns is None else datetime.utcfromtimestamp(int(ns) / 1e9)

        data = pa.Table.from_pylist(
            [
                {
                    "segment": r["segment"],
                    "token": r.get("token"),
                    "agent": r.get("agent"),
                    "host": r.get("host"),
                    "service": r.get("service"),
                    "pid": r.get("pid"),
                    "received": ts(r.get("received_ns")),
                    "started": ts(r.get("started_ns")),
                }
                for r in rows
            ],
            schema=schema.SEGMENTS_RECEIVED.arrow_schema(),
        )
        new = self._new_keys("segments_received", data)
        if new is not None and new.num_rows:
            self._client.insert_arrow("segments_received", new, {})

    def apply_retention(self, days: int = 7, rollup_days: int = 90) -> list[str]:
        """Drop whole days (partitions) that ended more than ``days`` days ago, and the agent
        counters, captures, offsets of finished segments and received-segment rows older than
        that (a process that still has requests keeps its rows: the fleet names it); rollup
        days (partitions) that ended more than ``rollup_days`` ago, and their minute rows with
        the raw rows. On a cluster each statement runs ``ON CLUSTER`` on the ``_local`` tables
        (a Distributed table takes no DELETE)."""
        self._writable("retention")
        if days < 1 or rollup_days < 1:
            raise StoreError(f"retention must be at least 1 day (got {min(days, rollup_days)})")
        cutoff = utcnow() - timedelta(days=days)
        keep_from = datetime.combine(cutoff.date(), datetime.min.time())  # the first day kept
        last_day = (cutoff - timedelta(days=1)).date()

        def local(name: str) -> str:
            return self._t(f"{name}_local" if self.cluster else name)

        def lit(v: Any) -> str:
            return str(literal(v).sql(dialect="clickhouse"))

        rollup_last = (utcnow() - timedelta(days=rollup_days + 1)).date()
        names = [self._local(t.name) for t in (*schema.EVENT_TABLES, *schema.ROLLUP_TABLES)]
        parts = self._parts(names)  # on a cluster, every node's

        def gone(p: str) -> bool:
            """Raw days past ``days``; rollup days past ``rollup_days``, their minute rows
            past ``days`` (hours and days answer for them)."""
            d, res = partition_day(p)
            if res is None:
                return d <= last_day
            return d <= rollup_last or (res == rollups.MINUTE and d <= last_day)

        old = sorted({p for _, p in parts if partition_day(p)[1] is None and gone(p)})
        on_cluster = f" ON CLUSTER {quote(self.cluster)}" if self.cluster else ""
        for table, p in parts:
            if gone(p):
                self._client.command(
                    f"ALTER TABLE {self._t(table)}{on_cluster} DROP PARTITION {p}"
                    if p.startswith("(")
                    else f"ALTER TABLE {self._t(table)}{on_cluster} DROP PARTITION {lit(p)}"
                )
        for name in ("agent_stats", "captures"):
            self._client.command(f"DELETE FROM {local(name)}{on_cluster} WHERE ts < {lit(cutoff)}")
        present = [f.base for f in spool.list_spool(self.spool_dir)]
        self._client.command(
            f"DELETE FROM {local('ingest_offsets')}{on_cluster} WHERE closed "
            f"AND updated < {lit(cutoff)} AND NOT has({lit(present)}, segment)"
        )
        process = "concat(coalesce(host, ''), '/', toString(coalesce(pid, -1)))"
        live = [r[0] for r in self._q(f"SELECT DISTINCT {process} FROM {self._t('requests')}")]
        self._client.command(
            f"DELETE FROM {local('segments_received')}{on_cluster} "
            f"WHERE received < {lit(cutoff)} AND (started IS NULL OR started < {lit(keep_from)}) "
            f"AND NOT has({lit(live)}, {process})"
        )
        return old
