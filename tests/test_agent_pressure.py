"""The agent under pressure: statements that never repeat, a stalled writer, a full disk,
SIGTERM. It sheds detail before speed, holds at most its memory budget in bytes, and counts
every request it could not write where `perfsleuth top` and stderr show it.

Each case runs in a fresh interpreter (the agent's state is process-wide) with real sqlite3
statements through the agent's instrumentation. No timing thresholds: counts and byte bounds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from perfsleuth.agent import recorder
from spoolread import read_spool
from tinyfs import tmpfs

# argv: data dir, agent settings (JSON), requests, statements per request, stall the writer
# (0/1), distinct statements (0/1). Prints the agent's counters and traced memory figures.
APP = r"""
import json, sqlite3, sys, tracemalloc
import perfsleuth.agent as ps
from perfsleuth.agent import recorder
from perfsleuth.agent.spool import writer

data, cfg, n, per, stall, distinct = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:7])
share = cfg.pop("share_statements", True)
assert ps.start(data, service="pressure", **cfg)
if not share and recorder.speedups is not None:  # each text recorded as made (the writer's work)
    recorder.speedups.configure(statement_scan=None)
db = sqlite3.connect(":memory:")
db.execute("create table orders (id integer primary key, note text, amount real)")
filler = ", ".join(f"'{'x' * 20}{k}' AS c{k}" for k in range(40))  # ~1.5 KB of literals

def statement(i, j):
    if not distinct:
        return "select id, note from orders where id = ?", (j,)
    ids = ", ".join(str(i * 100 + k) for k in range(j % 7 + 1))
    return (f"/* trace='{i:08x}{j:04x}' */ select id, {filler}, {i} * {j} from orders "
            f"where id in ({ids}) and note <> 'n{i}-{j}'"), ()

