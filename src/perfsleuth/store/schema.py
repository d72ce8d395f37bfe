"""The store's logical schema, and the DDL rendered from it for each engine.

One description of every table (columns with logical types, sort key, per-day partitioning)
serves DuckDB (the embedded default), the Arrow schemas used at ingest, and ClickHouse.

Event tables (``requests``, ``calls``, ``attributes``) are partitioned by day (UTC). In DuckDB
each day is a physical table (``requests_d20261123``) and a view of the same name as the
logical table UNION ALLs the days that exist, so retention drops whole tables and never
deletes rows. In ClickHouse the same tables are MergeTree tables ``PARTITION BY toDate(ts)``
sorted by ``(service, endpoint, ts)`` with a TTL that drops whole parts.

Identifiers (fingerprints, code locations, stacks) are the agent's stable 63-bit hashes: they
fit a signed 64-bit integer in both engines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from datetime import date

import pyarrow as pa

# Logical type -> (DuckDB, ClickHouse, Arrow)
_TYPES: dict[str, tuple[str, str, pa.DataType]] = {
    "timestamp": ("TIMESTAMP", "DateTime64(6)", pa.timestamp("us")),
    "string": ("VARCHAR", "String", pa.string()),
    "int32": ("INTEGER", "Int32", pa.int32()),
    "int64": ("BIGINT", "Int64", pa.int64()),
    "float64": ("DOUBLE", "Float64", pa.float64()),
    "bool": ("BOOLEAN", "Bool", pa.bool_()),
    "id": ("BIGINT", "Int64", pa.int64()),
    "id_list": ("BIGINT[]", "Array(Int64)", pa.list_(pa.int64())),
}


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # a key of _TYPES
    nullable: bool = True
    low_cardinality: bool = False  # a hint for ClickHouse (LowCardinality(String))


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    by_day: bool = False  # partitioned by day of ``ts`` (event tables)
    order_by: tuple[str, ...] = ()  # sort key (ClickHouse ORDER BY)
    key: tuple[str, ...] = ()  # unique key: rows are inserted or ignored / replaced by it

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, _TYPES[c.type][2], c.nullable) for c in self.columns])


def _c(spec: str) -> tuple[Column, ...]:
    """Columns from ``"name type[!][~], ..."``: ``!`` not nullable, ``~`` low cardinality."""
    out = []
    for item in spec.split(","):
        name, typ = item.split()
        out.append(
            Column(name, typ.rstrip("!~"), nullable="!" not in typ, low_cardinality="~" in typ)
        )
    return tuple(out)


EVENT_ORDER = ("service", "endpoint", "ts")

REQUESTS = Table(
    "requests",
    _c(
        "ts timestamp!, trace_id string!, service string!~, host string~, pid int32,"
        " kind string!~, method string~, endpoint string!~, path string, status int32,"
        " error string, duration_ms float64, cpu_ms float64, req_bytes int64, resp_bytes int64,"
        " user string, tenant string~, db_calls int32!, db_ms float64!, http_calls int32!,"
        " http_ms float64!, cache_calls int32!, cache_ms float64!, calls_dropped int32!,"
        " gc_ms float64, gc_count int32, version string~"
    ),
    by_day=True,
    order_by=EVENT_ORDER,
)

CALLS = Table(
    "calls",
    _c(
        "ts timestamp!, trace_id string!, service string!~, endpoint string!~, seq int32!,"
        " kind string!~, system string~, fingerprint_id id, offset_ms float64,"
        " duration_ms float64, rows int64, bytes int64, params_hash int64, stack_id id,"
        " site_id id, host string~, status int32, hit bool, wait_ms float64, error string,"
        " unfinished bool"
    ),
    by_day=True,
    order_by=EVENT_ORDER,
)

ATTRIBUTES = Table(
    "attributes",
    _c(
        "ts timestamp!, trace_id string!, service string!~, endpoint string!~, kind string!~,"
        " key string!~, value string, num float64"
    ),
    by_day=True,
    order_by=EVENT_ORDER,
)

# Runtime evidence (agent.sampler, agent.watchdog, agent.gcwatch). A sample's endpoint is ''
# when it was shipped while its request was still running: join requests on trace_id.
SAMPLES = Table(
    "samples",
    _c(
        "ts timestamp!, trace_id string!, service string!~, endpoint string!~, method string~,"
        " path string, offset_ms float64, state string~, stack_id id"
    ),
    by_day=True,
    order_by=EVENT_ORDER,
)

# One row per event-loop blocker: its most common stack, the request whose code ran, how many
# other requests in flight on that loop it delayed, and the last call that request finished.
BLOCKERS = Table(
    "blockers",
    _c(
        "ts timestamp!, trace_id string, service string!~, host string~, pid int32,"
        " endpoint string!~, method string~, path string, duration_ms float64, stack_id id,"
        " stack_samples int32, samples int32, delayed int32, last_kind string~, last_call string,"
        " last_rows int64, last_bytes int64, last_ms float64"
    ),
    by_day=True,
    order_by=EVENT_ORDER,
)

# Garbage-collection pauses of at least PERFSLEUTH_GC_EVENT_MS, with the requests in flight.
GC_PAUSES = Table(
    "gc_pauses",
    _c(
        "ts timestamp!, service string!~, host string~, pid int32, endpoint string!~,"
        " generation int32, duration_ms float64, collected int64, trace_ids string"
    ),
    by_day=True,
    order_by=EVENT_ORDER,
)

FINGERPRINTS = Table(
    "fingerprints",
    _c("id id!, kind string~, op string~, text string"),
    order_by=("id",),
    key=("id",),
)
LOCATIONS = Table(
    "locations",
    _c("id id!, file string, line int32, function string, app bool"),
    order_by=("id",),
    key=("id",),
)
STACKS = Table("stacks", _c("id id!, frames id_list"), order_by=("id",), key=("id",))

# Agent counters from STATS records, one row per counter: (ts, process, name, value).
AGENT_STATS = Table(
    "agent_stats",
    _c("ts timestamp!, service string!~, host string!~, pid int32!, name string!~, value int64"),
    order_by=("host", "pid", "name", "ts"),
)

# Replayable request captures (agent.capture), one per trace; secret headers are redacted by
# the agent. Kept by ``ts`` like the event tables' days (apply_retention deletes older rows).
CAPTURES = Table(
    "captures",
    _c(
        "trace_id string!, ts timestamp!, service string~, endpoint string~, method string~,"
        " status int32, duration_ms float64, reason string~, url string, headers string,"
        " redacted string, body_b64 string, body_size int64, body_sha256 string,"
        " body_truncated bool"
    ),
    order_by=("trace_id",),
    key=("trace_id",),
)

# Ingest progress per spool segment (name without suffix): committed with the rows it covers.
INGEST_OFFSETS = Table(
    "ingest_offsets",
    _c(
        "segment string!, offset int64!, closed bool!, damaged bool!, service string,"
        " host string, pid int32, updated timestamp!, version string"
    ),
    order_by=("segment",),
    key=("segment",),
)

# Segments a collector (``perfsleuth server``) received, with the name of the token that sent
# each (segment is ``agent~name``); ``started`` is the segment's own start (its header's).
SEGMENTS_RECEIVED = Table(
    "segments_received",
    _c(
        "segment string!, token string~, agent string~, host string~, service string~,"
        " pid int32, received timestamp, started timestamp"
    ),
    order_by=("segment",),
    key=("segment",),
)

# Rollups of requests (store.rollups): per period of ``res`` seconds (60, 3600, 86400) from
# ``ts`` and per service, host, kind and endpoint, the request counts and sums (rollup_stats)
# and the latency histogram in fixed log buckets (rollup_hist: one row per bucket with
# requests). Rows with the same key add up (merging = summing). Partitioned by day like the
# event tables, and kept longer than raw rows (ROLLUP_DAYS).
_ROLLUP_KEY = "ts timestamp!, res int32!, service string!~, host string~, kind string!~,"
_ROLLUP_KEY += " endpoint string!~"
ROLLUP_STATS = Table(
    "rollup_stats",
    _c(
        _ROLLUP_KEY + ", requests int64!, errors int64!, duration_ms float64, max_ms float64,"
        " cpu_ms float64, db_calls int64, db_ms float64, http_calls int64, http_ms float64,"
        " cache_calls int64, cache_ms float64, gc_ms float64, over_1000 int64, over_2000 int64,"
        " over_5000 int64"
    ),
    by_day=True,
    order_by=("res", "service", "endpoint", "ts"),
)
ROLLUP_HIST = Table(
    "rollup_hist",
    _c(_ROLLUP_KEY + ", bucket int32!, requests int64!"),
    by_day=True,
    order_by=("res", "service", "endpoint", "ts", "bucket"),
)
ROLLUP_TABLES = (ROLLUP_STATS, ROLLUP_HIST)
# Days of rollups made compact (rows of equal key summed into one), with their row count then.
ROLLUP_COMPACTED = Table(
    "rollup_compacted",
    _c("day timestamp!, stats_rows int64!, hist_rows int64!"),
    order_by=("day",),
    key=("day",),
)

EVENT_TABLES = (REQUESTS, CALLS, ATTRIBUTES, SAMPLES, BLOCKERS, GC_PAUSES)
GLOBAL_TABLES = (
    FINGERPRINTS,
    LOCATIONS,
    STACKS,
    AGENT_STATS,
    INGEST_OFFSETS,
    CAPTURES,
    SEGMENTS_RECEIVED,
    ROLLUP_COMPACTED,
)
TABLES = {t.name: t for t in EVENT_TABLES + ROLLUP_TABLES + GLOBAL_TABLES}

_DAY_SUFFIX = re.compile(r"^(?P<table>[a-z_]+)_d(?P<day>\d{8})$")


def day_table(table: Table, day: date) -> str:
    """Physical name of one day of an event table: ``requests_d20261123``."""
    return f"{table.name}_d{day:%Y%m%d}"


def parse_day_table(name: str) -> tuple[str, date] | None:
    """(logical table, day) of a physical day table name, or None."""
    m = _DAY_SUFFIX.match(name)
    if m is None or m["table"] not in TABLES or not TABLES[m["table"]].by_day:
        return None
    d = m["day"]
    try:
        return m["table"], date(int(d[:4]), int(d[4:6]), int(d[6:]))
    except ValueError:
        return None


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# ---------------------------------------------------------------------------------- DuckDB


def duckdb_create(table: Table, physical: str | None = None) -> str:
    cols = [
        f"{quote(c.name)} {_TYPES[c.type][0]}{'' if c.nullable else ' NOT NULL'}"
        for c in table.columns
    ]
    if table.key:
        cols.append(f"PRIMARY KEY ({', '.join(quote(k) for k in table.key)})")
    return f"CREATE TABLE IF NOT EXISTS {quote(physical or table.name)} ({', '.join(cols)})"


def duckdb_type(column: Column) -> str:
    return _TYPES[column.type][0]


def duckdb_empty(table: Table) -> str:
    """A typed, empty SELECT with the table's columns (the view when no day exists)."""
    cols = ", ".join(f"CAST(NULL AS {_TYPES[c.type][0]}) AS {quote(c.name)}" for c in table.columns)
    return f"SELECT {cols} WHERE false"


