"""The thin client layer under the ClickHouse store: three calls (a statement, a query read as
Arrow, an Arrow insert) over either of two ways to reach the engine.

* ``clickhouse://[user[:password]@]host[:8123]/database`` (``clickhouses://`` for TLS): a
  ClickHouse server over HTTP through its official Python client, ``clickhouse-connect``
  (the SQL needs ClickHouse 24.x or later: ``GROUP BY ALL``, aggregate FILTER, named tuples,
  ``session_timezone``; tested only on chDB 4.4.0, ClickHouse 26.9's engine: no server can be
  installed where the tests run);
* ``chdb:///path/to/dir[?database=name]``: chDB, ClickHouse's engine in this process, with its
  data in that directory (the tests run on it; chDB holds one directory per process, so every
  store of a process uses the same directory, each with its own database).

Both come with the ``clickhouse`` extra (``pip install 'perfsleuth[clickhouse]'``); a URL given
without it installed is a :class:`StoreError` saying so.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store.base import StoreError, StoreLocked
from perfsleuth.store.clickhouse_dialect import SESSION_SETTINGS

__all__ = ["Client", "connect"]


class Client(Protocol):
    database: str
    where: str  # for messages: the server or directory, and the database

    def command(self, sql: str) -> None: ...

    def query_arrow(self, sql: str) -> pa.Table:
        """The rows of one query; timestamps as naive UTC."""
        ...

    def insert_arrow(self, table: str, data: pa.Table, settings: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _missing_extra(what: str, exc: ImportError) -> StoreError:
    return StoreError(
        f"a {what} store needs the clickhouse extra: pip install 'perfsleuth[clickhouse]' "
        f"({exc.name or exc} is not installed)"
    )


def connect(url: str) -> Client:
    u = urlparse(url)
    if u.scheme == "chdb":
        db = parse_qs(u.query).get("database", ["perfsleuth"])[0]
        path = unquote(u.path) or ""
        if not path:
            raise StoreError(f"give chDB a directory: chdb:///path/to/dir (got {url})")
        return ChdbClient(os.path.abspath(path), db)
    if u.scheme in ("clickhouse", "clickhouses"):
        return HttpClient(u)
    raise StoreError(f"unknown store URL {url}: use clickhouse://host:8123/db or chdb:///dir")


def _naive_utc(table: pa.Table) -> pa.Table:
    for i, f in enumerate(table.schema):
        if pa.types.is_timestamp(f.type) and f.type.tz is not None:
            table = table.set_column(i, f.name, pc.cast(table[i], pa.timestamp(f.type.unit)))
        elif pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.name, pc.cast(table[i], f.type.value_type))
    return table


def _settings_sql(settings: dict[str, Any]) -> str:
    def val(v: Any) -> str:
        return f"'{v}'" if isinstance(v, str) else str(int(v) if isinstance(v, bool) else v)

    return ", ".join(f"{k} = {val(v)}" for k, v in settings.items())


# chDB: one embedded engine per process, on one directory; stores share it.
_chdb_lock = threading.Lock()
_chdb_session: Any = None
_chdb_path: str | None = None
_chdb_users = 0


class ChdbClient:
    def __init__(self, path: str, database: str) -> None:
        global _chdb_session, _chdb_path, _chdb_users
        try:
            from chdb import session as chdb_session
        except ImportError as e:
            raise _missing_extra("chDB", e) from e
        self.database = database
        self.where = f"chDB in {path}, database {database}"
        self._lock = _chdb_lock
        with _chdb_lock:
            if _chdb_session is None:
                os.makedirs(path, exist_ok=True)
                try:
                    _chdb_session = chdb_session.Session(path)
                except Exception as e:
                    if "EmbeddedServer" in str(e) or "lock" in str(e).lower():
                        raise StoreLocked(
                            f"the store {self.where} is in use by another process (chDB lets "
                            "one process at a time open a directory); wait for it to finish "
                            "or stop it, then try again"
                        ) from e
                    raise StoreError(f"cannot open chDB in {path}: {e}") from e
                _chdb_path = path
                atexit.register(_close_engine)
                for stmt in (f"SET {k} = {v!r}" for k, v in SESSION_SETTINGS.items()):
                    _chdb_session.query(stmt)
            elif _chdb_path != path:
                raise StoreError(
                    f"chDB holds one directory per process ({_chdb_path} is open): "
                    f"use that one, with another ?database= for another store"
                )
            _chdb_users += 1
        self._session = _chdb_session
        self._closed = False

    def _run(self, sql: str, fmt: str = "CSV") -> Any:
        with self._lock:
            try:
                return self._session.query(sql, fmt)
            except Exception as e:  # chDB raises RuntimeError with the engine's message
                # A query stopped while its Arrow stream was being written (a timeout) leaves
                # the stream's rest to the next Arrow query of the session (chDB 4.4): a
                # throwaway query takes it.
                try:
                    self._session.query("SELECT 1", "ArrowTable")
                except Exception:
                    pass
                raise StoreError(f"ClickHouse (chDB): {e}") from e

    def command(self, sql: str) -> None:
        self._run(sql)

    def query_arrow(self, sql: str) -> pa.Table:
        return _naive_utc(self._run(sql, "ArrowTable"))

    def insert_arrow(self, table: str, data: pa.Table, settings: dict[str, Any]) -> None:
        cols = ", ".join(f'"{n}"' for n in data.column_names)
        with_settings = f" SETTINGS {_settings_sql(settings)}" if settings else ""
        # chDB's Python() table function reads the local variable named ``data``
        self._run(
            f'INSERT INTO "{self.database}"."{table}" ({cols}){with_settings} '
            f"SELECT {cols} FROM Python(data)"
        )

    def close(self) -> None:
        global _chdb_users
        if self._closed:
            return
        self._closed = True
        with _chdb_lock:
            _chdb_users -= 1  # the engine stays up for the process's next store


def _close_engine() -> None:
    """At exit: the embedded engine stops before the process's C++ destructors run; left
    open, its background threads (merges) ran into them and crashed the process at exit."""
    global _chdb_session
    with _chdb_lock:
        session, _chdb_session = _chdb_session, None
    if session is not None:
        try:
            session.close()
        except Exception:
            pass


class HttpClient:
    def __init__(self, u: Any) -> None:
        try:
            import clickhouse_connect
        except ImportError as e:
            raise _missing_extra("ClickHouse", e) from e
        self.database = (u.path or "/").strip("/") or "perfsleuth"
        secure = u.scheme == "clickhouses"
        host = u.hostname or "localhost"
        port = u.port or (8443 if secure else 8123)
        self.where = f"ClickHouse at {host}:{port}, database {self.database}"
        try:
            # The database may not exist yet: connect to default, name ours in every query.
            self._client = clickhouse_connect.get_client(
                host=host,
                port=port,
                username=unquote(u.username or "default"),
                password=unquote(u.password or ""),
                secure=secure,
                settings=dict(SESSION_SETTINGS),
            )
        except Exception as e:
            raise StoreError(f"cannot reach {self.where}: {e}") from e

    def command(self, sql: str) -> None:
        try:
            self._client.command(sql)
        except Exception as e:
            raise StoreError(f"ClickHouse: {e}") from e

    def query_arrow(self, sql: str) -> pa.Table:
        try:
            return _naive_utc(self._client.query_arrow(sql, use_strings=True))
        except Exception as e:
            raise StoreError(f"ClickHouse: {e}") from e

    def insert_arrow(self, table: str, data: pa.Table, settings: dict[str, Any]) -> None:
        try:
            self._client.insert_arrow(table, data, database=self.database, settings=settings)
        except Exception as e:
            raise StoreError(f"ClickHouse: {e}") from e

    def close(self) -> None:
        self._client.close()
