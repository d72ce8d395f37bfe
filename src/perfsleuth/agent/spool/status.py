"""The agent's counters where a reader finds them: ``DATA/agents/<host>-<pid>.json`` (rewritten
by the writer every second and at exit) and, when requests were lost, one line on stderr at
exit (the status file may not say so on a full disk, and the counters die with the process).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from perfsleuth.agent import accel
from perfsleuth.agent.config import Config
from perfsleuth.agent.recorder import stats


def hostname() -> str:
    """This machine's name, as socket.gethostname() says it (without importing socket at the
    agent's start where the system tells it otherwise)."""
    uname = getattr(os, "uname", None)
    if uname is not None:
        return str(uname().nodename)
    import socket

    return socket.gethostname()


HOST = hostname().replace("-", "_")[:64] or "host"  # in spool and status file names

# A status file is padded to this size (JSON allows trailing spaces), so that on a full disk it
# can still be overwritten in place, in the blocks it already has.
STATUS_BYTES = 4096

last_error = ""  # the last write error or writer death, as the status file says it
written = True  # whether the last status update reached the file


def _replace_file(path: str, data: bytes) -> None:
    """``data`` into ``path``: written to ``path.tmp``, renamed over ``path``; OSError when
    that fails (the .tmp removed)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError:
        unlink(tmp)
        raise


# The accelerator's does it letting the interpreter lock go once, not four times (each time an
# agent thread lets it go, a busy app gives it back late: agent/_speedups.c).
replace_file = accel.pick("replace_file", _replace_file)


def error(text: str) -> None:
    global last_error
    last_error = text


def write(cfg: Config, *, queued: int = 0, writer_dead: bool = False) -> None:
    """Replace DATA/agents/<host>-<pid>.json with the current counters (best effort).
    ``queued``: requests waiting for the writer (lost, if ``writer_dead``). When the disk is
    full, the file is overwritten in place; the counters stay in memory and are written by the
    next update that succeeds, and report_drops() says so on stderr."""
    global written
    written = False
    try:
        import json

        path = os.path.join(cfg.agents_dir, f"{HOST}-{os.getpid()}.json")
        body: dict[str, Any] = dict(stats)
        body["dropped_writer_dead"] = stats["dropped_writer_dead"] + (queued if writer_dead else 0)
        body.update(
            pid=os.getpid(),
            host=hostname(),
            service=cfg.service,
            updated_ns=time.time_ns(),
            last_error=last_error,
            queued=queued,
        )
        data = json.dumps(body).encode()
        data += b" " * (STATUS_BYTES - len(data) - 1) + b"\n"
        try:
            try:
                replace_file(path, data)
            except FileNotFoundError:  # no agents directory (yet, or deleted)
                os.makedirs(cfg.agents_dir, exist_ok=True)
                replace_file(path, data)
        except OSError:
            if len(data) > STATUS_BYTES:
                raise
            with open(path, "r+b") as fh:  # no new blocks needed: a full disk allows it
                fh.write(data)
        written = True
    except Exception:
        pass  # nowhere to report to: the in-memory counters still hold the truth


def report_drops() -> None:
    """One line on stderr when requests recorded in this process were dropped."""
    drops = {k[8:]: v for k, v in stats.items() if k.startswith("dropped_") and v}
    total = sum(v for k, v in drops.items() if k != "events")
    if total <= 0:
        return
    reasons = ", ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in drops.items())
    where = "" if written else " (the status file could not be updated)"
    line = f"perfsleuth: {total:,} requests were not written ({reasons}){where}"
    if last_error:
        line += f"; last error: {last_error}"
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
