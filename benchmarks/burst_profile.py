"""The burst app of pressure.py (in-process Flask, 3 repeating sqlite statements a request; with
``--app distinct``, its distinct app: 20 distinct 1.7 KB statements a request), one process,
measured on the request thread: instructions under callgrind, or thread CPU time.

    .venv/bin/python benchmarks/burst_profile.py callgrind [--variants bare,agent] [-n 1000]
        [--app burst|distinct]
    .venv/bin/python benchmarks/burst_profile.py time [--variants ...] [-n 20000] [--rounds 3]
    .venv/bin/python benchmarks/burst_profile.py inproc [--modes full,drop,burn,off] [-n 2000]
        [--rounds 16]

callgrind: start-up and 300 warm-up requests run uncounted (``--instr-atstart=no``), then the
child switches counting on, runs N requests with the collector off and flushes the agent's
writer; the counts over N are one request's instructions on each thread (thread 1 the request
thread; with ``BURST_REQUEST_ONLY=1`` in the environment the flush is left out: the request
path alone). time: ``time.thread_time_ns`` of the request thread over N requests (writer flushed
outside the timed part) and the wall time, variants in turn, each in a fresh process.
inproc: one process with the agent (no evidence thread), slices of N requests alternating
between how its recorder is configured, so that the machine's drift hits them alike (the
order reversed every other round): ``full`` (requests queued for the writer, flushed at the
slice's end, as the agent runs), ``drop`` (recorded, then dropped: the request path alone),
``off`` (the wrappers in place, recording nothing) and ``burn`` (``off`` plus a Python
function of ~26.9k instructions a request, callgrind-counted: what that many of the app's
kind of instructions cost here). Prints each mode's request-thread CPU a request and its
paired ratio to ``off`` (median and middle half over the rounds).

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
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def make_app(name: str) -> Any:
    import pressure

    return pressure.make_app(20, True) if name == "distinct" else pressure.make_app(3, False)


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
    app = make_app(os.environ["BURST_APP"])

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


_BURN_TABLE = {i: i for i in range(64)}


class _Burn:
    __slots__ = ("a", "b")


def burn() -> int:
    """~26.9k instructions of attribute and dict work (callgrind: 5,000 calls 134.7M)."""
    o, get, t = _Burn(), _BURN_TABLE.get, 0
    for i in range(31):
        o.a = i
        o.b = get(i & 63, 0)
        t += o.b
    return t


def inproc(modes: list[str], n: int, rounds: int) -> None:
    """Alternating slices of one process's recorder modes; see the module docstring."""
    import statistics

    os.environ["PERFSLEUTH_EVIDENCE"] = "0"
    sys.path.insert(0, HERE)
    import perfsleuth.agent as ps
    import pressure
    from perfsleuth.agent import recorder, shipper

    assert ps.start(tempfile.mkdtemp(prefix="perfsleuth-burst-"), service="burst")
    app = make_app(os.environ["BURST_APP"])
    limits = {
        "max_calls": recorder._max_rows // recorder.ROW,
        "stacks_per_site": recorder._stacks_per_site,
    }
    sinks = {"full": shipper.enqueue, "drop": lambda req: None, "off": None, "burn": None}
    k = [0]

    def one() -> None:
        k[0] += 1
        body = app(pressure.environ(f"/orders/{k[0]}"), lambda *a: None)
        for _ in body:
            pass
        body.close()

    for _ in range(2000):
        one()
    ps.flush()
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            recorder.configure(sinks[mode], **limits)
            for _ in range(200):
                one()
            ps.flush()
            c0 = time.thread_time_ns()
            if mode == "burn":
                for _ in range(n):
                    one()
                    burn()
            else:
                for _ in range(n):
                    one()
            ps.flush()  # the slice's queued requests are encoded in it
            cpu[mode].append((time.thread_time_ns() - c0) / n / 1000)
    recorder.configure(shipper.enqueue, **limits)
    base = cpu["off"] if "off" in cpu else cpu[modes[-1]]
    for mode in modes:
        ratios = [a / b for a, b in zip(cpu[mode], base, strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(
            f"{mode:5s} request thread {statistics.median(cpu[mode]):6.1f} us CPU, against off "
            f"{statistics.median(ratios):.3f} (middle half {q[0]:.3f}..{q[2]:.3f})",
            flush=True,
        )


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
    ap.add_argument("mode", choices=["callgrind", "time", "inproc"])
    ap.add_argument("--variants", default="bare,agent")
    ap.add_argument("--app", choices=["burst", "distinct"], default="burst")
    ap.add_argument("--modes", default="full,drop,burn,off", help="inproc: recorder modes")
    ap.add_argument(
        "-n", type=int, help="requests measured (1000 callgrind, 20000 time, 2000 a slice inproc)"
    )
    ap.add_argument("--rounds", type=int, default=1, help="(inproc: default 16)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ["BURST_APP"] = args.app  # children read it too
    if args.mode == "inproc":
        inproc(args.modes.split(","), args.n or 2000, args.rounds if args.rounds > 1 else 16)
        return
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
