"""The spool fuzz suite's long mode: structure-aware segments (tests/test_fuzz_records.py)
ingested into real DuckDB stores, and the figures.

    .venv/bin/python benchmarks/fuzz.py [--cases 100000] [--seed 1] [--per-store 100] [--dir DIR]

Prints cases, damaged cases, records read, crashes, hangs, well-formed requests expected
(those before each segment's first damage), lost, doubled, and the time taken; the first
failures with the seed and case index that reproduce them (``make_case(seed, index)``).
Exits 1 on any crash, hang, loss or double.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_fuzz_records import Figures, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--per-store", type=int, default=100, help="segments per store")
    ap.add_argument(
        "--dir", default=None, help="where the stores go (default: /dev/shm if there, else temp)"
    )
    args = ap.parse_args()
    base = args.dir or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    work = tempfile.mkdtemp(prefix="perfsleuth-fuzz-", dir=base)
    total = Figures()
    t0 = time.perf_counter()
    try:
        for fig in run(args.cases, args.seed, work, args.per_store):
            total.add(fig)
            shutil.rmtree(work)
            os.makedirs(work)
            if total.cases % 5_000 < args.per_store:
                print(f"  {total.cases:,} cases, {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    print(f"cases: {total.cases:,} (seed {args.seed}), damaged: {total.damaged_cases:,}")
    print(f"records read: {total.records:,}")
    print(f"well-formed requests before the damage: {total.good_expected:,}")
    print(f"crashes: {total.crashes}, hangs: {total.hangs}")
    print(f"requests lost: {total.lost}, doubled: {total.doubled}")
    print(f"time: {elapsed:.0f} s ({total.ingest_seconds:.0f} s of ingest)")
    for f in total.failures[:20]:
        print("FAIL", f)
    return 1 if (total.crashes, total.hangs, total.lost, total.doubled) != (0, 0, 0, 0) else 0


if __name__ == "__main__":
    sys.exit(main())