# DuckDB keeps a call row without copies of its request's columns (issue 20: 212 -> ~130
# bytes per request with 10 calls): ``rid`` numbers the requests of a day table (a column of
# DuckDB's requests day tables, left out of the ``requests`` view) and a call row names its
# request by it; the ``calls`` view joins them back, with the logical columns of CALLS.
# Offsets, durations and waits are whole microseconds (integers compress; ns / 1e6 doubles did
# not), and ``params_hash`` numbers the distinct hashes of a request's calls 0, 1, ... (equal
# exactly when the agent's 63-bit hashes are: duckdb_writer.params_numbers); only ever
# compared within a request (repeated_query), it takes a few bits where a hash took 8 bytes.
# ClickHouse keeps the logical layout. Day tables written before this (``calls_d…`` with
# ``trace_id``) stay as they are: the view reads each day in its own layout.
# The compact layout is made from CALLS (a column added there is added here):
_CALL_OF_REQUEST = ("ts", "trace_id", "service", "endpoint")  # read from its request
# logical -> (physical column, its type) where the compact layout keeps it in another unit
_COMPACT_COLUMN = {
    "offset_ms": ("offset_us", "int64"),
    "duration_ms": ("duration_us", "int64"),
    "wait_ms": ("wait_us", "int64"),
    "params_hash": ("params_hash", "int32"),
}


