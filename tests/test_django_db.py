"""Django's execute hook (agent.instrument.django_db) in process, on the project's Django with
its sqlite backend: one call per statement whichever sqlite wrappers run (C or Python), the
call site above an application's own execute wrapper, errors, executemany, and statements
Django runs on the raw connection left to the driver patches. The Django versions, PostgreSQL
and real servers: tests/test_django_versions.py."""

from __future__ import annotations

import inspect
import os
import sqlite3
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import MYSQL, PG_DSN
from perfsleuth.wire.internal_sql import is_internal

HERE = os.path.abspath(__file__)


def here() -> int:
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


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


@pytest.fixture(scope="module")
def django_conn(tmp_path_factory: pytest.TempPathFactory, agent_data_dir: str) -> Iterator[Any]:
    """A Django sqlite connection (its own alias) to a table ``djdb_item`` of 10 rows, opened
    after the agent started (so its connection_created signal installs the hook)."""
    import django
    from django.apps import apps
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DEBUG=False, USE_TZ=True, INSTALLED_APPS=[], DATABASES={}, SECRET_KEY="x" * 50
        )
    if not apps.ready:
        django.setup()
    from django.db import connections

    from perfsleuth.agent.instrument import django_db

    django_db.install()  # as the agent's import hook does when Django is imported
    alias = "perfsleuth_django_db_test"
    path = str(tmp_path_factory.mktemp("djdb") / "db.sqlite3")
    with sqlite3.connect(path) as raw:
        raw.execute("CREATE TABLE djdb_item (id INTEGER PRIMARY KEY, name TEXT)")
        raw.executemany("INSERT INTO djdb_item VALUES (?, ?)", [(i, f"n{i}") for i in range(10)])
    raw.close()
    conf = {"default": {}, alias: {"ENGINE": "django.db.backends.sqlite3", "NAME": path}}
    connections.settings[alias] = connections.configure_settings(conf)[alias]
    conn = connections[alias]
    conn.ensure_connection()
    yield conn
    conn.close()


def db_calls(req: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in req["calls"] if c["kind"] == "db"]


def one_request(captured: Callable[[], list[dict[str, Any]]]) -> dict[str, Any]:
    reqs = captured()
    assert len(reqs) == 1, [r["endpoint"] for r in reqs]
    return reqs[0]


def test_hook_is_on_every_connection(django_conn: Any) -> None:
    from perfsleuth.agent.instrument.django_db import execute_wrapper

    assert django_conn.execute_wrappers.count(execute_wrapper) == 1
    django_conn.close()
    django_conn.ensure_connection()  # a reconnect: still once
    assert django_conn.execute_wrappers.count(execute_wrapper) == 1


def test_each_statement_once_from_the_application_line(
    django_conn: Any, sqlite_wrappers: str, in_request: Any, captured: Any
) -> None:
    seen: list[str] = []

    def app_wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)  # an application's own execute wrapper
        return execute(sql, params, many, context)

    rows = ((i,) for i in (1, 2))
    with (
        in_request("GET /django-db"),
        django_conn.execute_wrapper(app_wrapper),
        django_conn.cursor() as cur,
    ):
        for i in range(3):
            loop_line = here() + 1
            cur.execute("SELECT name FROM djdb_item WHERE id = %s", [i])
            assert cur.fetchone() == (f"n{i}",)
        all_line = here() + 1
        cur.execute("SELECT name FROM djdb_item WHERE id >= %s", [0])
        assert len(cur.fetchmany(4)) == 4 and len(cur.fetchall()) == 6
        many_line = here() + 1
        cur.executemany("UPDATE djdb_item SET name = name WHERE id = %s", rows)
    assert len(seen) == 5
    calls = db_calls(one_request(captured))
    assert len(calls) == 5, [c["fingerprint"] for c in calls]
    lines = [(Path(c["site_loc"]["file"]).resolve(), c["site_loc"]["line"]) for c in calls]
    me = Path(HERE).resolve()
    assert lines == [(me, loop_line)] * 3 + [(me, all_line), (me, many_line)]
    assert [c["rows"] for c in calls[:4]] == [1, 1, 1, 10]
    assert len({c["ph"] for c in calls[:3]}) == 3
    assert calls[4]["extra"] == {"many": 2} and calls[4]["rows"] == 2
    assert all(c["system"] == "sqlite" for c in calls)


def test_a_failing_statement_is_recorded_and_raised(
    django_conn: Any, sqlite_wrappers: str, in_request: Any, captured: Any
) -> None:
    from django.db import OperationalError

    with (
        in_request("GET /django-db-error"),
        django_conn.cursor() as cur,
        pytest.raises(OperationalError),
    ):
        cur.execute("SELECT nothing FROM no_such_table WHERE id = %s", [1])
    (call,) = db_calls(one_request(captured))
    assert call["error"] == "OperationalError"


def test_raw_connection_statements_stay_with_the_driver(
    django_conn: Any, sqlite_wrappers: str, in_request: Any, captured: Any
) -> None:
    """What Django runs on the raw connection (DEBUG's QUOTE helper) is recorded by the driver
    patch, once; the store files it as internal (test_internal_sql)."""
    with in_request("GET /django-db-raw"):
        with django_conn.cursor() as cur:
            cur.execute("SELECT name FROM djdb_item WHERE id = %s", [1])
            cur.fetchall()
        raw = django_conn.connection.cursor()
        assert raw.execute("SELECT QUOTE(?)", ("a",)).fetchone() == ("'a'",)
    calls = db_calls(one_request(captured))
    assert [c["fingerprint"] for c in calls] == [
        "SELECT name FROM djdb_item WHERE id = ?",
        "SELECT QUOTE(?)",
    ]


