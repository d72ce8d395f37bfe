"""Instructions per request, per thread, of the overhead benchmark's variants, under callgrind.

    .venv/bin/python benchmarks/instructions.py [--stack fastapi-sqlite] [--requests N]
        [--variants bare,perfsleuth-no-evidence] [--no-gc] [--rounds 1]

Timings on a shared 2-core machine move by several per cent from run to run; instruction
counts do not, so this is the tool for telling whether a change to the agent's hot path helps
(it does not replace ``make bench``: instructions are not time, cache misses and system calls
weigh differently). Each variant runs a stack of ``overhead.py`` (``--stack``: fastapi-sqlite,
django-pg, flask-sqlalchemy-pg, or all) under
``valgrind --tool=callgrind --separate-threads=yes --instr-atstart=no``: start-up and the
warm-up requests run uninstrumented (several times faster than under callgrind's counting, and
out of the count), then the child switches counting on (``callgrind_control -i on``) and runs
N requests (default 500 on fastapi-sqlite, 40 on the PostgreSQL stacks, whose requests make 12
round trips each) and flushes the agent's writer; the counts over N are what one request costs
on each thread. ``--no-gc`` switches the garbage collector off for the counted part, for A/B
pairs of code paths (a collection otherwise falls into one run and not the next; even so,
runs of the same code moved by ~1 % on the PostgreSQL stacks and by up to 2 % on FastAPI,
whose two threads take turns at the GIL differently from run to run). ``--rounds`` repeats
each measurement. Threads are numbered in start order: 1 the event loop (the PostgreSQL
stacks serve on it, without a loop), then the agent's writer (perfsleuth), then the
thread-pool worker.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_REQUESTS = {"fastapi-sqlite": 500, "django-pg": 40, "flask-sqlalchemy-pg": 40}


def child(variant: str, n: int, stack: str, no_gc: bool) -> None:
    # Under callgrind everything runs ~50x slower: the writer's timer (0.2 s) would wake it
    # every few requests, and batches 50x smaller than in overhead.py would cost it more per
    # request. Waking at WAKE_AT queued requests only keeps the batches of the timed run.
    os.environ.setdefault("PERFSLEUTH_FLUSH_SECONDS", "1000")
    sys.path.insert(0, HERE)
    import overhead as ob

    tmp = tempfile.mkdtemp(prefix="perfsleuth-instr-")
    db = os.path.join(tmp, "db.sqlite")
    if stack == "fastapi-sqlite":
        ob.seed_db(db)
    app, flush, _check = ob.SETUPS[variant](db, tmp, stack)
    warmup = ob.STACK_WARMUP[stack]

    def count_from_here() -> None:
        flush()  # the warm-up's requests are written outside the count
        gc.collect()
        if no_gc:
            gc.disable()
        cmd = ["callgrind_control", "-i", "on", str(os.getpid())]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    async def run() -> None:
        for i in range(warmup):
            await ob.request(app, i % ob.ORDERS + 1)
        count_from_here()
        for i in range(warmup, warmup + n):
            await ob.request(app, i % ob.ORDERS + 1)
        flush()

    if stack == "fastapi-sqlite":
        asyncio.run(run())
    else:
        for i in range(warmup):
            ob.wsgi_request(app, i % ob.ORDERS + 1)
        count_from_here()
        for i in range(warmup, warmup + n):
            ob.wsgi_request(app, i % ob.ORDERS + 1)
        flush()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown in the count


def per_thread(out_dir: str) -> dict[int, int]:
    counts = {}
    for path in glob.glob(os.path.join(out_dir, "cg.out.*")):
        name = os.path.basename(path)
        thread = int(name.rsplit("-", 1)[1]) if "-" in name else 1
        with open(path, errors="replace") as fh:
            for line in fh:
                if line.startswith(("summary:", "totals:")):
                    counts[thread] = int(line.split()[1])
                    break
    return counts


def measure(variant: str, n: int, tmp: str, stack: str, no_gc: bool) -> dict[int, int]:
    out_dir = tempfile.mkdtemp(prefix=f"{stack}-{variant}-", dir=tmp)
    cmd = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
        f"--callgrind-out-file={out_dir}/cg.out.%p",
        sys.executable, __file__, "--child", variant, str(n), "--stack", stack,
    ] + (["--no-gc"] if no_gc else [])  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return per_thread(out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="bare,perfsleuth-no-evidence")
    ap.add_argument("--requests", type=int, help="counted requests (default by stack)")
    ap.add_argument("--stack", default="fastapi-sqlite", help="a stack of overhead.py, or all")
    ap.add_argument("--no-gc", action="store_true", help="no garbage collection while counting")
    ap.add_argument("--rounds", type=int, default=1, help="measurements of each variant")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.stack, args.no_gc)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    sys.path.insert(0, HERE)
    import overhead as ob

    stacks = list(ob.STACKS) if args.stack == "all" else [args.stack]
    for stack in stacks:
        if stack != "fastapi-sqlite":
            ob.seed_pg()
        n = args.requests or DEFAULT_REQUESTS[stack]
        tmp = tempfile.mkdtemp(prefix="perfsleuth-callgrind-")
        totals: dict[str, int | float] = {}
        print(f"== {stack}: {n} requests counted" + (", GC off" if args.no_gc else ""))
        try:
            for _ in range(args.rounds):
                for variant in args.variants.split(","):
                    counts = measure(variant, n, tmp, stack, args.no_gc)
                    threads = {t: v / n for t, v in sorted(counts.items())}
                    totals[variant] = total = sum(threads.values())
                    parts = ", ".join(
                        f"thread {t} {v / 1000:,.1f}k" for t, v in threads.items() if v > 50
                    )
                    print(
                        f"{variant:26s} {total / 1000:9,.1f}k instructions/request ({parts})",
                        flush=True,
                    )
                base = totals.get("bare")
                if base:
                    for variant, total in totals.items():
                        if variant != "bare":
                            pct = (total - base) / base * 100
                            print(f"{variant}: {pct:+.1f} % instructions over bare")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
