"""Run the zoo under the agent and ask perfsleuth what it found.

For each framework: launch its zoo app with the real launcher (``python -m perfsleuth run
--data DIR -- <server>``, the way a user would, as tests/test_run_servers.py does), warm every
endpoint up with a few anonymous requests, drive every plant's bad and then clean endpoint from
five tenants and seven users (X-Tenant / X-User), stop the server gracefully (SIGTERM: the
agent flushes), then ``perfsleuth ingest``; ``findings`` runs ``perfsleuth findings --json``.

One server per framework serves all of that framework's plants, so the whole zoo costs three
launches. Used by tests/test_zoo.py and benchmarks/accuracy.py.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo import env, seed, upstream
from zoo.catalog import FRAMEWORKS, PLANTS, VARIANTS, ZOO_DIR, Plant

TESTS_DIR = ZOO_DIR.parent  # the apps' working directory: they import ``zoo.*`` from there
REQUESTS_PER_ENDPOINT = 40
CONCURRENCY = 2  # concurrent clients per endpoint: more, and GIL waits blur the timings
WARMUP_REQUESTS = 2 * CONCURRENCY  # per endpoint, before measuring
START_TIMEOUT = 90.0  # hang guards only: nothing depends on how long anything takes
REQUEST_TIMEOUT = 120.0
CLI_TIMEOUT = 300.0


def _gunicorn(app: str) -> list[str]:
    # Threaded workers: several requests in flight per worker, like most production set-ups.
    return [sys.executable, "-m", "gunicorn", "-w", "2", "--worker-class", "gthread",
            "--threads", "4", "-b", "127.0.0.1:{port}", "--no-control-socket",
            "--timeout", "120", "--graceful-timeout", "60", app]  # fmt: skip


@dataclass(frozen=True)
class AppSpec:
    command: list[str]  # the server command line; "{port}" is replaced
    ready: str  # a path answering 200 once the app is up


_UVICORN = [sys.executable, "-m", "uvicorn", "zoo.fastapi_app:app", "--host", "127.0.0.1",
            "--port", "{port}", "--no-access-log"]  # fmt: skip

APPS = {
    "fastapi": AppSpec(_UVICORN, "/health"),
    "flask": AppSpec(_gunicorn("zoo.flask_app:app"), "/health"),
    "django": AppSpec(_gunicorn("zoo.djzoo.wsgi:application"), "/health/"),
}


# ------------------------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_ready(self, path: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log.read_text()}")
            try:
                if self.request("GET", path, None, {})[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server never answered:\n{self.log.read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Graceful stop (SIGTERM, as a process manager would): the agent flushes its spool."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"server did not stop:\n{self.log.read_text()}") from None


def app_env(upstream_url: str) -> dict[str, str]:
    # The agent settings come from the launcher only, not from whoever runs the tests.
    child = {k: v for k, v in os.environ.items() if not k.startswith("PERFSLEUTH_")}
    child.update(ZOO_PG_DSN=env.PG_DSN, ZOO_REDIS_URL=env.REDIS_URL, ZOO_UPSTREAM=upstream_url,
                 PYTHONUNBUFFERED="1")  # fmt: skip
    return child


@contextmanager
def launched(framework: str, data: Path, upstream_url: str) -> Iterator[Server]:
    spec = APPS[framework]
    port = free_port()
    log = data.parent / f"{framework}-server.log"
    cmd = [c.replace("{port}", str(port)) for c in spec.command]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "perfsleuth", "run", "--data", str(data),
             "--service", f"zoo-{framework}", "--", *cmd],
            cwd=TESTS_DIR,
            env=app_env(upstream_url),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: cleaned up by id below
        )  # fmt: skip
    server = Server(proc, port, log)
    try:
        server.wait_ready(spec.ready)
        yield server
    finally:
        # Whatever happened, no server or worker of ours outlives the block.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------- traffic


def headers_for(i: int) -> dict[str, str]:
    """Five tenants and seven users, spread evenly over a plant's requests."""
    return {"X-Tenant": seed.TENANTS[i % len(seed.TENANTS)],
            "X-User": seed.USERS[i % len(seed.USERS)]}  # fmt: skip


def _send(server: Server, plant: Plant, i: int, variant: str, headers: dict[str, str]) -> None:
    method, path, body = plant.request(i, variant)
    status, answer = server.request(method, path, body, headers)
    if status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {status}: {answer[:300]!r}\n"
                           f"server log:\n{server.log.read_text()[-3000:]}")  # fmt: skip


