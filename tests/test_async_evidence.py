"""Runtime evidence on an async stack: FastAPI with a ``BaseHTTPMiddleware`` under uvicorn.

- an event-loop blocker in a route run in a child task names its endpoint and the handler's
  line that made the synchronous call (the deepest application line kept as evidence);
- a garbage collection is charged to the request whose code started it (a big ``json.loads`` on
  the loop), not to a request that only waited meanwhile;
- ``requests.cpu_ms`` of ASGI requests: the worker thread's CPU for a sync endpoint, the loop
  thread's CPU while the request's own steps run for an async one (with and without the C
  accelerator).

App: tests/apps/async_evidence_app.py, whose planted lines carry markers. The CPU endpoints burn
a fixed amount of thread CPU time (not wall time), so the comparisons hold on a busy machine.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.analysis.config import Config
from perfsleuth.analysis.findings import find
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import SegmentWriter
from test_run_servers import APPS, launched, uvicorn

APP = os.path.join(APPS, "async_evidence_app.py")


def line_of(marker: str) -> int:
    with open(APP, encoding="utf-8") as fh:
        hits = [i for i, s in enumerate(fh.read().splitlines(), 1) if marker in s]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def loop_lines(marker: str) -> set[int]:
    """The planted line and the ``while`` above it (a busy loop is sampled on either)."""
    return {line_of(marker) - 1, line_of(marker)}


def findings(data: Path, kinds: list[str], **overrides: Any) -> list[Any]:
    cfg = Config()
    for key, value in overrides.items():
        kind, name = key.split("__")
        cfg.set(kind, name, value)
    with DuckDBStore(str(data), read_only=True) as store:
        return find(store, config=cfg, kinds=kinds)


def in_flight_during(srv: Any, path: str, during: Any) -> None:
    """Start GET ``path``, let it reach its await, run ``during()``, wait for the answer."""
    answered: list[int] = []
    t = threading.Thread(target=lambda: answered.append(srv.get(path)[0]))
    t.start()
    time.sleep(0.15)
    during()
    t.join()
    assert answered == [200]


def drive(srv: Any, rounds: int) -> None:
    """async_evidence_app's traffic: /block and POST /ingest while /wait is in flight, the
    sync and async CPU and sleep endpoints ``rounds`` times each, then /health."""
    for _ in range(3):
        in_flight_during(srv, "/wait", lambda: srv.get("/block"))
    for _ in range(4):
        in_flight_during(srv, "/wait", lambda: srv.request("POST", "/ingest"))
    for path in ("/cpu-sync", "/sleep-sync", "/cpu-async", "/sleep-async") * rounds:
        assert srv.get(path)[0] == 200
    for _ in range(5):
        assert srv.get("/health")[0] == 200


@pytest.fixture(scope="module")
def async_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("async-evidence")
    data = tmp / "data"
    with launched(
        tmp, data, uvicorn("async_evidence_app:app", "--loop", "asyncio"), service="aev",
        ready="/health", PERFSLEUTH_CPU_SAMPLE="1",
    ) as srv:  # fmt: skip
        drive(srv, 2)
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
    return data


def test_a_blocker_behind_base_http_middleware_names_its_endpoint_and_handler_line(
    async_store: Path,
) -> None:
    with DuckDBStore(str(async_store), read_only=True) as store:
        blockers = store.blockers()
        block_ids = {t["trace_id"] for t in store.traces(endpoint="GET /block")}
    assert len(block_ids) == 3
    # every block of /block is its own (the watchdog found the request through the child
    # task's context), none is "<no request>" nor blamed on the request that waited
    mine = [b for b in blockers if b["trace_id"] in block_ids]
    assert len(mine) == 3, blockers
    assert {b["endpoint"] for b in mine} == {"GET /block"}
    assert all(b["delayed"] >= 1 for b in mine)  # /wait was in flight each time
    for b in mine:
        app_frames = [f for f in b["stack"] if f["app"]]
        assert app_frames[-1]["line"] in loop_lines("PLANTED-DEEP")

    (f,) = [f for f in findings(async_store, ["event_loop_blocker"]) if f.endpoint == "GET /block"]
    handler = line_of("PLANTED-HANDLER")
    assert f.callsite == {"file": APP, "line": handler, "function": "block"}
    assert f.title.startswith(
        f"block (apps/async_evidence_app.py:{handler}) blocked the event loop"
    )
    # the deepest application frame, as evidence
    assert f"parse_feed (async_evidence_app.py:{line_of('PLANTED-DEEP')})" in f.title or (
        f"parse_feed (async_evidence_app.py:{line_of('PLANTED-DEEP') - 1})" in f.title
    )
    assert {x["line"] for x in f.evidence["lines"]} <= loop_lines("PLANTED-DEEP")
    assert f.evidence["handler"]["line"] == handler


def test_gc_is_charged_to_the_allocating_request_not_to_one_that_waited(
    async_store: Path,
) -> None:
    with DuckDBStore(str(async_store), read_only=True) as store:
        rows = store.query(
            "SELECT endpoint, count(*) AS n, sum(coalesce(gc_count, 0)) AS collections,"
            " sum(coalesce(gc_ms, 0)) AS gc_ms, sum(duration_ms) AS ms"
            " FROM requests GROUP BY endpoint"
        )
    by = {r["endpoint"]: r for r in rows}
    ingest, waited = by["POST /ingest"], by["GET /wait"]
    assert ingest["n"] == 4 and waited["n"] == 7  # both were recorded
    assert ingest["collections"] >= 4 * 10  # 60 parses of 5,000 objects each, per request
    # /wait's own steps allocate a little: a stray young collection at most, not /ingest's
    assert waited["collections"] <= ingest["collections"] / 10
    assert waited["gc_ms"] < 0.01 * waited["ms"]
    # thresholds low enough for a few requests (/block allocates too: its parsing is charged
    # to it), judged per endpoint
    found = findings(
        async_store, ["gc_pressure"], gc_pressure__min_requests=3,
        gc_pressure__min_time_share=0.02, gc_pressure__min_ms_per_request=0.5,
        gc_pressure__service_min_endpoints=99,
    )  # fmt: skip
    assert "POST /ingest" in {f.endpoint for f in found}
    assert "GET /wait" not in {f.endpoint for f in found}
    # /ingest's surviving documents bring full collections: the heap they scan was sampled
    with DuckDBStore(str(async_store), read_only=True) as store:
        heap = store.query("SELECT max(value) AS n FROM agent_stats WHERE name = 'gc_heap_objects'")
    assert heap[0]["n"] and heap[0]["n"] > 10_000


def cpu_by_endpoint(data: Path) -> dict[str, list[dict[str, Any]]]:
    with DuckDBStore(str(data), read_only=True) as store:
        rows = store.query(
            "SELECT endpoint, cpu_ms, duration_ms FROM requests WHERE endpoint LIKE 'GET /%'"
        )
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["endpoint"], []).append(r)
    return out


def check_cpu(by: dict[str, list[dict[str, Any]]]) -> None:
    for kind in ("sync", "async"):
        cpu, sleep = by[f"GET /cpu-{kind}"], by[f"GET /sleep-{kind}"]
        assert len(cpu) == 2 and len(sleep) == 2
        for r in cpu + sleep:
            assert r["cpu_ms"] is not None and 0 < r["cpu_ms"] <= r["duration_ms"], (kind, r)
        # the endpoint burns 200 ms of its thread's CPU: all of it is counted
        assert all(r["cpu_ms"] >= 200 for r in cpu), (kind, cpu)
        assert max(r["cpu_ms"] for r in sleep) < min(r["cpu_ms"] for r in cpu), (kind, by)
    # an async request's CPU is its own steps', not the loop's while it awaited
    assert all(r["cpu_ms"] is not None for r in by["GET /wait"])


def test_cpu_time_of_asgi_requests(async_store: Path) -> None:
    check_cpu(cpu_by_endpoint(async_store))


@pytest.mark.parametrize("speedups", ["0", "1"])
def test_cpu_time_of_asgi_requests_with_and_without_the_accelerator(
    tmp_path: Path, speedups: str
) -> None:
    data = tmp_path / "data"
    with launched(
        tmp_path, data, uvicorn("async_evidence_app:app"), service="cpu", ready="/health",
        PERFSLEUTH_SPEEDUPS=speedups, PERFSLEUTH_EVIDENCE="0", PERFSLEUTH_CPU_SAMPLE="1",
    ) as srv:  # fmt: skip
        for path in ("/cpu-sync", "/sleep-sync", "/cpu-async", "/sleep-async", "/wait") * 2:
            assert srv.get(path)[0] == 200
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
    check_cpu(cpu_by_endpoint(data))


def gc_store(data: Path, shares: dict[str, float], heap_objects: int | None) -> None:
    """Ten 100 ms requests per endpoint, ``share`` of each in collections it started."""
    w = SegmentWriter(str(data))
    for endpoint, share in shares.items():
        for _ in range(10):
            w.request(endpoint, dur_ms=100, gc_ns=int(share * 100e6), gc_count=3)
    if heap_objects is not None:
        w.stats({"gc_heap_objects": heap_objects, "gc_collections": 120})
    w.close()
    with DuckDBStore(str(data)) as store:
        store.ingest()


def test_collections_costing_the_same_on_every_endpoint_are_the_service_s(
    tmp_path: Path,
) -> None:
    shares = {"GET /a": 0.2, "GET /b": 0.25, "POST /c": 0.3, "GET /d": 0.22}
    gc_store(tmp_path / "heap", shares, heap_objects=2_400_000)
    with DuckDBStore(str(tmp_path / "heap"), read_only=True) as store:
        assert store.query("SELECT count(*) AS n FROM requests")[0]["n"] == 40
    (f,) = findings(tmp_path / "heap", ["gc_pressure"])
    assert f.endpoint == "<service>"
    assert "2,400,000 objects" in f.title and "4 of 4 endpoints" in f.title
    assert "gc.freeze()" in f.suggestion
    assert f.evidence["heap_objects"] == 2_400_000 and len(f.evidence["endpoints"]) == 4

    # one endpoint allocating far more than the others is that endpoint's problem
    gc_store(tmp_path / "one", {**shares, "GET /a": 0.02, "GET /b": 0.01}, heap_objects=None)
    found = findings(tmp_path / "one", ["gc_pressure"])
    assert sorted(f.endpoint for f in found) == ["GET /d", "POST /c"]


def test_a_blocker_is_named_by_its_handler_not_by_the_script_that_started_the_server(
    tmp_path: Path,
) -> None:
    """``python main.py`` running ``uvicorn.run(app)``: the script's ``<module>`` frame is the
    outermost application frame of every stack on the loop; the finding names the handler's
    line that made the blocking call, and the deepest application line as evidence."""
    data = tmp_path / "data"
    w = SegmentWriter(str(data))
    script = ("/srv/app/main.py", 210, "<module>", True)
    lib = [
        ("/venv/site-packages/uvicorn/main.py", 580, "run", False),
        ("/usr/lib/python3.11/asyncio/events.py", 80, "Handle._run", False),
        ("/venv/site-packages/fastapi/routing.py", 212, "run_endpoint_function", False),
    ]
    handler = ("/srv/app/main.py", 40, "import_feed", True)
    helper = ("/srv/app/feeds.py", 12, "parse", True)
    json_lib = ("/usr/lib/python3.11/json/decoder.py", 353, "raw_decode", False)
    stacks = [
        w.stack([script, *lib, handler, helper, json_lib]),
        w.stack([script, *lib, handler, ("/srv/app/feeds.py", 14, "parse", True)]),
    ]
    for i in range(4):
        trace = f"{i + 1:016x}"
        w.request("POST /import", trace_id=trace, dur_ms=400)
        w.event(
            b"B",
            {"ts": time.time_ns(), "dur": 300_000_000, "delayed": 1, "id": trace,
             "endpoint": "POST /import", "stacks": [[stacks[i % 2], 5]]},
        )  # fmt: skip
    w.close()
    with DuckDBStore(str(data)) as store:
        store.ingest()
    (f,) = findings(data, ["event_loop_blocker"])
    assert f.callsite == {"file": "/srv/app/main.py", "line": 40, "function": "import_feed"}
    assert f.title.startswith("import_feed (app/main.py:40) blocked the event loop in POST /import")
    assert "<module>" not in f.title and "parse (feeds.py:1" in f.title
    assert {x["line"] for x in f.evidence["lines"]} == {12, 14}


def test_in_threads_a_collection_is_charged_to_the_thread_s_own_request(
    agent_data_dir: str,
) -> None:
    """A WSGI-style server: one request per thread; the one whose allocations start the
    collections is charged, the one waiting on the next thread is not."""
    import gc

    from perfsleuth.agent import gcwatch, recorder

    assert gcwatch._installed  # the agent in this process watches collections
    waiting_started, allocating_done = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def waiter() -> None:
        req = recorder.begin("web", "GET", "/wait")
        assert req is not None
        waiting_started.set()
        allocating_done.wait(60)
        recorder.end(req)
        got["wait"] = req

    def allocator() -> None:
        waiting_started.wait(60)
        req = recorder.begin("web", "POST", "/alloc")
        assert req is not None

        class Node:
            def __init__(self) -> None:
                self.me = self

        junk = [Node() for _ in range(50_000)]  # young collections as they are made
        del junk
        gc.collect()  # and a full one
        recorder.end(req)
        got["alloc"] = req
        allocating_done.set()

    threads = [threading.Thread(target=waiter), threading.Thread(target=allocator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got["alloc"].gc_count >= 2 and got["alloc"].gc_ns > 0
    assert got["wait"].gc_count == 0 and got["wait"].gc_ns == 0


FEED_APP = """\
import functools
import json