def duckdb_compact_calls(calls: Table) -> Table:
    """DuckDB's compact calls day table for the logical ``calls`` table (see above): ``rid``,
    then the call's own columns, in whole microseconds where CALLS has ms."""
    cols = [Column("rid", "int64", nullable=False)]
    for c in calls.columns:
        if c.name in _CALL_OF_REQUEST:
            continue
        name, typ = _COMPACT_COLUMN.get(c.name, (c.name, c.type))
        cols.append(replace(c, name=name, type=typ))
    return Table(calls.name, tuple(cols), by_day=True, order_by=("fingerprint_id", "rid"))


DUCKDB_CALLS = duckdb_compact_calls(CALLS)

# The physical day tables of DuckDB where they differ from the logical ones: requests gain
# ``rid`` (the key calls name their request by), calls lose the request's columns.
DUCKDB_REQUESTS = Table(
    "requests", REQUESTS.columns + _c("rid int64"), by_day=True, order_by=EVENT_ORDER
)
_DUCKDB_PHYSICAL = {"requests": DUCKDB_REQUESTS, "calls": DUCKDB_CALLS}
# A call's columns in the compact layout that hold a logical column in another unit:
# logical -> SQL over the physical row ``c`` (its request is ``r``).
_COMPACT_READ = {
    "ts": "r.ts",
    "trace_id": "r.trace_id",
    "service": "r.service",
    "endpoint": "r.endpoint",
    "offset_ms": "CAST(c.offset_us AS DOUBLE) / 1000",
    "duration_ms": "CAST(c.duration_us AS DOUBLE) / 1000",
    "wait_ms": "CAST(c.wait_us AS DOUBLE) / 1000",
    "params_hash": "CAST(c.params_hash AS BIGINT)",
}


