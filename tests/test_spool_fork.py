"""A fork while the writer thread imports its encoder (it does so at its first write, not at the
agent's start): the child must not inherit a half-imported module it can never finish."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FORK_MID_IMPORT = r"""
import importlib.machinery, json, os, sys, threading, time
import perfsleuth.agent as ps

assert ps.start(sys.argv[1], service="fork")
assert "perfsleuth.wire.segment" not in sys.modules
importing = threading.Event()


class SlowLoader:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        importing.set()
        time.sleep(0.5)  # the fork comes while the writer thread is in here
        self.loader.exec_module(module)


class SlowFinder:
    def find_spec(self, name, path, target=None):
        if name != "perfsleuth.wire.segment":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = SlowLoader(spec.loader)
        return spec


sys.meta_path.insert(0, SlowFinder())
with ps.task("parent"):
    pass
assert importing.wait(30)  # the writer thread's first write imports the encoder
pid = os.fork()
if pid == 0:
    with ps.task("child"):
        pass
    ps.flush()
    os._exit(0 if ps.stats()["requests_written"] == 1 else 3)
_, status = os.waitpid(pid, 0)
ps.flush()
written = ps.stats()["requests_written"]
print(json.dumps({"child": os.waitstatus_to_exitcode(status), "parent": written}))
"""


def test_a_fork_during_the_encoder_import_leaves_the_child_a_working_writer(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", FORK_MID_IMPORT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"child": 0, "parent": 1}
