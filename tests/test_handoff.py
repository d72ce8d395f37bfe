"""Thread-pool hand-offs (issue 15: a helper's caller across the hop): a statement run
by a sync helper in a worker thread (Starlette's ``run_in_threadpool``, ``asyncio.to_thread``,
anyio's ``to_thread.run_sync``, ``loop.run_in_executor``, ``ThreadPoolExecutor.submit``) has a
stack that goes on past the worker into the code that handed the helper over, so the findings
name the caller's line, not only the helper's.

A real FastAPI app under uvicorn, run by ``perfsleuth run``: one sync helper (one query per
call) called in a loop by five endpoints, each through another hand-off (run_in_threadpool,
asyncio.to_thread, anyio.to_thread.run_sync, loop.run_in_executor, and a sync endpoint's
ThreadPoolExecutor.submit), and a generic executor handed a statement returning too many rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.analysis import find, load_config
from perfsleuth.store.duckdb_store import DuckDBStore
from test_run_servers import launched, uvicorn

APP = """\
import asyncio
import sqlite3
import threading

from concurrent.futures import ThreadPoolExecutor

import anyio
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

DB = sqlite3.connect(":memory:", check_same_thread=False)
DB.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT)")
DB.executemany("INSERT INTO items VALUES (?, ?)", [(i, f"item {i}") for i in range(1, 41)])
EXECUTOR = ThreadPoolExecutor(4)
N = 24
CROSS = "SELECT a.id, b.id FROM items a, items b, items c"


LOCK = threading.Lock()  # one connection, many threads: sqlite3 3.12+ does not serialize


def load_item(item_id):
    with LOCK:
        return DB.execute("SELECT name FROM items WHERE id = ?", (item_id,)).fetchone()[0]


def load_all(ids):
    return [load_item(i) for i in ids]  # ALL


def run_query(sql):  # a generic executor
    with LOCK:
        return DB.execute(sql).fetchall()


app = FastAPI()


@app.get("/cart")
async def cart():
    names = []
    for i in range(1, N + 1):
        names.append(await run_in_threadpool(load_item, i))  # CART
    return names


@app.get("/wishlist")
async def wishlist():
    names = []
    for i in range(1, N + 1):
        names.append(await asyncio.to_thread(load_item, i))  # WISHLIST
    return names


@app.get("/gifts")
async def gifts():
    loop = asyncio.get_running_loop()
    names = []
    for i in range(1, N + 1):
        names.append(await loop.run_in_executor(None, load_item, i))  # GIFTS
    return names


@app.get("/orders")
def orders():  # sync: FastAPI runs it in the thread pool, it submits to another pool
    return [EXECUTOR.submit(load_item, i).result() for i in range(1, N + 1)]  # ORDERS


@app.get("/export")
async def export():
    rows = await run_in_threadpool(run_query, CROSS)  # EXPORT
    return len(rows)


@app.get("/saved")
async def saved():
    return await anyio.to_thread.run_sync(load_all, list(range(1, N + 1)))  # SAVED
