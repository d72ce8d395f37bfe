"""Start and stop the demo's three processes: the shop (uvicorn), the legacy admin app
(gunicorn, two pre-fork workers) and the fake carrier API. The first two run under the agent
through the ``wrap`` prefix the caller gives (``perfsleuth run --service NAME --``)."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str, path: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=2)
        conn.request("GET", path)
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


@dataclass
class DemoServers:
    shop_url: str
    legacy_url: str
    upstream_url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)

    def wait_ready(self, timeout: float) -> bool:
        checks = [(self.upstream_url, "/health"), (self.shop_url, "/health"),
                  (self.legacy_url, "/admin/health")]  # fmt: skip
        deadline = time.monotonic() + timeout
        while checks and time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"the {name} server exited with status {proc.returncode}")
            checks = [c for c in checks if not _healthy(*c)]
            if checks:
                time.sleep(0.2)
        return not checks

    def stop(self) -> None:
        """SIGTERM everything (the servers shut down gracefully and the agent flushes), then
        wait; SIGKILL only what is still running after the timeout."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_servers(
    db_path: str, data: str, wrap: Callable[[str], list[str]] | None = None
) -> DemoServers:
    """Start the three servers (not waiting for them: call ``wait_ready``). ``wrap(service)``
    returns the command prefix that runs a server under the agent."""
    wrap = wrap or (lambda _service: [])
    ports = {name: free_port() for name in ("shop", "legacy", "upstream")}
    servers = DemoServers(
        shop_url=f"http://127.0.0.1:{ports['shop']}",
        legacy_url=f"http://127.0.0.1:{ports['legacy']}",
        upstream_url=f"http://127.0.0.1:{ports['upstream']}",
    )
    env = dict(os.environ)
    env.update(
        PERFSLEUTH_DEMO_DB=os.path.abspath(db_path),
        PERFSLEUTH_DEMO_UPSTREAM=servers.upstream_url,
        PYTHONUNBUFFERED="1",
    )
    # The demo's slow requests take 100-300 ms on a quiet machine (a form parse, a search): the
    # agent's default 300 ms would profile only the slowest of them, so the demo samples from
    # 100 ms unless the user chose otherwise.
    env.setdefault("PERFSLEUTH_SAMPLE_AFTER_MS", "100")
    py = sys.executable
    commands = {
        "upstream": [py, "-m", "perfsleuth.demo.upstream", "--port", str(ports["upstream"])],
        "shop": [*wrap("shop"), py, "-m", "uvicorn", "perfsleuth.demo.shop:app",
                 "--host", "127.0.0.1", "--port", str(ports["shop"]), "--no-access-log"],
        "legacy": [*wrap("legacy-admin"), py, "-m", "gunicorn", "-w", "2",
                   "-b", f"127.0.0.1:{ports['legacy']}", "--no-control-socket",
                   "--timeout", "120", "perfsleuth.demo.legacy:app"],
    }  # fmt: skip
    log_dir = os.path.join(data, "demo-logs")
    os.makedirs(log_dir, exist_ok=True)
    try:
        for name, argv in commands.items():
            path = os.path.join(log_dir, f"{name}.log")
            servers.logs[name] = path
            with open(path, "wb") as log:
                servers.procs[name] = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
    except BaseException:
        servers.stop()
        raise
    return servers
