"""The shared instrumentation API: one patch/mark helper (agent/instrument/_patch.py), one
DB-API statement body with one rows rule (agent/instrument/dbcall.py) used by every driver, and
one switch for the C accelerator (agent/accel.py) that every module follows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from conftest import MYSQL, PG_DSN


def test_patch_wraps_a_function_and_its_aliases_once() -> None:
    from perfsleuth.agent.instrument import _patch

    class Client:
        def set(self, key: str) -> str:
            return key

        __setitem__ = set

    wrapped: list[Any] = []

    def wrap(orig: Any) -> Any:
        def set(self: Any, key: str) -> str:
            return "wrapped " + orig(self, key)

        wrapped.append(orig)
        return _patch.mark(set, orig)

    assert _patch.patch(Client, "set", wrap)
    assert not _patch.patch(Client, "set", wrap)  # ours already: left alone
    assert wrapped == [Client.set._perfsleuth_orig]  # type: ignore[attr-defined]
    assert Client.__dict__["__setitem__"] is Client.__dict__["set"]
    assert Client().set("k") == "wrapped k" and Client.set.__name__ == "set"
    assert _patch.is_patched(Client, "set") and not _patch.is_patched(Client, "get")


@pytest.mark.parametrize(
    ("rowcount", "rows"),
    [
        (0, 0),
        (3, 3),
        (-1, None),
        (None, None),
        ((1 << 64) - 1, None),
        ((1 << 62) - 1, (1 << 62) - 1),
    ],
)
def test_one_rows_rule(rowcount: Any, rows: int | None) -> None:
    from perfsleuth.agent.instrument.dbcall import known_rows

    assert known_rows(rowcount) == rows


PROBE = """
import json, sqlite3, types
from perfsleuth.agent import accel
from perfsleuth.agent.spool import columns
from perfsleuth.agent.frameworks import asgi
from perfsleuth.agent.instrument import dbapi, threads
dbapi.patch_sqlite3(sqlite3)
print(json.dumps({
    "on": accel.on,
    "send_tap_c": asgi._SendTap is not asgi.SendTap,
    "cpu_meter_c": asgi._CpuMeter is not asgi.CpuMeter,
    "row_c": columns._c_row is not None,
    "hand_off_c": not isinstance(threads._wrap_async(print), types.FunctionType),
    "sqlite_c": dbapi.use_speedups(True),
}))
"""


def _probe(speedups: str) -> dict[str, bool]:
    env = {**os.environ, "PERFSLEUTH_SPEEDUPS": speedups}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_every_module_follows_the_one_accelerator_switch() -> None:
    from perfsleuth.agent import accel

    off = _probe("0")
    assert off == dict.fromkeys(off, False), off
    if not accel.on:
        pytest.skip("the C accelerator is not built here")
    on = _probe("1")
    assert on == dict.fromkeys(on, True), on


def _table(cur: Any) -> str:
    name = f"ps_{uuid.uuid4().hex[:12]}"
    cur.execute(f"CREATE TABLE {name} (v int)")
    return name


def _only_db_call(reqs: list[dict[str, Any]], op: str) -> dict[str, Any]:
    (req,) = reqs
    calls = [c for c in req["calls"] if c["kind"] == "db" and c["op"] == op]
    assert len(calls) == 1, calls
    return calls[0]


def test_psycopg2_executemany_of_a_generator_by_keyword(
    in_request: Callable[..., Any], captured: Callable[[], list[dict[str, Any]]]
) -> None:
    import psycopg2

    conn = psycopg2.connect(PG_DSN)
    try:
        cur = conn.cursor()
        table = _table(cur)
        values = ((i,) for i in range(7))
        cur.executemany(f"INSERT INTO {table} (v) VALUES (%s)", vars_list=values)  # no request
        with in_request("POST /many"):
            cur.executemany(
                f"INSERT INTO {table} (v) VALUES (%s)", vars_list=((i,) for i in range(5))
            )
        cur.execute(f"SELECT count(*) FROM {table}")
        assert cur.fetchone() == (12,)  # every row of both generators reached the driver
        cur.execute(f"DROP TABLE {table}")
        conn.commit()
    finally:
        conn.close()
    many = _only_db_call(captured(), "INSERT")
    assert many["extra"] == {"many": 5}
    assert many["rows"] == 5
    assert "ph" not in many  # an unsized iterable is not hashed


def test_pymysql_executemany_is_one_call_and_its_rows(
    in_request: Callable[..., Any], captured: Callable[[], list[dict[str, Any]]]
) -> None:
    import pymysql

    conn = pymysql.connect(**MYSQL)
    try:
        cur = conn.cursor()
        table = _table(cur)
        with in_request("POST /many"):
            # not an INSERT ... VALUES: PyMySQL runs it through execute once per row
            cur.executemany(f"UPDATE {table} SET v = %s WHERE v = %s", [(1, 2), (3, 4)])
            cur.execute(f"INSERT INTO {table} (v) VALUES (%s)", args=(9,))
        cur.execute(f"DROP TABLE {table}")
        conn.commit()
    finally:
        conn.close()
    reqs = captured()
    update = _only_db_call(reqs, "UPDATE")
    assert update["extra"] == {"many": 2} and update["rows"] == 0
    insert = _only_db_call(reqs, "INSERT")
    assert insert["rows"] == 1 and "ph" in insert


def test_psycopg_parameters_by_keyword_are_recorded_and_reach_the_driver(
    in_request: Callable[..., Any], captured: Callable[[], list[dict[str, Any]]]
) -> None:
    import psycopg

    with psycopg.connect(PG_DSN) as conn, conn.cursor() as cur, in_request("GET /kw"):
        cur.execute("SELECT %s::int + 1 WHERE %s", params=(41, True), prepare=False)
        assert cur.fetchone() == (42,)
    select = _only_db_call(captured(), "SELECT")
    assert select["rows"] == 1 and "ph" in select
