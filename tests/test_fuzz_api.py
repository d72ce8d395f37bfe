"""API fuzz: the API's GET and POST inputs (paths, query parameters, JSON bodies, the Host header)
with random and hostile values, sent over HTTP to the real server under uvicorn. No answer may
be a 5xx, every answer must come (a 60 s socket timeout catches a hang), and the server must
still answer afterwards.

GET paths and their parameter names are read from the app's routes, so an endpoint added later
is fuzzed too. Hypothesis drives it: ``PERFSLEUTH_FUZZ_CASES`` sets the number of cases of each
test (100 by default, short enough for ``make test``; ``make fuzz`` runs many more). Cases are
derived from a fixed seed, so a failure reproduces.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perfsleuth.cli.ui import free_port
from perfsleuth.server import create_app
from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.wire import CAPTURE
from spoolwrite import SegmentWriter, call

CASES = int(os.environ.get("PERFSLEUTH_FUZZ_CASES", "100"))
FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
# A hang is caught per request (the socket timeout); the suite's per-test limit grows with the
# number of cases (a console statement may take its whole 3 s time limit).
pytestmark = pytest.mark.timeout(max(300, CASES))
TRACE = "0123456789abcdef"
ENDPOINTS = ("GET /items/{id}", "POST /orders", "GET /search")


def get_routes() -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    """(path, query parameter names) of every GET operation in the API's OpenAPI schema, and
    the catch-all of unknown /api/ paths; the paths of its POST operations."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        app = create_app(d, ingest_every=0)
        paths = app.openapi()["paths"]
        app.state.backend.close()
    routes = [
        (path, tuple(p["name"] for p in ops["get"].get("parameters", ()) if p["in"] == "query"))
        for path, ops in paths.items()
        if "get" in ops
    ]
    assert len(routes) >= 10
    posts = [path for path, ops in paths.items() if "post" in ops]
    return [*routes, ("/api/{rest}", ())], posts


