"""The SQL console's engine memory (issue 17): statements that make huge values or huge
intermediate results in DuckDB itself (a billion-character string, a list of a hundred million
numbers, a string_agg of as many, a cross join's hash table) are stopped with a 400 saying
they used too much memory, the server's peak RSS stays bounded, and it keeps answering and
ingesting.

The real server (``perfsleuth ui``, ingesting) runs in a process of its own, so that its peak
RSS (``VmHWM``) is its own.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from perfsleuth.cli.ui import free_port
from perfsleuth.server import console
from spoolwrite import SegmentWriter

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/status"), reason="peak RSS is read from /proc"
)

MB = 1 << 20
# Peak RSS the server may reach while refusing all of HOSTILE: generous over its cap
# (console.MAX_MEMORY above what it used before), far below what they reach unbounded.
PEAK_BOUND = 1024 * MB
CAPPED = f"used more than {console.MAX_MEMORY // MB} MB of memory"
LIMIT = "the console memory limit"
# A statement stopped at its cap leaves memory the allocator gives back within seconds: the
# next one may start above the resting size, and then its time limit may stop it first.
CAPPED_OR_TIME = f"{CAPPED}|ran longer than"
HOSTILE = (  # statement, what the refusal must say
    ("SELECT repeat('x', 1000000000) AS s", LIMIT),
    ("SELECT list(range(1000000000)) AS l", LIMIT),
    ("SELECT lpad('z', 1000000000, '-') AS s", LIMIT),
    ("SELECT repeat('y', 10000000) AS s FROM range(1000)", LIMIT),
    ("SELECT list(i) AS l FROM range(100000000) t(i)", CAPPED),
    ("SELECT string_agg(i::VARCHAR, ',') AS s FROM range(100000000) t(i)", CAPPED_OR_TIME),
    # a hash table of 200 million numbers: it spills (within the cap) until the time limit
    (
        "SELECT count(DISTINCT a.i * 100000 + b.i) AS n FROM range(20000) a(i), range(10000) b(i)",
        CAPPED_OR_TIME,
    ),
)


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def request(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        payload = json.dumps(body) if body is not None else None
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def count(port: int) -> int:
    status, body = request(port, "POST", "/api/sql", {"query": "SELECT count(*) FROM requests"})
    assert status == 200, body
    return int(body["rows"][0][0])


def write_requests(data: str, n: int, seq: int) -> None:
    w = SegmentWriter(data, seq=seq)
    for i in range(n):
        w.request("GET /items", dur_ms=5.0 + i)
    w.close()


@pytest.fixture
def server(tmp_path: Any) -> Iterator[tuple[int, int, str]]:
    """(port, pid, data dir) of ``perfsleuth ui`` ingesting a store of 20 requests."""
    data = str(tmp_path / "data")
    write_requests(data, 20, 1)
    port = free_port("127.0.0.1", 0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "perfsleuth", "ui", "--data", data, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                if count(port) == 20:
                    break
            except (OSError, AssertionError):
                pass
            assert time.monotonic() < deadline, "the server did not start and ingest"
            time.sleep(0.2)
        yield port, proc.pid, data
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_huge_engine_values_are_refused_and_rss_stays_bounded(server: tuple[int, int, str]) -> None:
    port, pid, data = server
    replies = [request(port, "POST", "/api/sql", {"query": q, "limit": 10}) for q, _ in HOSTILE]
    peak = status_kb(pid, "VmHWM") * 1024
    for (q, reason), (status, body) in zip(HOSTILE, replies, strict=True):
        assert status == 400, (q, status, str(body)[:200])
        assert re.search(reason, body["error"]), (q, body["error"])
    assert peak < PEAK_BOUND, f"peak RSS {peak // MB} MB"
    # Still answering, and still ingesting: new requests arrive in the store.
    status, body = request(port, "GET", "/api/status")
    assert status == 200
    write_requests(data, 7, 2)
    deadline = time.monotonic() + 60
    while count(port) != 27:
        assert time.monotonic() < deadline, "ingest stopped"
        time.sleep(0.2)
    # An ordinary statement is unaffected.
    status, body = request(port, "POST", "/api/sql", {"query": "SELECT 6 * 7 AS n"})
    assert status == 200 and body["rows"] == [[42]]


def test_intermediate_results_bigger_than_the_cap_but_a_small_reply_still_run() -> None:
    """The cap stops what grows the process, not what is merely large: a sort of ten million
    rows (spilled or streamed) with a one-row reply passes."""
    import duckdb

    con = duckdb.connect(":memory:")
    console.sandbox(con)
    res = console.run(
        con.cursor(),
        "SELECT max(i * 7 % 1000003) AS m FROM range(10000000) t(i)",
        time_limit=60,
    )
    assert res.encoded == ["[1000002]"]


def test_the_guarded_functions_still_make_ordinary_values() -> None:
    """The macros in front of repeat, lpad, rpad, range and generate_series give what the
    functions give below the limit (strings, lists, numbers, dates and times, either
    direction), refuse above it, and leave the table functions alone."""
    import duckdb

    con = duckdb.connect(":memory:")
    console.sandbox(con)
    q = (
        "SELECT repeat('ab', 3), 'x'.repeat(2), repeat([1, 2], 2), lpad('a', 4, '-'), "
        "rpad('a', 3, '.'), range(3), range(1, 4), range(5, 1, -2), generate_series(1, 3), "
        "range(TIMESTAMP '2024-01-01', TIMESTAMP '2024-01-03', INTERVAL 1 DAY), "
        "len(range(DATE '2024-01-01', DATE '2024-03-01', INTERVAL 1 DAY)), "
        "len(range(8000)), (SELECT count(*) FROM range(1000000)), "
        "(SELECT count(*) FROM generate_series(1, 100000))"
    )
    row = json.loads(console.run(con.cursor(), q).encoded[0])
    assert row == [
        "ababab",
        "xx",
        [1, 2, 1, 2],
        "---a",
        "a..",
        [0, 1, 2],
        [1, 2, 3],
        [5, 3],
        [1, 2, 3],
        ["2024-01-01T00:00:00", "2024-01-02T00:00:00"],
        60,
        8000,
        1000000,
        100000,
    ]
    for big in (
        "SELECT repeat('ab', 200000)",
        "SELECT rpad('a', 300000, '.')",
        "SELECT range(20000)",
        "SELECT generate_series(0, 1000000, 2)",
        "SELECT range(TIMESTAMP '2024-01-01', TIMESTAMP '2124-01-01', INTERVAL 1 MINUTE)",
    ):
        with pytest.raises(console.ConsoleError, match="memory limit"):
            console.run(con.cursor(), big)


def test_a_result_left_unread_is_stopped_within_the_time_limit() -> None:
    """A statement whose rows go on forever (a recursive CTE without an end) stops at the row
    cap; closing its cursor must stop the rest, not run it to an end that never comes (with
    the console's memory limit set, close() ran it on for some 20 s past a 3 s time limit)."""
    import duckdb

    con = duckdb.connect(":memory:")
    console.sandbox(con)
    forever = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT n FROM r"
    for _ in range(3):
        t0 = time.monotonic()
        res = console.run(con.cursor(), forever, limit=5, time_limit=3.0)
        elapsed = time.monotonic() - t0
        assert res.encoded == ["[1]", "[2]", "[3]", "[4]", "[5]"]
        assert res.truncated_by == "rows"
        assert elapsed < 3.0 * 3, f"{elapsed:.1f} s for a 3 s time limit"


def _console() -> Any:
    import duckdb

    con = duckdb.connect(":memory:")
    console.sandbox(con)
    return con


# Each makes one value of 5000 characters or items from a number; under max_memory=2 MB the
# limit is 1024 characters (64 items). Named fully, a guarded function would reach DuckDB's
# own, not the console's macro.
BYPASSES = (
    "SELECT length(system.main.repeat('x', 5000)) AS n",
    "SELECT length(main.repeat('x', 5000)) AS n",
    'SELECT length("system"."main"."lpad"(\'x\', 5000, \'-\')) AS n',
    "SELECT length(list_transform([1], lambda x: system.main.rpad('x', 5000, '-'))[1]) AS n",
    "SELECT len(system.main.range(5000)) AS n",
    "SELECT length(printf('%5000s', 'x')) AS n",
    "SELECT length(printf('%*s', 5000, 'x')) AS n",
    "SELECT length(printf(f, 'x')) AS n FROM (SELECT '%5000s' AS f)",
    "SELECT length(format('{:>5000}', 'x')) AS n",
    "SELECT length(format('{:>{}}', 'x', 5000)) AS n",
    "SELECT len(list_resize([1], 5000)) AS n",
    "SELECT len(array_resize([1], 5000, 0)) AS n",
    "SELECT length(bar(1, 0, 1, 5000)) AS n",
    "SELECT length(bitstring('1', 5000)::VARCHAR) AS n",
    "SELECT length(to_base(5, 2, 5000)) AS n",
    "SELECT len(equi_width_bins(0, 10, 5000, false)) AS n",
    "SELECT * FROM query('SELECT length(system.main.repeat(''x'', 5000)) AS n')",
    "EXPLAIN SELECT length(system.main.repeat('x', 5000)) AS n",
)


@pytest.mark.parametrize("query", BYPASSES)
def test_the_memory_guard_holds_against_qualified_names_and_other_builders(query: str) -> None:
    """Every function that builds one big value from a number is refused over the limit,
    however it is named or reached (issue 17 review item 1)."""
    with pytest.raises(console.ConsoleError, match=r"memory limit|not available"):
        console.run(_console().cursor(), query, max_memory=2 * MB)


def test_the_newly_guarded_functions_still_make_ordinary_values() -> None:
    """Below the limit printf, format, list_resize, array_resize, bar, bitstring, to_base and
    equi_width_bins give what DuckDB gives."""
    q = (
        "SELECT printf('%5s|%-3d|%.2f', 'x', 7, 1.5), format('{:>4}{}', 'a', 1), "
        "format('{{}}'), list_resize([1], 3), list_resize([1], 2, 9), array_resize([1, 2], 1), "
        "length(bar(5, 0, 10)), length(bar(5, 0, 10, 20)), bitstring('101', 8)::VARCHAR, "
        "to_base(5, 2), to_base(5, 2, 8), len(equi_width_bins(0, 10, 5, false))"
    )
    row = json.loads(console.run(_console().cursor(), q, max_memory=2 * MB).encoded[0])
    assert row == [
        "    x|7  |1.50",
        "   a1",
        "{}",
        [1, None, None],
        [1, 9],
        [1],
        80,
        20,
        "00000101",
        "101",
        "00000101",
        5,
    ]


def test_two_statements_share_one_budget_and_the_one_that_grows_is_stopped() -> None:
    """Two console statements at once (CONSOLE_SLOTS) grow one process: a quiet one running
    when another grows past the budget is left alone, the growing one is stopped and told
    that the console's statements together went over (issue 17 review item 2)."""
    import threading

    con = _console()
    quiet_out: list[Any] = []
    started = threading.Event()

    def quiet() -> None:
        started.set()
        try:
            res = console.run(
                con.cursor(),
                "SELECT count(*) FROM range(3000000000) t(i) WHERE i % 7 = 3",
                time_limit=6,
                max_memory=64 * MB,
            )
            quiet_out.append(res.encoded)
        except console.ConsoleError as e:
            quiet_out.append(e)

    t = threading.Thread(target=quiet)
    t.start()
    started.wait()
    time.sleep(0.5)
    with pytest.raises(console.ConsoleError, match="together used more than 64 MB") as grew:
        console.run(
            con.cursor(),
            "SELECT list(i) AS l FROM range(100000000) t(i)",
            time_limit=30,
            max_memory=64 * MB,
        )
    t.join(timeout=60)
    assert "this one the most" in str(grew.value)
    assert quiet_out and "memory" not in str(quiet_out[0]), quiet_out
