"""The DuckDB store's file: creating it safely, opening it, its schema and migrations, and the
day tables behind the views named like the logical tables.

Event rows live in one table per day (``requests_d20261123``, ``calls_d…``, ``attributes_d…``)
behind views named like the logical tables (:mod:`perfsleuth.store.schema`); retention drops
whole days. :class:`DuckDBFile` is the base of the writer (:mod:`.duckdb_writer`) and the reader
(:mod:`.duckdb_reader`), which :class:`perfsleuth.store.duckdb_store.DuckDBStore` joins.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Set as AbstractSet
from datetime import UTC, date, datetime

import duckdb

from perfsleuth.store import schema
from perfsleuth.store.base import StoreError, StoreLocked, disk_full
from perfsleuth.store.schema import quote

DB_NAME = "perfsleuth.duckdb"
# DuckDB moves committed rows from its log into the file, compressed, once the log passes
# this. At its default (16 MB) a server that ingests what arrived every second checkpointed
# every round or two, each time recompressing the day tables' last, partly filled row groups
# (benchmarks/README.md, "Checkpoints"). The rows in the log are held in memory meanwhile.
CHECKPOINT_THRESHOLD = "256MB"
_LOCK_PID = re.compile(r"\(PID (\d+)\)")


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


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.replace(tzinfo=UTC).isoformat()


class DuckDBFile:
    """An open DuckDB store file (``self._con``), with its schema brought up to date."""

    def __init__(self, data_dir: str, read_only: bool = False) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.spool_dir = os.path.join(self.data_dir, "spool")
        self.corrupt_dir = os.path.join(self.spool_dir, "corrupt")
        self.agents_dir = os.path.join(self.data_dir, "agents")
        self.path = os.path.join(self.data_dir, DB_NAME)
        self.read_only = read_only
        # The layouts of the day tables (see _layouts), with the set of tables they are of.
        self._layout_cache: tuple[frozenset[str], dict[str, frozenset[str]]] | None = None
        # The writer's next ``rid`` of each requests day table it wrote (duckdb_writer).
        self._next_rid: dict[date, int] = {}
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
            config: dict[str, str | bool | int | float | list[str]] = {}
            if not read_only:
                config["checkpoint_threshold"] = CHECKPOINT_THRESHOLD
            con = duckdb.connect(path or self.path, read_only=read_only, config=config)
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
        have = self._columns()
        tables = [(t, t.name) for t in schema.GLOBAL_TABLES]
        for d in days:
            calls = have.get(schema.day_table(schema.CALLS, d))
            # a day written before the compact layout keeps the logical one (its calls name
            # their request by trace id: its requests need no rid)
            logical = calls is not None and not schema.duckdb_compact(calls)
            for t in schema.EVENT_TABLES:
                name = schema.day_table(t, d)
                if name not in have:
                    self._con.execute(schema.duckdb_create(schema.duckdb_physical(t), name))
                elif logical and t.name in ("requests", "calls"):
                    tables.append((t, name))
                else:
                    tables.append((schema.duckdb_physical(t), name))
        for t, name in tables:
            for c in t.columns:
                if c.name not in have.get(name, {c.name}):
                    self._con.execute(
                        f"ALTER TABLE {quote(name)} ADD COLUMN {quote(c.name)} "
                        f"{schema.duckdb_type(c)}"
                    )
        if "started" not in have.get(schema.SEGMENTS_RECEIVED.name, {"started"}):
            # Segments the collector recorded before ``started``: its name has it (the time
            # the agent opened it, ``<host>-<pid>-<ns>-<seq>``).
            self._con.execute(
                "UPDATE segments_received SET started = make_timestamp("
                "CAST(regexp_extract(segment, '-([0-9]{1,20})-[0-9]+$', 1) AS BIGINT) // 1000) "
                "WHERE started IS NULL AND regexp_matches(segment, '-[0-9]{1,20}-[0-9]+$')"
            )
        self._layout_cache = None  # columns were added

    def _columns(self) -> dict[str, set[str]]:
        """Each table of the store's file with its columns."""
        have: dict[str, set[str]] = {}
        for table, column in self._con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE schema_name = 'main' "
            "AND database_name = current_database()"
        ).fetchall():
            have.setdefault(table, set()).add(column)
        return have

    def _layouts(self, names: AbstractSet[str] | None = None) -> dict[str, frozenset[str]]:
        """The columns of each requests and calls day table: what a day's layout is read by
        (schema.duckdb_day_select). Asking the catalogue for them costs ~20 us a table (every
        table's columns were 7-25 ms at 210-540 days), so they are kept while the store's set
        of tables (``names``: _table_names(), which the caller often has) stays the same: a day
        made or dropped, here or by another process, asks again; a migration, which adds
        columns, and retention, after which a day may be made again, forget them."""
        key = frozenset(self._table_names() if names is None else names)
        cached = self._layout_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        have: dict[str, set[str]] = {}
        for table, column in self._con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE schema_name = 'main' "
            "AND database_name = current_database() "
            "AND (starts_with(table_name, 'calls_d') OR starts_with(table_name, 'requests_d'))"
        ).fetchall():
            have.setdefault(table, set()).add(column)
        layouts = {t: frozenset(cols) for t, cols in have.items()}
        self._layout_cache = (key, layouts)
        return layouts

    def _compact_call_days(self, names: AbstractSet[str] | None = None) -> set[date]:
        """The days whose calls table has the compact layout (schema.DUCKDB_CALLS)."""
        out = set()
        for name, cols in self._layouts(names).items():
            parsed = schema.parse_day_table(name)
            if parsed is not None and parsed[0] == "calls" and schema.duckdb_compact(cols):
                out.add(parsed[1])
        return out

    def close(self) -> None:
        con = getattr(self, "_con", None)
        if con is not None:
            con.close()
            self._con = None  # type: ignore[assignment]

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"the store was opened read-only; {what} needs a writable store")

    def _day_tables(self, names: AbstractSet[str] | None = None) -> dict[str, set[date]]:
        """Days for which each event table exists (``names``: _table_names(), if at hand)."""
        out: dict[str, set[date]] = {
            t.name: set() for t in schema.EVENT_TABLES + schema.ROLLUP_TABLES
        }
        for name in self._table_names() if names is None else names:
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
        names = self._table_names()
        have = self._day_tables(names)
        # Each day's tables are read in their own layout (calls: the compact one or, written
        # by an older version, the logical one).
        columns = self._layouts(names)
        wanted = [
            (
                t,
                schema.duckdb_view(
                    t, [d for d in days if d in have[t.name]], temp=temp, columns=columns
                ),
            )
            for t in schema.EVENT_TABLES
        ]
        # Rollups are kept longer than raw rows: their views cover every day they exist.
        wanted += [
            (t, schema.duckdb_view(t, sorted(have[t.name]), temp=temp))
            for t in schema.ROLLUP_TABLES
        ]
        # A view is replaced only when its definition changed (its comment holds a digest of
        # the statement that made it): opening an up-to-date store writes nothing, so it
        # opens on a full disk, and ingest then says that the disk is full.
        made = {} if temp else self._view_digests()
        for t, sql in wanted:
            digest = hashlib.sha1(sql.encode()).hexdigest()[:16]
            if made.get(t.name) == digest:
                continue
            self._con.execute(sql)
            if not temp:
                self._con.execute(f"COMMENT ON VIEW {quote(t.name)} IS '{digest}'")

    def _view_digests(self) -> dict[str, str]:
        return {
            name: comment or ""
            for name, comment in self._con.execute(
                "SELECT view_name, comment FROM duckdb_views() WHERE NOT internal "
                "AND schema_name = 'main' AND database_name = current_database()"
            ).fetchall()
        }

    def _table_names(self) -> set[str]:
        return {
            r[0]
            for r in self._con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' "
                "AND database_name = current_database()"
            ).fetchall()
        }