ROUTES, POSTS = get_routes()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, list[int]]]:
    """(port, statuses seen): a store with requests, calls and a capture, served read-only."""
    import uvicorn

    data = str(tmp_path_factory.mktemp("fuzz") / "data")
    w = SegmentWriter(data)
    for i in range(30):
        w.request(
            ENDPOINTS[i % 3],
            dur_ms=3.0 + 40 * (i % 5),
            calls=[call("db", "SELECT * FROM t WHERE id = ?", dur_ms=1.0)] * (1 + i % 4),
            trace_id=TRACE if i == 0 else None,
        )
    w.event(
        CAPTURE,
        {
            "id": TRACE,
            "ts": time.time_ns(),
            "dur": 3_000_000,
            "endpoint": ENDPOINTS[0],
            "method": "GET",
            "status": 200,
            "reason": "slow",
            "url": "http://127.0.0.1:8000/items/1?a=[1-2]",
            "headers": [["host", "127.0.0.1:8000"]],
            "redacted": [],
            "body_b64": "",
            "body_size": 0,
            "body_sha256": None,
            "body_truncated": False,
        },
    )
    w.close()
    with DuckDBStore(data) as s:
        s.ingest()
        assert s.query("SELECT count(*) AS n FROM requests")[0]["n"] == 30
    app = create_app(data, ingest_every=0, sql_time_limit=3.0)
    port = free_port("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    seen: list[int] = []
    yield port, seen
    # Still answering, with the data, after everything it was sent.
    status, body = send(port, "GET", "/api/status")
    assert status == 200 and json.loads(body)["endpoints"] == 3
    srv.should_exit = True
    t.join(timeout=60)


def send(
    port: int,
    method: str,
    target: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# PERFSLEUTH_FUZZ_PROGRESS=FILE: a line every PROGRESS_EVERY requests (a long run's log)
PROGRESS = os.environ.get("PERFSLEUTH_FUZZ_PROGRESS")
PROGRESS_EVERY = 1000
_started = time.monotonic()
_slowest: list[float] = [0.0]


def check(server: tuple[int, list[int]], method: str, target: str, **kw: Any) -> None:
    port, seen = server
    t0 = time.monotonic()
    status, body = send(port, method, target, **kw)
    _slowest[0] = max(_slowest[0], time.monotonic() - t0)
    seen.append(status)
    if PROGRESS and len(seen) % PROGRESS_EVERY == 0:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(PROGRESS, "a") as fh:
            fh.write(
                f"{time.strftime('%H:%M:%S')} {len(seen)} requests "
                f"({time.monotonic() - _started:.0f} s) in {test}; 5xx: "
                f"{sum(s >= 500 for s in seen)}; slowest {_slowest[0]:.1f} s\n"
            )
    assert status < 500, f"{method} {target} -> {status}: {body[:500]!r}"


# ------------------------------------------------------------------------------ values

HOSTILE = st.sampled_from(
    [
        "",
        " ",
        "0",
        "-1",
        "1e309",
        "-1e309",
        "nan",
        "inf",
        "NaN",
        "9" * 40,
        "0.0000001s",
        "99999999999999999999d",
        "1e400d",
        "1.5h",
        "all",
        "ALL",
        "15m",
        "7d",
        "0x10",
        "true",
        "null",
        "[]",
        "{}",
        "\x00",
        "%00",
        "../../etc/passwd",
        "' OR 1=1 --",
        '"; DROP TABLE requests; --',
        "{id}",
        "GET /items/{id}",
        ENDPOINTS[1],
        TRACE,
        TRACE[:3],
        "db",
        "http",
        "cache",
        "\u202e\ufeff\ud7ff",
        "😀" * 50,
        "x" * 5000,
    ]
)
TEXT = st.one_of(HOSTILE, st.text(max_size=60), st.text(alphabet="0123456789abcdef", max_size=17))
NUMBER = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    HOSTILE,
)
PARAM_NAMES = tuple(sorted({"token", "to", *(n for _, names in ROUTES for n in names)}))
PARAMS = st.dictionaries(
    st.one_of(st.sampled_from(PARAM_NAMES), st.text(max_size=10)),
    st.one_of(TEXT, NUMBER),
    max_size=5,
)


def _fill(template: str, values: list[str]) -> str:
    """A route path with its {parameters} replaced by ``values`` (URL-quoted)."""
    out, rest = [], template
    for v in values:
        head, sep, tail = rest.partition("{")
        if not sep:
            break
        out.append(head + quote(v, safe=""))
        rest = tail.partition("}")[2]
    return "".join(out) + rest.replace("{", "").replace("}", "")


GET_PATHS = st.one_of(
    st.builds(
        _fill, st.sampled_from([p for p, _ in ROUTES]), st.lists(TEXT, min_size=3, max_size=3)
    ),
    st.sampled_from(["/", "/index.html", "/assets/../../etc/passwd"]),
    st.builds(lambda t: "/api/" + quote(t, safe="/"), TEXT),
)


@FUZZ
@given(path=GET_PATHS, params=PARAMS)
def test_get_inputs(server: tuple[int, list[int]], path: str, params: dict[str, str]) -> None:
    query = urlencode(params, quote_via=quote) if params else ""
    check(server, "GET", path + (f"?{query}" if query else ""))


# ---------------------------------------------------------------------------- SQL console

SQL_PARTS = st.sampled_from(
    [
        "SELECT",
        "*",
        "count(*)",
        "FROM",
        "requests",
        "calls",
        "captures",
        "range(1000000000000)",
        "WHERE",
        "1=1",
        "GROUP BY ALL",
        "ORDER BY 1",
        "LIMIT",
        "-1",
        ";",
        "EXPLAIN",
        "EXPLAIN ANALYZE",
        "COPY requests TO '/tmp/x.csv'",
        "ATTACH '/tmp/x.db'",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "read_csv('/etc/passwd')",
        "'https://example.com/a.parquet'",
        "repeat('x', 100000)",
        "range(2000)",
        "(SELECT",
        ")",
        "'",
        '"',
        "/*",
        "--",
        "PRAGMA database_list",
        "CALL",
        "CREATE TABLE t AS",
        "DROP TABLE requests",
        "VALUES (1)",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r)",
        "1e309",
        "NULL",
        "'\\x00'",
        "[1, 2, [3]]",
        "{'a': 1}",
        "INTERVAL 1 DAY",
        "DATE '2026-01-01'",
        "uuid()",
        "blob 'a'",
        "nan",
        "'inf'::DOUBLE",
    ]
)
QUERIES = st.one_of(
    st.lists(SQL_PARTS, min_size=1, max_size=8).map(" ".join),
    st.text(max_size=200),
    st.sampled_from(
        [
            "SELECT 'nan'::DOUBLE, 'inf'::DOUBLE, -0.0, 1e308 * 10",
            "SELECT [1, NULL], {'a': [1]}, map([1], ['x']), 'a'::BLOB, uuid(), now()",
            "SELECT INTERVAL 3 DAY, TIME '01:02:03', 12345678901234567890::HUGEINT",
            "SELECT 1.5::DECIMAL(38, 10), '\\u0000', chr(0), chr(55295)",
            "SELECT * FROM requests, calls, calls",
            "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT * FROM r",
        ]
    ),
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
LIMITS = st.one_of(
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
    st.none(),
    st.booleans(),
)


@FUZZ
@given(
    query=st.one_of(QUERIES, JSON_VALUES),
    limit=st.one_of(st.just(None), LIMITS),
    extra=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=2),
)
def test_sql_bodies(
    server: tuple[int, list[int]], query: Any, limit: Any, extra: dict[str, Any]
) -> None:
    body: dict[str, Any] = {**extra, "query": query}
    if limit is not None:
        body["limit"] = limit
    payload = json.dumps(body, allow_nan=True).encode()
    check(server, "POST", "/api/sql", body=payload, headers={"Content-Type": "application/json"})


@FUZZ
@given(
    raw=st.one_of(
        st.binary(max_size=300),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.sampled_from([b"", b"{", b'{"query": ', b"[]", b"null", b'{"query": "SELECT 1"' * 3]),
    ),
    content_type=st.sampled_from(
        ["application/json", "text/plain", "", "application/x-www-form-urlencoded"]
    ),
    path=st.sampled_from(sorted({*POSTS, "/api/sql", "/api/status", "/api/nope", "/"})),
)
def test_raw_post_bodies(
    server: tuple[int, list[int]], raw: bytes, content_type: str, path: str
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    check(server, "POST", path, body=raw, headers=headers)


@FUZZ
@given(
    host=st.one_of(TEXT, st.sampled_from(["localhost", "[::1]:1", "127.0.0.1:0", "[", "]:", ":"]))
)
def test_host_headers(server: tuple[int, list[int]], host: str) -> None:
    value = "".join(c for c in host if c.isprintable() and c not in "\r\n")
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        value = value.encode("utf-8").decode("latin-1")
    check(server, "GET", "/api/status", headers={"Host": value})
