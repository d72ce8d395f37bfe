"""Framework-internal statements (wire.internal_sql): the store files them as ``db.internal``,
which no detector counts, and the application's statements stay ``db``; on segments written
with the real wire encoder and on what the real in-process agent records."""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.analysis import Config, find
from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.wire.internal_sql import INTERNAL_KIND, is_internal
from spoolwrite import SegmentWriter, call

SITE = ("app/views.py", 12, "page")
ITEM = "SELECT * FROM items WHERE id = ?"
QUOTE = "SELECT QUOTE(?)"


@pytest.mark.parametrize(
    "sql",
    [
        "PRAGMA foreign_keys = ON",
        "  SET TIME ZONE %s",
        "/* django */ SET search_path TO app",
        "show standard_conforming_strings",
        "SELECT QUOTE(?), QUOTE(?), QUOTE(?)",
        "select pg_catalog.version()",
        "SELECT typarray FROM pg_type WHERE typname = %s",
        "SELECT name FROM sqlite_master WHERE type = 'table'",
        "SELECT table_name FROM information_schema.tables",
        "SELECT @@SQL_AUTO_IS_NULL",
        "select sqlite_compileoption_used(?)",
        "SELECT set_config(?, ?, false)",
    ],
)
def test_internal_statements(sql: str) -> None:
    assert is_internal(sql)


@pytest.mark.parametrize(
    "sql",
    [
        ITEM,
        'SELECT "djv_book"."id" FROM "djv_book" WHERE "djv_book"."author_id" = %s',
        "UPDATE settings SET value = ? WHERE name = ?",
        "SELECT QUOTE(name) FROM items",
        "SELECT ? FROM items",
        "SELECT 1",
        "SAVEPOINT s1",
        "SELECT * FROM pg_sleep(?)",
        "WITH x AS (SELECT 1) SELECT * FROM x",
    ],
)
def test_application_statements(sql: str) -> None:
    assert not is_internal(sql)


@pytest.fixture
def data_dir(tmp_path: Path) -> str:
    d = str(tmp_path / "data")
    os.makedirs(os.path.join(d, "spool"))
    return d


@pytest.fixture
def store(data_dir: str) -> Iterator[DuckDBStore]:
    s = DuckDBStore(data_dir)
    yield s
    s.close()


def kinds(store: DuckDBStore, endpoint: str | None = None) -> dict[str, int]:
    where = "" if endpoint is None else f"WHERE endpoint = '{endpoint}'"
    rows = store.sql(f"SELECT kind, count(*) FROM calls {where} GROUP BY kind")[1]
    return {k: int(n) for k, n in rows}


def debug_page(w: SegmentWriter, endpoint: str = "GET /clean") -> None:
    """A clean page under Django's DEBUG on sqlite: each statement followed by its QUOTE
    helper, the same parameters each time, and the connection's PRAGMA first."""
    w.request(
        endpoint,
        calls=[
            call(text="PRAGMA foreign_keys = ON", site=SITE),
            call(text=ITEM, site=SITE, ph=7),
            call(text=QUOTE, site=SITE, ph=7),
            call(text="SELECT * FROM tags WHERE item_id = ?", site=SITE, ph=7),
            call(text=QUOTE, site=SITE, ph=7),
        ],
    )


def test_store_files_internal_calls_apart(data_dir: str, store: DuckDBStore) -> None:
    w = SegmentWriter(data_dir)
    for _ in range(6):
        debug_page(w)
    w.close()
    store.ingest()
    assert kinds(store) == {"db": 12, INTERNAL_KIND: 18}
    fps = dict(store.sql("SELECT text, kind FROM fingerprints")[1])
    assert fps[QUOTE] == INTERNAL_KIND and fps["PRAGMA foreign_keys = ON"] == INTERNAL_KIND
    assert fps[ITEM] == "db"
    per_request = store.sql("SELECT DISTINCT db_calls FROM requests")[1]
    assert per_request == [(2,)]  # the request's count is the application's statements


def test_internal_calls_of_a_later_batch(data_dir: str, store: DuckDBStore) -> None:
    """A segment read in two passes: the second pass's calls use fingerprints whose records
    the first pass read."""
    w = SegmentWriter(data_dir, pid=os.getpid())  # a live writer: the segment stays open
    debug_page(w, "GET /first")
    assert store.ingest().requests == 1
    debug_page(w, "GET /second")
    w.close()
    assert store.ingest().requests == 1
    assert kinds(store, "GET /second") == {"db": 2, INTERNAL_KIND: 3}


def test_internal_calls_of_a_segment_another_process_began(
    data_dir: str, store: DuckDBStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process continues a segment: the fingerprint records are before its offset; the
    ids of the internal ones come from the store's fingerprints."""
    from perfsleuth.store import records

    w = SegmentWriter(data_dir, pid=os.getpid())
    debug_page(w, "GET /first")
    assert store.ingest().requests == 1
    debug_page(w, "GET /second")
    w.close()
    monkeypatch.setattr(records, "_internal_fps", set())  # what a new process knows
    known = store.sql("SELECT id FROM fingerprints WHERE kind = 'db.internal'")[1]
    records.remember_internal_fingerprints(fid for (fid,) in known)
    assert store.ingest().requests == 1
    assert kinds(store, "GET /second") == {"db": 2, INTERNAL_KIND: 3}


def test_internal_calls_raise_no_finding(data_dir: str, store: DuckDBStore) -> None:
    """Repeated helpers with the same parameters on every request of a clean page: no
    repeated_query, no n_plus_one; the same repeats of an application statement are found."""
    w = SegmentWriter(data_dir)
    for _ in range(8):
        debug_page(w)
        w.request("GET /repeats", calls=[call(text=ITEM, site=SITE, ph=9) for _ in range(6)])
    w.close()
    store.ingest()
    found = {(f.kind, f.endpoint) for f in find(store, config=Config())}
    assert not [f for f in found if f[1] == "GET /clean"], found
    assert kinds(store, "GET /clean")[INTERNAL_KIND] == 8 * 3  # ingested, and internal
    assert ("repeated_query", "GET /repeats") in found


def test_agent_recorded_helpers_are_internal(
    tmp_path: Path,
    agent_data_dir: str,
    in_request: Callable[..., Any],
    captured: Callable[[], list[dict[str, Any]]],
) -> None:
    """What the real agent records from sqlite3 (the C or Python wrappers) for a PRAGMA, a
    QUOTE helper on a raw cursor and an application statement, through the real store."""
    conn = sqlite3.connect(str(tmp_path / "app.db"))
    conn.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO items VALUES (1, 'a')")
    with in_request("GET /internal-helpers"):
        conn.execute("PRAGMA foreign_keys = ON")
        cur = conn.cursor()
        cur.execute("SELECT name FROM items WHERE id = ?", (1,)).fetchall()
        cur.execute("SELECT QUOTE(?)", (1,)).fetchone()
    conn.close()
    assert len(captured()) == 1
    data = tmp_path / "copy"
    shutil.copytree(os.path.join(agent_data_dir, "spool"), data / "spool")
    with DuckDBStore(str(data)) as copy:
        copy.ingest()
        assert kinds(copy, "GET /internal-helpers") == {"db": 1, INTERNAL_KIND: 2}
