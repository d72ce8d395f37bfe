"""Heap snapshots written by the agent (agent.heap): taking one from a running process, reading
them back, and what grows between two."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import time
from typing import Any

from perfsleuth.agent.heap import marker_path, process_started


class HeapError(Exception):
    """A snapshot cannot be taken or read (one sentence for the user)."""


def _same_process(marker: str, pid: int) -> bool:
    """Whether the process that wrote the marker is the one running as ``pid`` now (their
    start times match); a marker without one (or unreadable) is not trusted."""
    try:
        with open(marker, encoding="utf-8") as fh:
            started = json.load(fh).get("started")
    except (OSError, ValueError, AttributeError):
        return False
    now = process_started(pid)
    if now is None and started is None:
        return True  # no /proc here (nor where the agent ran): nothing to compare
    return isinstance(started, int) and started == now


def _catches_usr2(pid: int) -> bool | None:
    """Whether the process has a handler for SIGUSR2 (Linux /proc; None when unknown)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGUSR2 - 1) & 1)
    except (OSError, ValueError):
        return None
    return None


def take(data_dir: str, pid: int, timeout: float = 60.0) -> tuple[str, dict[str, Any]]:
    """Signal ``pid`` and wait for its snapshot: (path, snapshot)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise HeapError(f"no process with PID {pid}") from None
    except PermissionError:
        raise HeapError(f"not allowed to signal PID {pid} (it belongs to another user)") from None
    # Without our handler SIGUSR2 would kill the process: never send it blind.
    path = marker_path(data_dir, pid)
    if not os.path.exists(path) or _catches_usr2(pid) is False:
        raise HeapError(
            f"PID {pid} has no perfsleuth heap hook in {data_dir} (it does not run the agent "
            "with this data dir, runs it with PERFSLEUTH_HEAP=0, or handles SIGUSR2 itself)"
        )
    if not _same_process(path, pid):
        with contextlib.suppress(OSError):
            os.remove(path)  # stale: its process is gone and the PID now names another
        raise HeapError(
            f"PID {pid} is not the process that registered the heap hook in {data_dir} (it "
            "ended and the PID was reused); the stale marker was removed"
        )
    before = set(glob.glob(os.path.join(data_dir, "heap", f"heap-{pid}-*.json")))
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = set(glob.glob(os.path.join(data_dir, "heap", f"heap-{pid}-*.json"))) - before
        if new:
            path = max(new)
            return path, load(path)
        time.sleep(0.05)
    raise HeapError(f"PID {pid} wrote no heap snapshot within {timeout:g} s")


def resolve(data_dir: str, name: str) -> str:
    """A snapshot given as a path, or as a file name in DATA/heap."""
    if os.path.exists(name):
        return name
    inside = os.path.join(data_dir, "heap", name)
    if os.path.exists(inside):
        return inside
    raise HeapError(f"no heap snapshot {name} (neither a file nor in {data_dir}/heap)")


def load(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            snap = json.load(fh)
    except (OSError, ValueError) as e:
        raise HeapError(f"cannot read the heap snapshot {path}: {e}") from e
    if not isinstance(snap, dict) or not isinstance(snap.get("types"), list):
        raise HeapError(f"{path} is not a perfsleuth heap snapshot")
    return snap


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per type, the change from snapshot ``a`` to ``b``; what grew most (bytes) first."""
    old = {r["type"]: r for r in a["types"]}
    new = {r["type"]: r for r in b["types"]}
    rows = []
    for name in old.keys() | new.keys():
        o = old.get(name, {"count": 0, "bytes": 0})
        n = new.get(name, {"count": 0, "bytes": 0})
        dc, db = int(n["count"]) - int(o["count"]), int(n["bytes"]) - int(o["bytes"])
        if dc or db:
            rows.append(
                {
                    "type": name,
                    "count": int(n["count"]),
                    "bytes": int(n["bytes"]),
                    "count_delta": dc,
                    "bytes_delta": db,
                }
            )
    rows.sort(key=lambda r: (-r["bytes_delta"], -r["count_delta"], r["type"]))
    return rows
