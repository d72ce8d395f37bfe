"""Replay and heap with real servers under `perfsleuth run`: captures of slow, failed, flagged
requests (uvicorn and gunicorn), secrets never stored, `replay --curl` and `replay --to`
reproducing the request (same status, same endpoint recorded again), truncated bodies refused,
a crashing capture never reaching the app; heap snapshots showing a planted leak grow.

App: tests/apps/replay_app.py. Sampling is off (PERFSLEUTH_CAPTURE_SAMPLE=0) so that fast
requests are never captured and every capture has a reason the test planted.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from perfsleuth.analysis import replay as rp
from test_run_servers import free_port, gunicorn, launched, status_files, uvicorn

NO_SAMPLE = {"PERFSLEUTH_CAPTURE_SAMPLE": "0", "PERFSLEUTH_CAPTURE_SLOW_MS": "300"}
SECRETS = ("TOPSECRET", "COOKIESECRET", "APIKEYSECRET")
HEADERS = {
    "Authorization": "Bearer TOPSECRET",
    "Cookie": "session=COOKIESECRET",
    "X-Api-Key": "APIKEYSECRET",
    "X-Custom": "keep me, it's fine",
    "Content-Type": "application/json",
}
BODY = json.dumps({"q": 'it\'s "quoted" & $spaced `x`', "n": list(range(50))}).encode()


def cli(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "perfsleuth", *args, "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def ok_json(data: Path, *args: str) -> Any:
    res = cli(data, *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def sql(data: Path, query: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = ok_json(data, "sql", query)
    return rows


def wait_for_captures(data: Path, n: int) -> dict[str, dict[str, Any]]:
    """Captures by endpoint once ``n`` are in the store (the writer flushes every 0.2 s)."""
    deadline = time.monotonic() + 30
    while True:
        rows = sql(data, "SELECT * FROM captures ORDER BY ts")
        if len(rows) >= n or time.monotonic() > deadline:
            return {r["endpoint"]: r for r in rows}
        time.sleep(0.2)


def fails(res: subprocess.CompletedProcess[str], *words: str) -> None:
    assert res.returncode != 0, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr  # one sentence, no traceback
    for w in words:
        assert w in lines[0], lines[0]


def heap_diff_shows_leak(data: Path, srv: Any, pid: int) -> None:
    a = ok_json(data, "heap", str(pid))
    assert a["pid"] == pid and a["objects"] > 0
    hits = 0
    for _ in range(50):  # until this process served one (gunicorn has two workers)
        hits += json.loads(srv.get("/grow?n=5000")[1])["pid"] == pid
        if hits:
            break
    b = ok_json(data, "heap", str(pid))
    d = ok_json(data, "heap", "--diff", a["path"], b["path"])
    top = d["types"][0]
    assert top["type"] == "replay_app.PlantedLeak", d["types"][:5]
    assert top["count_delta"] == 5000 * hits
    assert top["bytes_delta"] > 0
    text = cli(data, "heap", "--diff", os.path.basename(a["path"]), os.path.basename(b["path"]))
    assert text.returncode == 0 and "replay_app.PlantedLeak" in text.stdout


def test_uvicorn_capture_replay_and_heap(tmp_path: Path) -> None:
    data = tmp_path / "data"
    big = bytes(range(256)) * 400  # 102,400 bytes: past the 64 KiB body maximum
    with launched(tmp_path, data, uvicorn("replay_app:app"), service="rp", ready="/fast",
                  **NO_SAMPLE) as srv:  # fmt: skip
        url = f"http://127.0.0.1:{srv.port}"
        for _ in range(30):  # fast, sampled out: never captured
            assert srv.get("/fast", headers=HEADERS)[0] == 200
        status, orig = srv.request("POST", "/slow/7?ms=400&x=a%20b", body=BODY, headers=HEADERS)
        assert status == 200
        orig_answer = json.loads(orig)
        assert srv.get("/boom")[0] == 500
        assert srv.request("POST", "/upload?keep=1", body=big)[0] == 200
        assert srv.request("POST", "/upload", body=b"small, fast, not flagged")[0] == 200
        caps = wait_for_captures(data, 3)
        assert set(caps) == {"POST /slow/{item_id}", "GET /boom", "POST /upload"}
        slow, boom, upload = caps["POST /slow/{item_id}"], caps["GET /boom"], caps["POST /upload"]
        assert (slow["reason"], slow["status"]) == ("slow", 200)
        assert slow["url"] == f"http://127.0.0.1:{srv.port}/slow/7?ms=400&x=a%20b"
        assert slow["body_size"] == len(BODY) and not slow["body_truncated"]
        assert (boom["reason"], boom["status"]) == ("error", 500)
        assert upload["reason"] == "flag"
        assert upload["body_truncated"] and upload["body_size"] == len(big)
        assert upload["body_sha256"] == __import__("hashlib").sha256(big).hexdigest()
        # Secrets: never in the store (names listed as redacted, values replaced).
        dump = json.dumps(sql(data, "SELECT * FROM captures"))
        assert not any(s in dump for s in SECRETS)
        assert slow["redacted"] == "authorization,cookie,x-api-key"
        assert "keep me, it's fine" in slow["headers"]

        # --curl: parses as shell, leaves the secrets out (and says so), reproduces the request.
        res = cli(data, "replay", slow["trace_id"][:10], "--curl")
        assert res.returncode == 0, res.stderr
        cmd = res.stdout
        assert not any(s in cmd for s in SECRETS)
        assert "redacted at capture time, not sent: authorization, cookie, x-api-key" in cmd
        shlex.split(cmd, comments=True)
        out = subprocess.run(
            ["bash", "-c", cmd],
            env={**os.environ, "PERFSLEUTH_TARGET": url},
            capture_output=True,
            timeout=60,
            check=True,
        )
        again = json.loads(out.stdout)
        assert {k: again[k] for k in ("sha256", "size", "custom", "item_id")} == {
            k: orig_answer[k] for k in ("sha256", "size", "custom", "item_id")
        }
        assert orig_answer["authorized"] and not again["authorized"]  # redacted: not sent

        # --to: re-sent twice, the original timing alongside.
        rep = ok_json(data, "replay", slow["trace_id"], "--to", url, "--times", "2")
        assert [r["status"] for r in rep["runs"]] == [200, 200]
        assert rep["original"]["status"] == 200 and rep["original"]["duration_ms"] >= 400
        assert all(r["duration_ms"] >= 400 for r in rep["runs"])
        text = cli(data, "replay", slow["trace_id"], "--to", url)
        assert text.returncode == 0 and "original" in text.stdout and "replay 1" in text.stdout
        assert [
            r["status"] for r in ok_json(data, "replay", boom["trace_id"], "--to", url)["runs"]
        ] == [500]

        # A truncated body is refused, unless asked for.
        fails(
            cli(data, "replay", upload["trace_id"], "--to", url), "truncated", "--allow-truncated"
        )
        fails(cli(data, "replay", upload["trace_id"], "--curl"), "truncated")
        rep = ok_json(data, "replay", upload["trace_id"], "--to", url, "--allow-truncated")
        assert rep["runs"][0]["status"] == 200

        # Clear one-sentence errors.
        fast_trace = sql(data, "SELECT trace_id FROM requests WHERE endpoint = 'GET /fast' LIMIT 1")
        fails(cli(data, "replay", fast_trace[0]["trace_id"], "--curl"), "no replayable capture")
        fails(cli(data, "replay", "ffffffffffffffff", "--curl"), "no trace with id")
        fails(cli(data, "replay", slow["trace_id"], "--to", f"http://127.0.0.1:{free_port()}"),
              "connection refused")  # fmt: skip
        fails(cli(data, "replay", slow["trace_id"]), "--curl", "--to")

        # Heap: the uvicorn process answers SIGUSR2 with a snapshot; the planted leak grows.
        pid = json.loads(srv.get("/pid")[1])["pid"]
        assert pid == srv.proc.pid
        heap_diff_shows_leak(data, srv, pid)
        assert srv.stop() in (0, -15)
    fails(cli(data, "heap", str(pid)), f"no process with PID {pid}")

    # The replays were recorded as the same endpoint with the same status: the original, the
    # curl run and two --to runs of /slow; the original and one replay of /boom.
    rows = sql(
        data,
        "SELECT endpoint, status, count(*) AS n FROM requests "
        "WHERE endpoint IN ('POST /slow/{item_id}', 'GET /boom') GROUP BY ALL",
    )
    assert {(r["endpoint"], r["status"], r["n"]) for r in rows} == {
        ("POST /slow/{item_id}", 200, 5),
        ("GET /boom", 500, 2),
    }


def test_gunicorn_flask_capture_replay_and_heap(tmp_path: Path) -> None:
    data = tmp_path / "data"
    form = "name=O%27Brien+%26+sons&note=caf%C3%A9%0Aline+two"
    with launched(tmp_path, data, gunicorn("replay_app:flask_app", 2), service="rpw",
                  ready="/fast", **NO_SAMPLE) as srv:  # fmt: skip
        url = f"http://127.0.0.1:{srv.port}"
        for _ in range(20):
            assert srv.get("/fast", headers=HEADERS)[0] == 200
        status, _ = srv.request("POST", "/slow/3?ms=400", body=BODY, headers=HEADERS)
        assert status == 200
        status, form_orig = srv.request(
            "POST", "/form", body=form.encode(),
            headers={"Content-Type": "application/x-www-form-urlencoded",
                     "Cookie": "s=COOKIESECRET"},
        )  # fmt: skip
        assert status == 200
        assert srv.get("/boom")[0] == 500
        caps = wait_for_captures(data, 3)
        assert set(caps) == {"POST /slow/<int:item_id>", "POST /form", "GET /boom"}
        assert caps["GET /boom"]["reason"] == "error" and caps["GET /boom"]["status"] == 500
        assert caps["POST /form"]["reason"] == "flag"
        assert not any(s in json.dumps(list(caps.values())) for s in SECRETS)

        slow = caps["POST /slow/<int:item_id>"]
        assert slow["body_size"] == len(BODY) and not slow["body_truncated"]
        rep = ok_json(data, "replay", slow["trace_id"], "--to", url, "--times", "2")
        assert [r["status"] for r in rep["runs"]] == [200, 200]
        cmd = ok_json(data, "replay", caps["POST /form"]["trace_id"], "--curl", "--to", url)["curl"]
        out = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=60, check=True)
        assert json.loads(out.stdout) == json.loads(form_orig)

        # Heap: a worker answers (gunicorn resets SIGUSR2 in workers: the agent takes it
        # back); the master uses SIGUSR2 itself, so it is never signalled.
        worker = json.loads(srv.get("/pid")[1])["pid"]
        heap_diff_shows_leak(data, srv, worker)
        fails(cli(data, "heap", str(srv.proc.pid)), "no perfsleuth heap hook")
        assert srv.proc.poll() is None  # the master was not signalled
        assert srv.stop() == 0
    rows = sql(data, "SELECT status, count(*) AS n FROM requests "
                     "WHERE endpoint = 'POST /slow/<int:item_id>' GROUP BY ALL")  # fmt: skip
    assert [(r["status"], r["n"]) for r in rows] == [(200, 3)]


def test_crashing_capture_never_reaches_the_app(tmp_path: Path) -> None:
    data = tmp_path / "data"
    crash = {"PERFSLEUTH_FAULT": "capture_crash", "PERFSLEUTH_CAPTURE_SAMPLE": "1"}
    with launched(tmp_path, data, uvicorn("replay_app:app"), service="crash", ready="/fast",
                  **crash) as srv:  # fmt: skip
        for _ in range(5):
            assert srv.get("/fast")[0] == 200
        status, body = srv.request("POST", "/slow/1?ms=10", body=BODY, headers=HEADERS)
        assert status == 200 and json.loads(body)["size"] == len(BODY)
        assert srv.request("POST", "/upload?keep=1", body=b"x" * 1000)[0] == 200
        assert srv.get("/boom")[0] == 500
        assert srv.stop() in (0, -15)
        answered = srv.answered
    assert sql(data, "SELECT count(*) AS n FROM captures") == [{"n": 0}]
    assert sql(data, "SELECT count(*) AS n FROM requests") == [{"n": answered}]
    (status,) = status_files(data)  # the crashes were counted, as internal errors
    assert status["internal_errors"] >= answered and status["captures"] == 0


# ------------------------------------------------------------------------------ curl_for


def capture(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "trace_id": "00ff00ff00ff00ff",
        "method": "POST",
        "url": "http://shop.example:8000/a%20b/it's?q=$HOME&x=`id`",
        "headers": [
            ("host", "shop.example:8000"),
            ("content-length", "3"),
            ("authorization", "[redacted]"),
            ("x-note", 'it\'s "odd" $(id)'),
        ],
        "redacted": ["authorization"],
        "body_b64": "",
        "body_size": 0,
        "body_truncated": False,
    }
    base.update(kw)
    return base


def test_curl_for_is_shell_safe() -> None:
    import base64

    text = "{'a': \"$(rm -rf /)\"}\n`x`"
    cmd = rp.curl_for(capture(body_b64=base64.b64encode(text.encode()).decode()))
    comment, line = cmd.splitlines()[0], cmd.split("\n", 1)[1]
    assert comment.startswith("# redacted at capture time, not sent: authorization")
    assert line.startswith("# sent to $PERFSLEUTH_TARGET")
    line = line.split("\n", 1)[1]
    argv = shlex.split(line)
    # The target is $PERFSLEUTH_TARGET when the command runs, never the captured Host (which
    # the request's sender chose); that Host is sent as a header.
    assert argv[:6] == [
        "curl",
        "-sS",
        "-X",
        "POST",
        "--globoff",
        "${PERFSLEUTH_TARGET:?set PERFSLEUTH_TARGET to the server to send it to, like "
        "http://127.0.0.1:8000}/a%20b/it's?q=$HOME&x=`id`",
    ]
    assert argv[6:10] == ["-H", "Host: shop.example:8000", "-H", 'x-note: it\'s "odd" $(id)']
    assert argv[-2:] == ["--data-raw", text]
    assert "content-length" not in line and "authorization" not in line
    # Sent elsewhere: same path and query.
    moved = rp.curl_for(capture(), "http://127.0.0.1:9000")
    assert "'http://127.0.0.1:9000/a%20b/it'\"'\"'s?q=$HOME&x=`id`'" in moved
    # Binary bodies go through base64.
    binary = rp.curl_for(capture(body_b64=base64.b64encode(b"\x00\xff\x10").decode()))
    assert "| base64 -d |" in binary and binary.endswith("--data-binary @-")


# --------------------------------------------------------------------- agent and store, in-process


def test_body_budget_drops_and_counts(monkeypatch: Any) -> None:
    from perfsleuth.agent import capture

    monkeypatch.setattr(capture, "PENDING_MAX", 100_000)
    monkeypatch.setattr(capture, "_body_max", 1000)
    big = capture.BodyTap()
    for _ in range(9):
        big.add(b"a" * 10_000)  # whole body kept while the budget allows (for its hash)
    assert big.full and big.kept == 90_000
    other = capture.BodyTap()
    other.add(b"b" * 20_000)  # over budget: only its first body_max bytes
    assert not other.full and other.kept == 1000 and other.size == 20_000
    big.add(b"a" * 20_000)  # over budget: trimmed back to its first chunk
    assert not big.full and big.kept == 10_000 and big.size == 110_000
    other.add(b"b" * 20_000)  # no longer whole: nothing past its first body_max bytes
    assert other.kept == 1000 and other.size == 40_000 and len(other.chunks) == 1
    big.release()
    other.release()
    assert capture._pending == 0
    hog = capture.BodyTap()
    hog.add(b"h" * 99_500)
    starved = capture.BodyTap()
    starved.add(b"s" * 5000)  # not even 1000 bytes fit: this body is lost
    assert starved.lost and starved.kept == 0
    req = type("R", (), {"trace_id": 1, "start_wall": 0, "start": 0, "end": 0, "endpoint": "",
                         "method": "POST", "status": 500, "keep": None})()  # fmt: skip
    before = capture.stats["captures_dropped"]
    capture.finish_asgi(req, {"headers": []}, starved)  # type: ignore[arg-type]
    assert capture.stats["captures_dropped"] == before + 1
    hog.release()
    assert capture._pending == 0


def test_sampled_requests_are_captured(agent_data_dir: str, monkeypatch: Any) -> None:
    import asyncio

    import perfsleuth.agent as ps
    from perfsleuth.agent import capture
    from perfsleuth.wire.segment import read_segment

    monkeypatch.setattr(capture, "_sample", 1.0)
    monkeypatch.setattr(capture, "_countdown", 1)  # the next request is the sample
    monkeypatch.setattr(capture, "_in_window", 0)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"sampled body", "more_body": False}

    async def send(message: Any) -> None:
        pass

    scope = {"type": "http", "method": "PUT", "path": "/s", "raw_path": b"/s",
             "query_string": b"a=1", "scheme": "http", "server": ("10.0.0.1", 81),
             "headers": [(b"x-auth-token", b"APIKEYSECRET")]}  # fmt: skip
    asyncio.run(ps.asgi(app)(scope, receive, send))
    ps.flush()
    import glob

    recs = [
        o
        for p in glob.glob(os.path.join(agent_data_dir, "spool", "*"))
        if os.path.isfile(p)
        for t, o in read_segment(Path(p).read_bytes()).records
        if t == b"C" and o["url"] == "http://10.0.0.1:81/s?a=1"
    ]
    assert len(recs) == 1
    (rec,) = recs
    assert rec["reason"] == "sample" and rec["status"] == 204 and rec["method"] == "PUT"
    assert rec["headers"] == [["x-auth-token", "[redacted]"]]
    assert rec["body_b64"] == "c2FtcGxlZCBib2R5" and rec["body_size"] == 12


def test_random_samples_are_capped_per_minute(agent_data_dir: str, monkeypatch: Any) -> None:
    """PERFSLEUTH_CAPTURE_SAMPLE=1 keeps every request at random, but at most
    PERFSLEUTH_CAPTURE_SAMPLE_PER_MIN a minute; slow and failed ones are not capped."""
    from perfsleuth.agent import capture, recorder

    monkeypatch.setattr(capture, "_sample", 1.0)
    monkeypatch.setattr(capture, "_countdown", 1)
    monkeypatch.setattr(capture, "_sample_per_min", 3)
    monkeypatch.setattr(capture, "_window", time.monotonic())
    monkeypatch.setattr(capture, "_in_window", 0)
    capped = recorder.stats["captures_sample_capped"]

    def ended(status: int, ms: float) -> recorder.ActiveRequest:
        req = recorder.begin("web", "GET", "/c")
        assert req is not None
        req.status = status
        recorder.end(req)
        req.end = req.start + int(ms * 1e6)
        return req

    reasons = [capture.reason(ended(200, 1)) for _ in range(10)]
    assert reasons == ["sample"] * 3 + [None] * 7
    assert recorder.stats["captures_sample_capped"] - capped == 7
    assert capture.reason(ended(503, 1)) == "error"
    assert capture.reason(ended(200, 10_000)) == "slow"


def test_captures_ingest_exactly_once_and_expire(tmp_path: Path) -> None:
    from perfsleuth.store.duckdb_store import DuckDBStore
    from spoolwrite import SegmentWriter

    data = str(tmp_path / "data")
    old_ns = (time.time_ns() // 10**9 - 40 * 86400) * 10**9
    w = SegmentWriter(data)
    w.request("GET /a", trace_id="00000000000000aa")
    cap = {"id": "00000000000000aa", "ts": time.time_ns(), "dur": 7_000_000, "method": "GET",
           "endpoint": "GET /a", "status": 200, "reason": "slow", "url": "http://h/a",
           "headers": [["accept", "*/*"], "junk"], "redacted": [], "body_b64": "",
           "body_size": 0, "body_truncated": False}  # fmt: skip
    w.event(b"C", cap)
    w.event(b"C", cap)  # the same capture twice: one row
    w.event(b"C", dict(cap, id="00000000000000bb", ts=old_ns))
    w.event(b"C", {"no": "id"})
    w.close()
    with DuckDBStore(data) as store:
        store.ingest()
        store.ingest()
        assert store.query("SELECT count(*) AS n FROM captures") == [{"n": 2}]
        c = store.capture("00000000000000a")
        assert c is not None and c["headers"] == [("accept", "*/*")] and c["duration_ms"] == 7.0
        assert store.capture("00000000000000bb") is not None
        store.apply_retention(30)
        assert store.capture("00000000000000aa") is not None
        assert store.query("SELECT count(*) AS n FROM captures") == [{"n": 1}]


def test_django_failure_is_captured_and_replayed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with launched(tmp_path, data, gunicorn("djproject.wsgi:application", 1), service="dj",
                  ready="/health/", DJANGO_SETTINGS_MODULE="djproject.settings",
                  **NO_SAMPLE) as srv:  # fmt: skip
        assert srv.get("/boom/?q=caf%C3%A9", headers={"Cookie": "sid=COOKIESECRET"})[0] == 500
        assert srv.get("/orders/5/")[0] == 200
        caps = wait_for_captures(data, 1)
        assert set(caps) == {"GET /boom/"}
        boom = caps["GET /boom/"]
        assert boom["url"] == f"http://127.0.0.1:{srv.port}/boom/?q=caf%C3%A9"
        assert boom["redacted"] == "cookie" and "COOKIESECRET" not in boom["headers"]
        rep = ok_json(data, "replay", boom["trace_id"], "--to", f"http://127.0.0.1:{srv.port}")
        assert [r["status"] for r in rep["runs"]] == [500]
        assert srv.stop() == 0
    rows = sql(
        data,
        "SELECT status, count(*) AS n FROM requests WHERE endpoint = 'GET /boom/' GROUP BY ALL",
    )
    assert [(r["status"], r["n"]) for r in rows] == [(500, 2)]


def test_loop_blocker_is_captured(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"PERFSLEUTH_CAPTURE_SAMPLE": "0", "PERFSLEUTH_CAPTURE_SLOW_MS": "5000"}
    with launched(tmp_path, data, uvicorn("replay_app:app"), service="blk", ready="/fast",
                  **env) as srv:  # fmt: skip
        assert srv.get("/block")[0] == 200
        assert srv.get("/fast")[0] == 200
        caps = wait_for_captures(data, 1)
        assert srv.stop() in (0, -15)
    assert set(caps) == {"GET /block"} and caps["GET /block"]["reason"] == "blocker"


def test_redaction_settings() -> None:
    from perfsleuth.agent import capture, config

    fields = (1, 0, 0, "GET /x", "GET", 200, "slow")
    headers = [
        ("HTTP_AUTHORIZATION", "Basic c2VjcmV0"),
        ("HTTP_X_SESSION_TOKEN", "tok"),
        ("HTTP_X_PLAIN", "plain"),
        ("CONTENT_TYPE", "text/plain"),
    ]
    parts = ("http", "srv:80", None, "/x y", "a=1")
    names = ("_redact", "_secrets", "_body_max", "on", "_fault", "_slow_ns", "_sample")
    saved = {n: getattr(capture, n) for n in names}
    try:
        os.environ["PERFSLEUTH_REDACT_HEADERS"] = " X-Session-Token , "
        capture.configure(config.load())
        rec = capture._record(fields, headers, parts, None)
        assert rec["headers"] == [
            ["authorization", "[redacted]"],
            ["x-session-token", "[redacted]"],
            ["x-plain", "plain"],
            ["content-type", "text/plain"],
        ]
        assert rec["redacted"] == ["authorization", "x-session-token"]
        assert rec["url"] == "http://srv:80/x%20y?a=1"
        os.environ["PERFSLEUTH_CAPTURE_SECRETS"] = "1"
        capture.configure(config.load())
        rec = capture._record(fields, headers, parts, None)
        assert ["authorization", "Basic c2VjcmV0"] in rec["headers"] and rec["redacted"] == []
    finally:
        os.environ.pop("PERFSLEUTH_REDACT_HEADERS", None)
        os.environ.pop("PERFSLEUTH_CAPTURE_SECRETS", None)
        for n, v in saved.items():
            setattr(capture, n, v)


def test_heap_hook_steps_aside_for_the_app(tmp_path: Path) -> None:
    """An application that takes SIGUSR2 after the agent started keeps it: the marker goes, so
    `perfsleuth heap` refuses to signal it; one that never had a hook is refused too."""
    data = tmp_path / "data"
    code = (
        "import signal, sys, time\n"
        "import perfsleuth.agent as ps\n"
        "from perfsleuth.agent import heap\n"
        "heap.CHECK_SECONDS = 0.1\n"
        "assert ps.start(sys.argv[1], service='own', instrument=False)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "signal.signal(signal.SIGUSR2, lambda *a: print('app handler', flush=True))\n"
        "print('taken', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(data)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        marker = data / "agents" / f"heap-{proc.pid}.ready"
        assert marker.exists()
        snap = ok_json(data, "heap", str(proc.pid))
        assert snap["pid"] == proc.pid
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "taken"
        deadline = time.monotonic() + 30
        while marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not marker.exists()
        fails(cli(data, "heap", str(proc.pid)), "no perfsleuth heap hook")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
