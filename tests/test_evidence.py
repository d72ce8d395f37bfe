"""Runtime evidence with real servers: stack samples of slow requests (uvicorn thread pool,
gunicorn sync workers), event-loop blockers (asyncio and uvloop loops), GC pauses, and the
findings, ``profile`` and ``blockers`` commands over them.

Apps: tests/apps/evidence_app.py and evidence_wsgi.py, whose planted lines carry markers.
Nothing here asserts on durations beyond what the planted code guarantees (a 300 ms busy loop
blocks the loop for at least 300 ms minus scheduling noise: we ask for 200 ms).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.analysis import profile
from perfsleuth.analysis.config import Config
from perfsleuth.analysis.findings import find
from perfsleuth.store import schema
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import SegmentWriter
from test_run_servers import APPS, gunicorn, launched, uvicorn

APP = os.path.join(APPS, "evidence_app.py")
WSGI = os.path.join(APPS, "evidence_wsgi.py")
# Sample sooner than the 300 ms default so each planted request gives many samples.
FAST_SAMPLING = {"PERFSLEUTH_SAMPLE_AFTER_MS": "100"}


def line_of(path: str, marker: str) -> int:
    with open(path, encoding="utf-8") as fh:
        hits = [i for i, s in enumerate(fh.read().splitlines(), 1) if marker in s]
    assert len(hits) == 1, (path, marker, hits)
    return hits[0]


def loop_lines(marker: str, path: str = APP) -> set[int]:
    """The planted line and the ``while`` / ``for`` above it: a busy loop is sampled on either
    (its header runs once per round too)."""
    return {line_of(path, marker) - 1, line_of(path, marker)}


def cli(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "perfsleuth", *args, "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def drive_async_app(srv: Any) -> None:
    """/slow-wait in flight, then /parse blocks the loop; /hot, /alloc and /fast traffic."""
    waiting = threading.Thread(target=lambda: srv.get("/slow-wait"))
    waiting.start()
    time.sleep(0.15)  # /slow-wait is now awaiting on the loop
    assert srv.request("POST", "/parse")[0] == 200
    waiting.join()
    assert srv.request("POST", "/parse")[0] == 200
    assert srv.request("POST", "/import-rows")[0] == 200
    for _ in range(3):
        assert srv.get("/hot")[0] == 200
    for _ in range(3):
        assert srv.get("/alloc")[0] == 200
    for _ in range(20):
        assert srv.get("/fast")[0] == 200
    assert json.loads(srv.get("/items/count")[1])["n"] == 50_000


@pytest.fixture(scope="module")
def asyncio_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("evidence-asyncio")
    data = tmp / "data"
    with launched(
        tmp, data, uvicorn("evidence_app:app", "--loop", "asyncio"), service="ev",
        ready="/fast", **FAST_SAMPLING,
    ) as srv:  # fmt: skip
        drive_async_app(srv)
        assert srv.stop() in (0, -15)  # a single uvicorn re-raises the SIGTERM it handled
    with DuckDBStore(str(data)) as store:
        store.ingest()
    return data


def _findings(data: Path, **overrides: Any) -> list[Any]:
    cfg = Config()
    for key, value in overrides.items():
        kind, name = key.split("__")
        cfg.set(kind, name, value)
    with DuckDBStore(str(data), read_only=True) as store:
        return find(store, config=cfg)


def test_blocker_names_the_line_and_the_request_and_counts_the_delayed(
    asyncio_store: Path,
) -> None:
    with DuckDBStore(str(asyncio_store), read_only=True) as store:
        blockers = store.blockers(endpoint="POST /parse")
        others = [
            b for b in store.blockers() if b["endpoint"] not in ("POST /parse", "POST /import-rows")
        ]
        parse_ids = {t["trace_id"] for t in store.traces(endpoint="POST /parse")}
    assert len(blockers) == 2
    for b in blockers:
        assert b["duration_ms"] >= 200
        assert b["trace_id"] in parse_ids
        app_frames = [f for f in b["stack"] if f["app"]]
        assert app_frames[-1]["file"].endswith("evidence_app.py")
        assert app_frames[-1]["line"] in loop_lines("PLANTED-BLOCK")
    # The first /parse ran while /slow-wait was awaiting on the same loop.
    assert max(b["delayed"] for b in blockers) >= 1
    assert others == []  # /hot runs in the thread pool: it never blocks the loop

    found = [
        f
        for f in _findings(asyncio_store, event_loop_blocker__min_count=2)
        if f.kind == "event_loop_blocker"
    ]
    assert [f.endpoint for f in found] == ["POST /parse"]
    assert found[0].callsite["line"] in loop_lines("PLANTED-BLOCK")
    assert found[0].evidence["blocks"] == 2
    assert set(found[0].example_trace_ids) == parse_ids


def test_a_large_result_handled_on_the_loop_shows_with_the_blocker(asyncio_store: Path) -> None:
    with DuckDBStore(str(asyncio_store), read_only=True) as store:
        (b,) = store.blockers(endpoint="POST /import-rows")
    assert b["duration_ms"] >= 200
    assert [f for f in b["stack"] if f["app"]][-1]["line"] in loop_lines("PLANTED-ROWS")
    assert b["last_kind"] == "db" and "FROM items" in b["last_call"]
    assert b["last_rows"] == 50_000
    # One block is below the detector's min_count; with 1 it is reported, with the rows.
    (f,) = [
        f
        for f in _findings(asyncio_store, event_loop_blocker__min_count=1)
        if f.kind == "event_loop_blocker" and f.endpoint == "POST /import-rows"
    ]
    assert "50,000 rows" in f.title and f.evidence["last_rows"] == 50_000


def test_hotspot_in_a_thread_pool_endpoint_is_named(asyncio_store: Path) -> None:
    planted = loop_lines("PLANTED-HOTSPOT")
    with DuckDBStore(str(asyncio_store), read_only=True) as store:
        p = profile.load(store, "GET /hot")
        hot, n = p.hotspot()
        assert p.requests == 3 and p.samples >= 20
        assert hot is not None and hot.function == "crunch" and hot.line in planted
        assert n / p.samples >= 0.5
        # computing: on a CPU or waiting for one (a busy machine), not waiting for I/O
        assert p.states.get("cpu", 0) + p.states.get("starved", 0) > p.samples / 2
        assert p.top(3)[0]["function"] == "crunch"
        # An awaiting request is sampled along its coroutine chain, as waiting.
        w = profile.load(store, "GET /slow-wait")
        assert w.samples > 0 and set(w.states) == {"wait"}
        await_line = line_of(APP, "PLANTED-AWAIT")
        # Samples taken while the handler awaited point at its await. One taken before the
        # handler was entered or after it returned has no application frame: on a busy machine
        # (/parse holding the loop) the task can sit there past the sampling mark.
        in_app = [([f for f in st if f.app], n) for st, n in w.stacks]
        assert sum(n for fs, n in in_app if fs) * 2 > w.samples
        assert all(fs[-1].line == await_line for fs, _ in in_app if fs)
        tree = p.tree()
    assert tree["name"] == "GET /hot" and tree["value"] == p.samples

    def names(node: dict[str, Any]) -> set[str]:
        return {node["function"] or ""} | {n for c in node["children"] for n in names(c)}

    assert "crunch" in names(tree)

    found = [f for f in _findings(asyncio_store) if f.kind == "slow_request_hotspot"]
    hotspots = {f.endpoint: f.callsite["function"] for f in found}
    assert hotspots["GET /hot"] == "crunch"
    # The awaiting endpoint is no hotspot; /alloc (400,000 objects built a request) may be one
    # when a busy machine makes its requests slow enough to be sampled.
    assert set(hotspots) <= {"GET /hot", "GET /alloc"}
    assert next(f.callsite["line"] for f in found if f.endpoint == "GET /hot") in planted


def test_gc_pauses_are_attributed_to_the_requests_in_flight(asyncio_store: Path) -> None:
    with DuckDBStore(str(asyncio_store), read_only=True) as store:
        alloc = store.query(
            "SELECT trace_id, gc_ms, gc_count FROM requests WHERE endpoint = 'GET /alloc'"
        )
        pauses = store.query("SELECT trace_ids, duration_ms FROM gc_pauses")
        top = {r["endpoint"]: r for r in store.top()}
    assert len(alloc) == 3
    assert all(r["gc_count"] > 0 and r["gc_ms"] > 0 for r in alloc)
    hit = {t for p in pauses for t in (p["trace_ids"] or "").split(",") if t}
    assert hit & {r["trace_id"] for r in alloc}, "no stored pause names an /alloc request"
    assert top["GET /alloc"]["gc_share"] > 0
    # With a threshold this low the detector must fire for /alloc; at the defaults, the clean
    # /fast endpoint must not.
    low = _findings(
        asyncio_store, gc_pressure__min_time_share=0.0, gc_pressure__min_ms_per_request=0.0,
        gc_pressure__min_requests=3,
    )  # fmt: skip
    assert "GET /alloc" in {f.endpoint for f in low if f.kind == "gc_pressure"}
    assert "GET /fast" not in {
        f.endpoint for f in _findings(asyncio_store) if f.kind == "gc_pressure"
    }


def test_profile_and_blockers_commands(asyncio_store: Path, tmp_path: Path) -> None:
    svg, speedscope = tmp_path / "flame.svg", tmp_path / "profile.speedscope.json"
    out = cli(asyncio_store, "profile", "GET /hot", "--svg", str(svg),
              "--speedscope", str(speedscope), "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["top"][0]["function"] == "crunch" and body["requests"] == 3
    assert "crunch" in svg.read_text() and svg.read_text().startswith("<svg")
    ss = json.loads(speedscope.read_text())
    names = {f["name"] for f in ss["shared"]["frames"]}
    assert "crunch" in names
    prof = ss["profiles"][0]
    assert prof["type"] == "sampled" and sum(prof["weights"]) == body["samples"]

    text = cli(asyncio_store, "profile", "GET /hot")
    assert text.returncode == 0 and "Hotspot: crunch" in text.stdout

    with DuckDBStore(str(asyncio_store), read_only=True) as store:
        one = store.traces(endpoint="GET /hot", limit=1)[0]["trace_id"]
    single = cli(asyncio_store, "profile", "--trace", one[:8], "--json")
    assert single.returncode == 0, single.stderr
    body1 = json.loads(single.stdout)
    assert body1["endpoint"] == "GET /hot" and body1["requests"] == 1
    assert 0 < body1["samples"] < body["samples"]
    missing = cli(asyncio_store, "profile")
    assert missing.returncode != 0 and "--trace" in missing.stderr

    none = cli(asyncio_store, "profile", "GET /fast")
    assert none.returncode == 0 and "No stack samples" in none.stdout
    bad = cli(asyncio_store, "profile", "GET /nope")
    assert (
        bad.returncode != 0 and "unknown endpoint" in bad.stderr and "Traceback" not in bad.stderr
    )
    bad_state = cli(asyncio_store, "profile", "GET /hot", "--state", "sleeping")
    assert bad_state.returncode != 0 and "--state" in bad_state.stderr

    b = cli(asyncio_store, "blockers", "--json")
    assert b.returncode == 0
    assert {r["endpoint"] for r in json.loads(b.stdout)} == {"POST /parse", "POST /import-rows"}


def test_blockers_on_a_uvloop_loop(tmp_path: Path) -> None:
    pytest.importorskip("uvloop")
    data = tmp_path / "data"
    with launched(
        tmp_path, data, uvicorn("evidence_app:app", "--loop", "uvloop"), service="uv",
        ready="/fast",
    ) as srv:  # fmt: skip
        waiting = threading.Thread(target=lambda: srv.get("/slow-wait"))
        waiting.start()
        time.sleep(0.15)
        assert srv.request("POST", "/parse")[0] == 200
        waiting.join()
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
        blockers = store.blockers()
    assert [b["endpoint"] for b in blockers] == ["POST /parse"]
    assert blockers[0]["delayed"] >= 1
    assert [f for f in blockers[0]["stack"] if f["app"]][-1]["line"] in loop_lines("PLANTED-BLOCK")


def test_gunicorn_sync_workers_are_sampled(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with launched(tmp_path, data, gunicorn("evidence_wsgi:app", 2), service="wsgi",
                  ready="/health", **FAST_SAMPLING) as srv:  # fmt: skip
        for _ in range(3):
            assert srv.get("/checksum")[0] == 200
        for _ in range(10):
            assert srv.get("/health")[0] == 200
        assert srv.stop() == 0
    with DuckDBStore(str(data)) as store:
        store.ingest()
        p = profile.load(store, "GET /checksum")
        hot, _ = p.hotspot()
        assert profile.load(store, "GET /health").samples == 0
        offsets = store.query(
            "SELECT r.trace_id, r.duration_ms, list(s.offset_ms ORDER BY s.offset_ms) AS at"
            " FROM requests r JOIN samples s USING (trace_id) WHERE r.endpoint = ?"
            " GROUP BY ALL",
            ["GET /checksum"],
        )
    # Each request is sampled from the mark while it runs, on ticks an interval apart (the
    # first may follow its arming tick sooner): at most (duration - 100) // 20 + 2 samples.
    assert len(offsets) == 3, offsets
    for r in offsets:
        at = r["at"]
        assert at[0] >= 100 and at[-1] <= r["duration_ms"], r
        assert len(at) <= (r["duration_ms"] - 100) // 20 + 2, r
    assert hot is not None and hot.function == "checksum"
    assert hot.line in loop_lines("PLANTED-WSGI-HOTSPOT", WSGI)
    found = _findings(data)
    assert [(f.kind, f.endpoint) for f in found if f.kind == "slow_request_hotspot"] == [
        ("slow_request_hotspot", "GET /checksum")
    ]
    assert not [f for f in found if f.kind in ("event_loop_blocker", "gc_pressure")]


def test_evidence_off_records_requests_only(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with launched(tmp_path, data, uvicorn("evidence_app:app"), service="off", ready="/fast",
                  PERFSLEUTH_EVIDENCE="0", **FAST_SAMPLING) as srv:  # fmt: skip
        assert srv.get("/hot")[0] == 200
        assert srv.request("POST", "/parse")[0] == 200
        assert srv.stop() in (0, -15)
    with DuckDBStore(str(data)) as store:
        store.ingest()
        assert store.query("SELECT count(*) AS n FROM requests")[0]["n"] >= 3
        for table in ("samples", "blockers", "gc_pauses"):
            assert store.query(f"SELECT count(*) AS n FROM {table}")[0]["n"] == 0


def test_a_crashing_evidence_thread_costs_evidence_not_answers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with launched(tmp_path, data, uvicorn("evidence_app:app"), service="crash", ready="/fast",
                  PERFSLEUTH_FAULT="evidence_crash", **FAST_SAMPLING) as srv:  # fmt: skip
        assert json.loads(srv.get("/hot")[1])["n"] > 0
        assert json.loads(srv.request("POST", "/parse")[1])["rows"] > 0
        assert json.loads(srv.get("/alloc")[1])["n"] == 400_000
        assert srv.get("/fast")[0] == 200
        answered = srv.answered
        assert srv.stop() in (0, -15)
    (status,) = [json.loads(p.read_text()) for p in (data / "agents").glob("*.json")]
    assert status["internal_errors"] > 0
    with DuckDBStore(str(data)) as store:
        store.ingest()
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": answered}]
        assert store.query("SELECT count(*) AS n FROM samples") == [{"n": 0}]


def test_call_stacks_stop_at_the_thread_pool_hand_off(asyncio_store: Path) -> None:
    with DuckDBStore(str(asyncio_store), read_only=True) as store:
        (t,) = store.traces(endpoint="GET /items/count")
        (call,) = store.trace(t["trace_id"])["calls"]
    files = [f["file"] for f in call["stack"]]
    assert files[-1].endswith("evidence_app.py")
    # The request entered the app's code in the pool's worker thread: the stack stops there,
    # without the thread's frames (anyio's worker loop, threading) or the agent's.
    assert not [f for f in files if "anyio" in f or f.endswith("threading.py")]
    assert not [f for f in files if os.sep + os.path.join("perfsleuth", "agent") in f]


# ------------------------------------------------------------------ the store side, no server


def test_malformed_evidence_records_are_coerced_not_fatal(tmp_path: Path) -> None:
    data = tmp_path / "data"
    w = SegmentWriter(str(data))
    w.request("GET /a", trace_id="00000000000000aa")
    w.event(b"P", {"id": "00000000000000aa", "samples": [[1_000_000, "cpu", None], "junk", [1]]})
    w.event(b"P", {"id": 5, "samples": "not a list"})
    w.event(b"B", {"dur": "long", "stacks": [["x", "y"], 3], "delayed": -1, "last_call": 7})
    w.event(b"G", {"pauses": [{"ts": "soon", "dur": 2_000_000, "gen": 2, "ids": "abc"}, 3]})
    w.event(b"G", ["not", "an", "object"])
    w.close()
    with DuckDBStore(str(data)) as store:
        report = store.ingest()
        assert report.requests == 1 and report.damaged == []
        assert store.query("SELECT offset_ms, state FROM samples") == [
            {"offset_ms": 1.0, "state": "cpu"}
        ]
        b = store.query("SELECT duration_ms, stack_id, delayed, last_call FROM blockers")
        assert b == [{"duration_ms": None, "stack_id": None, "delayed": -1, "last_call": None}]
        g = store.query("SELECT generation, duration_ms, trace_ids FROM gc_pauses")
        assert g == [{"generation": 2, "duration_ms": 2.0, "trace_ids": None}]


def test_a_block_after_the_handler_returned_counts_with_the_handler(tmp_path: Path) -> None:
    """The loop caught freeing what a handler built (no application frame on it) is the tail
    of that handler's block, not a second finding at a library line; a library-only block in
    an endpoint whose own code never blocked is still reported, at the library line."""
    data = tmp_path / "data"
    w = SegmentWriter(str(data))
    lib = ("/usr/lib/python3.11/asyncio/events.py", 80, "Handle._run", False)
    handler = w.stack([lib, ("/srv/app/main.py", 40, "import_feed", True)])
    freeing = w.stack([lib, ("/usr/lib/python3.11/contextlib.py", 769, "__exit__", False)])
    other = w.stack([lib, ("/venv/site-packages/lib/parse.py", 12, "loads", False)])
    for i, (endpoint, stack) in enumerate(
        [("POST /import", handler)] * 2 + [("POST /import", freeing), ("GET /feed", other)] * 2
    ):
        trace = f"{i + 1:016x}"
        w.request(endpoint, trace_id=trace, dur_ms=400)
        w.event(
            b"B",
            {"ts": time.time_ns(), "dur": 300_000_000, "delayed": 1, "id": trace,
             "endpoint": endpoint, "stacks": [[stack, 5]]},
        )  # fmt: skip
    w.close()
    with DuckDBStore(str(data)) as store:
        store.ingest()
        found = {f.endpoint: f for f in find(store, kinds=["event_loop_blocker"])}
    assert set(found) == {"POST /import", "GET /feed"}
    mine = found["POST /import"]
    assert mine.callsite is not None and mine.callsite["line"] == 40
    assert mine.evidence["blocks"] == 4 and mine.evidence["after_return"] == 2
    assert "2 of them after it returned" in mine.title
    theirs = found["GET /feed"]
    assert theirs.callsite is not None and theirs.callsite["line"] == 12
    assert theirs.evidence["after_return"] == 0


def test_a_loop_waiting_for_a_new_pool_thread_to_start_is_not_a_blocker(tmp_path: Path) -> None:
    """On an oversubscribed machine the loop waited 143 ms inside ``Thread.start`` (anyio's
    pool growing for a sync endpoint: the new thread had no CPU to start on) and a clean
    endpoint got an event_loop_blocker at threading.py's Condition.wait. Waiting for a thread
    to be scheduled is the machine's (cpu_starved), not the endpoint's; a Condition.wait
    reached otherwise (a future's result awaited synchronously) is still a blocker."""
    data = tmp_path / "data"
    w = SegmentWriter(str(data))
    threading_py = "/usr/lib/python3.11/threading.py"
    lib = ("/usr/lib/python3.11/asyncio/events.py", 80, "Handle._run", False)
    wait = (threading_py, 327, "Condition.wait", False)
    start = w.stack([lib, ("/venv/site-packages/anyio/to_thread.py", 56, "run_sync", False),
                     (threading_py, 964, "Thread.start", False), (threading_py, 629, "Event.wait",
                     False), wait])  # fmt: skip
    result = w.stack([lib, ("/srv/app/main.py", 12, "report", True),
                      ("/usr/lib/python3.11/concurrent/futures/_base.py", 451, "Future.result",
                      False), wait])  # fmt: skip
    for i, (endpoint, stack) in enumerate(
        [("GET /orders/{id}", start), ("GET /report", result)] * 2
    ):
        trace = f"{i + 1:016x}"
        w.request(endpoint, trace_id=trace, dur_ms=400)
        w.event(
            b"B",
            {"ts": time.time_ns(), "dur": 140_000_000, "delayed": 10, "id": trace,
             "endpoint": endpoint, "stacks": [[stack, 5]]},
        )  # fmt: skip
    w.close()
    with DuckDBStore(str(data)) as store:
        store.ingest()
        found = {f.endpoint: f for f in find(store, kinds=["event_loop_blocker"])}
    assert set(found) == {"GET /report"}
    assert found["GET /report"].callsite is not None
    assert found["GET /report"].callsite["line"] == 12


def test_a_store_from_before_evidence_is_migrated(tmp_path: Path) -> None:
    data = tmp_path / "data"
    w = SegmentWriter(str(data))
    w.request("GET /a", trace_id="00000000000000ab")
    w.close()
    with DuckDBStore(str(data)) as store:
        store.ingest()
        (day,) = store._days()
        # What an older version left behind: no gc columns, no evidence tables.
        for t in ("samples", "blockers", "gc_pauses"):
            store._con.execute(f"DROP TABLE {schema.day_table(schema.TABLES[t], day)}")
        req = schema.day_table(schema.REQUESTS, day)
        store._con.execute(f"ALTER TABLE {req} DROP COLUMN gc_ms")
        store._con.execute(f"ALTER TABLE {req} DROP COLUMN gc_count")
    with DuckDBStore(str(data), read_only=True) as ro:  # readers cope without migrating
        assert ro.query("SELECT count(*) AS n FROM samples") == [{"n": 0}]
        assert ro.top()[0]["gc_share"] == 0.0
    w = SegmentWriter(str(data))
    w.request("GET /a", trace_id="00000000000000ac")
    w.event(b"G", {"pauses": [{"dur": 3_000_000, "gen": 1, "ids": ["00000000000000ac"]}]})
    w.close()
    with DuckDBStore(str(data)) as store:  # a writer migrates, then ingests into the old day
        store.ingest()
        assert store.query("SELECT count(*) AS n FROM requests") == [{"n": 2}]
        assert store.query("SELECT count(*) AS n FROM gc_pauses") == [{"n": 1}]


# ------------------------------------------------- when a slow request's samples are taken

AFTER_MS, INTERVAL_MS = 100, 20  # the request below is sampled from 100 ms, every 20 ms


def _sampled_offsets(
    duration_ms: int, phase_ms: int, late_ms: int, pinged: bool = False
) -> list[float]:
    """The offsets (ms) of the samples the evidence thread's ticks take of one request in
    flight for ``duration_ms`` (a real request on a real thread, parked on an event), when the
    thread's last tick before the request was meant for ``phase_ms`` before it started and
    every tick starts ``late_ms`` after its mark (waiting for the interpreter lock or a CPU);
    ``pinged``: a watched event loop has a request in flight, so every tick pings it (tick()
    returns true whatever the sampler does).
    The ticks run on the sampler's own clock, each at the time the evidence thread's loop sets
    for it (evidence.next_tick), so what is counted is the policy, not the machine's speed."""
    from perfsleuth.agent import evidence, recorder, sampler
    from perfsleuth.agent.config import Config as AgentConfig

    cfg = AgentConfig()
    cfg.sample_after_ms, cfg.sample_interval_ms = AFTER_MS, INTERVAL_MS
    s = sampler.Sampler(cfg)
    started, release = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def handler() -> None:
        req = recorder.begin("web", "GET", "/known-length")
        got["req"] = req
        started.set()
        release.wait(30)
        recorder.end(req)

    t = threading.Thread(target=handler)
    t.start()
    try:
        assert started.wait(10)
        req = got["req"]
        assert req is not None
        end = req.start + duration_ms * 1_000_000
        target = req.start - phase_ms * 1_000_000  # the last tick's mark before it started
        now = target + late_ms * 1_000_000
        s.clock = lambda: now
        while now <= end:
            s.tick()
            busy = bool(s.tracked) or s.armed or pinged
            target = evidence.next_tick(s, busy, INTERVAL_MS * 1_000_000, target, now)
            now = target + late_ms * 1_000_000
        tracked = s.tracked.get(id(req))
        return [] if tracked is None else [off / 1e6 for off, _, _ in tracked.samples]
    finally:
        release.set()
        t.join(10)
        s._forget(set())


@pytest.mark.parametrize("pinged", [False, True], ids=["unwatched", "watched_loop"])
@pytest.mark.parametrize("late_ms", [0, 4])
@pytest.mark.parametrize("phase_ms", [0, 1, 13, 30, 49])
@pytest.mark.parametrize("duration_ms", [200, 330])
def test_a_slow_request_is_sampled_from_the_mark_at_every_interval(
    agent_data_dir: str, duration_ms: int, phase_ms: int, late_ms: int, pinged: bool
) -> None:
    """A request in flight for D ms gets its first sample at PERFSLEUTH_SAMPLE_AFTER_MS and one
    every PERFSLEUTH_SAMPLE_INTERVAL_MS after (each as late as the evidence thread's ticks
    start, at most): (D - after - late) // interval + 1 samples or one more, whatever the idle
    tick's phase, and whether or not the ticks also ping a watched event loop (an asyncio app
    with a request in flight).
    Before, the thread looked every 50 ms (IDLE_TICK) until a request crossed the mark, that
    look only read its thread, and each tick slept a whole interval after the last one ended:
    a 200 ms request got 3-5 of 6 here (1-4 on a real, busy machine). Pinging ticks, one
    interval after each other, ignored when the request was to be armed: its first sample
    came 7-20 ms after the mark (18 of the 20 watched_loop cases failed: all but phase 0
    with ticks on time, whose pings fell on the arming tick)."""
    offsets = _sampled_offsets(duration_ms, phase_ms, late_ms, pinged)
    assert offsets, offsets
    first = offsets[0]
    assert AFTER_MS <= first <= AFTER_MS + late_ms, offsets
    want = int(duration_ms - first) // INTERVAL_MS + 1
    assert offsets == pytest.approx([first + i * INTERVAL_MS for i in range(want)]), offsets


def test_an_idle_evidence_thread_sleeps_a_whole_idle_tick(agent_data_dir: str) -> None:
    """Nothing in flight: no wake-up before IDLE_TICK (no busy polling); a request in flight
    short of the mark: a wake-up one interval before it, never later than IDLE_TICK."""
    from perfsleuth.agent import evidence, recorder, sampler
    from perfsleuth.agent.config import Config as AgentConfig

    cfg = AgentConfig()
    cfg.sample_after_ms, cfg.sample_interval_ms = AFTER_MS, INTERVAL_MS
    s = sampler.Sampler(cfg)
    ms = 1_000_000

    def tick_at(now: int) -> int:
        """Tick at ``now`` (its own mark); returns in how many ms the next tick is."""
        s.clock = lambda: now
        s.tick()
        busy = bool(s.tracked) or s.armed
        return (evidence.next_tick(s, busy, INTERVAL_MS * ms, now, now) - now) / ms

    assert not recorder.inflight
    assert tick_at(10**15) == evidence.IDLE_TICK * 1000 and s.wake_at == 0
    started, release = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def handler() -> None:
        req = recorder.begin("web", "GET", "/idle-tick")
        got["req"] = req
        started.set()
        release.wait(30)
        recorder.end(req)

    t = threading.Thread(target=handler)
    t.start()
    try:
        assert started.wait(10)
        start = got["req"].start
        assert tick_at(start + 10 * ms) == 50  # the idle tick comes before the arming
        assert s.wake_at == start + 80 * ms
        assert tick_at(start + 70 * ms) == 10  # armed at 80 ms
        assert tick_at(start + 80 * ms) == 20 and s.armed and not s.tracked
        assert tick_at(start + 100 * ms) == 20  # due: sampled, then every interval
        assert [off for off, _, _ in s.tracked[id(got["req"])].samples] == [100 * ms]
    finally:
        release.set()
        t.join(10)
        s._forget(set())


class _StopLoop(Exception):
    """Raised by the test's sleep to leave the evidence thread's loop."""


def test_a_failing_tick_sleeps_a_whole_idle_tick(agent_data_dir: str) -> None:
    """A tick that raises (a bug reading some frame) is followed by an IDLE_TICK sleep, even
    when the last good tick set a wake-up time that is now past: the evidence thread must not
    spin, taking the interpreter lock, for as long as its ticks fail.
    Before, the loop scheduled from the last good tick's ``wake_at``: 0 s sleeps (a real
    thread: ~6,000 ticks in 0.6 s, and on after the request ended)."""
    from perfsleuth.agent import evidence, recorder, sampler
    from perfsleuth.agent.config import Config as AgentConfig

    cfg = AgentConfig()
    cfg.sample_after_ms, cfg.sample_interval_ms = AFTER_MS, INTERVAL_MS
    s = sampler.Sampler(cfg)
    ms = 1_000_000
    started, release = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def handler() -> None:
        req = recorder.begin("web", "GET", "/failing-tick")
        got["req"] = req
        started.set()
        release.wait(30)
        recorder.end(req)

    t = threading.Thread(target=handler)
    t.start()
    try:
        assert started.wait(10)
        start = got["req"].start
        now = start + 10 * ms
        s.clock = lambda: now
        ticks: list[int] = []
        sleeps: list[float] = []

        def tick_once() -> bool:
            """The first tick is good (the request is to be armed at 80 ms); the next fail,
            90 ms into the request and on."""
            ticks.append(now)
            if len(ticks) == 1:
                s.tick()
                assert s.wake_at == start + 80 * ms
                return bool(s.tracked) or s.armed
            raise RuntimeError("a bug reading frames")

        def sleep(seconds: float) -> None:
            nonlocal now
            sleeps.append(seconds)
            if len(sleeps) == 4:
                raise _StopLoop
            now = start + 90 * ms + (len(sleeps) - 1) * int(evidence.IDLE_TICK * 1e9)

        with pytest.raises(_StopLoop):
            evidence._loop(INTERVAL_MS * ms, s, tick_once, sleep)
        assert sleeps == pytest.approx([0.05, 0.05, 0.05, 0.05]), sleeps
    finally:
        release.set()
        t.join(10)
        s._forget(set())
