"""Instructions per request, per thread, of the overhead benchmark's variants, under callgrind.

    .venv/bin/python benchmarks/instructions.py [--stack fastapi-sqlite] [--requests 200,1200]
        [--variants bare,perfsleuth-no-evidence]

Timings on a shared 2-core machine move by several per cent from run to run; instruction
counts do not, so this is the tool for telling whether a change to the agent's hot path helps
(it does not replace ``make bench``: instructions are not time, cache misses and system calls
weigh differently). Each variant runs a stack of ``overhead.py`` (``--stack``: fastapi-sqlite,
django-pg, flask-sqlalchemy-pg, or all) twice under
``valgrind --tool=callgrind --separate-threads=yes`` (300 warm-up requests, then N1 and N2
requests, the background writer flushed); the difference divided by N2 - N1 is what one
request costs on each thread, without start-up. Threads are numbered in start order: 1 the
event loop, then the agent's writer (perfsleuth), then the thread-pool worker.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def child(variant: str, n: int, stack: str) -> None:
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

    async def run() -> None:
        for i in range(warmup + n):
            await ob.request(app, i % ob.ORDERS + 1)
        flush()

    if stack == "fastapi-sqlite":
        asyncio.run(run())
    else:
        for i in range(warmup + n):
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


def measure(variant: str, n: int, tmp: str, stack: str) -> dict[int, int]:
    out_dir = os.path.join(tmp, f"{stack}-{variant}-{n}")
    os.makedirs(out_dir)
    cmd = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes",
        f"--callgrind-out-file={out_dir}/cg.out.%p",
        sys.executable, __file__, "--child", variant, str(n), "--stack", stack,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return per_thread(out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="bare,perfsleuth-no-evidence")
    ap.add_argument("--requests", help="N1,N2 (default 200,1200; 50,250 on PostgreSQL)")
    ap.add_argument("--stack", default="fastapi-sqlite", help="a stack of overhead.py, or all")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.stack)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    sys.path.insert(0, HERE)
    import overhead as ob

    stacks = list(ob.STACKS) if args.stack == "all" else [args.stack]
    for stack in stacks:
        if stack != "fastapi-sqlite":
            ob.seed_pg()
        default = "200,1200" if stack == "fastapi-sqlite" else "50,250"
        n1, n2 = (int(x) for x in (args.requests or default).split(","))
        tmp = tempfile.mkdtemp(prefix="perfsleuth-callgrind-")
        totals = {}
        print(f"== {stack}: requests {n1},{n2}")
        try:
            for variant in args.variants.split(","):
                a, b = measure(variant, n1, tmp, stack), measure(variant, n2, tmp, stack)
                threads = {
                    t: (b.get(t, 0) - a.get(t, 0)) / (n2 - n1) for t in sorted(set(a) | set(b))
                }
                totals[variant] = sum(threads.values())
                parts = ", ".join(
                    f"thread {t} {v / 1000:,.1f}k" for t, v in threads.items() if v > 50
                )
                print(
                    f"{variant:26s} {totals[variant] / 1000:9,.1f}k instructions/request ({parts})",
                    flush=True,
                )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        base = totals.get("bare")
        if base:
            for variant, total in totals.items():
                if variant != "bare":
                    print(f"{variant}: +{(total - base) / base * 100:.1f} % instructions over bare")


if __name__ == "__main__":
    main()
