"""One rule for milliseconds and shares (perfsleuth.analysis.text's docstring): the Python
functions that finding titles and the CLI use, and the web UI's web/src/format.ts compiled with
the UI's own TypeScript and run in Node, give the same text for the same values."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from perfsleuth.analysis import text
from perfsleuth.cli import render

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"
TSC = WEB / "node_modules" / ".bin" / "tsc"

# Ties at each digit (0.125, 1234.5, 2.5), just under and over the thresholds, negatives.
MS = [0, 0.004, 0.005, 0.125, 0.35, 0.999, 0.9951, 1, 2.25, 4.2, 9.95, 9.96, 10, 63.4, 99.5]
MS += [999.5, 1234.5, 1250, 12_345.678, 1_000_000.5, -0.5, -3.25, -12.5, -1234.5]
SHARES = [0, 0.0004, 0.00045, 0.012, 0.042, 0.0995, 0.1, 0.125, 0.555, 0.63, 1, -0.05]


def test_the_rule() -> None:
    assert [text.ms_number(v) for v in (0.35, 4.2, 63, 1250, None, float("nan"))] == [
        "0.35",
        "4.2",
        "63",
        "1,250",
        "-",
        "-",
    ]
    assert [text.pct_number(v) for v in (0, 0.042, 0.63, None)] == ["0%", "4.2%", "63%", "-"]
    # half away from zero on the float's exact value: 2.25 and 0.125 are exact, 9.95 is not
    assert [text.ms_number(v) for v in (2.25, 0.125, 9.95, -12.5)] == ["2.3", "0.13", "9.9", "-13"]
    assert text.ms(4.2) == "4.2 ms" and text.ms(12_345) == "12.3 s" and text.ms(None) == "?"
    assert text.pct(0.042) == "4.2%" and text.pct(None) == "?"


def test_the_cli_uses_the_rule() -> None:
    for v in MS:
        assert render.ms(v) == text.ms_number(v)
    for s in SHARES:
        want = "-" if s == 0 else text.pct_number(s)
        assert render.pct(s, zero="-") == want
    assert render.ms(None) == render.pct(None) == "-"


@pytest.mark.skipif(
    shutil.which("node") is None or not TSC.exists(),
    reason="needs Node.js and web/node_modules (scripts/setup.sh installs them)",
)
def test_the_ui_uses_the_same_rule(tmp_path: Path) -> None:
    out = tmp_path / "js"
    options = ["--outDir", str(out), "--target", "ES2022", "--module", "ESNext"]
    r = subprocess.run(
        [str(TSC), str(WEB / "src" / "format.ts"), *options],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (out / "format.mjs").write_text((out / "format.js").read_text())
    script = (
        "import { fmtMs, fmtPct, fmtInt } from './format.mjs';"
        "const [ms, shares] = JSON.parse(process.argv[2]);"
        "console.log(JSON.stringify({ms: ms.map(fmtMs), pct: shares.map(fmtPct),"
        " int: ms.map(fmtInt)}));"
    )
    (out / "run.mjs").write_text(script)
    values = [*MS, None]
    r = subprocess.run(
        ["node", str(out / "run.mjs"), json.dumps([values, [*SHARES, None]])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["ms"] == [text.ms_number(v) for v in values]
    assert got["pct"] == [text.pct_number(v) for v in [*SHARES, None]]
    assert got["int"][MS.index(1234.5)] == "1,235"
