"""Cost of the runtime-evidence thread (stack sampler, loop watchdog, GC hook).

    .venv/bin/python benchmarks/evidence.py [--seconds 5] [--rounds 3]

Three measurements, each in fresh child processes with the agent started, evidence on
(PERFSLEUTH_EVIDENCE=1, the default) against off, interleaved over ``--rounds``:

- idle: an asyncio loop (watched by the watchdog, its heartbeat running) and nothing else for
  ``--seconds``: the process's CPU time per second of wall time, i.e. the share of one core
  the agent's evidence costs a service that is waiting for traffic.
- a slow request: one recorded request burning CPU in a pure-Python loop for ``--seconds``
  while the sampler samples its stack every 10 ms: loop iterations per second of that
  request, evidence on relative to off (its slowdown while being profiled).
- GC-heavy requests: requests that create cyclic garbage (many collections each): requests
  per CPU second, evidence on relative to off (the gc.callbacks hook's cost).
- sampling cadence (evidence on only): 20 requests one after another, each burning CPU for
  200 ms: samples a request, against the (200 - 100) / 20 + 1 = 6 that sampling from the
  100 ms mark every 20 ms allows (ticks start a little late: the interpreter lock).

The load figures for ordinary fast requests are in benchmarks/overhead.py (variant
``perfsleuth`` against ``perfsleuth-no-evidence``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

RESULT = "@@result "
CADENCE_REQUESTS = 20


def child(mode: str, seconds: float, evidence: bool) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="perfsleuth-evidence-bench-")
    os.environ["PERFSLEUTH_EVIDENCE"] = "1" if evidence else "0"
    os.environ["PERFSLEUTH_SAMPLE_AFTER_MS"] = "100"
    import perfsleuth.agent as ps
    from perfsleuth.agent import recorder, watchdog

    assert ps.start(tmp, service="bench", instrument=False)
    if mode == "idle":

        async def idle() -> None:
            watchdog.watch_current_loop()  # what the ASGI wrapper does on the first request
            await asyncio.sleep(0.2)
            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.sleep(seconds)
            return (time.process_time() - c0) / (time.perf_counter() - t0)

        share = asyncio.run(idle())
        return {"cpu_share_of_one_core": share}
    if mode == "slow":
        result: dict[str, Any] = {}

        def work() -> None:
            req = recorder.begin("web", "GET", "/slow")
            assert req is not None
            req.endpoint = "GET /slow"
            n = 0
            t_end = time.perf_counter() + 0.2  # past the sampling threshold first
            while time.perf_counter() < t_end:
                n += 1
            n = 0
            t0 = time.perf_counter()
            t_end = t0 + seconds
            while True:
                for _ in range(1000):
                    n += 1
                if time.perf_counter() >= t_end:
                    break
            result["iterations_per_s"] = n / (time.perf_counter() - t0)
            recorder.end(req)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        ps.flush()
        result["samples_taken"] = ps.stats().get("samples_taken", 0)
        return result
    if mode == "gc":

        class Node:
            def __init__(self) -> None:
                self.me = self

        n = 0
        c0 = time.process_time()
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            req = recorder.begin("web", "GET", "/alloc")
            assert req is not None
            junk = [Node() for _ in range(2000)]
            del junk
            recorder.end(req)
            n += 1
        cpu = time.process_time() - c0
        ps.flush()
        return {
            "requests_per_cpu_s": n / cpu,
            "collections": ps.stats().get("gc_collections", 0),
        }
    if mode == "cadence":
        counts = []
        for _ in range(CADENCE_REQUESTS):
            before = ps.stats().get("samples_taken", 0)
            req = recorder.begin("web", "GET", "/two-hundred-ms")
            assert req is not None
            t_end = time.perf_counter() + 0.2
            while time.perf_counter() < t_end:
                pass
            recorder.end(req)
            time.sleep(0.1)  # the request's samples are shipped at the next tick
            counts.append(ps.stats().get("samples_taken", 0) - before)
        return {"samples_per_request": statistics.mean(counts), "fewest": min(counts)}
    raise SystemExit(f"unknown mode {mode}")


def run(mode: str, seconds: float, evidence: bool) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--seconds", str(seconds)]
    if evidence:
        cmd.append("--evidence")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 10 + 60)
    for line in out.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line[len(RESULT) :]))
    raise RuntimeError(f"child {mode} failed:\n{out.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--evidence", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.seconds, args.evidence)), flush=True)
        return
    res: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for mode in ("idle", "slow", "gc"):
            for ev in (False, True):
                res.setdefault((mode, ev), []).append(run(mode, args.seconds, ev))
        res.setdefault(("cadence", True), []).append(run("cadence", args.seconds, True))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    def med(mode: str, ev: bool, key: str) -> float:
        return statistics.median(x[key] for x in res[(mode, ev)])

    idle_on, idle_off = (
        med("idle", True, "cpu_share_of_one_core"),
        med("idle", False, "cpu_share_of_one_core"),
    )
    slow_on, slow_off = (
        med("slow", True, "iterations_per_s"),
        med("slow", False, "iterations_per_s"),
    )
    gc_on, gc_off = med("gc", True, "requests_per_cpu_s"), med("gc", False, "requests_per_cpu_s")
    samples = med("slow", True, "samples_taken")
    print(f"runtime evidence cost, median of {args.rounds} rounds, {args.seconds:g} s each")
    print(
        f"  idle service:     {100 * (idle_on - idle_off):+.2f} % of one core "
        f"(on {100 * idle_on:.2f} %, off {100 * idle_off:.2f} %)"
    )
    print(
        f"  sampled request:  {100 * (slow_off / slow_on - 1):+.2f} % time for the same work "
        f"({samples:.0f} samples in {args.seconds:g} s)"
    )
    print(
        f"  GC-heavy request: {100 * (gc_off / gc_on - 1):+.2f} % CPU per request "
        f"({med('gc', True, 'collections'):.0f} collections)"
    )
    print(
        f"  slow requests:    {med('cadence', True, 'samples_per_request'):.2f} samples a "
        f"200 ms request (fewest {med('cadence', True, 'fewest'):.0f}; from the 100 ms mark "
        "every 20 ms: at most 6)"
    )


if __name__ == "__main__":
    main()
