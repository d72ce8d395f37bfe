"""A request's CPU time is measured for a random sample of requests (PERFSLEUTH_CPU_SAMPLE).

A thread CPU clock reading is a system call on Linux (~4.5 µs inside a request): a request in
the sample is measured as before, one outside it reads no thread clock anywhere (begin, end,
the ASGI meter's steps, a worker's run) and keeps ``cpu_ns`` None. Each test runs the C
accelerator's begin/end and the Python reference ([c, python]); the draw is the trace id's.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from perfsleuth.agent import config, cpushare, recorder, shipper
from perfsleuth.agent.frameworks import asgi as ps_asgi
from perfsleuth.agent.instrument import threads
from perfsleuth.agent.spool import writer

IMPLS = ["c", "python"]


def begin_end(impl: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    if impl == "c":
        if recorder.speedups is None:
            pytest.skip("the C accelerator is not built")
        return recorder.speedups.begin, recorder.speedups.end
    return recorder.python_begin, recorder.python_end


@pytest.fixture
def clock_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], int]]:
    """Readings of the thread CPU clock since the test began: the C accelerator's own count,
    plus the Python reference's calls of time.thread_time_ns (wrapped to count them)."""
    python_reads = [0]
    real = time.thread_time_ns

    def counted() -> int:
        python_reads[0] += 1
        return real()

    monkeypatch.setattr(time, "thread_time_ns", counted)
    monkeypatch.setattr(ps_asgi, "_thread_time", counted)
    monkeypatch.setattr(threads, "_thread_time", counted)
    speedups = recorder.speedups
    c_before = speedups.cpu_clock_reads() if speedups is not None else 0

    def reads() -> int:
        c_now = speedups.cpu_clock_reads() if speedups is not None else 0
        return python_reads[0] + int(c_now - c_before)

    yield reads


def recorded(
    impl: str, fraction: float, paths: list[str], n: int, work: Callable[[], Any] | None = None
) -> list[recorder.ActiveRequest]:
    """``n`` requests with begin(cpu=True) (as WSGI, Django and tasks begin), their paths
    taken in turn, under a CPU sample of ``fraction``: the ended requests."""
    begin, end = begin_end(impl)
    got: list[recorder.ActiveRequest] = []

    def run() -> None:
        for k in range(n):
            req = begin("web", "GET", paths[k % len(paths)], cpu=True)
            assert req is not None
            req.endpoint = "GET " + req.path
            if work is not None:
                work()
            end(req)

    recorder.configure(got.append, max_calls=20000, stacks_per_site=1, cpu_sample=fraction)
    try:
        contextvars.Context().run(run)
    finally:
        recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1)
    assert len(got) == n
    return got


def long_enough() -> None:
    """Past the short-run bound (a shorter request counts its wall time, no clock read)."""
    t0 = time.perf_counter_ns()
    while time.perf_counter_ns() - t0 < 2 * recorder.SHORT_RUN_NS:
        pass


@pytest.mark.parametrize("impl", IMPLS)
def test_with_a_sample_of_one_every_request_has_its_cpu_time(
    agent_data_dir: str, impl: str
) -> None:
    reqs = recorded(impl, 1.0, ["/a", "/b"], 200)
    assert all(r.cpu_ns is not None and r.cpu_start is not None for r in reqs)


@pytest.mark.parametrize("impl", IMPLS)
def test_with_a_sample_of_zero_no_request_reads_the_thread_clock(
    agent_data_dir: str, impl: str, clock_reads: Callable[[], int]
) -> None:
    reqs = recorded(impl, 0.0, ["/a", "/b"], 50, long_enough)
    assert clock_reads() == 0
    assert all(r.cpu_ns is None and r.cpu_start is None for r in reqs)
    # the same requests in the sample read the clock (a reading at the end, at least)
    recorded(impl, 1.0, ["/a"], 5, long_enough)
    assert clock_reads() >= 5


