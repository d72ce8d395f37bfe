"""Shared machinery of the real-world suite: app venvs, servers under `perfsleuth run`, traffic,
findings and the verdict of one run.

A case (one module in ``cases/``) names a PyPI app at two pinned releases, the buggy one and the
one that fixed the documented problem, writes the small project that serves it (settings, URLs,
seed data: what a user of the app writes, never the app's own code), and says what perfsleuth
should find: the finding kind, the endpoint and the documented line. Everything here is driven
by plain HTTP on 127.0.0.1 and ephemeral ports.
"""

from __future__ import annotations

import hashlib
import http.client
import http.cookiejar
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VENV_CACHE = REPO / ".venvs" / "realworld"
# The launcher and the analysis run from the project's own venv; the app runs from its venv.
TOOLS_BIN = Path(sys.executable).parent
PERFSLEUTH = str(TOOLS_BIN / "perfsleuth")
# Apps run on the project's own interpreter (the agent's C accelerator is built for it); a
# venv made from inside a venv is based on the same base interpreter.
APP_PYTHON = sys.executable
PYTHON_TAG = f"python{sys.version_info[0]}.{sys.version_info[1]}"


def log(msg: str) -> None:
    print(f"[realworld {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- venvs -----------------------------------------------------------------------------------


def app_venv(name: str, requirements: list[str]) -> Path:
    """A venv with ``requirements`` (pinned) and this project (the agent), cached by their hash.

    The project goes in with ``--no-deps``: the app's process only needs the agent, which is
    stdlib-only, and perfsleuth's own dependencies (FastAPI among them) could clash with the
    app's pins. The CLI that launches and analyses runs from the project's venv.
    """
    key = hashlib.sha256("\n".join([PYTHON_TAG, *sorted(requirements)]).encode()).hexdigest()[:10]
    venv = VENV_CACHE / f"{name}-{key}"
    ready = venv / ".ready"
    if ready.exists():
        return venv
    log(f"creating venv {venv.name}: {' '.join(requirements)}")
    if venv.exists():
        subprocess.run(["rm", "-rf", str(venv)], check=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([APP_PYTHON, "-m", "venv", str(venv)], check=True)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
    ]
    subprocess.run([*pip, *requirements], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(REPO)], check=True)
    ready.write_text("\n".join(requirements) + "\n")
    return venv


# -- servers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server command run under ``perfsleuth run`` with its own data dir; stopped by SIGTERM."""

    def __init__(
        self, argv: list[str], data: Path, port: int, cwd: Path, env: dict[str, str]
    ) -> None:
        self.port = port
        self.data = data
        self.log_path = data.parent / f"{data.name}-server.log"
        full_env = {**os.environ, **env, "PERFSLEUTH_DATA": str(data)}
        full_env.pop("PYTHONPATH", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PERFSLEUTH, "run", "--data", str(data), "--", *argv],
            cwd=cwd,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, path: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", path)
                conn.getresponse().read()
                conn.close()
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 2000) -> str:
        if not self._log.closed:  # closed once stopped
            self._log.flush()
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


# -- traffic ---------------------------------------------------------------------------------


