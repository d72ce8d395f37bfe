"""The real-world suite (``make bench-realworld``): perfsleuth on open-source apps from PyPI.

    .venv/bin/python benchmarks/realworld/run.py [--case NAME ...] [--json out.json] [--keep]

Each case in ``cases/`` is a web app published on PyPI at a release where a performance bug is
documented in its own tracker, changelog or commit message, and at the release that fixed it.
For each release the case installs the pinned app into a cached venv under
``.venvs/realworld/``, writes the few files a user of the app writes (settings, URLs, seed
script), seeds data, runs the server under ``perfsleuth run`` with its own data dir on an
ephemeral port, drives plain HTTP traffic on 127.0.0.1 (the buggy page and clean pages),
ingests, and reads ``perfsleuth findings --json``:

- buggy release: the documented problem is found on its endpoint and the finding names the
  documented line;
- fixed release: that finding is gone;
- both: no finding on a clean page, and every page's requests were stored.

Prints a table (app, version, problem, found?, line, false alarms) and exits 1 when a case
fails. Installs come from PyPI the first time (then from the cache); a case takes a minute or
two once its venvs exist.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import harness

CASES = ["admin_index", "starlette_admin", "auditlog", "appbuilder", "sqladmin", "wagtail"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=CASES, help="run only these cases")
    parser.add_argument("--role", choices=["buggy", "fixed"], help="run only this release")
    parser.add_argument("--json", metavar="FILE", help="write every result (findings too) here")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as Markdown here")
    parser.add_argument("--keep", action="store_true", help="keep the work dirs (data, logs)")
    args = parser.parse_args()
    names = args.case or CASES
    roles = [args.role] if args.role else ["buggy", "fixed"]
    results = []
    for name in names:
        case = importlib.import_module(f"cases.{name}")
        for role in roles:
            workdir = Path(tempfile.mkdtemp(prefix=f"realworld-{name}-{role}-"))
            started = time.monotonic()
            harness.log(f"{case.APP} {role}: work dir {workdir}")
            res = case.run(role, workdir)
            res_seconds = time.monotonic() - started
            harness.log(
                f"{case.APP} {res.version} ({role}): {'ok' if res.ok else 'FAIL'} "
                f"in {res_seconds:.0f} s {res.error}"
            )
            results.append(res)
            if args.keep:
                harness.log(f"kept {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    print_table(results)
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps([r.__dict__ | {"ok": r.ok} for r in results], indent=2, default=str)
        )
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


HEADER = ("app", "version", "problem", "found?", "line", "false alarms", "lost", "verdict")


def table_rows(results: list[harness.RunResult]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for r in results:
        if r.role == "buggy":
            found = "yes" if r.found else "no"
            verdict = f"right, in the {r.line_where}" if r.line_ok else "wrong"
            line = f"{r.named_line} ({verdict})" if r.found else "-"
        else:
            found = "still reported" if r.found else "no (fixed)"
            line = r.named_line or "-"
        rows.append(
            (
                r.app,
                f"{r.version} ({r.role})",
                r.problem,
                found,
                line,
                str(len(r.false_alarms)),
                str(len(r.lost)),
                "ok" if r.ok else "FAIL",
            )
        )
        for x in r.also:  # the case's further documented problems: a row each
            rows.append(
                (
                    r.app,
                    f"{r.version} ({r.role})",
                    x["problem"],
                    x["found"],
                    x["line"],
                    '"',
                    '"',
                    "ok" if x["ok"] else "FAIL",
                )
            )
    return rows


def markdown_table(results: list[harness.RunResult]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    return "\n".join(lines) + "\n"


def print_table(results: list[harness.RunResult]) -> None:
    header = HEADER
    rows = table_rows(results)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    for r in results:
        for alarm in r.false_alarms:
            print(f"  false alarm, {r.app} {r.version}: {alarm}")
        for lost in r.lost:
            print(f"  requests lost, {r.app} {r.version}: {lost}")
        for other in r.other:
            print(f"  also reported, {r.app} {r.version}: {other}")
        if r.error:
            print(f"  error, {r.app} {r.version}: {r.error}")


if __name__ == "__main__":
    sys.exit(main())