# "after" leaves out what imports allocate (at any depth of the traceback: the modules the
# agent imports when it first needs them, ~0.5 MB on 3.11 and ~1 MB on 3.13): not the caches
tracemalloc.start(64)
imports = [tracemalloc.Filter(False, f, all_frames=True)
           for f in ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")]
def kept():
    return sum(t.size for t in tracemalloc.take_snapshot().filter_traces(imports).traces)
base_kept = kept()
if stall:
    writer.lock.acquire()  # the writer thread blocks on it: nothing is written meanwhile
base = tracemalloc.get_traced_memory()[0]
for i in range(n):
    req = recorder.begin("web", "GET", f"/orders/{i}")
    req.endpoint = "GET /orders/{id}"
    for j in range(per):
        db.execute(*statement(i, j)).fetchall()
    req.status = 200
    recorder.end(req)
held = tracemalloc.get_traced_memory()[0] - base
tracemalloc.reset_peak()
if stall:
    writer.lock.release()
ps.flush()
peak = tracemalloc.get_traced_memory()[1] - base
after = kept() - base_kept
print(json.dumps({"stats": ps.stats(), "held": held, "peak": peak, "after": after}))
"""


def run_app(
    data: Path, n: int, per: int, *, stall: bool = False, distinct: bool = True, **cfg: object
) -> dict:
    args = [str(data), json.dumps(cfg), str(n), str(per), str(int(stall)), str(int(distinct))]
    out = subprocess.run(
        [sys.executable, "-c", APP, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def dropped(stats: dict) -> int:
    return sum(v for k, v in stats.items() if k.startswith("dropped_") and k != "dropped_events")


@pytest.mark.parametrize("share", [False, True], ids=["as made", "shared"])
def test_over_its_cpu_budget_the_writer_skips_fingerprints_and_counts_them(
    tmp_path: Path, share: bool
) -> None:
    res = run_app(tmp_path, 30, 5, fingerprint_cpu_pct=0, share_statements=share)
    stats = res["stats"]
    assert stats["requests_written"] == 30
    # every statement is new and the budget is nil: none normalised, each counted. Shared by
    # their tokens (the accelerator's shared_statement), the writer meets one text a shape:
    # 5 (the IN list's lengths)
    shapes = 5 if share and recorder.speedups is not None else 30 * 5
    assert stats.get("fingerprints_skipped") == shapes
    reqs = read_spool(str(tmp_path))
    assert sum(len(r["calls"]) for r in reqs) == 30 * 5  # the calls and their timing stay
    texts = {c["fingerprint"] for r in reqs for c in r["calls"]}
    assert len(texts) == shapes  # a hash per text met: never lumped with another shape
    assert all(t.startswith("[not fingerprinted:") and "xxxx" not in t for t in texts)
    assert all(c["dur"] >= 0 and c["off"] >= 0 for r in reqs for c in r["calls"])


def test_within_its_cpu_budget_the_writer_fingerprints_every_statement(tmp_path: Path) -> None:
    res = run_app(tmp_path, 30, 5)
    assert res["stats"].get("fingerprints_skipped", 0) == 0
    reqs = read_spool(str(tmp_path))
    assert sum(len(r["calls"]) for r in reqs) == 30 * 5
    texts = {c["fingerprint"] for r in reqs for c in r["calls"]}
    assert all(t.startswith("select id, ?") and "in (...)" in t for t in texts), texts


@pytest.mark.parametrize("distinct", [True, False])
def test_stalled_writer_holds_at_most_the_memory_budget(tmp_path: Path, distinct: bool) -> None:
    budget_mb = 4
    res = run_app(tmp_path, 1500, 20, stall=True, distinct=distinct, memory_budget_mb=budget_mb)
    stats = res["stats"]
    # at most the budget held, measured in traced bytes (the app's own share: sqlite3's
    # statement cache, under 1 MB)
    assert res["held"] <= budget_mb * (1 << 20) * 1.1 + (1 << 20), res
    if distinct:
        assert stats.get("dropped_memory", 0) > 0
    # after the stall the backlog drains in bounded slices: no buffer of the whole backlog
    assert res["peak"] <= budget_mb * (1 << 20) * 1.1 + res["held"], res
    # every request recorded is written or counted as dropped, exactly
    assert stats["requests_recorded"] == 1500
    assert stats["requests_written"] + dropped(stats) == 1500, stats
    assert len(read_spool(str(tmp_path))) == stats["requests_written"]


@pytest.mark.parametrize("share", [False, True], ids=["as made", "shared"])
def test_distinct_statements_do_not_grow_the_caches_past_the_budget(
    tmp_path: Path, share: bool
) -> None:
    res = run_app(tmp_path, 1500, 20, memory_budget_mb=2, share_statements=share)
    stats = res["stats"]
    assert stats["requests_written"] > 0
    assert stats["requests_written"] + dropped(stats) == 1500, stats
    if share and recorder.speedups is not None:  # one text a shape: the caches do not fill
        assert stats.get("cache_resets", 0) == 0 and dropped(stats) == 0, stats
    else:  # a text a call: they fill, and are emptied
        assert stats.get("cache_resets", 0) > 0
    # the statements, fingerprints and stacks kept after everything was written
    assert res["after"] <= 2 * (1 << 20), res


def test_repeated_statements_keep_their_caches(tmp_path: Path) -> None:
    res = run_app(tmp_path, 300, 20, distinct=False, memory_budget_mb=2)
    stats = res["stats"]
    assert stats["requests_written"] == 300 and dropped(stats) == 0
    assert stats.get("cache_resets", 0) == 0 and stats.get("fingerprints_skipped", 0) == 0
    assert len({c["fingerprint"] for r in read_spool(str(tmp_path)) for c in r["calls"]}) == 1


@pytest.fixture
def tiny_data_dir(tmp_path: Path) -> Iterator[Path]:
    """A real 384 KiB filesystem holding the whole data dir (spool and status files), so
    writes fail with ENOSPC once it is full."""
    with tmpfs(tmp_path / "data", "384k") as data:
        yield data


def test_drops_on_a_full_disk_reach_the_status_file_and_stderr(tiny_data_dir: Path) -> None:
    # ~1.5 KB statements, all distinct, into a filesystem that holds a fraction of them; the
    # writer is woken often so that it retries many times while the disk is full
    cfg = {"segment_bytes": 50_000, "flush_seconds": 0.01}
    args = [str(tiny_data_dir), json.dumps(cfg), "1500", "20", "0", "1"]
    out = subprocess.run(
        [sys.executable, "-c", APP, *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    stats = json.loads(out.stdout.strip().splitlines()[-1])["stats"]
    lost = dropped(stats)
    assert lost > 0 and stats["requests_written"] + lost == 1500, stats
    # the status file, on the full disk too, has the final counts
    (status_path,) = (tiny_data_dir / "agents").glob("*.json")
    status = json.loads(status_path.read_text())
    assert status["requests_written"] == stats["requests_written"]
    assert dropped(status) == lost
    # the process said so on its way out
    assert f"perfsleuth: {lost:,} requests were not written" in out.stderr, out.stderr
    # no empty segments left behind by the retries
    for seg in (tiny_data_dir / "spool").iterdir():
        assert seg.stat().st_size > 200, seg.name


def test_sigterm_to_a_server_without_a_handler_writes_what_it_queued(tmp_path: Path) -> None:
    from test_run_servers import launched

    data = tmp_path / "data"
    cmd = [sys.executable, "-m", "django", "runserver", "--noreload", "127.0.0.1:{port}"]
    # The writer would wait 60 s: everything answered is still queued when SIGTERM comes.
    with launched(tmp_path, data, cmd, service="runserver", ready="/health/",
                  DJANGO_SETTINGS_MODULE="djproject.settings",
                  PERFSLEUTH_FLUSH_SECONDS="60") as srv:  # fmt: skip
        for i in range(40):
            assert srv.get(f"/health/?i={i}")[0] == 200
        rc = srv.stop()
        answered = srv.answered
    assert rc == -signal.SIGTERM  # it still dies of the signal, as without the agent
    recs = read_spool(str(data))
    assert len(recs) == answered
    (status_path,) = (data / "agents").glob("*.json")
    status = json.loads(status_path.read_text())
    assert status["requests_written"] == answered and dropped(status) == 0


def imported_by(code: str) -> set[str]:
    """The modules a fresh interpreter imports to run ``code``."""
    probe = (
        "import sys, json; before = set(sys.modules)\n"
        + code
        + "\nprint(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_the_agent_imports_next_to_nothing() -> None:
    # a launcher imports it before the application: what the app never uses is not imported
    loaded = imported_by("import perfsleuth.agent")
    assert not loaded & {"perfsleuth.agent.recorder", "perfsleuth.agent.capture", "typing"}
    assert not loaded & {"hashlib", "base64", "urllib.parse", "threading"}
    # and what the app calls still works
    loaded = imported_by("import perfsleuth.agent as ps; ps.attr('x', 1); ps.keep_capture()")
    assert "perfsleuth.agent.recorder" in loaded and "perfsleuth.agent.capture" in loaded


def test_starting_the_agent_imports_only_what_it_runs(tmp_path: Path) -> None:
    loaded = imported_by(f"import perfsleuth.agent as ps; assert ps.start({str(tmp_path)!r})")
    assert "perfsleuth.agent.shipper" in loaded
    # the encoder is the writer's to import when it first writes
    encoder = {"perfsleuth.agent.spool.encode", "perfsleuth.wire.segment", "dataclasses"}
    assert not loaded & encoder
    loaded = imported_by(
        f"import perfsleuth.agent as ps; assert ps.start({str(tmp_path)!r})\n"
        "with ps.task('t'): pass\n"
        "ps.flush()\n"
        "assert ps.stats()['requests_written'] == 1"
    )
    assert loaded >= encoder
    assert not loaded & {"importlib.abc", "multiprocessing", "multiprocessing.util"}
    # multiprocessing imported later is still hooked (its children flush at exit)
    loaded = imported_by(
        f"import perfsleuth.agent as ps; assert ps.start({str(tmp_path)!r})\n"
        "import multiprocessing.util\n"
        "from perfsleuth.agent import shipper\n"
        "assert shipper._mp_hook in multiprocessing.util._afterfork_registry.values()"
    )


def test_perfsleuth_run_execs_the_command_without_importing_the_cli(tmp_path: Path) -> None:
    from perfsleuth.cli.entry import run_args

    assert run_args(["--data", "d", "--service=s", "--", "gunicorn", "app:app"]) == (
        "d",
        "s",
        ["gunicorn", "app:app"],
    )
    assert run_args(["--help"]) is None and run_args(["--data", "d", "--"]) is None
    # the launcher process imports neither typer nor the store before it execs the command, nor
    # any module the interpreter does not load by itself but os and sys
    probe = (
        "import sys\n"
        "sys.argv = ['perfsleuth', 'run', '--data', sys.argv[1], '--', sys.executable, '-c',"
        " 'import perfsleuth.agent as ps; print(ps.started())']\n"
        "import perfsleuth.cli.entry as e\n"
        "import os\n"
        "real_execve = os.execve\n"
        "def execve(path, args, env):\n"
        "    print([m for m in ('typer', 'rich', 'duckdb', 're', 'shutil', 'typing')"
        " if m in sys.modules], flush=True)\n"
        "    real_execve(path, args, env)\n"
        "os.execve = execve\n"
        "e.main()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True"], out.stdout