class Client:
    """A browser-like HTTP client: a cookie jar, Django's CSRF token on POSTs."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def request(self, method: str, path: str, form: dict[str, str] | None = None) -> int:
        return self.fetch(method, path, form)[0]

    def fetch(self, method: str, path: str, form: dict[str, str] | None = None) -> tuple[int, str]:
        data = None
        headers = {"User-Agent": "perfsleuth-realworld"}
        if form is not None:
            data = urllib.parse.urlencode(form).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
            headers["Referer"] = self.base + path
            token = self.cookie("csrftoken")
            if token:
                headers["X-CSRFToken"] = token
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with self.opener.open(req, timeout=120) as resp:
                return int(resp.status), resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode("utf-8", "replace")

    def get(self, path: str) -> int:
        return self.request("GET", path)

    def cookie(self, name: str) -> str | None:
        for c in self.jar:
            if c.name == name:
                return c.value
        return None

    def django_login(self, user: str, password: str, login_path: str = "/admin/login/") -> None:
        self.get(login_path)
        token = self.cookie("csrftoken") or ""
        form = {"username": user, "password": password, "csrfmiddlewaretoken": token}
        status = self.request("POST", login_path + "?next=/admin/", form)
        if self.cookie("sessionid") is None:
            raise RuntimeError(f"login as {user} failed (status {status})")

    def form_login(self, path: str, fields: dict[str, str], verify_path: str) -> None:
        """Log in through an HTML form that carries a hidden ``csrf_token`` (Flask-WTF); then
        ``verify_path`` must show something other than a password form."""
        _, page = self.fetch("GET", path)
        m = re.search(r'name="csrf_token"[^>]*value="([^"]+)"', page) or re.search(
            r'value="([^"]+)"[^>]*name="csrf_token"', page
        )
        form = {**fields, **({"csrf_token": m.group(1)} if m else {})}
        status = self.request("POST", path, form)
        _, page = self.fetch("GET", verify_path)
        if 'type="password"' in page:
            raise RuntimeError(f"form login at {path} failed (status {status})")


def drive(plan: Iterable[tuple[Callable[[], int], int]], threads: int = 1) -> dict[str, Any]:
    """Run each ``(call, times)`` of the plan, interleaved, on ``threads`` threads.

    Returns the number of requests and how many got each status."""
    work: list[Callable[[], int]] = []
    items = [(call, n) for call, n in plan]
    rounds = max((n for _, n in items), default=0)
    for i in range(rounds):
        work.extend(call for call, n in items if i < n)
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    it = iter(work)

    def worker() -> None:
        while True:
            with lock:
                call = next(it, None)
            if call is None:
                return
            try:
                status = call()
            except Exception:  # a request that could not be made counts as status 0
                status = 0
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"requests": len(work), "statuses": statuses}


# -- perfsleuth's answer ---------------------------------------------------------------------


def perfsleuth_json(*args: str, data: Path) -> Any:
    out = subprocess.run(
        [PERFSLEUTH, *args, "--data", str(data), "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(out.stdout)


def requests_by_endpoint(data: Path) -> dict[str, int]:
    rows = perfsleuth_json(
        "sql",
        "select endpoint, count(*) as n from requests where kind = 'web' group by 1",
        data=data,
    )
    if isinstance(rows, dict):
        rows = rows.get("rows", [])
    out: dict[str, int] = {}
    for r in rows:
        if isinstance(r, dict):
            out[str(r["endpoint"])] = int(r["n"])
        else:
            out[str(r[0])] = int(r[1])
    return out


def locations(obj: Any) -> list[tuple[str, int]]:
    """Every ``{file, line}`` a finding names (its call site and its evidence), in order."""
    found: list[tuple[str, int]] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            f, ln = o.get("file"), o.get("line")
            if isinstance(f, str) and isinstance(ln, int):
                found.append((f, ln))
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(obj)
    return found


@dataclass
class Expect:
    """What perfsleuth should say about the documented problem."""

    kinds: tuple[str, ...]  # finding kinds that name this problem (any of them)
    endpoint: str  # as perfsleuth names it, e.g. "GET /admin/"
    file_suffix: str  # e.g. "django_admin_index/models.py"
    line: int  # the documented line, in the buggy release
    problem: str  # a few words for the table
    also: tuple[str, ...] = ()  # other endpoints the same documented code runs on
    other_lines: tuple[int, ...] = ()  # lines of the same file the same fix changed
    # Other (file suffix, line) places that name the same problem, e.g. the template line of
    # the loop that runs it.
    other_places: tuple[tuple[str, int], ...] = ()
    # The documented problem's statements (prefixes of the fingerprint), when the endpoint
    # has other findings of the same kind that the fix did not touch; empty: any statement.
    statements: tuple[str, ...] = ()
    # Real problems the app has on every page, in both releases, that its tracker does not
    # document: (statement prefix, why it is real). Findings on them are listed, not judged.
    known: tuple[tuple[str, str], ...] = ()
    # False: a further documented problem (judge's ``also``) whose cost sits near the
    # detectors' floors, so that the buggy release may or may not raise it from run to run
    # (when it does, at a documented line); the fixed release must not raise it.
    required: bool = True


@dataclass
class RunResult:
    """One release of one case: what was driven, what perfsleuth said, the verdict."""

    app: str
    version: str
    role: str  # "buggy" or "fixed"
    problem: str
    requests: dict[str, int] = field(default_factory=dict)  # endpoint -> requests stored
    findings: list[dict[str, Any]] = field(default_factory=list)
    found: bool | None = None  # the problem's finding on its endpoint
    line_ok: bool | None = None  # buggy: that finding names the documented line
    named_line: str = ""  # the call site perfsleuth named
    line_where: str = ""  # where the documented line is named: "call site" or "evidence"
    false_alarms: list[str] = field(default_factory=list)  # "kind @ endpoint: title"
    other: list[str] = field(default_factory=list)  # other findings on the affected pages
    lost: list[str] = field(default_factory=list)  # "endpoint: stored/served" where some lack
    # the case's further documented problems (judge's ``also``): problem, endpoint, found,
    # line, ok (each a row of the table), and whether all are right
    also: list[dict[str, Any]] = field(default_factory=list)
    also_ok: bool = True
    error: str = ""

    @property
    def ok(self) -> bool:
        if self.error or self.lost or not self.also_ok:
            return False
        if self.role == "buggy":
            return bool(self.found and self.line_ok and not self.false_alarms)
        return not self.found and not self.false_alarms


def conclude(
    result: RunResult,
    server: Any,
    data: Path,
    traffic: dict[str, Any],
    expect: Expect,
    min_requests: dict[str, int],
    also: tuple[Expect, ...] = (),
) -> None:
    """After a case's traffic: an unexpected status is an error; the server stops (the agent
    flushes at SIGTERM); the stored requests and the findings are read and judged."""
    if set(traffic["statuses"]) != {200}:
        result.error = f"unexpected statuses {traffic['statuses']}"
    server.stop()
    result.requests = requests_by_endpoint(data)
    result.findings = perfsleuth_json("findings", "--limit", "100", data=data)
    judge(result, expect, min_requests, also)


@dataclass
class _Match:
    """What the findings say about one documented problem."""

    hits: list[dict[str, Any]]
    line_ok: bool
    named_line: str
    line_where: str


def _match(result: RunResult, expect: Expect) -> _Match:
    """The findings naming ``expect``'s problem on its endpoint (``also`` endpoints added on
    the fixed release), and whether one of them names a documented line."""

    def known(f: dict[str, Any]) -> bool:
        fp = f.get("fingerprint") or ""
        if expect.statements and not fp.startswith(expect.statements):
            return True
        return any(fp.startswith(prefix) for prefix, _ in expect.known)

    endpoints = {expect.endpoint, *(expect.also if result.role == "fixed" else ())}
    hits = [
        f
        for f in result.findings
        if f["kind"] in expect.kinds and f["endpoint"] in endpoints and not known(f)
    ]
    lines = {expect.line, *expect.other_lines}

    def documented(file: str, line: Any) -> bool:
        if file.endswith(expect.file_suffix) and line in lines:
            return True
        return any(file.endswith(sfx) and line == ln for sfx, ln in expect.other_places)

    m = _Match(hits, False, "", "")
    for f in hits:
        if f["endpoint"] != expect.endpoint:
            continue
        site = f.get("callsite") or {}
        if site and not m.named_line:
            m.named_line = f"{_short(site.get('file'))}:{site.get('line')}"
        if documented(str(site.get("file", "")), site.get("line")):
            m.line_ok, m.line_where = True, "call site"
        elif any(documented(fl, ln) for fl, ln in locations(f)):
            m.line_ok = True
            m.line_where = m.line_where or "evidence"
    return m


def judge(
    result: RunResult, expect: Expect, min_requests: dict[str, int], also: tuple[Expect, ...] = ()
) -> None:
    """Fill the verdict of ``result`` from its findings.

    Both releases: a finding of ``expect.kinds`` on ``expect.endpoint`` is the problem found; on
    the buggy release it must name ``expect.file_suffix:expect.line`` (as its call site or in its
    evidence), on the fixed release it must be gone (from ``expect.also`` too). ``also``: other
    problems of the buggy release that the fixed one documents as fixed, judged the same way
    (each found at its line, each gone) and summed up in ``result.also``. Any finding on
    another page (the clean ones driven, or a login page on the way) is a false alarm.
    Other findings on the affected pages, and about the whole service, are listed, not judged:
    the documented bug is not all a real page does. Every
    endpoint driven must have its requests stored, so that silence is never mistaken for a pass.
    """
    for ep, n in min_requests.items():
        got = result.requests.get(ep, 0)
        if got < n:
            result.lost.append(f"{ep}: {got} of {n} requests stored")

    def known(f: dict[str, Any]) -> str | None:
        fp = f.get("fingerprint") or ""
        affected = f["kind"] in expect.kinds and f["endpoint"] in (expect.endpoint, *expect.also)
        if affected and expect.statements and not fp.startswith(expect.statements):
            return "not the documented statement"
        return next((why for prefix, why in expect.known if fp.startswith(prefix)), None)

    main = _match(result, expect)
    hits = main.hits
    result.found = any(f["endpoint"] == expect.endpoint for f in hits) or (
        result.role == "fixed" and bool(hits)
    )
    result.line_ok, result.named_line, result.line_where = (
        main.line_ok,
        main.named_line,
        main.line_where,
    )
    expected = [id(f) for f in hits]
    for x in also:
        m = _match(result, x)
        expected += [id(f) for f in m.hits]
        if result.role == "buggy":
            ok = m.line_ok if m.hits else not x.required
            where = f"right, in the {m.line_where}" if m.line_ok else "wrong"
            line = f"{m.named_line} ({where})" if m.hits else "-"
            found = "yes" if m.hits else "no" if x.required else "no (not required)"
        else:
            ok = not m.hits
            line = m.named_line or "-"
            found = "still reported" if m.hits else "no (fixed)"
        result.also.append(
            {"problem": x.problem, "endpoint": x.endpoint, "found": found, "line": line, "ok": ok}
        )
        result.also_ok = result.also_ok and ok
    affected = {expect.endpoint, *expect.also}
    for x in also:
        affected |= {x.endpoint, *x.also}
    for f in result.findings:
        text = f"{f['kind']} @ {f['endpoint']}: {f['title']}"
        why = known(f)
        if why:
            result.other.append(f"[not judged: {why}] {text}")
        elif id(f) in expected:
            continue
        elif f["endpoint"] in affected or f["endpoint"].startswith("<"):
            # Another finding on a page with the documented bug, or about the whole service
            # (a CPU-starved machine): listed, not judged.
            result.other.append(text)
        else:
            result.false_alarms.append(text)


def _short(path: Any) -> str:
    p = str(path or "")
    marker = "site-packages/"
    return p.split(marker, 1)[1] if marker in p else p
