"""scripts/check_imports.py: finds module-level import circles, and src/perfsleuth has none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_imports.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (pkg / "__init__.py").touch()
    return pkg


def test_perfsleuth_has_no_module_level_import_circle() -> None:
    result = _run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CYCLE" not in result.stdout


def test_perfsleuth_deferred_circles_are_only_the_listed_ones() -> None:
    result = _run("--deferred")
    assert result.returncode == 0, result.stdout + result.stderr


def test_module_level_circle_is_reported(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "a.py": "from pkg import b\n",
            "b.py": "from pkg.sub.c import X\n",
            "sub/__init__.py": "",
            "sub/c.py": "from . import d\nX = 1\n",
            "sub/d.py": "from ..a import *\n",
        },
    )
    result = _run("--root", str(pkg))
    assert result.returncode == 1
    assert "CYCLE: pkg.a -> pkg.b -> pkg.sub.c -> pkg.sub.d -> pkg.a" in result.stdout


def test_deferred_and_type_checking_imports_are_not_circles(tmp_path: Path) -> None:
    files = {
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n",
        "b.py": "import pkg.a\n",
        "c.py": "def f():\n    from pkg import d\n",
        "d.py": "from pkg import c\n",
    }
    pkg = _package(tmp_path, files)
    result = _run("--root", str(pkg))
    assert result.returncode == 0, result.stdout
    deferred = _run("--root", str(pkg), "--deferred")
    assert deferred.returncode == 1
    assert "CYCLE: pkg.c -> pkg.d -> pkg.c" in deferred.stdout
    assert "pkg.a" not in deferred.stdout  # TYPE_CHECKING imports never count


def test_allowed_edges_make_a_circle_known(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {"a.py": "from pkg import b\n", "b.py": "import pkg.a\n"})
    one_edge = _run("--root", str(pkg), "--allow", "a:b")
    assert one_edge.returncode == 1
    allow_file = tmp_path / "allowed.txt"
    allow_file.write_text("# known, issue 16\na:b\npkg.b:pkg.a  # both spellings\n")
    both = _run("--root", str(pkg), "--allow-file", str(allow_file), "-v")
    assert both.returncode == 0, both.stdout
    assert "known: pkg.a -> pkg.b -> pkg.a" in both.stdout
