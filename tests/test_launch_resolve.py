"""``perfsleuth run``'s lookup of the command (agent.launch.resolve) finds what
``shutil.which`` finds for the same PATH, real files in a temporary tree (issue 22 item 7)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from perfsleuth.agent.launch import resolve

PROGRAM = "perfsleuth-probe-tool"


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def lookup(program: str, env: dict[str, str]) -> str | None:
    try:
        return resolve(program, env)
    except FileNotFoundError:
        return None


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    executable(tmp_path / "cwd" / PROGRAM)  # in the current directory only
    executable(tmp_path / "b" / PROGRAM)
    (tmp_path / "a" / PROGRAM).mkdir(parents=True)  # a directory of that name comes first
    (tmp_path / "c").mkdir()
    plain = tmp_path / "c" / PROGRAM
    plain.write_text("not executable")
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


@pytest.mark.parametrize(
    "path",
    [
        "",  # set but empty: nothing (not the current directory)
        "{a}:{b}",
        "{c}:{a}",
        "{a}:{a}:{b}:{b}",
        ":{b}",  # an empty entry is the current directory, for shutil.which too
        None,  # no PATH: the system's default
    ],
)
def test_resolve_finds_what_shutil_which_finds(tree: Path, path: str | None) -> None:
    env: dict[str, str] = {}
    if path is not None:
        env["PATH"] = path.format(a=tree / "a", b=tree / "b", c=tree / "c")
    expected = shutil.which(PROGRAM, path=env["PATH"] if path is not None else None)
    if path is None:
        saved = os.environ.pop("PATH", None)
        try:
            expected = shutil.which(PROGRAM)
        finally:
            if saved is not None:
                os.environ["PATH"] = saved
    assert lookup(PROGRAM, env) == expected
    if path == "":
        assert expected is None


def test_a_path_with_a_directory_is_taken_as_it_is(tree: Path) -> None:
    assert lookup(f"./{PROGRAM}", {"PATH": ""}) == f"./{PROGRAM}"
    assert lookup(str(tree / "a" / PROGRAM), {}) is None  # a directory
    assert lookup(str(tree / "c" / PROGRAM), {}) is None  # not executable
