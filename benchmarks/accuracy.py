"""Detector accuracy on the zoo: precision and recall per finding kind (``make bench-accuracy``).

    .venv/bin/python benchmarks/accuracy.py [--requests 40] [--dir DIR] [--json out.json]

Runs the zoo of tests/zoo (FastAPI, Flask and Django apps, each endpoint with a planted problem
next to a clean twin, on the local PostgreSQL and Redis; see tests/zoo/catalog.py) through the
same harness as tests/test_zoo.py, then scores ``perfsleuth findings --json``:

* TP: a planted problem found (a finding of its kind on its bad endpoint);
* FN: a planted problem not found;
* FP: a finding of a kind on an endpoint not planted with that kind (a clean twin, another
  plant's endpoint, a health check), counted once per (kind, endpoint); except the kinds a
  plant declares it causes (``Plant.also``, e.g. GC pressure from parsing huge bodies), which
  are listed as "also" and counted neither way.

For kinds whose findings point at code, ``line ok`` counts the TPs whose callsite is the
``# PLANTED`` line. Kinds reported but never planted get rows too (all their findings are
FPs). Exits 0 whatever the scores: it measures, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The zoo lives with the tests (tests/ is not a package: its modules are found through sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zoo import harness
from zoo.catalog import CALLSITE_KINDS, PLANTS, Plant


@dataclass
class Score:
    planted: int = 0
    tp: int = 0
    fp: int = 0
    fn: int = 0
    line_ok: int | None = None  # TPs pointing at the planted line (callsite kinds only)
    missed: list[str] = field(default_factory=list)  # bad endpoints not found
    false: list[str] = field(default_factory=list)  # endpoints wrongly reported
    also: list[str] = field(default_factory=list)  # consequences of a plant (Plant.also)
    wrong_line: list[str] = field(default_factory=list)

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else None


def points_at_plant(finding: dict[str, Any], plant: Plant) -> bool:
    site = finding.get("callsite") or {}
    return bool(
        str(site.get("file", "")).endswith(f"zoo/{plant.module}")
        and site.get("line") == plant.planted_line()
    )


def score(plants: Iterable[Plant], findings: list[dict[str, Any]]) -> dict[str, Score]:
    plants = list(plants)
    reported: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for f in findings:
        reported.setdefault((f["kind"], f["endpoint"]), []).append(f)
    planted = {(p.kind, p.bad): p for p in plants}
    scores: dict[str, Score] = {}
    for (kind, endpoint), plant in planted.items():
        s = scores.setdefault(kind, Score(line_ok=0 if kind in CALLSITE_KINDS else None))
        s.planted += 1
        hits = reported.get((kind, endpoint), [])
        if not hits:
            s.fn += 1
            s.missed.append(endpoint)
            continue
        s.tp += 1
        if s.line_ok is not None:
            if all(points_at_plant(f, plant) for f in hits):
                s.line_ok += 1
            else:
                s.wrong_line.append(endpoint)
    also = {(k, p.bad) for p in plants for k in p.also}
    for kind, endpoint in reported:
        if (kind, endpoint) in also:
            scores.setdefault(kind, Score()).also.append(endpoint)
        elif (kind, endpoint) not in planted:
            s = scores.setdefault(kind, Score())
            s.fp += 1
            s.false.append(endpoint)
    return scores


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def table(scores: dict[str, Score]) -> str:
    rows = sorted(scores.items(), key=lambda kv: (kv[1].planted == 0, kv[0]))  # planted first
    callsite = [s for s in scores.values() if s.line_ok is not None]
    total = Score(
        planted=sum(s.planted for s in scores.values()),
        tp=sum(s.tp for s in scores.values()),
        fp=sum(s.fp for s in scores.values()),
        fn=sum(s.fn for s in scores.values()),
    )
    # "line ok" is k/n: of the n TPs of a callsite kind, k point at the planted line.
    line_ok = {kind: f"{s.line_ok}/{s.tp}" for kind, s in rows if s.line_ok is not None}
    line_ok["overall"] = f"{sum(s.line_ok or 0 for s in callsite)}/{sum(s.tp for s in callsite)}"

    head = (f"{'kind':<20} {'planted':>7} {'TP':>4} {'FP':>4} {'FN':>4} {'precision':>9} "
            f"{'recall':>7} {'line ok':>8}")  # fmt: skip
    rule = "-" * len(head)
    lines = [head, rule]
    for kind, s in [*rows, ("overall", total)]:
        if kind == "overall":
            lines.append(rule)
        lines.append(
            f"{kind:<20} {s.planted:>7} {s.tp:>4} {s.fp:>4} {s.fn:>4} {pct(s.precision):>9} "
            f"{pct(s.recall):>7} {line_ok.get(kind, ''):>8}"
        )
    return "\n".join(lines)


def details(scores: dict[str, Score]) -> str:
    out = []
    for kind, s in sorted(scores.items()):
        out += [f"  missed     {kind:<20} {e}" for e in s.missed]
        out += [f"  false      {kind:<20} {e}" for e in s.false]
        out += [f"  also       {kind:<20} {e} (a consequence of its plant)" for e in s.also]
        out += [f"  wrong line {kind:<20} {e}" for e in s.wrong_line]
    return "\n".join(out) if out else "  none: every plant found, nothing else reported"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=harness.REQUESTS_PER_ENDPOINT,
                        help="requests per endpoint (bad and clean each)")  # fmt: skip
    parser.add_argument("--dir", help="work directory to keep (default: a temporary one)")
    parser.add_argument("--json", help="also write the scores to this JSON file")
    args = parser.parse_args()

    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="perfsleuth-zoo-"))
    try:
        t0 = time.monotonic()
        runs = harness.run_zoo(workdir, n=args.requests)
        ran = time.monotonic() - t0
        findings = harness.all_findings(runs)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)

    scores = score(PLANTS, findings)
    sent = sum(r.requests for r in runs.values())
    print(f"zoo: {len(PLANTS)} planted problems in {len(runs)} apps, {sent:,} requests, "
          f"{len(findings)} findings ({ran:.0f} s)\n")  # fmt: skip
    print(table(scores))
    print("\ndetails:")
    print(details(scores))
    if args.json:
        out = {k: {**asdict(s), "precision": s.precision, "recall": s.recall}
               for k, s in scores.items()}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