def _send_all(server: Server, jobs: list[tuple[Plant, int, str, dict[str, str]]]) -> None:
    """Send the requests CONCURRENCY at a time (any failure is raised here)."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda job: _send(server, *job), jobs))


def warm_up(server: Server, plant: Plant) -> None:
    """A few requests to each endpoint, without user or tenant headers, sent like the measured
    ones (same concurrency, so they are not slower for being crowded).

    Cold starts (a connection opened per worker thread, lazy imports, first-query set-up) would
    otherwise land on the first measured requests, and so on whichever users sent them, making
    those users look slow to the outlier detector.
    """
    for variant in VARIANTS:
        _send_all(server, [(plant, i, variant, {}) for i in range(WARMUP_REQUESTS)])


def drive(server: Server, plant: Plant, n: int) -> int:
    """n requests to the bad endpoint, then n to its clean twin, CONCURRENCY at a time.
    Returns the number of requests sent.

    One endpoint at a time: the bad twin's CPU work (parsing 2 MB bodies, sorting 25,000 rows)
    holds the GIL of the worker it runs in and would slow down clean requests served next to it.
    """
    for variant in VARIANTS:
        _send_all(server, [(plant, i, variant, headers_for(i)) for i in range(n)])
    return n * len(VARIANTS)


# ---------------------------------------------------------------------------- the CLI


def cli(data: Path, *args: str) -> str:
    """Run ``python -m perfsleuth ARGS --data DATA``; its stdout, or an error with stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "perfsleuth", *args, "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"perfsleuth {' '.join(args)}: exit {out.returncode}\n{out.stderr}")
    return out.stdout


def ingest(data: Path) -> dict[str, Any]:
    return dict(json.loads(cli(data, "ingest", "--json")))


def findings(data: Path) -> list[dict[str, Any]]:
    return list(json.loads(cli(data, "findings", "--json")))


def sql(data: Path, query: str) -> list[dict[str, Any]]:
    return list(json.loads(cli(data, "sql", query, "--json", "--no-ingest", "--limit", "100000")))


# -------------------------------------------------------------------------------- the zoo


@dataclass(frozen=True)
class ZooRun:
    framework: str
    data: Path  # the perfsleuth data dir, ingested
    requests: int  # requests measured (warm-up requests and readiness probes not counted)

    def findings(self) -> list[dict[str, Any]]:
        return findings(self.data)

    def sql(self, query: str) -> list[dict[str, Any]]:
        return sql(self.data, query)


def run_framework(
    framework: str, workdir: Path, upstream_url: str, n: int = REQUESTS_PER_ENDPOINT
) -> ZooRun:
    data = workdir / framework / "data"
    data.parent.mkdir(parents=True, exist_ok=True)
    sent = 0
    plants = [p for p in PLANTS if p.framework == framework]
    with launched(framework, data, upstream_url) as server:
        for plant in plants:
            warm_up(server, plant)
        for plant in plants:
            sent += drive(server, plant, n)
        server.stop()
    ingest(data)
    return ZooRun(framework, data, sent)


def run_zoo(
    workdir: Path, frameworks: Sequence[str] = FRAMEWORKS, n: int = REQUESTS_PER_ENDPOINT
) -> dict[str, ZooRun]:
    """Seed the databases, then run each framework's zoo app in turn (one at a time, so the
    apps do not slow each other down) into its own data dir under ``workdir``."""
    seed.seed(env.PG_DSN, env.REDIS_URL)
    with upstream.serving() as upstream_url:
        return {fw: run_framework(fw, workdir, upstream_url, n) for fw in frameworks}


def all_findings(runs: dict[str, ZooRun]) -> list[dict[str, Any]]:
    """The findings of every run (endpoint names do not overlap between the zoo apps)."""
    return [f for run in runs.values() for f in run.findings()]


if __name__ == "__main__":  # cd tests && python -m zoo.harness [WORKDIR [FRAMEWORK...]]
    import tempfile

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="zoo-"))
    t0 = time.monotonic()
    runs = run_zoo(root, sys.argv[2:] or FRAMEWORKS)
    for run in runs.values():
        print(f"{run.framework}: {run.requests} requests -> {run.data}")
    print(f"{time.monotonic() - t0:.1f} s")