def test_outside_a_request_nothing_is_kept(django_conn: Any) -> None:
    from perfsleuth.agent import recorder

    errors = recorder.stats["internal_errors"]
    with django_conn.cursor() as cur:
        cur.execute("SELECT name FROM djdb_item WHERE id = %s", [1])
        assert cur.fetchall() == [("n1",)]
        assert getattr(cur.cursor, "_perfsleuth_rows", None) is None
    assert recorder.stats["internal_errors"] == errors


def _as_mysqldb() -> Callable[[], None]:
    """PyMySQL as MySQLdb for Django's mysql backend; the function that undoes it. Django's
    imports of ``MySQLdb.err``, ``MySQLdb.constants.*`` ... load PyMySQL's modules a second
    time and rebind ``pymysql.err`` and alike to the copies (whose exception classes are not
    the ones PyMySQL raises): the other tests of this process need the originals back."""
    import pymysql
    import pymysql.constants

    packages = (pymysql, pymysql.constants)
    saved = [(pkg, dict(vars(pkg))) for pkg in packages]
    pymysql.install_as_MySQLdb()

    def restore() -> None:
        for pkg, attrs in saved:
            for name in [n for n in vars(pkg) if n not in attrs]:
                delattr(pkg, name)
            for name, value in attrs.items():
                setattr(pkg, name, value)
        for name in [n for n in sys.modules if n == "MySQLdb" or n.startswith("MySQLdb.")]:
            del sys.modules[name]

    return restore


@pytest.fixture(params=["postgresql", "mysql"])
def server_conn(request: pytest.FixtureRequest, django_conn: Any) -> Iterator[tuple[Any, str]]:
    """A Django connection (its own alias, not yet connected) to PostgreSQL (psycopg 3) or
    MariaDB (PyMySQL as MySQLdb), and a table of 10 rows there."""
    from urllib.parse import urlsplit

    from django.db import connections

    table = f"djdb_{uuid.uuid4().hex[:10]}"
    if request.param == "postgresql":
        import psycopg

        pg = urlsplit(PG_DSN)
        settings = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": pg.path.lstrip("/"),
            "USER": pg.username or "postgres",
            "PASSWORD": pg.password or "",
            "HOST": pg.hostname or "127.0.0.1",
            "PORT": str(pg.port or 5432),
        }
        raw: Any = psycopg.connect(PG_DSN, autocommit=True)
    else:
        import pymysql

        restore_pymysql = _as_mysqldb()
        request.addfinalizer(restore_pymysql)
        settings = {
            "ENGINE": "django.db.backends.mysql",
            "NAME": MYSQL["database"],
            "USER": MYSQL["user"],
            "PASSWORD": MYSQL["password"],
            "HOST": MYSQL["host"],
            "PORT": str(MYSQL["port"]),
        }
        raw = pymysql.connect(**MYSQL, autocommit=True)
    with raw.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, name TEXT)")
        cur.executemany(f"INSERT INTO {table} VALUES (%s, %s)", [(i, f"n{i}") for i in range(10)])
    alias = f"perfsleuth_django_db_{request.param}"
    connections.settings[alias] = connections.configure_settings({"default": {}, alias: settings})[
        alias
    ]
    conn = connections[alias]
    conn.close()
    try:
        yield conn, table
    finally:
        conn.close()
        with raw.cursor() as cur:
            cur.execute(f"DROP TABLE {table}")
        raw.close()


def test_server_backends_each_statement_once(
    server_conn: tuple[Any, str], in_request: Any, captured: Any
) -> None:
    """The hook on Django's PostgreSQL and MySQL backends (Python driver patches): each
    statement once, from the view's line, with its rows; the connection's own set-up, made in
    the request, is there too and is what the store files as internal."""
    conn, table = server_conn
    with in_request("GET /django-db-server"), conn.cursor() as cur:
        for i in range(3):
            loop_line = here() + 1
            cur.execute(f"SELECT name FROM {table} WHERE id = %s", [i])
            assert list(cur.fetchall()) == [(f"n{i}",)]
    calls = db_calls(one_request(captured))
    app = [c for c in calls if not is_internal(c["fingerprint"])]
    assert [c["fingerprint"] for c in app] == [f"SELECT name FROM {table} WHERE id = ?"] * 3
    assert [c["site_loc"]["line"] for c in app] == [loop_line] * 3
    assert [c["rows"] for c in app] == [1, 1, 1]
    assert {c["system"] for c in app} == {conn.vendor}
    assert len(calls) > len(app)  # the connection's set-up, recorded


def test_a_statement_the_c_path_declines_walks_it_once(
    django_conn: Any, in_request: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C site path declines a statement (-1: here, several stacks per site are asked for,
    which only Python's path keeps): the hook goes to Python's path directly, not through
    record_call, which would walk the C path a second time (issue 22 item 4)."""
    from perfsleuth.agent import recorder
    from perfsleuth.agent.instrument import django_db

    real = django_db._c_record_call
    if real is None:
        pytest.skip("the C accelerator is not built here")
    answers: list[int] = []

    def counted(*args: Any) -> int:
        i = real(*args)
        answers.append(i)
        return int(i)

    monkeypatch.setattr(django_db, "_c_record_call", counted)
    monkeypatch.setattr(recorder, "_c_record_call", counted)
    recorder.speedups.configure(stacks_per_site=2)
    try:
        with in_request("GET /django-declined") as req, django_conn.cursor() as cur:
            cur.execute("SELECT name FROM djdb_item WHERE id = %s", [3])
    finally:
        recorder.speedups.configure(stacks_per_site=recorder._stacks_per_site)
    assert answers == [-1]  # asked once
    sqls = [e[2] for e in req.site_list or []]
    assert sqls.count("SELECT name FROM djdb_item WHERE id = %s") == 1
