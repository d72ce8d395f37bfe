"""Database instrumentation against real drivers and servers: sqlite3, psycopg (sync and
async), psycopg2, PyMySQL, asyncpg, SQLAlchemy (statements once + pool waits) and Django.

No timing thresholds: the assertions are about counts, fingerprints, parameter hashes, rows,
error names and call sites (file and line of the statement in this file).
"""

from __future__ import annotations

import glob
import inspect
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from conftest import MYSQL, PG_DSN

SECRET = "hunter2-secret"
HERE = os.path.abspath(__file__)


def here() -> int:
    """The line number of the caller (statements are placed on the next line)."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def table_name() -> str:
    return f"ps_{uuid.uuid4().hex[:12]}"


def one_request(captured: Callable[[], list[dict[str, Any]]]) -> dict[str, Any]:
    reqs = captured()
    assert len(reqs) == 1, [r["endpoint"] for r in reqs]
    return reqs[0]


def db_calls(req: dict[str, Any], *, connect: bool = False) -> list[dict[str, Any]]:
    calls = [c for c in req["calls"] if c["kind"] == "db"]
    if not connect:
        calls = [c for c in calls if c["fingerprint"] != "CONNECT"]
    return calls


def assert_site(call: dict[str, Any], line: int) -> None:
    loc = call["site_loc"]
    assert loc is not None
    assert os.path.abspath(loc["file"]) == HERE, loc
    assert loc["line"] == line, (loc, line)
    assert loc["app"] is True


def assert_no_secret(data_dir: str) -> None:
    files = [p for p in glob.glob(os.path.join(data_dir, "spool", "*")) if os.path.isfile(p)]
    assert files
    for path in files:
        with open(path, "rb") as fh:
            assert SECRET.encode() not in fh.read(), path


# ---------------------------------------------------------------------------------------------
# One scenario for every synchronous DB-API driver


def dbapi_scenario(
    conn: Any,
    *,
    mark: str,
    system: str,
    error: type[BaseException],
    in_request: Callable[..., Any],
    captured: Callable[[], list[dict[str, Any]]],
    agent_data_dir: str,
) -> list[dict[str, Any]]:
    """create / executemany / 5 distinct SELECTs / 2 identical / 1000 rows / an error."""
    t = table_name()
    cur = conn.cursor()
    try:
        with in_request("GET /dbapi"):
            cur.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY, name VARCHAR(100))")
            cur.executemany(
                f"INSERT INTO {t} (id, name) VALUES ({mark}, {mark})",
                [(i, f"n{i}") for i in range(1, 1001)],
            )
            cur.execute(f"INSERT INTO {t} (id, name) VALUES (5000, '{SECRET}')")
            for i in range(1, 6):
                loop_line = here() + 1
                cur.execute(f"SELECT name FROM {t} WHERE id = {mark}", (i,))
                assert list(cur.fetchall()) == [(f"n{i}",)]
            for _ in range(2):
                cur.execute(f"SELECT name FROM {t} WHERE id = {mark}", (7,))
                cur.fetchall()
            big_line = here() + 1
            cur.execute(f"SELECT id, name FROM {t} WHERE id <= {mark} ORDER BY id", (1000,))
            assert len(cur.fetchall()) == 1000
            with pytest.raises(error) as raised:
                err_line = here() + 1
                cur.execute(f"SELECT * FROM {t}_missing")
        assert type(raised.value) is error or isinstance(raised.value, error)
        assert f"{t}_missing" in str(raised.value)
        # outside a request: nothing is recorded
        cur.execute(f"SELECT name FROM {t} WHERE id = {mark}", (3,))
        cur.fetchall()
    finally:
        cur.execute(f"DROP TABLE {t}")
        if hasattr(conn, "commit"):
            conn.commit()

    calls = db_calls(one_request(captured))
    assert len(calls) == 12, [c["fingerprint"] for c in calls]
    assert {c["system"] for c in calls} == {system}
    create, many, secret_insert = calls[0], calls[1], calls[2]
    assert create["op"] == "CREATE"
    assert many["op"] == "INSERT"
    assert many["extra"] == {"many": 1000}
    assert many["rows"] == 1000
    assert "ph" in many
    assert secret_insert["rows"] == 1

    loop = calls[3:8]
    assert {c["fingerprint"] for c in loop} == {f"SELECT name FROM {t} WHERE id = ?"}
    assert len({c["ph"] for c in loop}) == 5
    assert [c["rows"] for c in loop] == [1] * 5
    for c in loop:
        assert_site(c, loop_line)
    same = calls[8:10]
    assert same[0]["fingerprint"] == loop[0]["fingerprint"]
    assert same[0]["ph"] == same[1]["ph"]
    assert same[0]["ph"] not in {c["ph"] for c in loop}

    big = calls[10]
    assert big["rows"] == 1000
    assert big["op"] == "SELECT"
    assert_site(big, big_line)

    failed = calls[11]
    assert failed["error"] == type(raised.value).__name__
    assert failed["fingerprint"] == f"SELECT * FROM {t}_missing"
    assert_site(failed, err_line)

    for c in calls:
        assert SECRET not in c["fingerprint"]
        assert c["dur"] >= 0
        assert c["stack_locs"], c
    assert_no_secret(agent_data_dir)
    return calls


# ---------------------------------------------------------------------------------------------
# sqlite3: every test runs with the C wrappers (agent/_speedups.c) and with the Python ones


@pytest.fixture(params=["c", "python"])
def sqlite_wrappers(request: pytest.FixtureRequest, agent_data_dir: str) -> Iterator[str]:
    from perfsleuth.agent.instrument import dbapi

    sqlite3.connect(":memory:").close()  # the patch made the instrumented classes
    if request.param == "c" and not dbapi.use_speedups(True):
        pytest.skip("the C accelerator is not built here")
    if request.param == "python":
        dbapi.use_speedups(False)
    yield request.param
    dbapi.use_speedups(True)


def test_the_c_accelerator_is_built_where_a_compiler_is() -> None:
    import shutil

    from perfsleuth.agent import recorder

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the agent runs its Python wrappers")
    assert recorder.speedups is not None, "pip install built no perfsleuth.agent._speedups"


def test_sqlite3_scenario(tmp_path, in_request, captured, agent_data_dir, sqlite_wrappers) -> None:
    conn = sqlite3.connect(str(tmp_path / "a.db"))
    assert isinstance(conn, sqlite3.Connection)
    assert isinstance(conn.cursor(), sqlite3.Cursor)
    try:
        dbapi_scenario(
            conn,
            mark="?",
            system="sqlite",
            error=sqlite3.OperationalError,
            in_request=in_request,
            captured=captured,
            agent_data_dir=agent_data_dir,
        )
    finally:
        conn.close()


def test_sqlite3_row_counting_and_shortcuts(
    tmp_path, in_request, captured, sqlite_wrappers
) -> None:
    conn = sqlite3.connect(str(tmp_path / "b.db"))
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    conn.executemany("INSERT INTO t (v) VALUES (?)", [(str(i),) for i in range(50)])
    conn.commit()
    with in_request("GET /rows"):
        cur = conn.cursor()
        cur.execute("SELECT v FROM t")
        n_iter = sum(1 for _ in cur)  # iteration
        cur.execute("SELECT v FROM t WHERE id <= 10")
        first = cur.fetchone()
        some = cur.fetchmany(3)
        rest = cur.fetchall()
        assert first is not None and len(some) == 3 and len(rest) == 6
        assert cur.fetchone() is None
        cur.execute("SELECT v FROM t WHERE id <= 20")
        cur.fetchmany(5)  # the app reads only 5 of 20
        shortcut = conn.execute("SELECT v FROM t WHERE id > ?", (40,)).fetchall()
        conn.execute("UPDATE t SET v = 'x' WHERE id <= 7")
        conn.executemany("UPDATE t SET v = ? WHERE id = ?", ((str(i), i) for i in range(3)))
        conn.executescript("UPDATE t SET v = 'y' WHERE id = 1; UPDATE t SET v = 'z' WHERE id = 2;")
        cur.execute("SELECT v FROM t")
        cur.execute("SELECT v FROM t WHERE id = 1")  # first one never fetched: rows 0
        cur.fetchall()
    conn.close()
    assert n_iter == 50 and len(shortcut) == 10
    # the C wrappers read a plain cursor's fields in place (the Python ones by name)
    assert type(cur).execute.__class__.__name__ == (
        "CursorMethod" if sqlite_wrappers == "c" else "function"
    )
    assert sqlite_wrappers != "c" or all(
        getattr(type(cur), m).in_place for m in ("execute", "fetchone", "fetchall")
    )
    calls = db_calls(one_request(captured))
    rows = [c.get("rows") for c in calls]
    assert rows == [50, 10, 5, 10, 7, 2, None, 0, 1]
    assert calls[5]["extra"] == {"many": 3}
    assert "ph" not in calls[5]  # generator arguments are not hashed
    assert calls[6]["fingerprint"].startswith("UPDATE t SET v = ?")


def test_sqlite3_row_factory_and_user_factories(
    tmp_path, in_request, captured, sqlite_wrappers
) -> None:
    class MyCursor(sqlite3.Cursor):
        seen = 0

        def execute(self, sql, params=(), /):  # type: ignore[override]
            MyCursor.seen += 1
            return super().execute(sql, params)

    class MyConn(sqlite3.Connection):
        def cursor(self, factory=MyCursor):  # type: ignore[override]
            return super().cursor(factory)

    path = str(tmp_path / "c.db")
    conn = sqlite3.connect(path, factory=MyConn)
    conn2 = sqlite3.connect(path, 5.0, 0, "DEFERRED", True, MyConn)  # positional factory
    assert type(conn).__mro__[1] is MyConn and isinstance(conn, MyConn)
    assert isinstance(conn2, MyConn)
    conn.row_factory = sqlite3.Row
    with in_request("GET /factories"):
        cur = conn.cursor()
        assert isinstance(cur, MyCursor) and isinstance(cur, sqlite3.Cursor)
        cur.execute("SELECT 1 AS a UNION ALL SELECT 2")
        rows = cur.fetchall()
        assert rows[0]["a"] == 1
        c2 = conn2.cursor(sqlite3.Cursor)
        c2.execute("SELECT 3")
        assert c2.fetchone() == (3,)
        with conn:
            conn.execute("CREATE TABLE IF NOT EXISTS x (a)")
    conn.close()
    conn2.close()
    assert MyCursor.seen == 1
    calls = db_calls(one_request(captured))
    assert [c["rows"] for c in calls[:2]] == [2, 1]
    assert len(calls) == 3


def test_sqlite3_cursor_factory_with_slots(tmp_path, in_request, captured, sqlite_wrappers) -> None:
    """A factory that adds slots of its own cannot be mixed with the instrumented cursor (both
    lay out slots): its calls are still recorded, rows counted by name."""

    class SlotCursor(sqlite3.Cursor):
        __slots__ = ("mine",)

    conn = sqlite3.connect(str(tmp_path / "s.db"))
    with in_request("GET /slots"):
        cur = conn.cursor(SlotCursor)
        cur.mine = 1
        cur.execute("SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3")
        assert len(cur.fetchall()) == 3
        assert isinstance(cur, SlotCursor) and cur.mine == 1
        assert not hasattr(cur, "__dict__")
    conn.close()
    calls = db_calls(one_request(captured))
    assert [c["rows"] for c in calls] == [3]


def test_sqlite3_patch_is_idempotent(tmp_path, in_request, captured, sqlite_wrappers) -> None:
    from perfsleuth.agent.instrument import dbapi, django_db

    dbapi.patch_sqlite3(sqlite3)
    dbapi.patch_sqlite3(sqlite3)
    django_db.patch_sqlite_backend(sqlite3)
    assert sqlite3.connect is sqlite3.dbapi2.connect
    conn = sqlite3.connect(str(tmp_path / "d.db"))
    with in_request("GET /twice"):
        conn.execute("SELECT 1").fetchall()
    conn.close()
    calls = db_calls(one_request(captured))
    assert len(calls) == 1 and calls[0]["rows"] == 1


def test_sqlite3_executemany_error(tmp_path, in_request, captured, sqlite_wrappers) -> None:
    conn = sqlite3.connect(str(tmp_path / "e.db"))
    conn.execute("CREATE TABLE u (id INTEGER PRIMARY KEY)")
    with in_request("GET /err"), pytest.raises(sqlite3.IntegrityError):
        conn.executemany("INSERT INTO u (id) VALUES (?)", [(1,), (1,)])
    conn.close()
    (call,) = db_calls(one_request(captured))
    assert call["error"] == "IntegrityError"
    assert call["extra"] == {"many": 2}


# ---------------------------------------------------------------------------------------------
# psycopg 3


def test_psycopg_scenario(in_request, captured, agent_data_dir) -> None:
    import psycopg

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        assert isinstance(conn, psycopg.Connection)
        assert type(conn.cursor()) is psycopg.Cursor
        calls = dbapi_scenario(
            conn,
            mark="%s",
            system="postgresql",
            error=psycopg.errors.UndefinedTable,
            in_request=in_request,
            captured=captured,
            agent_data_dir=agent_data_dir,
        )
    assert calls[0]["fingerprint"].startswith("CREATE TABLE")


def test_psycopg_cursor_kinds(in_request, captured) -> None:
    import psycopg
    from psycopg import sql
    from psycopg.rows import dict_row

    t = table_name()
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY)")
        conn.cursor().executemany(f"INSERT INTO {t} VALUES (%s)", [(i,) for i in range(20)])
        try:
            with in_request("GET /kinds"):
                rows = conn.execute(f"SELECT id FROM {t} WHERE id < %s", (5,)).fetchall()
                assert len(rows) == 5
                with conn.cursor(row_factory=dict_row) as cur:
                    cur.execute(
                        sql.SQL("SELECT id FROM {} WHERE id = %s").format(sql.Identifier(t)), (3,)
                    )
                    assert cur.fetchone() == {"id": 3}
                with psycopg.ClientCursor(conn) as cur:
                    cur.execute(f"SELECT id FROM {t} WHERE id = %s", (4,))
                with conn.transaction(), conn.cursor(name="srv") as cur:
                    cur.execute(f"SELECT id FROM {t}")
                    assert len(cur.fetchall()) == 20
                conn.cursor().execute(f"DELETE FROM {t} WHERE id >= %s", (15,))
        finally:
            conn.execute(f"DROP TABLE {t}")
    calls = db_calls(one_request(captured))
    assert len(calls) == 5, [c["fingerprint"] for c in calls]
    assert calls[0]["rows"] == 5
    assert calls[1]["fingerprint"] == f'SELECT id FROM "{t}" WHERE id = ?'
    assert calls[1]["rows"] == 1
    assert calls[2]["rows"] == 1
    assert calls[3]["fingerprint"] == f"SELECT id FROM {t}"
    assert calls[4]["rows"] == 5 and calls[4]["op"] == "DELETE"


def test_psycopg_named_parameters_are_hashed_while_the_request_runs(in_request, captured) -> None:
    """Named parameters (``%(name)s``, SQLAlchemy's on psycopg) are hashed on the request path
    as positional ones are: the request keeps no reference to the application's values for
    the writer (only values that cannot be hashed are left to it, hashed by their text), and
    the same values in another key order hash alike."""
    import psycopg

    from perfsleuth.agent import recorder

    t = table_name()
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY, name TEXT)")
        try:
            with in_request("GET /named") as req:
                q = f"SELECT id FROM {t} WHERE id = %(id)s AND name = %(name)s"
                conn.cursor().execute(q, {"id": 1, "name": "a"})
                conn.cursor().execute(q, {"name": "a", "id": 1})
                conn.cursor().execute(q, {"id": 2, "name": "a"})
                conn.cursor().execute(f"SELECT id FROM {t} WHERE id = ANY(%(ids)s)", {"ids": [1]})
                conn.cursor().execute(f"SELECT count(*) FROM {t}", {})  # nothing to hash
                left = {i // recorder.ROW: sorted(v) for i, v in (req.more or {}).items()}
        finally:
            conn.execute(f"DROP TABLE {t}")
    assert left == {3: ["params"]}  # only the list-valued call's parameters wait for the writer
    calls = db_calls(one_request(captured))
    assert len(calls) == 5
    assert calls[0]["ph"] == calls[1]["ph"]
    assert calls[2]["ph"] != calls[0]["ph"]
    assert calls[3]["ph"] is not None
    assert "ph" not in calls[4]


async def test_psycopg_async(in_request, captured) -> None:
    import psycopg

    t = table_name()
    aconn = await psycopg.AsyncConnection.connect(PG_DSN, autocommit=True)
    try:
        with in_request("GET /async"):
            async with aconn.cursor() as cur:
                await cur.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY, name TEXT)")
                await cur.executemany(
                    f"INSERT INTO {t} VALUES (%s, %s)", [(i, SECRET) for i in range(1000)]
                )
                for i in range(5):
                    line = here() + 1
                    await cur.execute(f"SELECT name FROM {t} WHERE id = %s", (i,))
                    await cur.fetchall()
                await cur.execute(f"SELECT * FROM {t}")
                assert len(await cur.fetchall()) == 1000
                with pytest.raises(psycopg.errors.UndefinedTable):
                    await cur.execute(f"SELECT * FROM {t}_nope")
        async with aconn.cursor() as cur:
            await cur.execute(f"DROP TABLE {t}")
    finally:
        await aconn.close()
    calls = db_calls(one_request(captured))
    assert len(calls) == 9
    assert calls[1]["extra"] == {"many": 1000}
    loop = calls[2:7]
    assert len({c["fingerprint"] for c in loop}) == 1 and len({c["ph"] for c in loop}) == 5
    for c in loop:
        assert_site(c, line)
    assert calls[7]["rows"] == 1000
    assert calls[8]["error"] == "UndefinedTable"


# ---------------------------------------------------------------------------------------------
# psycopg2


def test_psycopg2_scenario(in_request, captured, agent_data_dir) -> None:
    import psycopg2
    import psycopg2.extensions

    conn = psycopg2.connect(PG_DSN)
    conn.autocommit = True
    assert isinstance(conn, psycopg2.extensions.connection)
    assert isinstance(conn.cursor(), psycopg2.extensions.cursor)
    try:
        dbapi_scenario(
            conn,
            mark="%s",
            system="postgresql",
            error=psycopg2.errors.UndefinedTable,
            in_request=in_request,
            captured=captured,
            agent_data_dir=agent_data_dir,
        )
    finally:
        conn.close()


def test_psycopg2_cursor_factories(in_request, captured) -> None:
    import psycopg2
    import psycopg2.extras
    from psycopg2 import sql

    conn = psycopg2.connect(PG_DSN, cursor_factory=psycopg2.extras.RealDictCursor)
    conn.autocommit = True
    dict_conn = psycopg2.connect(PG_DSN, connection_factory=psycopg2.extras.DictConnection)
    assert isinstance(dict_conn, psycopg2.extras.DictConnection)
    try:
        with in_request("GET /factories"):
            cur = conn.cursor()
            assert isinstance(cur, psycopg2.extras.RealDictCursor)
            cur.execute("SELECT 1 AS a UNION ALL SELECT 2")
            assert cur.fetchall() == [{"a": 1}, {"a": 2}]
            nt = conn.cursor(cursor_factory=psycopg2.extras.NamedTupleCursor)
            nt.execute("SELECT %s AS b", (5,))
            assert nt.fetchone().b == 5
            dc = dict_conn.cursor()
            assert isinstance(dc, psycopg2.extras.DictCursor)
            dc.execute(sql.SQL("SELECT {} AS c").format(sql.Literal(SECRET)))
            assert dc.fetchone()["c"] == SECRET
            named = conn.cursor("srv")  # server-side cursor, positional name
            conn.autocommit = False
            named.execute("SELECT generate_series(1, 10)")
            assert len(named.fetchall()) == 10
            conn.rollback()
    finally:
        conn.close()
        dict_conn.close()
    calls = db_calls(one_request(captured))
    assert [c.get("rows") for c in calls[:3]] == [2, 1, 1]
    assert len(calls) == 4
    assert SECRET not in calls[2]["fingerprint"]
    assert calls[2]["fingerprint"] == "SELECT ? AS c"


# ---------------------------------------------------------------------------------------------
# PyMySQL


def test_pymysql_scenario(in_request, captured, agent_data_dir) -> None:
    import pymysql

    conn = pymysql.connect(**MYSQL, autocommit=True)
    assert isinstance(conn.cursor(), pymysql.cursors.Cursor)
    try:
        dbapi_scenario(
            conn,
            mark="%s",
            system="mysql",
            error=pymysql.err.ProgrammingError,
            in_request=in_request,
            captured=captured,
            agent_data_dir=agent_data_dir,
        )
    finally:
        conn.close()


def test_pymysql_cursor_kinds(in_request, captured) -> None:
    import pymysql
    import pymysql.cursors

    t = table_name()
    conn = pymysql.connect(**MYSQL, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY, v INTEGER)")
            cur.executemany(f"INSERT INTO {t} VALUES (%s, %s)", [(i, i) for i in range(30)])
        with in_request("GET /kinds"):
            with conn.cursor(pymysql.cursors.DictCursor) as cur:
                cur.execute(f"SELECT v FROM {t} WHERE id < %s", (4,))
                assert len(cur.fetchall()) == 4
                # not an INSERT ... VALUES: PyMySQL loops over execute() internally
                cur.executemany(f"UPDATE {t} SET v = %s WHERE id = %s", [(0, 1), (0, 2), (0, 3)])
            with conn.cursor(pymysql.cursors.SSCursor) as cur:
                cur.execute(f"SELECT v FROM {t}")
                assert len(cur.fetchall()) == 30
    finally:
        with conn.cursor() as cur:
            cur.execute(f"DROP TABLE {t}")
        conn.close()
    calls = db_calls(one_request(captured))
    assert len(calls) == 3
    assert calls[0]["rows"] == 4
    assert calls[1]["extra"] == {"many": 3} and calls[1]["rows"] == 3
    assert "rows" not in calls[2]  # unbuffered: the driver does not know


# ---------------------------------------------------------------------------------------------
# asyncpg


async def test_asyncpg(in_request, captured, agent_data_dir) -> None:
    import asyncpg

    t = table_name()
    conn = await asyncpg.connect(PG_DSN)
    assert isinstance(conn, asyncpg.Connection)
    try:
        with in_request("GET /asyncpg"):
            await conn.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY, name TEXT)")
            await conn.executemany(
                f"INSERT INTO {t} VALUES ($1, $2)", [(i, f"n{i}") for i in range(1, 1001)]
            )
            status = await conn.execute(f"INSERT INTO {t} VALUES (5000, '{SECRET}')")
            assert status == "INSERT 0 1"
            for i in range(1, 6):
                loop_line = here() + 1
                await conn.fetch(f"SELECT name FROM {t} WHERE id = $1", i)
            for _ in range(2):
                await conn.fetchrow(f"SELECT name FROM {t} WHERE id = $1", 7)
            big_line = here() + 1
            assert len(await conn.fetch(f"SELECT * FROM {t} WHERE id <= $1", 1000)) == 1000
            assert await conn.fetchval(f"SELECT count(*) FROM {t}") == 1001
            stmt = await conn.prepare(f"SELECT name FROM {t} WHERE id > $1")
            assert len(await stmt.fetch(990)) == 11
            with pytest.raises(asyncpg.exceptions.UndefinedTableError):
                err_line = here() + 1
                await conn.fetch(f"SELECT * FROM {t}_missing")
        # outside a request
        await conn.fetch(f"SELECT name FROM {t} WHERE id = $1", 3)
    finally:
        await conn.execute(f"DROP TABLE {t}")
        await conn.close()

    calls = db_calls(one_request(captured))
    assert len(calls) == 14, [c["fingerprint"] for c in calls]
    assert {c["system"] for c in calls} == {"postgresql"}
    assert calls[1]["extra"] == {"many": 1000}
    assert calls[2]["rows"] == 1
    loop = calls[3:8]
    assert {c["fingerprint"] for c in loop} == {f"SELECT name FROM {t} WHERE id = ?"}
    assert len({c["ph"] for c in loop}) == 5
    assert [c["rows"] for c in loop] == [1] * 5
    for c in loop:
        assert_site(c, loop_line)
    assert calls[8]["ph"] == calls[9]["ph"] and calls[8]["rows"] == 1
    assert calls[10]["rows"] == 1000
    assert_site(calls[10], big_line)
    assert calls[11]["rows"] == 1
    assert calls[12]["rows"] == 11 and calls[12]["fingerprint"].endswith("id > ?")
    assert calls[13]["error"] == "UndefinedTableError"
    assert_site(calls[13], err_line)
    assert_no_secret(agent_data_dir)


async def test_asyncpg_pool(in_request, captured) -> None:
    import asyncpg

    pool = await asyncpg.create_pool(PG_DSN, min_size=1, max_size=2)
    try:
        with in_request("GET /pool"):
            async with pool.acquire() as conn:
                line = here() + 1
                assert await conn.fetchval("SELECT $1::int + 1", 41) == 42
                rows = await conn.fetchmany("SELECT $1::int AS x", [(1,), (2,), (3,)])
                assert len(rows) == 3
            assert await pool.fetchval("SELECT 7") == 7
    finally:
        await pool.close()
    # asyncpg's reset query on release is a real round trip and is recorded too
    calls = [c for c in db_calls(one_request(captured)) if "RESET ALL" not in c["fingerprint"]]
    assert len(calls) == 3, [c["fingerprint"] for c in calls]
    assert_site(calls[0], line)
    assert calls[1]["extra"] == {"many": 3} and calls[1]["rows"] == 3


# ---------------------------------------------------------------------------------------------
# SQLAlchemy: statements once (recorded by the driver), pool checkout waits


def _sa_roundtrip(engine: Any, in_request: Callable[..., Any], system: str, captured: Any) -> None:
    import sqlalchemy as sa

    meta = sa.MetaData()
    t = sa.Table(
        table_name(),
        meta,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(50)),
    )
    meta.create_all(engine)
    try:
        with engine.begin() as conn:  # warm: first connect runs dialect initialisation queries
            conn.execute(t.insert(), [{"id": i, "name": f"n{i}"} for i in range(1, 301)])
        with in_request("GET /sa"):
            with engine.connect() as conn:
                for i in range(1, 6):
                    query = sa.select(t.c.name).where(t.c.id == i)
                    line = here() + 1
                    assert conn.execute(query).scalar_one() == f"n{i}"
                big_line = here() + 1
                assert len(conn.execute(sa.select(t)).all()) == 300
                conn.execute(t.update().where(t.c.id <= 10).values(name=SECRET))
                conn.commit()
            with pytest.raises(sa.exc.DBAPIError) as raised, engine.connect() as conn:
                conn.execute(sa.text(f"SELECT * FROM {t.name}_missing"))
    finally:
        meta.drop_all(engine)
        engine.dispose()
    calls = db_calls(one_request(captured))
    assert len(calls) == 8, [c["fingerprint"] for c in calls]  # each statement exactly once
    assert {c["system"] for c in calls} == {system}
    loop = calls[:5]
    assert len({c["fingerprint"] for c in loop}) == 1 and len({c["ph"] for c in loop}) == 5
    assert [c["rows"] for c in loop] == [1] * 5
    for c in loop:
        assert_site(c, line)
    assert calls[5]["rows"] == 300
    assert_site(calls[5], big_line)
    assert calls[6]["op"] == "UPDATE" and calls[6]["rows"] == 10
    assert calls[7]["error"] == type(raised.value.orig).__name__


def test_sqlalchemy_over_sqlite(tmp_path, in_request, captured) -> None:
    import sqlalchemy as sa

    _sa_roundtrip(sa.create_engine(f"sqlite:///{tmp_path}/sa.db"), in_request, "sqlite", captured)


def test_sqlalchemy_over_psycopg(in_request, captured) -> None:
    import sqlalchemy as sa

    url = PG_DSN.replace("postgresql://", "postgresql+psycopg://", 1)
    _sa_roundtrip(sa.create_engine(url), in_request, "postgresql", captured)


def test_sqlalchemy_memory_sqlite_singleton_pool(in_request, captured) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine("sqlite://")
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    with in_request("GET /mem"), engine.connect() as conn:
        assert conn.execute(sa.text("SELECT :x"), {"x": 2}).scalar() == 2
    engine.dispose()
    (call,) = db_calls(one_request(captured))
    assert call["fingerprint"] == "SELECT ?" and call["rows"] == 1


def _hold(engine: Any, held: threading.Event, seconds: float) -> threading.Thread:
    def run() -> None:
        with engine.connect():
            held.set()
            time.sleep(seconds)

    th = threading.Thread(target=run)
    th.start()
    assert held.wait(10)
    return th


def test_sqlalchemy_pool_wait(in_request, captured) -> None:
    import sqlalchemy as sa

    url = PG_DSN.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = sa.create_engine(url, pool_size=1, max_overflow=0, pool_timeout=30)
    with engine.connect() as conn:  # warm the single pooled connection
        conn.execute(sa.text("SELECT 1"))
    th = _hold(engine, threading.Event(), 0.1)
    try:
        with in_request("GET /wait"):
            line = here() + 1
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT 2")).scalar() == 2
    finally:
        th.join()
        engine.dispose()
    calls = db_calls(one_request(captured), connect=True)
    assert [c["fingerprint"] for c in calls] == ["CONNECT", "SELECT ?"]
    wait = calls[0]
    assert wait["wait"] > 0 and wait["system"] == "postgresql" and "error" not in wait
    assert_site(wait, line)


def test_sqlalchemy_pool_timeout(tmp_path, in_request, captured) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(
        f"sqlite:///{tmp_path}/t.db",
        poolclass=sa.pool.QueuePool,
        pool_size=1,
        max_overflow=0,
        pool_timeout=0.05,
    )
    th = _hold(engine, threading.Event(), 0.5)
    try:
        with in_request("GET /timeout"), pytest.raises(sa.exc.TimeoutError):
            engine.connect()
    finally:
        th.join()
        engine.dispose()
    (call,) = db_calls(one_request(captured), connect=True)
    assert call["fingerprint"] == "CONNECT" and call["error"] == "TimeoutError"
    assert call["wait"] > 0 and call["system"] == "sqlite"


# ---------------------------------------------------------------------------------------------
# Django (sqlite backend): the driver patch sees each statement once, from the view's line


@pytest.fixture(scope="module")
def django_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    import django
    from django.apps import apps
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DEBUG=False, USE_TZ=True, INSTALLED_APPS=[], DATABASES={}, SECRET_KEY="x" * 50
        )
    if not apps.ready:
        django.setup()
    from django.db import connections, models

    alias = "perfsleuth_instrument_test"
    path = str(tmp_path_factory.mktemp("django") / "dj.sqlite3")
    conf = {"default": {}, alias: {"ENGINE": "django.db.backends.sqlite3", "NAME": path}}
    connections.settings[alias] = connections.configure_settings(conf)[alias]

    class Item(models.Model):
        name = models.CharField(max_length=50)

        class Meta:
            app_label = "perfsleuth_instrument_test"

    conn = connections[alias]
    with conn.schema_editor() as editor:
        editor.create_model(Item)
    yield conn, Item
    conn.close()


def test_django_raw_cursor(django_db, in_request, captured) -> None:
    conn, item = django_db
    conn.ensure_connection()  # the connection's own PRAGMAs run outside the request
    table = item._meta.db_table
    with in_request("GET /django/raw"):
        with conn.cursor() as cur:
            line = here() + 1
            cur.executemany(
                f"INSERT INTO {table} (name) VALUES (%s)", ((f"n{i}",) for i in range(20))
            )
            for i in range(1, 4):
                loop_line = here() + 1
                cur.execute(f"SELECT name FROM {table} WHERE id = %s", [i])
                assert cur.fetchone() is not None
        assert isinstance(conn.connection, sqlite3.Connection)
    calls = db_calls(one_request(captured))
    assert len(calls) == 4
    assert calls[0]["extra"] == {"many": 20} and calls[0]["rows"] == 20
    assert_site(calls[0], line)
    loop = calls[1:]
    assert {c["fingerprint"] for c in loop} == {f"SELECT name FROM {table} WHERE id = ?"}
    assert len({c["ph"] for c in loop}) == 3
    for c in loop:
        assert_site(c, loop_line)
        assert c["rows"] == 1


def test_django_orm(django_db, in_request, captured) -> None:
    conn, item = django_db
    alias = conn.alias
    conn.ensure_connection()
    item.objects.using(alias).bulk_create([item(name=f"o{i}") for i in range(10)])
    with in_request("GET /django/orm"):
        for pk in (1, 2, 3):
            line = here() + 1
            assert item.objects.using(alias).filter(pk=pk).first() is not None
        list_line = here() + 1
        everything = list(item.objects.using(alias).all())
        item.objects.using(alias).filter(name=SECRET).update(name="x")
    assert len(everything) >= 10
    calls = db_calls(one_request(captured))
    assert len(calls) == 5, [c["fingerprint"] for c in calls]
    first = calls[:3]
    assert len({c["fingerprint"] for c in first}) == 1
    assert len({c["ph"] for c in first}) == 3
    for c in first:
        assert_site(c, line)
        assert c["rows"] == 1
    assert calls[3]["rows"] == len(everything)
    assert_site(calls[3], list_line)
    assert calls[4]["op"] == "UPDATE" and calls[4]["rows"] == 0


# ---------------------------------------------------------------------------------------------
# Outside a request, and patching twice


def test_nothing_recorded_outside_a_request(tmp_path, captured, sqlite_wrappers) -> None:
    import psycopg
    import psycopg2
    import pymysql

    from perfsleuth.agent import recorder

    errors = recorder.stats["internal_errors"]
    assert recorder.current() is None
    conn = sqlite3.connect(str(tmp_path / "o.db"))
    conn.execute("SELECT 1").fetchall()
    cur = conn.cursor()
    cur.execute("SELECT 1")
    assert getattr(cur, "_perfsleuth_rows", None) is None  # no call kept on the cursor either
    conn.close()
    with psycopg.connect(PG_DSN) as pg:
        pg.execute("SELECT 1").fetchall()
    pg2 = psycopg2.connect(PG_DSN)
    pg2.cursor().execute("SELECT 1")
    pg2.close()
    my = pymysql.connect(**MYSQL)
    my.cursor().execute("SELECT 1")
    my.close()
    assert captured() == []
    assert recorder.stats["internal_errors"] == errors


def test_patches_are_idempotent(tmp_path, in_request, captured) -> None:
    import asyncpg
    import psycopg
    import psycopg2
    import pymysql
    import pymysql.cursors
    import sqlalchemy
    from sqlalchemy.pool import base as pool_base

    from perfsleuth.agent.instrument import asyncpg as i_asyncpg
    from perfsleuth.agent.instrument import dbapi
    from perfsleuth.agent.instrument import sqlalchemy as i_sqlalchemy

    before = (
        sqlite3.connect,
        psycopg.Cursor.execute,
        psycopg.AsyncCursor.executemany,
        psycopg2.connect,
        pymysql.cursors.Cursor.execute,
        asyncpg.connection.Connection.fetch,
        pool_base.Pool.connect,
    )
    for _ in range(2):
        dbapi.patch_sqlite3(sqlite3)
        dbapi.patch_psycopg(psycopg)
        dbapi.patch_psycopg2(psycopg2)
        dbapi.patch_pymysql(pymysql)
        i_asyncpg.patch(asyncpg)
        i_sqlalchemy.patch(sqlalchemy)
    after = (
        sqlite3.connect,
        psycopg.Cursor.execute,
        psycopg.AsyncCursor.executemany,
        psycopg2.connect,
        pymysql.cursors.Cursor.execute,
        asyncpg.connection.Connection.fetch,
        pool_base.Pool.connect,
    )
    assert before == after
    for fn in after:
        assert hasattr(fn, "_perfsleuth_orig")
    pg2 = psycopg2.connect(PG_DSN)
    with in_request("GET /once"):
        cur = pg2.cursor()
        cur.execute("SELECT 1")
    pg2.close()
    (call,) = db_calls(one_request(captured))
    assert call["rows"] == 1