@pytest.mark.parametrize("impl", IMPLS)
def test_an_eighth_of_the_requests_of_every_endpoint_is_measured(
    agent_data_dir: str, impl: str
) -> None:
    """A share of 0.125, two endpoints alternating: the draw does not follow the endpoint
    (2,000 requests: 250 expected, sd 14.8; each endpoint 125, sd 10.5; the bounds are ~7 sd
    wide)."""
    reqs = recorded(impl, 0.125, ["/a", "/b"], 2000)
    measured = [r for r in reqs if r.cpu_ns is not None]
    assert 150 <= len(measured) <= 360, len(measured)
    for path in ("/a", "/b"):
        n = sum(1 for r in measured if r.path == path)
        assert 60 <= n <= 190, (path, n)
    # the draw is the trace id's: C and Python choose the same requests for the same ids
    recorder.set_cpu_sample(0.125)
    try:
        assert all(recorder.cpu_sampled(r) == (r.cpu_ns is not None) for r in reqs)
    finally:
        recorder.set_cpu_sample(None)


def test_the_share_is_read_from_the_environment_and_kept_between_0_and_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for raw, share in (("1", 1.0), ("0", 0.0), ("0.5", 0.5), ("7", 1.0), ("-1", 0.0)):
        monkeypatch.setenv("PERFSLEUTH_CPU_SAMPLE", raw)
        assert config.cpu_sample_of() == share
        assert config.load().cpu_sample == share
    # auto (the default; a typo too): the recorder starts at every request, the writer moves it
    for raw in ("", "auto", "nan", "often"):
        monkeypatch.setenv("PERFSLEUTH_CPU_SAMPLE", raw)
        assert config.cpu_sample_of() == 1.0
        assert config.load().cpu_sample is None
    assert config.Config.cpu_sample is None


