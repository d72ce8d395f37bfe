"""Django's statements on every supported Django: 3.2 (whose sqlite backend calls the C
``Database.Cursor.execute`` and bypassed the driver patch), 4.2 and 5.x, on SQLite and
PostgreSQL, under runserver and gunicorn, launched as ``perfsleuth run`` launches them.

Each Django other than the project's own runs from its own virtualenv, made by the
``django_python`` fixture under ``.venvs/`` at the repository root and reused while its pins
hold (pinned Django, the project's gunicorn and psycopg; the project's ``src`` on the path
through a ``.pth`` file). ``pip install -e`` is not used: it would rebuild the C accelerator in
``src/`` in place, under every other process using it; the venvs run the same Python as the
project's, so they load the built one.

What is checked, per request, in the store (after ``perfsleuth ingest``): the exact number of
the application's statements (``kind = 'db'``: 1 + 60 on the N+1 page, 2 on its prefetching
twin, 1 on the raw-cursor page), their call site (the view's line), their rows, and that what
Django runs for itself (``PRAGMA``, ``SET``, DEBUG's ``SELECT QUOTE(?)``) is ``db.internal``,
counted by no detector: the clean pages raise no finding.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from conftest import PG_DSN
from perfsleuth.analysis import Config, find
from perfsleuth.store.duckdb_store import DuckDBStore
from test_run_servers import START_TIMEOUT, Server, child_env, free_port

pytestmark = pytest.mark.venvs  # makes virtualenvs on a cold cache (see the module docstring)

REPO = Path(__file__).resolve().parent.parent
APPS = Path(__file__).parent / "apps"
VIEWS = APPS / "djversions" / "views.py"
VENVS = REPO / ".venvs"
AUTHORS = 60  # views.AUTHORS: the N+1 page's authors
BOOKS_PER_AUTHOR = 2
# The Djangos tested: the latest release of each line (5.x: the project's own when it is one)
DJANGOS = {"3.2": "3.2.25", "4.2": "4.2.30", "5.x": "5.2.19"}
# Django 3.2 predates psycopg 3: psycopg2 there; psycopg 3 (which 4.2 and 5.x prefer) elsewhere
DRIVER = {"3.2": "psycopg2-binary", "4.2": "psycopg[binary]", "5.x": "psycopg[binary]"}


def view_line(marker: str) -> int:
    lines = VIEWS.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


def _pinned(requirement: str) -> str:
    name = requirement.split("[")[0]
    return f"{requirement}=={metadata.version(name)}"


def _venv(series: str) -> Path:
    """The python of a virtualenv with Django ``series``, made on first use (under a lock:
    parallel test runs share the cache). Django 3.2 imports ``cgi``, which Python 3.13 removed:
    its cases skip there."""
    if series == "3.2" and sys.version_info >= (3, 13):
        pytest.skip("Django 3.2 does not run on Python 3.13 (it imports cgi)")
    pins = [f"Django=={DJANGOS[series]}", _pinned("gunicorn"), _pinned(DRIVER[series])]
    where = VENVS / f"django-{DJANGOS[series]}-py{sys.version_info[0]}{sys.version_info[1]}"
    python = where / "bin" / "python"
    stamp = where / "perfsleuth-pins.json"
    want = json.dumps({"pins": pins, "src": str(REPO / "src")})
    VENVS.mkdir(exist_ok=True)
    with open(VENVS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == want and python.exists():
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(where)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *pins],
            check=True,
            timeout=900,
            stdin=subprocess.DEVNULL,
        )
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        (Path(site) / "perfsleuth-src.pth").write_text(str(REPO / "src") + "\n")
        stamp.write_text(want)
    return python


@pytest.fixture(scope="session")
def django_python() -> Iterator[Any]:
    """``django_python(series)``: the python to run Django ``series`` with."""
    made: dict[str, Path] = {}

    def get(series: str) -> Path:
        if series not in made:
            own = metadata.version("django")
            if own == DJANGOS[series]:
                made[series] = Path(sys.executable)
            else:
                made[series] = _venv(series)
        return made[series]

    yield get


# ------------------------------------------------------------------------------ the data


def _seed_rows() -> tuple[list[tuple[int, str]], list[tuple[int, int, str]]]:
    authors = [(i, f"author {i}") for i in range(1, AUTHORS + 6)]
    books = [(a * 10 + k, a, f"book {a}.{k}") for a, _ in authors for k in range(BOOKS_PER_AUTHOR)]
    return authors, books


@contextmanager
def database(kind: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A seeded database for the djversions project: its settings' environment."""
    authors, books = _seed_rows()
    if kind == "sqlite":
        path = tmp_path / "djv.sqlite3"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE djv_author (id INTEGER PRIMARY KEY, name TEXT NOT NULL)")
            conn.execute(
                "CREATE TABLE djv_book (id INTEGER PRIMARY KEY, author_id INTEGER NOT NULL"
                " REFERENCES djv_author (id), title TEXT NOT NULL)"
            )
            conn.executemany("INSERT INTO djv_author VALUES (?, ?)", authors)
            conn.executemany("INSERT INTO djv_book VALUES (?, ?, ?)", books)
        conn.close()
        yield {"DJV_DB": "sqlite", "DJV_SQLITE": str(path)}
        return
    import psycopg

    schema = f"djv_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.djv_author (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute(
            f"CREATE TABLE {schema}.djv_book (id INTEGER PRIMARY KEY, author_id INTEGER"
            f" NOT NULL REFERENCES {schema}.djv_author (id), title TEXT NOT NULL)"
        )
        with conn.cursor() as cur:
            cur.executemany(f"INSERT INTO {schema}.djv_author VALUES (%s, %s)", authors)
            cur.executemany(f"INSERT INTO {schema}.djv_book VALUES (%s, %s, %s)", books)
    try:
        yield {"DJV_DB": "postgresql", "DJV_PG_DSN": PG_DSN, "DJV_PG_SCHEMA": schema}
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


