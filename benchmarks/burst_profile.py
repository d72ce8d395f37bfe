"""The burst app of pressure.py (in-process Flask, 3 repeating sqlite statements a request), one
process, measured on the request thread: instructions under callgrind, or thread CPU time.

    .venv/bin/python benchmarks/burst_profile.py callgrind [--variants bare,agent] [-n 1000]
    .venv/bin/python benchmarks/burst_profile.py time [--variants ...] [-n 20000] [--rounds 3]

callgrind: start-up and 300 warm-up requests run uncounted (``--instr-atstart=no``), then the
child switches counting on, runs N requests with the collector off and flushes the agent's
writer; the counts over N are one request's instructions on each thread (thread 1 the request
thread; with ``BURST_REQUEST_ONLY=1`` in the environment the flush is left out: the request
path alone). time: ``time.thread_time_ns`` of the request thread over N requests (writer flushed
outside the timed part) and the wall time, variants in turn, each in a fresh process.
Variants: bare, agent (no evidence thread), agent-py (the same with the Python WSGI body,
not agent/_wsgi.c), agent-evidence (with the evidence thread). ``PERFSLEUTH_SPEEDUPS``
and the like pass through the environment (e.g. ``PERFSLEUTH_WSGI_C=0`` for the Python body).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(variant: str, n: int, mode: str) -> None:
    os.environ.setdefault("PERFSLEUTH_FLUSH_SECONDS", "1000" if mode == "callgrind" else "0.2")
    if variant in ("agent", "agent-py"):
        os.environ["PERFSLEUTH_EVIDENCE"] = "0"
    sys.path.insert(0, HERE)
    import pressure

    tmp = tempfile.mkdtemp(prefix="perfsleuth-burst-")
    flush = lambda: None  # noqa: E731
    if variant != "bare":
        import perfsleuth.agent as ps

        assert ps.start(tmp, service="burst")
        flush = ps.flush
        if variant == "agent-py":  # the Python WSGI body (frameworks/wsgi.py's reference)
            from flask import Flask

            from perfsleuth.agent.frameworks import wsgi

            wsgi.record_wsgi = wsgi.python_record_wsgi
            Flask.__call__ = getattr(Flask.__call__, "python", Flask.__call__)  # type: ignore[method-assign]
    app = pressure.make_app(3, False)

    def sr(status: str, headers: object, exc_info: object = None) -> None:
        return None

    k = [0]

    def one() -> None:
        k[0] += 1
        body = app(pressure.environ(f"/orders/{k[0]}"), sr)
        for _ in body:
            pass
        close = getattr(body, "close", None)
        if close is not None:
            close()

    for _ in range(300 if mode == "callgrind" else 2000):
        one()
    flush()
    gc.collect()
    gc.disable()
    if mode == "callgrind":
        cmd = ["callgrind_control", "-i", "on", str(os.getpid())]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        for _ in range(n):
            one()
        if os.environ.get("BURST_REQUEST_ONLY"):  # the writer's flush out of the count
            subprocess.run([*cmd[:2], "off", cmd[3]], check=True, stdout=subprocess.DEVNULL)
        flush()
        os._exit(0)  # the interpreter's finalization out of the count
    t0, c0 = time.perf_counter(), time.thread_time_ns()
    for _ in range(n):
        one()
    c1, t1 = time.thread_time_ns(), time.perf_counter()
    flush()
    t2 = time.perf_counter()
    print("@@" + json.dumps({"cpu_us": (c1 - c0) / n / 1e3, "wall_us": (t2 - t0) / n * 1e6,
                             "loop_us": (t1 - t0) / n * 1e6}))  # fmt: skip


def per_thread(out_dir: str) -> dict[int, int]:
    counts = {}
    for path in glob.glob(os.path.join(out_dir, "cg.out.*")):
        name = os.path.basename(path)
        thread = int(name.rsplit("-", 1)[1]) if "-" in name else 1
        with open(path, errors="replace") as fh:
            for line in fh:  # "totals:" (with counting switched off at the end, "summary: 0")
                if line.startswith(("summary:", "totals:")):
                    counts[thread] = max(counts.get(thread, 0), int(line.split()[1]))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["callgrind", "time"])
    ap.add_argument("--variants", default="bare,agent")
    ap.add_argument("-n", type=int, help="requests measured (1000 callgrind, 20000 time)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.n or (1000 if args.mode == "callgrind" else 20000)
    if args.child:
        child(args.child[0], n, args.mode)
        return
    env = dict(os.environ, PYTHONHASHSEED="0")
    for _ in range(args.rounds):
        for variant in args.variants.split(","):
            me = [sys.executable, __file__, args.mode, "-n", str(n), "--child", variant, "x"]
            if args.mode == "time":
                out = subprocess.run(me, check=True, capture_output=True, text=True, env=env)
                r = json.loads(out.stdout.split("@@", 1)[1])
                print(
                    f"{variant:16s} request thread {r['cpu_us']:6.1f} us CPU, loop "
                    f"{r['loop_us']:6.1f} us wall, with the flush {r['wall_us']:6.1f} us",
                    flush=True,
                )
                continue
            out_dir = tempfile.mkdtemp(prefix="burst-cg-")
            try:
                cmd = [
                    "valgrind", "--tool=callgrind", "--separate-threads=yes",
                    "--instr-atstart=no", f"--callgrind-out-file={out_dir}/cg.out.%p", *me,
                ]  # fmt: skip
                subprocess.run(cmd, check=True, capture_output=True, env=env)
                counts = per_thread(out_dir)
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)
            parts = ", ".join(
                f"thread {t} {v / n / 1000:,.1f}k" for t, v in sorted(counts.items()) if v > 50
            )
            total = sum(counts.values()) / n
            print(f"{variant:16s} {total / 1000:8,.1f}k instructions/request ({parts})", flush=True)


if __name__ == "__main__":
    main()
