"""`perfsleuth heap PID` signals only the process that registered the heap hook: a marker left
by a process that ended (killed before its exit hook ran) must not get SIGUSR2 sent to another
process that now has the same PID."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from perfsleuth.agent.heap import process_started
from perfsleuth.cli.main import app

# A process that handles SIGUSR2 itself (as a reused PID might): it notes every signal.
OTHER = """
import signal, sys, time
def note(*_):
    with open(sys.argv[1], "a") as fh:
        fh.write("usr2\\n")
signal.signal(signal.SIGUSR2, note)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_stale_marker_never_signals_the_process_that_reused_its_pid(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "agents").mkdir(parents=True)
    got = tmp_path / "signals"
    proc = subprocess.Popen(
        [sys.executable, "-c", OTHER, str(got)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        started = process_started(proc.pid)
        assert started is not None
        marker = data / "agents" / f"heap-{proc.pid}.ready"
        # what an agent process with this PID wrote before it was killed: another start time
        marker.write_text(json.dumps({"pid": proc.pid, "started": started - 100}))
        r = CliRunner().invoke(app, ["heap", str(proc.pid), "--data", str(data)])
        assert r.exit_code != 0
        assert "not the process that registered the heap hook" in r.stderr
        assert not marker.exists()  # the stale marker is removed
        time.sleep(0.3)
        assert not got.exists()  # and the other process was never signalled
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_the_marker_names_its_process_by_pid_and_start_time(tmp_path: Path) -> None:
    data = tmp_path / "data"
    code = (
        "import json, os, perfsleuth.agent as ps\n"
        f"ps.start({str(data)!r})\n"
        "m = os.path.join(" + repr(str(data)) + ", 'agents', 'heap-%d.ready' % os.getpid())\n"
        "print(json.dumps(json.load(open(m))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSLEUTH_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert isinstance(body["started"], int) and body["started"] > 0
    assert not list((data / "agents").glob("heap-*.ready"))  # removed at exit
