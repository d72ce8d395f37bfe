"""The release a request ran: PERFSLEUTH_VERSION, else the commit of the git checkout the app
runs in, carried by each segment's header into ``requests.version`` (and kept for a segment
continued by a later ingest run)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb

from perfsleuth.agent.config import git_commit
from perfsleuth.store.duckdb_store import DuckDBStore

APP = textwrap.dedent(
    """
    import sys, time
    import perfsleuth.agent as ps
    from perfsleuth.agent import recorder

    ps.start(sys.argv[1], service="rel")
    for i in range(int(sys.argv[2])):
        req = recorder.begin("web", "GET", "/r/%d" % i)
        req.endpoint = "GET /r/{i}"
        req.status = 200
        recorder.end(req)
    ps.flush()
    if len(sys.argv) > 3:  # keep the segment open while the test ingests, then add more
        print("flushed", flush=True)
        sys.stdin.readline()
        for i in range(int(sys.argv[3])):
            req = recorder.begin("web", "GET", "/s/%d" % i)
            req.endpoint = "GET /s/{i}"
            req.status = 200
            recorder.end(req)
        ps.flush()
    """
)


def git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    out = subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)
    return out.stdout.decode().strip()


def run(app: Path, cwd: Path, data: Path, n: int, env: dict[str, str] | None = None) -> None:
    base = {k: v for k, v in os.environ.items() if k != "PERFSLEUTH_VERSION"}
    out = subprocess.run(
        [sys.executable, str(app), str(data), str(n)],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def versions(data: Path) -> dict[str | None, int]:
    with DuckDBStore(str(data)) as store:
        store.ingest()
        rows = store.query("SELECT version, count(*) AS n FROM requests GROUP BY 1")
    return {r["version"]: r["n"] for r in rows}


def test_the_release_is_the_setting_else_the_checkout_commit(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(APP)
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "f").write_text("x")
    git(repo, "add", "f")
    git(repo, "commit", "-q", "-m", "one")
    first = git(repo, "rev-parse", "HEAD")
    assert git_commit(str(repo / "sub")) == first[:12]
    git(repo, "pack-refs", "--all")  # the branch now only in packed-refs
    assert git_commit(str(repo)) == first[:12]
    outside = tmp_path / "plain"
    outside.mkdir()

    data = tmp_path / "data"
    run(app, repo / "sub", data, 3)  # in the checkout: its commit
    run(app, repo, data, 2, {"PERFSLEUTH_VERSION": "2026.11.26"})  # the setting wins
    run(app, outside, data, 4)  # no checkout, no setting: none
    assert versions(data) == {first[:12]: 3, "2026.11.26": 2, None: 4}


def test_a_segment_continued_by_a_later_ingest_keeps_its_release(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(APP)
    data = tmp_path / "data"
    env = {**os.environ, "PERFSLEUTH_VERSION": "v7", "PERFSLEUTH_SEGMENT_SECONDS": "600"}
    proc = subprocess.Popen(
        [sys.executable, str(app), str(data), "2", "3"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "flushed"
        assert versions(data) == {"v7": 2}  # the open segment's first part
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert versions(data) == {"v7": 5}


def test_a_store_of_an_earlier_version_gains_the_column(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with DuckDBStore(str(data)) as store:
        store.ingest()
    con = duckdb.connect(str(data / "perfsleuth.duckdb"))
    con.execute("ALTER TABLE ingest_offsets DROP COLUMN version")
    con.close()
    with DuckDBStore(str(data)) as store:
        cols = {
            r["column_name"]
            for r in store.query(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = 'ingest_offsets'"
            )
        }
    assert "version" in cols
