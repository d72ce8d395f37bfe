"""Per-request cost of replayable captures (agent.capture) on the request path.

    .venv/bin/python benchmarks/capture_decision.py [--n 200000] [--repeat 7]

Measures, in this process with the agent started (writer thread running), the best of
``--repeat`` runs of ``--n`` calls:

- decision: ``capture.finish_asgi`` / ``finish_wsgi`` for a finished, fast, 200 request that
  is not kept (sampling rate 0, so the random draw happens and never keeps): what every
  request pays when nothing is captured. Target: < 0.5 µs.
- loop overhead: the same loop calling a no-op function, subtracted from the above.
- body tap: one request body chunk seen and released (a POST not kept).
- kept: a request that is kept (slow), up to the hand-off to the writer thread (the copy of
  the header list; encoding happens on the writer thread).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def best(fn: Callable[[], None], n: int, repeat: int) -> float:
    """Nanoseconds per call, best of ``repeat`` runs of ``n`` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / n)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    n, repeat = args.n, args.repeat

    import perfsleuth.agent as ps
    from perfsleuth.agent import capture, recorder, shipper

    assert ps.start(tempfile.mkdtemp(prefix="perfsleuth-capture-bench-"), service="bench",
                    instrument=False, capture_sample=0.0, evidence=False)  # fmt: skip
    req = recorder.ActiveRequest("web", "GET", "/orders/1")
    req.end = req.start + 2_000_000  # 2 ms: not slow
    req.status = 200
    req.endpoint = "GET /orders/{id}"
    scope: dict[str, Any] = {
        "type": "http", "method": "GET", "path": "/orders/1", "raw_path": b"/orders/1",
        "query_string": b"", "scheme": "http", "server": ("127.0.0.1", 8000),
        "headers": [(b"host", b"127.0.0.1:8000"), (b"accept", b"*/*")],
    }  # fmt: skip
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/orders/1", "HTTP_HOST": "x"}
    rng = range(n)
    finish_asgi, finish_wsgi = capture.finish_asgi, capture.finish_wsgi

    def noop(a: Any, b: Any, c: Any) -> None:
        return None

    def loop_noop() -> None:
        for _ in rng:
            noop(req, scope, None)

    def loop_asgi() -> None:
        for _ in rng:
            finish_asgi(req, scope, None)

    def loop_wsgi() -> None:
        for _ in rng:
            finish_wsgi(req, environ, None)

    chunk = b"x" * 1024

    def loop_tap() -> None:
        for _ in rng:
            t = capture.BodyTap()
            t.add(chunk)
            t.release()

    base = best(loop_noop, n, repeat)
    asgi = best(loop_asgi, n, repeat)
    wsgi = best(loop_wsgi, n, repeat)
    tap = best(loop_tap, n, repeat)

    slow = recorder.ActiveRequest("web", "GET", "/orders/1")
    slow.end = slow.start + 900_000_000
    slow.status = 200
    kept_n = 2000  # below the writer's queue size: measures the hand-off, not drops

    def loop_kept() -> None:
        for _ in range(kept_n):
            finish_asgi(slow, scope, None)
        shipper.flush()

    kept = best(loop_kept, kept_n, 3)
    assert recorder.stats["internal_errors"] == 0
    print(f"python {sys.version.split()[0]}, n={n:,}, best of {repeat}")
    print(f"no-capture decision, ASGI: {asgi:7.0f} ns/request ({asgi - base:.0f} ns over a no-op)")
    print(f"no-capture decision, WSGI: {wsgi:7.0f} ns/request ({wsgi - base:.0f} ns over a no-op)")
    print(f"body tap, one 1 KiB chunk: {tap:7.0f} ns/request (POSTs only)")
    print(f"kept request (incl. writer): {kept / 1000:5.1f} µs/request")


if __name__ == "__main__":
    main()