def cached(fn):
    @functools.wraps(fn)
    async def wrapper(*args):
        return await fn(*args)  # WRAPPER

    return wrapper


@cached
async def import_feed(raw):
    rows = [row for row in parse(raw)]  # HANDLER
    return rows


def parse(raw):
    return json.loads(raw)  # DEEP
"""


def test_a_blocker_is_named_by_the_coroutine_that_made_the_call_not_by_its_decorator(
    tmp_path: Path,
) -> None:
    """An app's own decorator around the endpoint is called by the framework too: the line to
    wrap in to_thread is the innermost ``async def``'s (read from the source), not the
    wrapper's ``await``; a comprehension inside the coroutine is not a coroutine of its own."""
    src = tmp_path / "feeds.py"
    src.write_text(FEED_APP)
    lines = {m: i for i, s in enumerate(FEED_APP.splitlines(), 1) for m in ("WRAPPER",
             "HANDLER", "DEEP") if f"# {m}" in s}  # fmt: skip
    data = tmp_path / "data"
    w = SegmentWriter(str(data))
    stack = w.stack([
        ("/venv/site-packages/fastapi/routing.py", 212, "run_endpoint_function", False),
        (str(src), lines["WRAPPER"], "cached.<locals>.wrapper", True),
        (str(src), lines["HANDLER"], "import_feed", True),
        (str(src), lines["HANDLER"], "import_feed.<locals>.<listcomp>", True),
        (str(src), lines["DEEP"], "parse", True),
        ("/usr/lib/python3.11/json/decoder.py", 353, "raw_decode", False),
    ])  # fmt: skip
    for i in range(2):
        trace = f"{i + 1:016x}"
        w.request("POST /feeds", trace_id=trace, dur_ms=400)
        w.event(
            b"B",
            {"ts": time.time_ns(), "dur": 300_000_000, "delayed": 0, "id": trace,
             "endpoint": "POST /feeds", "stacks": [[stack, 5]]},
        )  # fmt: skip
    w.close()
    with DuckDBStore(str(data)) as store:
        store.ingest()
    (f,) = findings(data, ["event_loop_blocker"])
    assert f.callsite == {"file": str(src), "line": lines["HANDLER"], "function": "import_feed"}
    assert f"parse (feeds.py:{lines['DEEP']})" in f.title