def _whole_us(ms: str) -> str:
    """SQL: a logical ms column (ns / 1e6) in whole microseconds, halves up: the ns it was
    made of (recovered exactly below ~10 days), then floor(ns / 1000 + 0.5) as
    tables.whole_us does, so a request's db/http/cache_ms are the sums of its calls' stored
    durations."""
    return f"CAST(floor(round({ms} * 1e6) / 1000 + 0.5) AS BIGINT)"


# ... and the other way, at insert: physical -> SQL over a logical row (with ``rid``).
_COMPACT_WRITE = {
    "offset_us": _whole_us("offset_ms"),
    "duration_us": _whole_us("duration_ms"),
    "wait_us": _whole_us("wait_ms"),
}


def duckdb_physical(table: Table) -> Table:
    """The table DuckDB's day tables of ``table`` are made with (see DUCKDB_CALLS)."""
    return _DUCKDB_PHYSICAL.get(table.name, table)


def duckdb_compact(columns: AbstractSet[str]) -> bool:
    """Whether a calls day table with these columns has the compact layout (DUCKDB_CALLS)."""
    return "rid" in columns and "trace_id" not in columns


def duckdb_insert_calls(physical: str, source: str) -> str:
    """INSERT of logical call rows with their request's ``rid`` (``source``: a registered
    relation) into a compact calls day table."""
    cols = [c.name for c in DUCKDB_CALLS.columns]
    values = ", ".join(_COMPACT_WRITE.get(c, quote(c)) for c in cols)
    names = ", ".join(quote(c) for c in cols)
    return f"INSERT INTO {quote(physical)} ({names}) SELECT {values} FROM {source}"


