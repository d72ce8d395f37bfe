"""A ``perfsleuth server`` child process for the benchmarks that measure one (``ingest.py``'s
collector run, ``otlp_ingest.py``'s OTLP over HTTP): started on a free port, ready once
``GET /api/status`` answers, and its CPU time read from /proc (every thread: HTTP, ingest,
queue, DuckDB)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(data_dir: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen[bytes], int]:
    """(the server process, its port) once it answers; SystemExit if it does not start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = subprocess.Popen(
        [sys.executable, "-m", "perfsleuth.cli.entry", "server", "--data", data_dir,
         "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=30):
                return server, port
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit("the perfsleuth server did not start") from None
            time.sleep(0.2)


def stop(server: subprocess.Popen[bytes], timeout_s: float = 120.0) -> float:
    """Stop the server as a service manager does (SIGTERM: it stores what it holds and
    closes the store, DuckDB's last checkpoint included) and return the CPU seconds of its
    whole life, from the kernel's account of the reaped child (every thread)."""
    server.terminate()
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(server.pid, os.WNOHANG)
        if pid:  # reaped here: Popen must not wait for it again
            server.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            server.kill()
        time.sleep(0.05)