# --------------------------------------------------------------------------- the servers


def server_command(python: Path, server: str) -> list[str]:
    if server == "runserver":
        return [str(python), "-m", "django", "runserver", "127.0.0.1:{port}", "--noreload"]
    return [
        str(python), "-m", "gunicorn", "-w", "2", "-b", "127.0.0.1:{port}",
        "--timeout", "120", "--graceful-timeout", "60", "djversions.wsgi:application",
    ]  # fmt: skip


@contextmanager
def launched(
    python: Path, server: str, data: Path, log_dir: Path, env: dict[str, str]
) -> Iterator[Server]:
    """The project under ``perfsleuth run``'s launcher, with ``python``'s Django."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in server_command(python, server)]
    log = log_dir / f"{server}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(python), "-m", "perfsleuth.agent.launch", "--data", str(data), "--", *cmd],
            cwd=APPS,
            env=child_env(DJANGO_SETTINGS_MODULE="djversions.settings", **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    srv = Server(proc, port, log)
    try:
        srv.wait_ready("/health/")
        yield srv
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def stop(srv: Server, server: str) -> None:
    """Graceful stop: SIGTERM for gunicorn; Ctrl-C for runserver (which has no SIGTERM
    handler of its own)."""
    srv.proc.send_signal(signal.SIGINT if server == "runserver" else signal.SIGTERM)
    assert srv.proc.wait(timeout=START_TIMEOUT) in (0, 1, -signal.SIGINT), srv.log.read_text()


def sql(data: Path, query: str) -> list[dict[str, Any]]:
    with DuckDBStore(str(data)) as store:
        cols, rows = store.sql(query, limit=100_000)
    return [dict(zip(cols, row, strict=True)) for row in rows]


PAGES = {"/n1/": "GET /n1/", "/clean/": "GET /clean/", "/raw/": "GET /raw/"}
APP_STATEMENTS = {"GET /n1/": 1 + AUTHORS, "GET /clean/": 2, "GET /raw/": 1}


def drive(srv: Server, rounds: int) -> None:
    for _ in range(rounds):
        for path in PAGES:
            status, body = srv.get(path)
            assert status == 200, body[:2000]


def run(django_python: Any, tmp_path: Path, series: str, db: str, server: str, rounds: int) -> Path:
    """Drive the pages ``rounds`` times under the agent; the ingested data dir."""
    python = django_python(series)
    data = tmp_path / "data"
    debug = "1" if server == "runserver" else "0"  # runserver as in development: DEBUG on
    with (
        database(db, tmp_path) as env,
        launched(python, server, data, tmp_path, {**env, "DJV_DEBUG": debug}) as srv,
    ):
        drive(srv, rounds)
        stop(srv, server)
    with DuckDBStore(str(data)) as store:
        store.ingest()
    return data


def per_request(data: Path) -> list[dict[str, Any]]:
    return sql(
        data,
        "SELECT r.trace_id, r.endpoint, r.db_calls,"
        " count(c.seq) FILTER (WHERE c.kind = 'db') AS app,"
        " count(c.seq) FILTER (WHERE c.kind = 'db.internal') AS internal"
        " FROM requests r LEFT JOIN calls c USING (trace_id)"
        " WHERE r.endpoint <> 'GET /health/' GROUP BY ALL",
    )


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("server", ["runserver", "gunicorn"])
@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
@pytest.mark.parametrize("series", list(DJANGOS))
def test_every_statement_once(
    django_python: Any, tmp_path: Path, series: str, db: str, server: str
) -> None:
    rounds = 2
    data = run(django_python, tmp_path, series, db, server, rounds)
    reqs = per_request(data)
    assert sorted(r["endpoint"] for r in reqs) == sorted(list(PAGES.values()) * rounds)
    for r in reqs:
        assert (r["endpoint"], r["app"]) == (r["endpoint"], APP_STATEMENTS[r["endpoint"]])
        assert r["db_calls"] == r["app"]  # the request's own count leaves internals out too

    # Where and how much: the N+1 statement from the view's loop line, a book list each
    loop = sql(
        data,
        "SELECT l.file, l.line, c.rows, f.text FROM calls c"
        " JOIN locations l ON l.id = c.site_id JOIN fingerprints f ON f.id = c.fingerprint_id"
        " WHERE c.endpoint = 'GET /n1/' AND c.kind = 'db' AND c.seq > 0"
        " AND f.text NOT LIKE '%LIMIT%'",
    )
    assert len(loop) == AUTHORS * rounds
    assert {(Path(r["file"]).name, r["line"]) for r in loop} == {
        ("views.py", view_line("N+1: one statement per author"))
    }
    assert {r["rows"] for r in loop} == {BOOKS_PER_AUTHOR}
    first = sql(
        data,
        "SELECT c.rows FROM calls c JOIN fingerprints f ON f.id = c.fingerprint_id"
        " WHERE c.endpoint = 'GET /n1/' AND c.kind = 'db' AND f.text LIKE '%LIMIT%'",
    )
    assert [r["rows"] for r in first] == [AUTHORS] * rounds

    # What Django runs for itself is kept, as internal
    internal = sql(
        data,
        "SELECT DISTINCT f.text, f.kind FROM calls c JOIN fingerprints f"
        " ON f.id = c.fingerprint_id WHERE c.kind = 'db.internal'",
    )
    assert all(r["kind"] == "db.internal" for r in internal)
    if db == "sqlite" and server == "runserver":  # DEBUG: last_executed_query's helper
        assert any(r["text"].startswith("SELECT QUOTE(?)") for r in internal), internal
    app_texts = sql(
        data,
        "SELECT DISTINCT f.text FROM calls c JOIN fingerprints f ON f.id = c.fingerprint_id"
        " WHERE c.kind = 'db'",
    )
    for r in app_texts:
        assert "QUOTE(" not in r["text"] and not r["text"].startswith(("PRAGMA", "SET")), r


@pytest.mark.parametrize("series", ["3.2", "5.x"])
def test_debug_helpers_raise_no_finding(django_python: Any, tmp_path: Path, series: str) -> None:
    """Django on sqlite with DEBUG=True (runserver): the N+1 page is found at the view's line;
    the clean pages, whose every statement DEBUG follows with a QUOTE helper, raise nothing."""
    data = run(django_python, tmp_path, series, "sqlite", "runserver", rounds=6)
    internal = sql(data, "SELECT count(*) AS n FROM calls WHERE kind = 'db.internal'")
    assert internal[0]["n"] > 0  # the helpers were recorded and ingested
    with DuckDBStore(str(data)) as store:
        found = [f.to_dict() for f in find(store, config=Config())]
    by_endpoint = {(f["kind"], f["endpoint"]) for f in found}
    assert ("n_plus_one", "GET /n1/") in by_endpoint, found
    n1 = next(f for f in found if f["kind"] == "n_plus_one")
    assert n1["callsite"]["line"] == view_line("N+1: one statement per author")
    assert not [f for f in found if f["endpoint"] in ("GET /clean/", "GET /raw/")], found
    assert not [f for f in found if "QUOTE" in json.dumps(f)], found