def duckdb_day_select(
    table: Table, d: date, columns: Mapping[str, AbstractSet[str]] | None = None
) -> str:
    """SELECT of one day of an event table with the logical columns, whatever its layout
    (``columns``: physical table -> its columns; None: the logical layout, as tables made by
    ``duckdb_create(table, ...)``). A compact calls table lacking a column (written by an
    older version, opened read-only) reads it as NULL."""
    name = day_table(table, d)
    have = (columns or {}).get(name, set())
    if table.name == "calls" and duckdb_compact(have):
        req = quote(day_table(REQUESTS, d))
        cols = []
        for c in table.columns:
            physical = _COMPACT_COLUMN.get(c.name, (c.name, ""))[0]
            if c.name in _CALL_OF_REQUEST or physical in have:
                sql = _COMPACT_READ.get(c.name, "c." + quote(c.name))
            else:
                sql = f"CAST(NULL AS {_TYPES[c.type][0]})"
            cols.append(f"{sql} AS {quote(c.name)}")
        return f"SELECT {', '.join(cols)} FROM {quote(name)} c JOIN {req} r ON r.rid = c.rid"
    if table.name == "requests" and "rid" in have:
        return f"SELECT * EXCLUDE (rid) FROM {quote(name)}"
    return f"SELECT * FROM {quote(name)}"


def duckdb_union(
    table: Table, days: list[date], columns: Mapping[str, AbstractSet[str]] | None = None
) -> str:
    """SELECT over the given days of an event table (by name, so older days missing a newer
    column still line up), or the typed empty SELECT. ``columns``: see duckdb_day_select."""
    if not days:
        return duckdb_empty(table)
    # The typed empty SELECT last: a day written before a column existed gets it as NULL.
    selects = [duckdb_day_select(table, d, columns) for d in sorted(days)]
    return " UNION ALL BY NAME ".join([*selects, duckdb_empty(table)])


def duckdb_view(
    table: Table,
    days: list[date],
    *,
    temp: bool = False,
    columns: Mapping[str, AbstractSet[str]] | None = None,
) -> str:
    kind = "TEMP VIEW" if temp else "VIEW"
    return f"CREATE OR REPLACE {kind} {quote(table.name)} AS {duckdb_union(table, days, columns)}"


# ------------------------------------------------------------------------------ ClickHouse

# ``ingest_offsets`` and the other keyed tables keep the row with the latest version
_CH_VERSION = {"ingest_offsets": "updated"}
# Replicated engines' Keeper path and replica name, from the server's macros
REPLICA_PATH = "/clickhouse/tables/{shard}/{database}/{table}"
REPLICA_NAME = "{replica}"
# Inserts whose deduplication token was seen among the last N of a table are dropped
DEDUP_WINDOW = 10_000
# Rollup tables on ClickHouse (store.clickhouse_rollups): AggregatingMergeTree sorted by their
# whole key, each value a SimpleAggregateFunction (sum; max for max_ms), so background merges
# sum rows of equal key as DuckDB's compaction does; partitioned by (day, res), so retention
# drops a day's minute rows (or the whole day) as partitions.
_CH_ROLLUP_KEY = ("ts", "res", "service", "host", "kind", "endpoint", "bucket")
_CH_ROLLUP_MAX = frozenset({"max_ms"})
ROLLUP_TTL_DAYS = 90


def clickhouse_type(c: Column) -> str:
    t = _TYPES[c.type][1]
    if c.nullable and c.type != "id_list":
        t = f"Nullable({t})"
    if c.low_cardinality and c.type == "string":
        t = f"LowCardinality({t})"
    return t