def test_a_block_is_charged_to_the_request_seen_running_most_often(agent_data_dir: str) -> None:
    """The watchdog's last look at a block can come after the blocking step ended and before
    its ping is answered (the loop first runs the callbacks queued ahead of the ping): it sees
    the next task running. The block is the request seen on most looks, not on the last."""
    import sys

    from perfsleuth.agent import recorder, watchdog
    from perfsleuth.agent.config import Config

    a_blocking, release_a = threading.Event(), threading.Event()
    b_blocking, release_b = threading.Event(), threading.Event()
    reqs: dict[str, Any] = {}
    loops: list[Any] = []

    async def blocking(name: str, started: threading.Event, release: threading.Event) -> None:
        started.set()
        release.wait(30)  # the loop runs nothing else meanwhile
        recorder.end(reqs[name])

    async def main() -> None:
        loops.append((asyncio.get_running_loop(), threading.get_ident()))
        b_wakes: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def b() -> None:
            reqs["b"] = recorder.begin("web", "GET", "/b")
            await b_wakes
            await blocking("b", b_blocking, release_b)

        async def a() -> None:
            reqs["a"] = recorder.begin("web", "POST", "/a")
            b_wakes.set_result(None)  # b's step is queued before anything posted from now on
            await blocking("a", a_blocking, release_a)

        tb = asyncio.create_task(b())
        await asyncio.sleep(0)
        await asyncio.gather(asyncio.create_task(a()), tb)

    runner = threading.Thread(target=lambda: asyncio.run(main()))
    runner.start()
    try:
        assert a_blocking.wait(30)
        loop, thread = loops[0]
        entry = watchdog._Loop.__new__(watchdog._Loop)
        entry.loop, entry.thread = loop, thread
        wd = watchdog.Watchdog(Config())
        block = watchdog._Block(time.perf_counter_ns())
        for _ in range(3):  # the block, looked at while a's step blocks the loop
            wd._observe(entry, block, sys._current_frames())
        release_a.set()
        assert b_blocking.wait(30)
        wd._observe(entry, block, sys._current_frames())  # too late: b's step is running
    finally:
        release_a.set()
        release_b.set()
        runner.join(30)
    assert reqs["a"] is not None and reqs["b"] is not None
    assert block.req is reqs["a"]
    assert block.delayed == {id(reqs["a"]), id(reqs["b"])}  # b counted as delayed