def _fastapi_app() -> Callable[[str], Any]:
    """A FastAPI app with a sync endpoint (run in the thread pool) and an async one, and a
    call of a path through its ASGI callable."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/sync")
    def sync_endpoint() -> dict[str, int]:
        long_enough()
        return {"ok": 1}

    @app.get("/async")
    async def async_endpoint() -> dict[str, int]:
        long_enough()
        await asyncio.sleep(0)
        long_enough()
        return {"ok": 2}

    async def call(path: str) -> int:
        status = 0
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"t")],
            "client": ("127.0.0.1", 1),
            "server": ("t", 80),
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        return status

    return call


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_an_asgi_request_outside_the_sample_reads_no_thread_clock(
    agent_data_dir: str,
    impl: str,
    fraction: float,
    monkeypatch: pytest.MonkeyPatch,
    clock_reads: Callable[[], int],
) -> None:
    """FastAPI, a sync endpoint (its run in a worker thread) and an async one (its steps on
    the loop): outside the sample no meter, no worker reading, cpu_ns None; in it, each
    request has its CPU time."""
    import anyio.to_thread

    begin, end = begin_end(impl)
    threads.patch_anyio(anyio.to_thread)
    if impl == "python":  # the Python reference throughout: begin, end, meter, hand-off
        original = getattr(anyio.to_thread.run_sync, "__wrapped__", anyio.to_thread.run_sync)
        monkeypatch.setattr(anyio.to_thread, "run_sync", threads._python_wrapper(original))
        monkeypatch.setattr(ps_asgi, "_CpuMeter", ps_asgi.CpuMeter)
    monkeypatch.setattr(ps_asgi, "_begin", begin)
    monkeypatch.setattr(ps_asgi, "_end", end)
    call = _fastapi_app()
    got: list[recorder.ActiveRequest] = []
    n = 10

    async def main() -> None:
        for _ in range(n):
            assert await call("/sync") == 200
            assert await call("/async") == 200

    recorder.configure(got.append, max_calls=20000, stacks_per_site=1, cpu_sample=fraction)
    try:
        asyncio.run(main())
    finally:
        recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1)
    assert sorted(r.endpoint for r in got) == ["GET /async"] * n + ["GET /sync"] * n
    if fraction == 0.0:
        assert all(r.cpu_ns is None for r in got)
        assert clock_reads() == 0
    else:
        assert all(r.cpu_ns is not None and r.cpu_ns > 0 for r in got)
        assert clock_reads() > 0


def test_the_automatic_share_adds_up_to_the_rate() -> None:
    for per_s, rate, share in ((50, 200, 1.0), (200, 200, 1.0), (1000, 200, 0.2), (10**6, 0, 1.0)):
        assert cpushare.share_for(per_s, rate) == share


@pytest.mark.parametrize("impl", IMPLS)
def test_automatic_share_measures_about_the_rate_when_busy_and_every_request_when_quiet(
    agent_data_dir: str, impl: str
) -> None:
    """PERFSLEUTH_CPU_SAMPLE=auto, 200 a second: after a second of 5,000 requests the writer's
    tick measures a random ~4 % of them (~200 of the next 5,000, of every endpoint), and after
    a quiet second every request again. The ticks' clock is given, the requests are real
    (begin and end of C or Python; the trace ids draw)."""
    begin, end = begin_end(impl)
    got: list[recorder.ActiveRequest] = []
    paths = ["/a", "/b"]

    def serve(n: int) -> list[recorder.ActiveRequest]:
        first = len(got)

        def run() -> None:
            for k in range(n):
                req = begin("web", "GET", paths[k % 2], cpu=True)
                assert req is not None
                req.endpoint = "GET " + req.path
                end(req)

        contextvars.Context().run(run)
        return got[first:]

    # the pytest process's writer ticks too: it waits for the lock, and stays fixed after
    with writer.lock:
        recorder.configure(got.append, max_calls=20000, stacks_per_site=1, cpu_sample=1.0)
        try:
            cpushare.configure(automatic=True, rate=200)
            cpushare.tick(now=100.0)
            busy = serve(5000)
            assert all(r.cpu_ns is not None for r in busy)  # measured until the first tick
            cpushare.tick(now=101.0)
            assert cpushare.share == pytest.approx(200 / 5000)
            sampled = serve(5000)
            measured = [r for r in sampled if r.cpu_ns is not None]
            assert 120 <= len(measured) <= 280  # binomial(5000, 0.04): mean 200, sd 14
            assert {r.path for r in measured} == {"/a", "/b"}
            assert all(recorder.cpu_sampled(r) == (r.cpu_ns is not None) for r in sampled)
            cpushare.tick(now=102.0)  # 5,000 in the second since: the same share
            assert cpushare.share == pytest.approx(200 / 5000)
            serve(50)
            cpushare.tick(now=103.0)  # 50 in the last second: every request again
            assert cpushare.share == 1.0
            assert all(r.cpu_ns is not None for r in serve(500))
        finally:
            cpushare.configure(automatic=False, rate=200)
            recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1, cpu_sample=1.0)


def test_a_fixed_share_is_not_moved_by_the_traffic(agent_data_dir: str) -> None:
    """PERFSLEUTH_CPU_SAMPLE set to a number: the ticks leave the share alone."""
    got: list[recorder.ActiveRequest] = []
    with writer.lock:
        recorder.configure(got.append, max_calls=20000, stacks_per_site=1, cpu_sample=0.5)
        try:
            cpushare.configure(automatic=False, rate=200)
            cpushare.tick(now=100.0)
            for _ in range(3000):
                req = recorder.python_begin("web", "GET", "/a", cpu=True)
                assert req is not None
                recorder.python_end(req)
            assert len(got) == 3000
            cpushare.tick(now=101.0)
            assert recorder._cpu_threshold == round(0.5 * recorder.CPU_SAMPLE_BITS)
        finally:
            recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1, cpu_sample=1.0)


@pytest.mark.parametrize(
    ("raw", "auto", "threshold"), [(None, True, 1.0), ("auto", True, 1.0), ("0.25", False, 0.25)]
)
def test_the_agent_starts_automatic_unless_a_share_is_set(
    tmp_path: Any, raw: str | None, auto: bool, threshold: float
) -> None:
    code = (
        "import perfsleuth.agent as ps\n"
        "from perfsleuth.agent import cpushare, recorder\n"
        f"assert ps.start({str(tmp_path)!r}, service='t')\n"
        "print(cpushare.auto, recorder._cpu_threshold / recorder.CPU_SAMPLE_BITS)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PERFSLEUTH_CPU_SAMPLE"}
    if raw is not None:
        env["PERFSLEUTH_CPU_SAMPLE"] = raw
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(auto), str(threshold)]


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_start_s_cpu_sample_setting_reaches_the_recorder(tmp_path: Any, share: float) -> None:
    """``ps.start(cpu_sample=...)`` sets the share the recorder measures (the environment
    variable is only the default)."""
    code = (
        "import sys, perfsleuth.agent as ps\n"
        "from perfsleuth.agent import recorder\n"
        f"assert ps.start({str(tmp_path)!r}, service='t', cpu_sample={share})\n"
        "print(recorder._cpu_threshold, recorder.CPU_SAMPLE_BITS)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PERFSLEUTH_CPU_SAMPLE"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    threshold, bits = map(int, out.stdout.split())
    assert threshold == round(share * bits)
