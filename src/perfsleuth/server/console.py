"""The SQL console (``POST /api/sql`` and ``perfsleuth sql``): one read-only statement, run in a
sandbox with a row cap, a byte cap on the encoded reply and a time limit that covers running,
fetching and encoding.

The sandbox is DuckDB's: no file or network access (``read_csv``, ``COPY``, URLs) and no
extension installed or loaded on demand. It is set on the database, so every connection of the
process has it, and DuckDB refuses to switch external access back on while the database is open.

Rows are fetched a few at a time and encoded as they come, so the reply never holds more than
``max_bytes`` of rows (DuckDB itself still computes a vector of up to 2048 rows at a time).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import duckdb

MAX_ROWS = 10_000
MAX_BYTES = 8 * 1024 * 1024
TIME_LIMIT_S = 10.0

_SANDBOX = (
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET enable_external_access = false",
)
_EXPLAIN = re.compile(r"^\s*explain\s+(?:analyze\s+|analyse\s+)?(?:\([^)]*\)\s*)?", re.I)
_READ_ONLY = {duckdb.StatementType.SELECT}


class ConsoleError(Exception):
    """The statement was refused, failed or ran too long (one sentence for the user)."""


def sandbox(con: duckdb.DuckDBPyConnection) -> None:
    """No file, network or extension access for any connection of ``con``'s database."""
    for stmt in _SANDBOX:
        con.execute(stmt)


def temp_views(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The statements making ``con``'s temporary views (a read-only store's views), which
    cursors of ``con`` do not see: a console cursor runs them first (``run``'s ``prepare``)."""
    rows = con.execute("SELECT sql FROM duckdb_views() WHERE temporary AND NOT internal").fetchall()
    return [r[0] for r in rows if r[0]]


def make_views(views: list[str]) -> Callable[[duckdb.DuckDBPyConnection], None]:
    def prepare(cur: duckdb.DuckDBPyConnection) -> None:
        for v in views:
            cur.execute(v)

    return prepare


def read_only_statement(con: duckdb.DuckDBPyConnection, query: str) -> str:
    """The one statement of ``query`` if it is a SELECT (or EXPLAIN of one); else ConsoleError."""
    try:
        stmts = con.extract_statements(query)
    except duckdb.Error as e:
        raise ConsoleError(_first_line(e)) from e
    if not stmts:
        raise ConsoleError("the query is empty")
    if len(stmts) > 1:
        raise ConsoleError(f"run one statement at a time (got {len(stmts)})")
    stmt = stmts[0]
    if stmt.type == duckdb.StatementType.EXPLAIN:
        try:
            inner = con.extract_statements(_EXPLAIN.sub("", stmt.query, count=1))
        except duckdb.Error:
            inner = []
        if len(inner) == 1 and inner[0].type in _READ_ONLY:
            return stmt.query
    elif stmt.type in _READ_ONLY:
        return stmt.query
    name = str(stmt.type).rsplit(".", 1)[-1]
    raise ConsoleError(
        "only read-only queries are allowed (SELECT, or EXPLAIN of a SELECT); "
        f"this is a {name} statement"
    )


def json_value(v: Any) -> Any:
    """``v`` as JSON can hold it: non-finite floats as null, times as ISO text, bytes as hex."""
    if v is None or isinstance(v, str | int | bool):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, datetime | date):
        return v.isoformat()
    if isinstance(v, Decimal):
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).hex()
    if isinstance(v, list | tuple):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    return str(v)


@dataclass
class Result:
    """What a console statement gave: ``rows`` are kept as values (``raw``) or as JSON texts
    of the encoded rows (``encoded``), whichever the caller asked for."""

    columns: list[str]
    raw: list[tuple[Any, ...]] = field(default_factory=list)
    encoded: list[str] = field(default_factory=list)
    truncated_by: str | None = None  # "rows" or "bytes"
    bytes: int = 0
    elapsed_ms: float = 0.0

    @property
    def truncated(self) -> bool:
        return self.truncated_by is not None


def run(
    cur: duckdb.DuckDBPyConnection,
    query: str,
    *,
    limit: int = MAX_ROWS,
    max_bytes: int | None = MAX_BYTES,
    time_limit: float | None = TIME_LIMIT_S,
    encode: bool = True,
    prepare: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
) -> Result:
    """Run one read-only statement on ``cur``, a cursor of its own (so that other threads may
    use the store's connection meanwhile), and close it. At most ``limit`` rows and
    ``max_bytes`` of encoded rows (JSON, UTF-8) are kept; past either the result says it was
    truncated. Over ``time_limit`` seconds, counted
    until the last row is encoded, it is stopped with a ConsoleError. ``prepare(cursor)`` runs
    first (e.g. the temporary views a read-only store made on its own connection)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit if time_limit else math.inf
    running = threading.Event()
    running.set()
    timer: threading.Timer | None = None
    if time_limit:

        def stop() -> None:
            if running.is_set():
                cur.interrupt()

        timer = threading.Timer(time_limit, stop)
        timer.daemon = True
        timer.start()
    try:
        if prepare is not None:
            prepare(cur)
        stmt = read_only_statement(cur, query)
        try:
            res = cur.execute(stmt)
            out = Result([d[0] for d in res.description or ()])
            batch = 1
            while len(out.raw) + len(out.encoded) < limit:
                if time.perf_counter() > deadline:
                    raise _too_long(time_limit)
                rows = res.fetchmany(min(batch, limit - len(out.raw) - len(out.encoded)))
                if not rows:
                    break
                for row in rows:
                    text = json.dumps(json_value(list(row)), ensure_ascii=False)
                    size = len(text.encode()) + 1
                    if max_bytes is not None and out.bytes + size > max_bytes:
                        out.truncated_by = "bytes"
                        break
                    out.bytes += size
                    if encode:
                        out.encoded.append(text)
                    else:
                        out.raw.append(tuple(row))
                if out.truncated_by:
                    break
                # Rows of the size seen so far that fit in what is left (64 at most): a few
                # rows in memory at a time however wide they are.
                kept = len(out.raw) + len(out.encoded)
                per_row = out.bytes / kept if kept else 1
                left = (max_bytes or 1 << 62) - out.bytes
                batch = int(max(1, min(64, left // max(per_row, 1) // 4)))
            else:
                if res.fetchmany(1):
                    out.truncated_by = "rows"
            if time.perf_counter() > deadline:
                raise _too_long(time_limit)
        except duckdb.InterruptException as e:
            raise _too_long(time_limit) from e
        except duckdb.Error as e:
            if time_limit and time.perf_counter() >= deadline and "interrupt" in str(e).lower():
                raise _too_long(time_limit) from e
            raise ConsoleError(_first_line(e)) from e
    finally:
        running.clear()
        if timer is not None:
            timer.cancel()
        cur.close()
    out.elapsed_ms = (time.perf_counter() - t0) * 1000
    return out


def _too_long(limit: float | None) -> ConsoleError:
    return ConsoleError(f"the query was stopped: it ran longer than {limit or 0:g} s")


def _first_line(e: BaseException) -> str:
    msg = str(e).strip()
    return msg.splitlines()[0] if msg else type(e).__name__
