"""The SQL console (``POST /api/sql`` and ``perfsleuth sql``): one read-only statement, run in a
sandbox with a row cap, a byte cap on the encoded reply and a time limit that covers running,
fetching and encoding.

The sandbox is DuckDB's: no file or network access (``read_csv``, ``COPY``, URLs) and no
extension installed or loaded on demand. It is set on the database, so every connection of the
process has it, and DuckDB refuses to switch external access back on while the database is open.

Rows are fetched a few at a time and encoded as they come, so the reply never holds more than
``max_bytes`` of rows (DuckDB itself still computes a vector of up to 2048 rows at a time).

DuckDB's own memory is bounded for the console's statements only, so that ingest on the same
database keeps the engine's whole memory: sorts, hash tables and aggregates of the console's
connection get ``max_memory / 2`` (DuckDB's per-connection ``operator_memory_limit``; past it
they spill to the store's temporary directory, itself capped), and a watcher stops a
statement (an interrupt) once the console's statements running together have grown the process
by ``max_memory`` (one budget, :class:`_Budget`; the store's tables cached meanwhile aside): the
values DuckDB builds (``list``, ``string_agg``) are outside its memory limits. An interrupt
is seen between vectors only, so the functions that make one value of any size from a number
(``repeat``, ``lpad``, ``rpad``, ``range``, ``list_resize``, ``bar``, ...) are guarded by
macros of the same name (:func:`guard_functions`).
The statement is parsed by DuckDB (``json_serialize_sql``) and every call in it checked
(:func:`check_calls`): a guarded function named with its schema (which would reach DuckDB's own,
not the macro), ``printf``/``format`` with a format that is not constant or pads too far, and
the functions running SQL given as a value (``query``) are refused. A value larger than the
reply may hold is refused before it is encoded. The global ``memory_limit`` is left to ingest:
it bounds none of these.

One module (~650 lines) because the sandbox, the call checks, the guards and the memory budget
are one policy: a statement is safe only with all of them, and a reader sees them together.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import duckdb

MAX_ROWS = 10_000
MAX_BYTES = 8 * 1024 * 1024
TIME_LIMIT_S = 10.0
MAX_MEMORY = 256 * 1024 * 1024  # what a console statement may grow the process by
# After a statement stopped at its cap, the memory it had comes back to the system within a few
# seconds: a statement starting meanwhile waits for it (within its time limit), up to SETTLE_S.
SETTLE_S = 5.0
MAX_TEMP = "4GiB"  # what DuckDB may spill to the store's temporary directory
WATCH_S = 0.02  # how often the watcher looks at the time and the process's memory
VECTOR = 2048  # rows DuckDB computes at a time (its STANDARD_VECTOR_SIZE)

_SANDBOX = (
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET enable_external_access = false",
    # Console statements spill past their operator_memory_limit: not until the disk is full.
    f"SET max_temp_directory_size = '{MAX_TEMP}'",
    # Memory freed (a statement stopped at its cap) goes back to the system within seconds,
    # so that the next statement's cap starts from where the process rests.
    "SET allocator_background_threads = true",
)
_EXPLAIN = re.compile(r"^\s*explain\s+(?:analyze\s+|analyse\s+)?(?:\([^)]*\)\s*)?", re.I)
_READ_ONLY = {duckdb.StatementType.SELECT}
# Functions that make one value of any size from a number: guarded by macros of the same name
# (guard_functions), which a statement must call by their name alone.
GUARDED = frozenset(
    {"repeat", "lpad", "rpad", "range", "generate_series", "list_resize", "array_resize", "bar"}
    | {"bitstring", "to_base", "equi_width_bins"}
)
# Their width is in the format text: a constant one is checked (_check_format), no other runs.
FORMATS = frozenset({"printf", "format"})
# Functions that run SQL given as a value, which no check of the statement's text would see.
RUNS_SQL = frozenset({"query", "query_table", "json_execute_serialized_sql"})


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


def rss() -> int | None:
    """The process's resident memory in bytes (None where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Budget:
    """The console's one memory budget, shared by its statements running at once (they all
    grow the same process, whose resident memory is all that can be measured): counted from
    the process's size when the console went from idle to busy, less the store's tables
    cached since. Growth is shared out among the statements running while it happened (equal
    parts: nothing tells which one allocated); past the budget, the most recent statement
    with at least half the largest part is stopped (the one that took the console over, where
    the others had grown little), and the others count afresh from there. When an older
    statement starts growing after a quiet one joined, the quiet one is stopped first: the
    older one is stopped in turn if it goes on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.shares: dict[_Watch, int] = {}  # running statements: growth ascribed to each
        self.base = 0  # resident bytes when the first of them started
        self.last = 0  # resident bytes at the last look
        self.cached0 = 0  # the store's cached table bytes at that start
        # statements stopped at the budget: (until, resident bytes to come back to)
        self.settling: list[tuple[float, int]] = []

    def settle_target(self, now: float) -> tuple[float, int] | None:
        """The latest time and the lowest size the stopped statements' memory is awaited
        until (None when none is)."""
        with self.lock:
            self.settling = [s for s in self.settling if s[0] > now]
            if not self.settling:
                return None
            return max(s[0] for s in self.settling), min(s[1] for s in self.settling)


_budget = _Budget()


def cached_table_bytes(con: duckdb.DuckDBPyConnection) -> int:
    """The bytes of stored tables DuckDB's buffer pool holds (evictable, bounded by its
    memory_limit, shared with ingest): a statement reading the store grows the process by
    these without making anything."""
    row = con.execute(
        "SELECT coalesce(sum(memory_usage_bytes), 0) FROM duckdb_memory() WHERE tag = 'BASE_TABLE'"
    ).fetchone()
    return int(row[0]) if row else 0


class _Watch:
    """Interrupts ``cur``'s statement past ``deadline``, or when the console's statements
    together grew the process by more than ``max_memory`` (:class:`_Budget`) and this one has
    the largest part of it; ``stopped`` says which."""

    def __init__(
        self, cur: duckdb.DuckDBPyConnection, time_limit: float | None, max_memory: int | None
    ) -> None:
        self.cur = cur
        self.time_limit = time_limit
        self.max_memory = max_memory
        self.deadline = time.perf_counter() + time_limit if time_limit else math.inf
        self.stopped: str | None = None  # "time" or "memory"
        self.together = False  # stopped at the budget while other statements ran
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._mon: duckdb.DuckDBPyConnection | None = None
        now = rss() if max_memory else None
        settle = _budget.settle_target(time.perf_counter()) if now is not None else None
        if now is not None and max_memory and settle is not None:
            # what a stopped statement had is still the process's: wait until it is not
            until = min(settle[0], self.deadline)
            while now > settle[1] + max_memory // 4 and time.perf_counter() < until:
                time.sleep(WATCH_S)
                now = rss() or now
        self.watched = now is not None and bool(max_memory)
        if self.watched:
            self._mon = cur.cursor()  # the watcher's own connection, for duckdb_memory()
            cached = cached_table_bytes(self._mon)
            with _budget.lock:
                if not _budget.shares:
                    _budget.base = _budget.last = now or 0
                    _budget.cached0 = cached
                _budget.shares[self] = 0
        if time_limit or self.watched:
            t = threading.Thread(target=self._watch, name="perfsleuth-sql-watch", daemon=True)
            t.start()

    def _watch(self) -> None:
        while not self._done.wait(WATCH_S):
            victim = None
            with self._lock:  # done() waits: the statement's thread closes the cursors
                if self._done.is_set() or self.stopped:
                    return
                if time.perf_counter() > self.deadline:
                    self.stopped = "time"
                    self.cur.interrupt()
                    return
                if self.watched:
                    victim = self._over()
            if victim is not None:
                victim.interrupt()

    def interrupt(self) -> None:
        with self._lock:
            if not self._done.is_set():
                self.cur.interrupt()

    def _over(self) -> _Watch | None:
        """The statement to stop for memory (marked so), if the console is over its budget."""
        now = rss() or 0
        cached = 0
        if now > _budget.base + (self.max_memory or 0) and self._mon is not None:
            # over on its face: less the store's tables cached meanwhile (evictable)?
            try:
                cached = cached_table_bytes(self._mon) - _budget.cached0
            except duckdb.Error:
                cached = 0
        with _budget.lock:
            running = [w for w in _budget.shares if not w.stopped]
            if running:
                part = (now - _budget.last) // len(running)
                for w in running:
                    _budget.shares[w] = max(0, _budget.shares[w] + part)
            _budget.last = now
            if now - cached <= _budget.base + (self.max_memory or 0) or not running:
                return None
            # the latest started (dicts keep insertion order) of those with at least half the
            # largest part: growth that began when it did is most likely its own
            top = max(_budget.shares[w] for w in running)
            victim = next(w for w in reversed(running) if 2 * _budget.shares[w] >= top)
            victim.stopped = "memory"
            victim.together = len(_budget.shares) > 1
            # its memory comes back to the system within seconds: statements starting meanwhile
            # wait for it, and the others running count afresh from now (none of what it made
            # is theirs to answer for)
            _budget.settling.append((time.perf_counter() + SETTLE_S, now - _budget.shares[victim]))
            _budget.base = now
            for w in running:
                _budget.shares[w] = 0
            return victim

    def done(self) -> None:
        with self._lock:
            self._done.set()
            if self._mon is not None:
                self._mon.close()
        with _budget.lock:
            _budget.shares.pop(self, None)

    def check(self) -> None:
        """ConsoleError if the statement was stopped, or its time is up."""
        if self.stopped is None and time.perf_counter() > self.deadline:
            self.stopped = "time"
        if self.stopped:
            raise self.error()

    def error(self) -> ConsoleError:
        if self.stopped == "memory":
            if self.together:
                return ConsoleError(
                    "the query was stopped: the console's statements together used more than "
                    f"{_mb(self.max_memory)} of memory, this one the most (make its values or "
                    "results smaller)"
                )
            return ConsoleError(
                "the query was stopped: it used more than "
                f"{_mb(self.max_memory)} of memory (make its values or results smaller)"
            )
        return _too_long(self.time_limit)


def guard_functions(max_memory: int) -> list[str]:
    """Temporary macros, for one connection, in front of the functions that make one value of
    any size from a number (``repeat``, ``lpad``, ``rpad``, the list-valued ``range`` and
    ``generate_series``): a value over ``max_memory / VECTOR`` (characters; list items count
    16 bytes) is an error, so that a whole vector of them stays within ``max_memory``. Such a
    value is allocated in one go, before anything else could stop it. Table functions
    (``FROM range(...)``) are not affected."""
    cap = _cap(max_memory)
    items = max(cap // 16, 64)

    def too_big(what: str, limit: int) -> str:
        return (
            f"error('{what} would make a value of more than {limit:,} "
            f"{'items' if limit == items else 'characters'} (the console memory limit)')"
        )

    def over(a: str, b: str, s: str) -> str:
        # range(a, b, s) makes more than ``items`` items; numbers, dates and times alike
        d = f"(({b} + {s} * 0) - {a})"
        n = f"{s} * {items}"
        return f"(({d} > {n} AND {n} > {s} * 0) OR ({d} < {n} AND {n} < {s} * 0))"

    # The function gets harmless arguments when over the limit: constant folding computes
    # the ELSE branch too.
    out = []
    big = f"length(s) * n * (CASE WHEN typeof(s) LIKE '%[]' THEN 16 ELSE 1 END) > {cap}"
    out.append(
        f"CREATE OR REPLACE TEMP MACRO repeat(s, n) AS CASE WHEN {big} THEN "
        f"{too_big('repeat', cap)} ELSE system.main.repeat(s, CASE WHEN {big} THEN 0 ELSE n END) "
        "END"
    )
    for f in ("lpad", "rpad"):
        out.append(
            f"CREATE OR REPLACE TEMP MACRO {f}(s, n, p) AS CASE WHEN n > {cap} THEN "
            f"{too_big(f, cap)} ELSE system.main.{f}(s, least(n, {cap}), p) END"
        )
    for f in ("range", "generate_series"):
        out.append(
            f"CREATE OR REPLACE TEMP MACRO {f}(b) AS CASE WHEN b > {items} THEN "
            f"{too_big(f, items)} ELSE system.main.{f}(least(b, {items})) END, "
            f"(a, b) AS CASE WHEN b - a > {items} THEN {too_big(f, items)} "
            f"ELSE system.main.{f}(a, CASE WHEN b - a > {items} THEN a ELSE b END) END, "
            f"(a, b, s) AS CASE WHEN {over('a', 'b', 's')} THEN {too_big(f, items)} "
            f"ELSE system.main.{f}(a, CASE WHEN {over('a', 'b', 's')} THEN a ELSE b END, s) END"
        )
    for f in ("list_resize", "array_resize"):
        out.append(
            f"CREATE OR REPLACE TEMP MACRO {f}(l, n) AS CASE WHEN n > {items} THEN "
            f"{too_big(f, items)} ELSE system.main.{f}(l, least(n, {items})) END, "
            f"(l, n, v) AS CASE WHEN n > {items} THEN {too_big(f, items)} "
            f"ELSE system.main.{f}(l, least(n, {items}), v) END"
        )
    # bar's characters are 3 bytes each in UTF-8
    out.append(
        "CREATE OR REPLACE TEMP MACRO bar(x, lo, hi) AS system.main.bar(x, lo, hi), "
        f"(x, lo, hi, w) AS CASE WHEN w > {cap // 3} THEN {too_big('bar', cap)} "
        f"ELSE system.main.bar(x, lo, hi, least(w, {cap // 3})) END"
    )
    out.append(
        f"CREATE OR REPLACE TEMP MACRO bitstring(s, n) AS CASE WHEN n > {cap} THEN "
        f"{too_big('bitstring', cap)} ELSE system.main.bitstring(s, least(n, {cap})) END"
    )
    out.append(
        "CREATE OR REPLACE TEMP MACRO to_base(n, r) AS system.main.to_base(n, r), "
        f"(n, r, m) AS CASE WHEN m > {cap} THEN {too_big('to_base', cap)} "
        f"ELSE system.main.to_base(n, r, least(m, {cap})) END"
    )
    out.append(
        f"CREATE OR REPLACE TEMP MACRO equi_width_bins(a, b, n, nice) AS CASE WHEN n > {items} "
        f"THEN {too_big('equi_width_bins', items)} "
        f"ELSE system.main.equi_width_bins(a, b, least(n, {items}), nice) END"
    )
    return out


def _calls(tree: Any) -> Iterator[dict[str, Any]]:
    """Every function call of a statement's parse tree (``json_serialize_sql``), at any depth:
    select lists, FROM, subqueries, lambdas, window and filter clauses alike."""
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if v.get("class") == "FUNCTION" and isinstance(v.get("function_name"), str):
                yield v
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _fmt_widths_ok(text: str, cap: int, name: str) -> bool:
    """True when the format text ``text`` of printf/format pads to at most ``cap`` characters:
    every width or precision in it is a number of at most ``cap`` (none given by an argument)."""
    if any(int(d) > cap for d in re.findall(r"\d+", text)):
        return False
    if name == "printf":
        return "*" not in text
    # fmt: a width taken from an argument is a field inside a field ({:>{}})
    fields = text.replace("{{", "").replace("}}", "")
    return re.search(r"\{[^}]*\{", fields) is None


def check_calls(con: duckdb.DuckDBPyConnection, stmt: str, max_memory: int) -> set[str]:
    """The names of the functions ``stmt`` calls (lowercase), after refusing (ConsoleError)
    what would get around the console's memory guard: a guarded function named with its
    catalog or schema (which reaches the function itself, not its macro), printf/format with a
    format that is not constant text or pads beyond the cap, and the functions that run SQL
    given as a value. The statement is parsed by DuckDB itself, so quoting, comments and
    spacing in the text change nothing; a statement it cannot parse so is refused."""
    inner = _EXPLAIN.sub("", stmt, count=1)
    try:
        row = con.execute("SELECT json_serialize_sql(?)", [inner]).fetchone()
    except duckdb.Error as e:
        raise ConsoleError(_first_line(e)) from e
    tree = json.loads(row[0]) if row and row[0] else {"error": True}
    if tree.get("error"):
        raise ConsoleError(
            "the console could not check this statement for its memory limit: "
            + str(tree.get("error_message") or "it could not be parsed")
        )
    cap = _cap(max_memory)
    names: set[str] = set()
    for call in _calls(tree.get("statements")):
        name = str(call["function_name"]).lower()
        names.add(name)
        if name in RUNS_SQL:
            raise ConsoleError(f"{name}() is not available in the console")
        if name in GUARDED | FORMATS and (call.get("catalog") or call.get("schema")):
            raise ConsoleError(
                f"call {name}() by its name alone (the console memory limit guards it so)"
            )
        if name in FORMATS:
            args = call.get("arguments") or []
            first = args[0].get("expression", args[0]) if args else {}
            lit = first.get("literal") if isinstance(first, dict) else None
            if (
                first.get("class") != "CONSTANT"
                or not isinstance(lit, dict)
                or lit.get("kind") != "STRING"
                or not _fmt_widths_ok(str(lit.get("text", "")), cap, name)
            ):
                raise ConsoleError(
                    f"{name}() takes a constant format here, with widths of at most {cap:,} "
                    "characters (the console memory limit)"
                )
    return names


def _cap(max_memory: int) -> int:
    """The characters one guarded value may have: a whole vector of them within max_memory."""
    return max(max_memory // VECTOR, 1024)


def _mb(n: int | None) -> str:
    return f"{(n or 0) / 2**20:g} MB"


def _longer_than(row: tuple[Any, ...] | list[Any], budget: int) -> bool:
    """True when ``row``'s texts, bytes and items alone exceed ``budget`` (so that a huge
    value is refused before it is encoded)."""
    stack: list[Any] = [row]
    total = 0
    while stack:
        v = stack.pop()
        if isinstance(v, str | bytes | bytearray):
            total += len(v)
        elif isinstance(v, list | tuple):
            total += len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.values())
        if total > budget:
            return True
    return False


def run(
    cur: duckdb.DuckDBPyConnection,
    query: str,
    *,
    limit: int = MAX_ROWS,
    max_bytes: int | None = MAX_BYTES,
    time_limit: float | None = TIME_LIMIT_S,
    max_memory: int | None = MAX_MEMORY,
    encode: bool = True,
    prepare: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
) -> Result:
    """Run one read-only statement on ``cur``, a cursor of its own (so that other threads may
    use the store's connection meanwhile), and close it. At most ``limit`` rows and
    ``max_bytes`` of encoded rows (JSON, UTF-8) are kept; past either the result says it was
    truncated. Over ``time_limit`` seconds, counted
    until the last row is encoded, or once the process grew by ``max_memory`` bytes, it is
    stopped with a ConsoleError. ``prepare(cursor)`` runs first (e.g. the temporary views a
    read-only store made on its own connection)."""
    t0 = time.perf_counter()
    try:
        watch = _Watch(cur, time_limit, max_memory)
    except duckdb.Error as e:
        cur.close()
        raise ConsoleError(_first_line(e)) from e
    try:
        if prepare is not None:
            prepare(cur)
        stmt = read_only_statement(cur, query)
        if max_memory:
            # sorts, hash tables, aggregates: of this connection only (ingest keeps its own)
            cur.execute(f"SET operator_memory_limit = '{max(max_memory // 2, 1 << 20)}B'")
            if check_calls(cur, stmt, max_memory) & GUARDED:
                for guard in guard_functions(max_memory):
                    cur.execute(guard)
        try:
            res = cur.execute(stmt)
            out = Result([d[0] for d in res.description or ()])
            batch = 1
            while len(out.raw) + len(out.encoded) < limit:
                watch.check()
                rows = res.fetchmany(min(batch, limit - len(out.raw) - len(out.encoded)))
                if not rows:
                    break
                for row in rows:
                    left = (max_bytes or 1 << 62) - out.bytes
                    if max_bytes is not None and _longer_than(row, left):
                        out.truncated_by = "bytes"
                        break
                    if not _append(out, row, max_bytes, encode):
                        break
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
            watch.check()
        except duckdb.InterruptException as e:
            raise (watch.error() if watch.stopped else _too_long(time_limit)) from e
        except duckdb.OutOfMemoryException as e:
            raise ConsoleError(
                f"the query needs more memory than the console allows ({_mb(max_memory)}): "
                + _first_line(e)
            ) from e
        except duckdb.Error as e:
            if watch.stopped and "interrupt" in str(e).lower():
                raise watch.error() from e
            raise ConsoleError(_first_line(e)) from e
    finally:
        watch.done()
        # a result not read to its end (rows or bytes cap) is stopped, not finished by close()
        cur.interrupt()
        cur.close()
    out.elapsed_ms = (time.perf_counter() - t0) * 1000
    return out


def _append(out: Result, row: Any, max_bytes: int | None, encode: bool) -> bool:
    """Add ``row`` to ``out`` (as its JSON line when ``encode``, else as a tuple) unless its
    line would take ``out`` past ``max_bytes``: then mark ``out`` truncated and say False."""
    text = json.dumps(json_value(list(row)), ensure_ascii=False)
    size = len(text.encode()) + 1
    if max_bytes is not None and out.bytes + size > max_bytes:
        out.truncated_by = "bytes"
        return False
    out.bytes += size
    if encode:
        out.encoded.append(text)
    else:
        out.raw.append(tuple(row))
    return True


def _too_long(limit: float | None) -> ConsoleError:
    return ConsoleError(f"the query was stopped: it ran longer than {limit or 0:g} s")


def _first_line(e: BaseException) -> str:
    msg = str(e).strip()
    return msg.splitlines()[0] if msg else type(e).__name__


def run_on_store(
    store: Any,
    query: str,
    limit: int,
    max_bytes: int | None,
    encode: bool = True,
    time_limit: float | None = None,
) -> Result:
    """A console statement on a store whose engine is not DuckDB (ClickHouse): the engine's
    own read-only statement (``store.sql``, which its server runs read-only and stops past
    ``time_limit``), capped like :func:`run` by rows and bytes."""
    from perfsleuth.store.base import StoreError

    started = time.monotonic()
    try:
        columns, rows = store.sql(query, limit + 1, time_limit=time_limit, max_bytes=max_bytes)
    except StoreError as e:
        if "TIMEOUT_EXCEEDED" in str(e):
            raise _too_long(time_limit) from e
        raise ConsoleError(str(e)) from e
    out = Result(list(columns))
    for row in rows[:limit]:
        if not _append(out, row, max_bytes, encode):
            break
    else:
        if len(rows) > limit:
            out.truncated_by = "rows"
    out.elapsed_ms = (time.monotonic() - started) * 1000
    return out