"""


def line_of(marker: str) -> int:
    return next(i for i, ln in enumerate(APP.splitlines(), 1) if ln.endswith(f"# {marker}"))


@pytest.fixture(scope="module", params=["1", "0"], ids=["speedups", "python"])
def recorded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The app served with the C accelerator's hand-off and sqlite3 wrappers, and without."""
    root = tmp_path_factory.mktemp("handoff")
    site = root / "site"
    site.mkdir()
    (site / "shop.py").write_text(APP)
    data = root / "data"
    cmd = uvicorn("shop:app", "--app-dir", str(site))
    with launched(
        root, data, cmd, service="handoff", ready="/missing", PERFSLEUTH_SPEEDUPS=request.param
    ) as srv:
        errors: list[Any] = []

        def drive(path: str) -> None:
            for _ in range(6):
                status, _body = srv.get(path)
                if status != 200:
                    errors.append((path, status))

        paths = ("/cart", "/wishlist", "/saved", "/gifts", "/orders", "/export")
        threads = [threading.Thread(target=drive, args=(p,)) for p in paths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        srv.stop()
    return data, site / "shop.py"


def test_worker_stacks_carry_the_callers_frames(recorded: tuple[Path, Path]) -> None:
    data, shop = recorded
    with DuckDBStore(str(data)) as s:
        s.ingest()
        for path, marker in (
            ("/cart", "CART"),
            ("/wishlist", "WISHLIST"),
            ("/saved", "SAVED"),
            ("/gifts", "GIFTS"),
            ("/orders", "ORDERS"),
        ):
            tids = [
                r["trace_id"]
                for r in s.query("SELECT trace_id FROM requests WHERE path = ?", [path])
            ]
            assert len(tids) == 6, path
            calls = s.trace(tids[-1])["calls"]
            assert len(calls) == 24, path
            for c in calls:
                # the statement's site stays the helper's line
                assert c["site"]["file"] == str(shop) and c["site"]["function"] == "load_item"
                app = [(f["function"], f["line"]) for f in c["stack"] if f["app"]]
                # outermost first: the endpoint's line that handed the helper over, then the
                # helper (through load_all for /saved)
                assert line_of(marker) in [ln for _, ln in app], (path, app)
                assert app[-1][0] == "load_item"


def test_findings_name_each_callers_line(recorded: tuple[Path, Path]) -> None:
    data, shop = recorded
    with DuckDBStore(str(data)) as s:
        s.ingest()
        found = find(s, config=load_config(), kinds=["n_plus_one", "oversized_result"])
    by_endpoint = {f.endpoint: f for f in found if f.kind == "n_plus_one"}
    for endpoint, marker in (
        ("GET /cart", "CART"),
        ("GET /wishlist", "WISHLIST"),
        ("GET /gifts", "GIFTS"),
        ("GET /orders", "ORDERS"),
    ):
        f = by_endpoint.get(endpoint)
        assert f is not None, (endpoint, [(x.endpoint, x.title) for x in found])
        # the loop is in the endpoint, across the hand-off: its line is the finding's
        assert f.callsite is not None
        assert (f.callsite["file"], f.callsite["line"]) == (str(shop), line_of(marker))
        assert f.evidence["loop_found_in_source"] is True
        assert f.evidence["call_site"]["function"] == "load_item"
    saved = by_endpoint.get("GET /saved")
    assert saved is not None
    # the loop of /saved runs in the worker (load_all's comprehension): named there
    assert saved.callsite is not None and saved.callsite["line"] == line_of("ALL")
    # a generic executor's statement: its site is the executor, its path names the caller
    (big,) = [f for f in found if f.kind == "oversized_result"]
    assert big.endpoint == "GET /export"
    assert big.callsite is not None and big.callsite["function"] == "run_query"
    path = [(p["function"], p["line"]) for p in big.evidence["app_path"]]
    assert path == [("export", line_of("EXPORT")), ("run_query", big.callsite["line"])]


# In process (issue 22 item 1): executor work submitted in a request keeps the worker's own
# context; only the agent's request variable is set for the work, and an ended request is not
# recorded into.


@pytest.fixture
def patched_pool(agent_data_dir: str) -> Any:
    import concurrent.futures.thread

    from perfsleuth.agent.instrument import handoff

    handoff.patch_futures(concurrent.futures.thread)  # idempotent: the registry's patch
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor


def test_executor_work_sees_the_workers_context_variables(
    in_request: Callable[..., Any], patched_pool: Any
) -> None:
    import contextvars

    from perfsleuth.agent import recorder

    conn: contextvars.ContextVar[str] = contextvars.ContextVar("conn")
    seen: list[Any] = []

    def task() -> None:
        seen.append((conn.get("MISSING"), recorder.current()))
        conn.set("changed by a task")

    with patched_pool(1, initializer=lambda: conn.set("per-thread connection")) as pool:
        with in_request("GET /ctx") as req:
            pool.submit(task).result()
            pool.submit(task).result()
            # asyncio's run_in_executor submits there too
            import asyncio

            async def via_loop() -> None:
                await asyncio.get_running_loop().run_in_executor(pool, task)

            asyncio.run(via_loop())
        pool.submit(task).result()  # outside a request: nothing set
    assert seen == [
        ("per-thread connection", req),
        ("changed by a task", req),
        ("changed by a task", req),  # the loop's task has a copy of the request's context
        ("changed by a task", None),
    ]


def test_work_outliving_its_request_records_nothing_after_the_end(
    in_request: Callable[..., Any], patched_pool: Any
) -> None:
    import sqlite3

    from perfsleuth.agent import recorder

    started, ended = threading.Event(), threading.Event()
    db = sqlite3.connect(":memory:", check_same_thread=False)  # the driver's wrappers

    def query(sql: str) -> None:
        call = recorder.start_call("db", "sqlite", sql)
        if call is not None:
            call.finish()

    def job() -> None:
        for k in range(3):
            # one line: its third call (after the end) meets the C wrapper's last-site shortcut
            db.execute("SELECT 1").fetchall()
            if k == 1:
                started.set()
                ended.wait(10)
        query("SELECT 2")  # after the request ended
        query("SELECT 2")

    with patched_pool(1) as pool:
        with in_request("GET /long") as req:
            fut = pool.submit(job)
            assert started.wait(10)
        n = len(req.calls or b"")
        ended.set()
        fut.result()
        late = pool.submit(job)  # submitted after the end: nothing set in the worker
        ended.set()
        late.result()
    assert n == 2 * recorder.ROW  # SELECT 1 twice
    assert len(req.calls or b"") == n
    assert [e[2] for e in req.site_list or []] == ["SELECT 1"]


def test_a_failing_parameter_note_keeps_one_row(in_request: Callable[..., Any]) -> None:
    """The C site path appended the row, then failed to note the parameters (a dict): it
    returns that row; Python's path must not append a second (issue 22 item 3)."""
    from perfsleuth.agent import recorder

    if recorder._c_record_call is None:
        pytest.skip("the C accelerator is not built")
    with in_request("GET /note") as req:
        req.more = []  # not a dict: noting the parameters fails
        call = recorder.start_call("db", "sqlite", "SELECT :a", {"a": 1})
        assert call is not None
        req.more = None
    assert len(req.calls or b"") == recorder.ROW


@pytest.mark.usefixtures("statements_as_made")  # shared by their tokens, they fill no cache
def test_distinct_statements_in_workers_stay_within_the_cache_budget(
    in_request: Callable[..., Any], patched_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Statements with their literals in the text, made in a worker from a request, each
    recorded as made (without the accelerator, or over its length for sharing): the
    hand-off's stitched entries and the recorder's stacks are forgotten with the site cache
    when the queue's share of the budget for them is used up (issue 22 item 2)."""
    from perfsleuth.agent import recorder
    from perfsleuth.agent.instrument import handoff
    from perfsleuth.agent.spool import queue

    limit = 64 << 10
    monkeypatch.setattr(queue, "cache_limit", limit)
    recorder.forget_sites()
    queue.forget_sites()

    def run(k: int) -> None:
        call = recorder.start_call("db", "sqlite", f"SELECT {k}, '{'x' * 1000}' FROM t")
        if call is not None:
            call.finish()

    def held() -> int:
        return sum(len(v[2][2]) for v in handoff._stitched.values())

    resets = first = queue.stats["cache_resets"]
    peak = 0
    with patched_pool(1) as pool:
        for k in range(400):
            with in_request("GET /distinct") as req:
                pool.submit(run, k).result()  # from the application's code: stitched
            assert req.site_list is not None and len(req.site_list[0][3]) > 2
            peak = max(peak, held())
            if queue.stats["cache_resets"] != resets:  # forgotten together
                resets = queue.stats["cache_resets"]
                assert not handoff._stitched and not recorder._stack_cache
    assert resets > first and peak <= 2 * limit
    assert held() <= 2 * limit
