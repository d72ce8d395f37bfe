"""Real servers under `perfsleuth run`: gunicorn (pre-fork workers), uvicorn (spawned workers),
Django under both, and the agent's failure modes, all launched the way the CLI launches them
(``perfsleuth.agent.launch``: exec with the bootstrap ``sitecustomize`` on PYTHONPATH).

Every request a client got an answer for must be in the spool exactly once after a graceful
stop (SIGTERM), recorded by the worker that served it, never by the master/supervisor.
"""

from __future__ import annotations

import collections
import glob
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.wire import HEADER, REQUESTS
from perfsleuth.wire.segment import read_segment
from spoolread import read_spool

APPS = str(Path(__file__).parent / "apps")
START_TIMEOUT = 90.0  # a hang guard only: nothing asserts on durations


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fetch(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.answered = 0  # responses received, readiness probes included

    def request(self, method: str, path: str, **kw: Any) -> tuple[int, bytes]:
        status, body = fetch(self.port, method, path, **kw)
        self.answered += 1
        return status, body

    def get(self, path: str, **kw: Any) -> tuple[int, bytes]:
        return self.request("GET", path, **kw)

    def wait_ready(self, path: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{self.log.read_text()}")
            try:
                self.get(path)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"server never answered:\n{self.log.read_text()}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> int:
        """Graceful stop (SIGTERM to the server process, as a process manager would)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server did not stop:\n{self.log.read_text()}") from None


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSLEUTH_")}
    env.update(extra)
    return env


@contextmanager
def launched(
    tmp_path: Path, data: Path, cmd: list[str], *, service: str, ready: str, **env: str
) -> Iterator[Server]:
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    log = tmp_path / f"{service}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "perfsleuth.agent.launch",
                "--data",
                str(data),
                "--service",
                service,
                "--",
                *cmd,
            ],
            cwd=APPS,
            env=child_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: cleaned up by id below
        )
    srv = Server(proc, port, log)
    try:
        srv.wait_ready(ready)
        yield srv
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        else:  # workers of a stopped server must be gone too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def segments(data: Path) -> list[tuple[int, str, list[dict[str, Any]]]]:
    """(pid from the segment header, file name, requests) of every spool file."""
    out = []
    for path in sorted(glob.glob(str(data / "spool" / "*"))):
        res = read_segment(Path(path).read_bytes())
        assert not res.damaged, path
        headers = [obj for t, obj in res.records if t == HEADER]
        assert len(headers) == 1, path
        reqs = [req for t, obj in res.records if t == REQUESTS for req in obj]
        out.append((int(headers[0]["pid"]), os.path.basename(path), reqs))
    return out


def status_files(data: Path) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text()) for p in glob.glob(str(data / "agents" / "*.json"))]


def gunicorn(app: str, workers: int) -> list[str]:
    return [
        sys.executable, "-m", "gunicorn", "-w", str(workers), "-b", "127.0.0.1:{port}",
        "--no-control-socket", "--timeout", "120", "--graceful-timeout", "60", app,
    ]  # fmt: skip


def uvicorn(app: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", "{port}",
            "--no-access-log", *extra]  # fmt: skip


def many(n: int, fn: Any, threads: int = 16) -> list[Any]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, range(n)))


# ------------------------------------------------------------------------------- gunicorn


def test_gunicorn_four_workers_flask_exactly_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    with launched(tmp_path, data, gunicorn("flask_app:app", 4), service="admin",
                  ready="/health", PERFSLEUTH_CPU_SAMPLE="1") as srv:  # fmt: skip
        # Four concurrent barrier calls occupy the four sync workers: each serves one.
        pids = many(4, lambda _: json.loads(srv.get(f"/barrier/4?dir={barrier}")[1])["pid"], 4)
        assert len(set(pids)) == 4
        results = many(196, lambda i: srv.get(f"/admin/customers/{i}", headers={"X-User": f"u{i}"}))
        assert all(status == 200 for status, _ in results)
        assert [json.loads(body)["customer_id"] for _, body in results] == list(range(196))
        master = srv.proc.pid
        assert srv.stop() == 0
        answered = srv.answered

    recs = read_spool(str(data))
    assert len(recs) == answered  # every answered request, once (probes included)
    assert len({r["id"] for r in recs}) == answered
    counts = collections.Counter(r["endpoint"] for r in recs)
    assert counts["GET /admin/customers/<int:customer_id>"] == 196
    assert counts["GET /barrier/<int:n>"] == 4
    assert sum(counts.values()) - 200 == counts["GET /health"] >= 1
    customers = sorted(
        (r for r in recs if r["endpoint"].startswith("GET /admin")),
        key=lambda r: r["attrs"]["customer_id"],
    )
    assert [r["user"] for r in customers] == [f"u{i}" for i in range(196)]
    assert all(r["status"] == 200 and r["cpu_ns"] > 0 for r in customers)

    segs = segments(data)
    assert {pid for pid, _, _ in segs} == set(pids)  # the four workers, not the master
    assert master not in {pid for pid, _, _ in segs}
    for pid, name, reqs in segs:
        assert name.endswith(".seg"), f"{name} left open: the worker did not flush at exit"
        assert f"-{pid}-" in name
        assert all(r["attrs"]["pid"] == pid for r in reqs if "pid" in r.get("attrs", {}))
    by_pid = {s["pid"]: s for s in status_files(data)}
    assert by_pid[master]["requests_recorded"] == 0
    assert sum(s["requests_written"] for s in by_pid.values()) == answered
    assert all(s["dropped_writer_dead"] == s["dropped_write_error"] == 0 for s in by_pid.values())


@pytest.mark.parametrize(
    "options",
    [["--preload"], ["--worker-class", "gthread", "--threads", "4"]],
    ids=["preload", "gthread"],
)
def test_gunicorn_variants_exactly_once(tmp_path: Path, options: list[str]) -> None:
    # --preload imports (and patches) the app in the master before forking; gthread serves
    # requests concurrently on threads of each worker.
    data = tmp_path / "data"
    cmd = gunicorn("flask_app:app", 3)
    cmd[-1:-1] = options
    with launched(tmp_path, data, cmd, service="admin", ready="/health") as srv:
        results = many(150, lambda i: srv.get(f"/admin/customers/{i}"))
        assert [json.loads(body)["customer_id"] for _, body in results] == list(range(150))
        master = srv.proc.pid
        assert srv.stop() == 0
        answered = srv.answered
    recs = read_spool(str(data))
    assert len(recs) == answered and len({r["id"] for r in recs}) == answered
    assert sorted(r["attrs"]["customer_id"] for r in recs if "attrs" in r) == list(range(150))
    assert master not in {pid for pid, _, _ in segments(data)}


# -------------------------------------------------------------------------------- uvicorn


def test_uvicorn_spawned_workers_fastapi(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with launched(tmp_path, data, uvicorn("fastapi_app:app", "--workers", "2"),
                  service="shop", ready="/health") as srv:  # fmt: skip
        orders = many(60, lambda i: srv.get(f"/orders/{i}", headers={"x-tenant": "acme"}))
        items = many(20, lambda i: srv.get(f"/api/v1/items/sku{i}"))
        reports = many(10, lambda i: srv.get(f"/legacy/t{i}/reports/{i}"))
        posts = many(5, lambda i: srv.request("POST", "/orders", body=b"z" * (100 + i)))
        scans = many(5, lambda i: srv.get(f"/scanner/probe-{i}.php"))
        boom = srv.get("/boom")
        supervisor = srv.proc.pid
        srv.stop()
        answered = srv.answered

    assert all(s == 200 for s, _ in orders + items + reports + posts)
    assert all(s == 404 for s, _ in scans) and boom[0] == 500
    recs = read_spool(str(data))
    assert len(recs) == answered and len({r["id"] for r in recs}) == answered
    counts = collections.Counter(r["endpoint"] for r in recs)
    assert counts["GET /orders/{order_id}"] == 60
    assert counts["GET /api/v1/items/{item_id}"] == 20
    assert counts["GET /legacy/{tenant}/reports/{report_id:int}"] == 10
    assert counts["POST /orders"] == 5
    assert counts["GET <unmatched>"] == 5
    assert counts["GET /boom"] == 1
    assert all(r["tenant"] == "acme" for r in recs if r["endpoint"] == "GET /orders/{order_id}")
    assert sorted(r["req_bytes"] for r in recs if r["method"] == "POST") == list(range(100, 105))
    (b,) = [r for r in recs if r["endpoint"] == "GET /boom"]
    assert b["status"] == 500 and b["error"] == "RuntimeError"
    segs = segments(data)
    assert supervisor not in {pid for pid, _, _ in segs}
    # uvicorn re-raises SIGTERM after its graceful shutdown (which skips atexit): the agent
    # still closed its segments.
    assert all(name.endswith(".seg") for _, name, _ in segs)


# --------------------------------------------------------------------------------- Django

DJANGO_REQUESTS = [
    ("/orders/5/", 200, "GET /orders/<int:order_id>/"),
    ("/api/orders/7/", 200, "GET /api/orders/<int:order_id>/"),
    ("/api/async-orders/8/", 200, "GET /api/async-orders/<int:order_id>/"),
    ("/api/invoices/2024/17/", 200, "GET /api/invoices/(?P<year>[0-9]{4})/(?P<number>[0-9]+)/"),
    ("/no/such/thing/", 404, "GET <unmatched>"),
    ("/boom/", 500, "GET /boom/"),
]


def check_django(recs: list[dict[str, Any]], answered: int, rounds: int) -> None:
    assert len(recs) == answered and len({r["id"] for r in recs}) == answered
    counts = collections.Counter((r["endpoint"], r["status"]) for r in recs)
    for _, status, ep in DJANGO_REQUESTS:
        assert counts[(ep, status)] == rounds, (ep, counts)
    for r in recs:
        if r["endpoint"] == "GET /boom/":
            assert r["error"] == "KeyError"
        if r["endpoint"] == "GET /orders/<int:order_id>/":
            assert r["user"] == "dj" and r["attrs"]["order_id"] == 5


@pytest.mark.parametrize("settings", ["djproject.settings", "djproject.settings_explicit"])
def test_django_under_gunicorn(tmp_path: Path, settings: str) -> None:
    data = tmp_path / "data"
    rounds = 10
    with launched(tmp_path, data, gunicorn("djproject.wsgi:application", 2), service="dj",
                  ready="/health/", DJANGO_SETTINGS_MODULE=settings,
                  PERFSLEUTH_CPU_SAMPLE="1") as srv:  # fmt: skip
        for _ in range(rounds):
            for path, status, _ in DJANGO_REQUESTS:
                assert srv.get(path, headers={"X-User": "dj"})[0] == status
        srv.stop()
        answered = srv.answered
    recs = read_spool(str(data))
    check_django([r for r in recs if r["path"] != "/health/"], answered - 1, rounds)
    assert all(r["cpu_ns"] > 0 for r in recs)


def test_django_under_uvicorn_asgi(tmp_path: Path) -> None:
    data = tmp_path / "data"
    rounds = 10
    with launched(tmp_path, data, uvicorn("djproject.asgi:application", "--lifespan", "off"),
                  service="dj", ready="/health/") as srv:  # fmt: skip
        for _ in range(rounds):
            for path, status, _ in DJANGO_REQUESTS:
                assert srv.get(path, headers={"X-User": "dj"})[0] == status
        srv.stop()
        answered = srv.answered
    recs = read_spool(str(data))
    check_django([r for r in recs if r["path"] != "/health/"], answered - 1, rounds)
    assert all(name.endswith(".seg") for _, name, _ in segments(data))


# --------------------------------------------------------------------------- agent faults


def answer_everything(srv: Server, n: int) -> None:
    results = many(n, lambda i: srv.get(f"/admin/customers/{i}"))
    assert [(s, json.loads(b)["customer_id"]) for s, b in results] == [(200, i) for i in range(n)]


def test_dead_writer_costs_data_not_answers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with launched(tmp_path, data, gunicorn("flask_app:app", 2), service="admin",
                  ready="/health", PERFSLEUTH_FAULT="writer_crash") as srv:  # fmt: skip
        answer_everything(srv, 100)
        assert srv.stop() == 0
        answered = srv.answered
    assert read_spool(str(data)) == []
    stats = status_files(data)
    assert sum(s["requests_recorded"] for s in stats) == answered
    assert sum(s["dropped_writer_dead"] for s in stats) == answered
    assert sum(s["requests_written"] for s in stats) == 0


def test_unwritable_spool_costs_data_not_answers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "spool").write_text("a file where the spool directory should be\n")
    with launched(tmp_path, data, gunicorn("flask_app:app", 2), service="admin",
                  ready="/health") as srv:  # fmt: skip
        answer_everything(srv, 100)
        assert srv.stop() == 0
        answered = srv.answered
    stats = status_files(data)
    assert sum(s["dropped_write_error"] for s in stats) == answered
    assert sum(s["requests_written"] for s in stats) == 0
    assert any("spool" in s["last_error"] for s in stats)
    assert (data / "spool").is_file()


# ------------------------------------------------------------------------------- launcher


def run_python(tmp_path: Path, code: str, *, service: str | None = None, **env: str) -> Any:
    args = [sys.executable, "-m", "perfsleuth.agent.launch", "--data", str(tmp_path / "d")]
    if service:
        args += ["--service", service]
    out = subprocess.run(
        [*args, "--", sys.executable, "-c", code],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


AGENT_STATE = """
import json, os, sys
import perfsleuth.agent as ps
from perfsleuth.agent import shipper
print(json.dumps({"started": ps.started(), "data": shipper.config().data_dir,
                  "service": shipper.config().service, "other": os.environ.get("OTHER_SC_RAN")}))
"""


def test_launcher_starts_agent_in_python_children(tmp_path: Path) -> None:
    state = run_python(tmp_path, AGENT_STATE, service="svc")
    assert state["started"] is True
    assert state["data"] == str(tmp_path / "d") and state["service"] == "svc"
    assert run_python(tmp_path, AGENT_STATE)["service"] == os.path.basename(sys.executable)


def test_launcher_chains_to_the_shadowed_sitecustomize(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SC_RAN'] = 'yes'\n")
    state = run_python(tmp_path, AGENT_STATE, PYTHONPATH=str(other))
    assert state["started"] is True and state["other"] == "yes"


def test_launcher_survives_a_broken_sitecustomize(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("raise RuntimeError('broken site')\n")
    state = run_python(tmp_path, AGENT_STATE, PYTHONPATH=str(other))
    assert state["started"] is True


def test_launcher_reports_missing_command(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "perfsleuth.agent.launch", "--data", str(tmp_path), "--",
         "no-such-command-perfsleuth"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 127
    assert "command not found: no-such-command-perfsleuth" in out.stderr