def clickhouse_create(
    table: Table,
    *,
    database: str = "perfsleuth",
    cluster: str | None = None,
    replicated: bool = False,
    ttl_days: int | None = None,
    name: str | None = None,
) -> str:
    """MergeTree DDL for ClickHouse (and chDB): event tables partitioned by day, sorted by
    (service, endpoint, ts), with a bloom-filter index on ``trace_id`` (trace look-ups and the
    ingest's already-stored check) and an optional TTL that drops whole parts; keyed tables as
    ReplacingMergeTree on their key. Inserts carry deduplication tokens (exactly-once ingest),
    so non-replicated tables keep a deduplication window too. ``name``: the physical name (a
    cluster's local table)."""
    on_cluster = f" ON CLUSTER {quote(cluster)}" if cluster else ""
    rollup = table in ROLLUP_TABLES
    engine = "ReplacingMergeTree" if table.key else "MergeTree"
    if rollup:
        engine = "AggregatingMergeTree"
    args = [quote(_CH_VERSION[table.name])] if table.name in _CH_VERSION else []
    if replicated:
        engine = "Replicated" + engine
        args = [f"'{REPLICA_PATH}'", f"'{REPLICA_NAME}'", *args]
    cols = [f"{quote(c.name)} {clickhouse_type(c)}" for c in table.columns]
    order = table.order_by
    if rollup:
        cols = [
            f"{quote(c.name)} {clickhouse_type(c)}"
            if c.name in _CH_ROLLUP_KEY
            else f"{quote(c.name)} SimpleAggregateFunction("
            f"{'max' if c.name in _CH_ROLLUP_MAX else 'sum'}, {clickhouse_type(c)})"
            for c in table.columns
        ]
        order = (*order, *(k for k in _CH_ROLLUP_KEY if k in table.column_names and k not in order))
    if table.by_day and "trace_id" in table.column_names:
        cols.append("INDEX trace_idx trace_id TYPE bloom_filter(0.01) GRANULARITY 4")
    full = f"{quote(database)}.{quote(name or table.name)}"
    parts = [
        f"CREATE TABLE IF NOT EXISTS {full}{on_cluster} (\n  " + ",\n  ".join(cols) + "\n)",
        f"ENGINE = {engine}({', '.join(args)})",
    ]
    if rollup:
        parts.append("PARTITION BY (toDate(ts), res)")
    elif table.by_day:
        parts.append("PARTITION BY toDate(ts)")
    parts.append(f"ORDER BY ({', '.join(quote(k) for k in order)})")
    settings = [] if replicated else [f"non_replicated_deduplication_window = {DEDUP_WINDOW}"]
    if rollup:
        settings.append("allow_nullable_key = 1")  # host may be NULL
    if rollup and ttl_days:  # minute rows as long as raw rows, hours and days ROLLUP_TTL_DAYS
        keep = max(int(ttl_days), ROLLUP_TTL_DAYS)
        parts.append(f"TTL toDateTime(ts) + toIntervalDay(if(res = 60, {int(ttl_days)}, {keep}))")
        settings.append("ttl_only_drop_parts = 1")
    elif table.by_day and ttl_days:
        parts.append(f"TTL toDateTime(ts) + INTERVAL {int(ttl_days)} DAY")
        settings.append("ttl_only_drop_parts = 1")
    if settings:
        parts.append("SETTINGS " + ", ".join(settings))
    return "\n".join(parts)


def clickhouse_distributed(table: Table, *, database: str, cluster: str, local: str) -> str:
    """The Distributed table named like the logical table, in front of each shard's ``local``
    table; a request's rows (requests, calls, attributes) go to one shard (by trace id), so a
    trace's joins stay local to a shard; a keyed table's rows by their key."""
    cols = ("trace_id",) if "trace_id" in table.column_names else table.key
    key = f"cityHash64({', '.join(quote(c) for c in cols)})" if cols else "rand()"
    return (
        f"CREATE TABLE IF NOT EXISTS {quote(database)}.{quote(table.name)} "
        f"ON CLUSTER {quote(cluster)} AS {quote(database)}.{quote(local)}\n"
        f"ENGINE = Distributed({quote(cluster)}, {quote(database)}, {quote(local)}, {key})"
    )


def clickhouse_ddl(
    *,
    database: str = "perfsleuth",
    cluster: str | None = None,
    replicated: bool = False,
    ttl_days: int | None = None,
    tables: tuple[Table, ...] | None = None,
) -> list[str]:
    """Every statement that makes the store in ClickHouse, in order: the database, then each
    table (default: all of :data:`TABLES`). With ``cluster``, each table is made ``ON CLUSTER``
    as ``<name>_local`` (Replicated when ``replicated``) with a Distributed table of the logical
    name in front."""
    on_cluster = f" ON CLUSTER {quote(cluster)}" if cluster else ""
    out = [f"CREATE DATABASE IF NOT EXISTS {quote(database)}{on_cluster}"]
    for t in tables if tables is not None else tuple(TABLES.values()):
        if cluster is None:
            out.append(
                clickhouse_create(t, database=database, replicated=replicated, ttl_days=ttl_days)
            )
            continue
        local = f"{t.name}_local"
        out.append(
            clickhouse_create(
                t,
                database=database,
                cluster=cluster,
                replicated=replicated,
                ttl_days=ttl_days,
                name=local,
            )
        )
        out.append(clickhouse_distributed(t, database=database, cluster=cluster, local=local))
    return out
