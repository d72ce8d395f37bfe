"""``perfsleuth startup -- CMD``: where a server's start-up time goes, until it first answers.

:func:`measure` runs the command under the agent (``perfsleuth.agent.launch``) with the
start-up probe (:mod:`perfsleuth.analysis.startup_probe`) as every interpreter's
``sitecustomize``, polls ``url`` until it answers (any HTTP status), sends a few more requests
for the steady state, stops the server and reads what the probe wrote. :func:`analyze` turns
that into a report:

- ``total_ms``: from launching the command to the first answer, on this process's clock;
- ``phases``: the critical path cut into phases that add up to the total. The path runs in
  the launched process until the process that answered starts (a forked or spawned worker),
  then in that process. Each instant belongs to the innermost probe span open on the path's
  main thread (an import, ``FastAPI()``, ``django.setup()``, uvicorn's lifespan startup, ...),
  else to the process's own context: interpreter start before the probe ran, worker boot in a
  worker, the server's own code in the launched process; the first request is its own phase;
- ``imports``: the import tree of the path's processes (self and cumulative ms, children
  ranked by cumulative time, the app's own modules marked) and the slowest imports by self time;
- ``first_request``: its latency against the median of the steady-state requests, and the
  modules the first request imported;
- ``notes``: what ran one after another that could overlap or be deferred.

It is one module because measuring and analysing share one format, the probe's events
(:mod:`perfsleuth.analysis.startup_probe` writes them, this module reads them), and the
saved runs are that report; the probe is apart because it runs inside the measured server.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

PROBE_FILE = Path(__file__).with_name("startup_probe.py")
PHASES = (
    "interpreter start",
    "imports",
    "settings / app factory",
    "framework init",
    "lifespan startup",
    "server start",
    "worker boot",
    "first request",
)
_SPAN_PHASE = {
    "app": "settings / app factory",
    "framework": "framework init",
    "lifespan": "lifespan startup",
    "server": "server start",
    "worker": "worker boot",
}
_SITECUSTOMIZE = """\
import importlib.util as _u
_s = _u.spec_from_file_location("_perfsleuth_startup_probe", {path!r})
_m = _u.module_from_spec(_s)
import sys as _sys
_sys.modules["_perfsleuth_startup_probe"] = _m
_s.loader.exec_module(_m)
_m.install()
"""


class StartupError(Exception):
    """The command could not be measured (one sentence for the user)."""


# ---------------------------------------------------------------------------------- measuring


def _get(url: str, timeout: float) -> float:
    """One GET; its latency in ms (until the whole response was read). OSError when there is
    no answer."""
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
        conn.getresponse().read()
        return (time.perf_counter() - t0) * 1000
    except http.client.HTTPException as e:
        raise OSError(str(e)) from e
    finally:
        conn.close()


def measure(
    cmd: Sequence[str],
    url: str,
    *,
    timeout: float = 60.0,
    steady: int = 20,
    data_dir: str | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``cmd`` under the agent and the probe until ``url`` answers; the raw measurement
    (see :func:`analyze`). The server is stopped (SIGTERM to its process group, then SIGKILL)."""
    if not cmd:
        raise StartupError("give the server command after --, e.g. -- uvicorn app:app")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StartupError(f"--url needs an http(s) URL like http://127.0.0.1:8000/, not {url!r}")
    work = Path(tempfile.mkdtemp(prefix="perfsleuth-startup-"))
    probe_dir, events = work / "probe", work / "events"
    probe_dir.mkdir()
    events.mkdir()
    (probe_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(path=str(PROBE_FILE)))
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(probe_dir), *[p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    child_env["PERFSLEUTH_STARTUP_DIR"] = str(events)
    child_env.pop("PYTHONPROFILEIMPORTTIME", None)
    data = data_dir or str(work / "data")
    log_path = work / "server.log"
    launcher = [sys.executable, "-m", "perfsleuth.agent.launch", "--data", data, "--", *cmd]
    with open(log_path, "wb") as log:
        t0 = time.time_ns()
        try:
            proc = subprocess.Popen(
                launcher, cwd=cwd, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise StartupError(f"cannot start {cmd[0]}: {e}") from e
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise StartupError(
                    f"the command exited with status {proc.returncode} before answering:\n{tail}"
                )
            if time.monotonic() > deadline:
                raise StartupError(f"{url} did not answer within {timeout:g} s")
            sent = time.time_ns()
            try:
                first_ms = _get(url, timeout=max(1.0, deadline - time.monotonic()))
            except OSError:
                time.sleep(0.005)
                continue
            answered = time.time_ns()
            break
        steady_ms = []
        for _ in range(steady):
            try:
                steady_ms.append(_get(url, timeout=10))
            except OSError:
                break
        _settle(events)
    finally:
        _stop(proc)
    return {
        "command": list(cmd),
        "url": url,
        "t0_ns": t0,
        "first_sent_ns": sent,
        "first_answer_ns": answered,
        "first_ms": first_ms,
        "steady_ms": steady_ms,
        "root_pid": proc.pid,
        "processes": read_events(events),
    }


def _settle(events: Path, quiet_s: float = 0.3, limit_s: float = 5.0) -> None:
    """Wait until the probe's files stop growing for ``quiet_s`` (at most ``limit_s``): the
    other workers may still be starting after the first one answered."""
    deadline = time.monotonic() + limit_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        size = sum(f.stat().st_size for f in events.glob("*.jsonl"))
        if size != last:
            last, since = size, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # workers left behind by a master that exited first
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_events(events_dir: Path) -> dict[int, dict[str, Any]]:
    """Per pid: {header, imports, spans, marks} from the probe's files."""
    out: dict[int, dict[str, Any]] = {}
    for f in sorted(events_dir.glob("*.jsonl")):
        proc: dict[str, Any] = {"header": None, "imports": [], "spans": [], "marks": []}
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by the kill
            kind = rec.get("type")
            if kind == "process":
                proc["header"] = rec
            elif kind in ("import", "span", "mark"):
                proc[kind + "s"].append(rec)
        if proc["header"] is not None:
            out[int(proc["header"]["pid"])] = proc
    return out


# ---------------------------------------------------------------------------------- analysis


def _is_app(file: str | None, header: dict[str, Any], name: str) -> bool:
    packages = {p for p in (header.get("app_packages") or "").split(",") if p}
    if name.split(".", 1)[0] in packages:
        return True
    if not file:
        return False
    file = os.path.abspath(file)
    if any(file.startswith(p.rstrip("/") + "/") for p in header.get("prefixes") or ()):
        return False
    if "site-packages" in file or "dist-packages" in file:
        return False
    cwd = (header.get("cwd") or "").rstrip("/") + "/"
    return file.startswith(cwd)


def import_tree(proc: dict[str, Any], *, main_only: bool = True) -> list[dict[str, Any]]:
    """The imports of one process as a tree (nesting by time on each thread): nodes
    {name, self_ms, cum_ms, app, start_ns, children}, children ranked by cum_ms."""
    header = proc["header"]
    recs = [r for r in proc["imports"] if r.get("main") or not main_only]
    recs.sort(key=lambda r: (r["start"], -r["end"]))
    roots: list[dict[str, Any]] = []
    stack: list[dict[str, Any]] = []
    for r in recs:
        node = {
            "name": r["name"],
            "self_ms": r["self"] / 1e6,
            "cum_ms": (r["end"] - r["start"]) / 1e6,
            "app": _is_app(r.get("file"), header, r["name"]),
            "start_ns": r["start"],
            "end_ns": r["end"],
            "children": [],
        }
        while stack and stack[-1]["end_ns"] < r["end"]:
            stack.pop()
        (stack[-1]["children"] if stack else roots).append(node)
        stack.append(node)

    def rank(nodes: list[dict[str, Any]]) -> None:
        nodes.sort(key=lambda n: -n["cum_ms"])
        for n in nodes:
            rank(n["children"])

    rank(roots)
    return roots


def _flat(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for n in nodes:
        out.append(n)
        out.extend(_flat(n["children"]))
    return out


def _serving_pid(raw: dict[str, Any]) -> int:
    """The process that answered: the worker that finished loading the app (or its server
    start) first, else the launched process."""
    root = raw["root_pid"]
    best: tuple[int, int] | None = None
    for pid, proc in raw["processes"].items():
        if pid == root:
            continue
        ends = [s["end"] for s in proc["spans"] if s["phase"] in ("app", "server")]
        if ends and (best is None or min(ends) < best[0]):
            best = (min(ends), pid)
    return best[1] if best else root


def analyze(raw: dict[str, Any]) -> dict[str, Any]:
    procs: dict[int, dict[str, Any]] = {int(k): v for k, v in raw["processes"].items()}
    raw = {**raw, "processes": procs}
    t0, sent, answered = raw["t0_ns"], raw["first_sent_ns"], raw["first_answer_ns"]
    root = raw["root_pid"]
    if root not in procs:
        raise StartupError(
            "the probe did not run in the launched process (is the command a Python program?)"
        )
    serving = _serving_pid(raw)
    switch = procs[serving]["header"]["probe_ns"] if serving != root else answered
    if serving != root and procs[serving]["header"].get("kind") == "exec":
        # a spawned interpreter: it started before its probe ran
        switch = procs[serving]["header"].get("proc_start_ns") or switch
        switch = max(t0, min(switch, procs[serving]["header"]["probe_ns"]))

    # (start, end, phase, label) of the path's spans, each within its process's part of the path
    # A forked worker inherits its master's open spans (spawn_worker): only its own count.
    spans = {
        pid: [
            sp
            for sp in proc["spans"]
            if sp.get("main", True)
            and (proc["header"].get("kind") != "fork" or sp["start"] >= proc["header"]["probe_ns"])
        ]
        for pid, proc in procs.items()
    }
    # The server can accept the first connection before it can answer it (gunicorn's master
    # binds, a worker then loads the app): the first request is what came after the last
    # start-up step of the process that answered.
    ready = max(
        (sp["end"] for sp in spans[serving] if sp["phase"] != "worker" and sp["end"] <= answered),
        default=sent,
    )
    first_from = max(sent, ready)
    if serving == root:
        path = [(root, t0, answered + 1, "server start")]
    else:
        path = [(root, t0, switch, "server start"), (serving, switch, answered + 1, "worker boot")]
    bounds: set[int] = {t0, first_from, answered}
    intervals: list[tuple[int, int, str, str, int]] = []
    for pid, lo, hi, default in path:
        proc = procs[pid]
        header = proc["header"]
        if header.get("kind") == "exec":
            intervals.append((lo, max(lo, header["probe_ns"]), "interpreter start", "", pid))
        for imp in proc["imports"]:
            if imp.get("main") and imp["depth"] == 0:
                intervals.append((imp["start"], imp["end"], "imports", imp["name"], pid))
        for sp in spans[pid]:
            phase = _SPAN_PHASE.get(sp["phase"], default)
            intervals.append((sp["start"], sp["end"], phase, sp["name"], pid))
        bounds.update((lo, min(hi, answered)))
    for s, e, *_ in intervals:
        bounds.update((s, e))
    cuts = sorted(b for b in bounds if t0 <= b <= answered)
    phase_ns: dict[str, int] = dict.fromkeys(PHASES, 0)
    contributors: dict[str, dict[str, int]] = {p: {} for p in PHASES}
    for lo, hi in itertools.pairwise(cuts):
        if hi <= lo:
            continue
        pid, default = next(((p, d) for p, a, b, d in path if a <= lo < b), path[-1][::3])
        if lo >= first_from:
            phase, label = "first request", ""
        else:
            active = [iv for iv in intervals if iv[4] == pid and iv[0] <= lo and iv[1] >= hi]
            if active:
                _, _, phase, label, _ = max(active, key=lambda iv: (iv[0], -iv[1]))
            else:
                phase, label = default, ""
        phase_ns[phase] += hi - lo
        if label:
            contributors[phase][label] = contributors[phase].get(label, 0) + hi - lo
    total_ns = answered - t0
    phases = [
        {
            "phase": p,
            "ms": round(phase_ns[p] / 1e6, 3),
            "share": round(phase_ns[p] / total_ns, 4) if total_ns else 0.0,
            "top": [
                {"name": k, "ms": round(v / 1e6, 3)}
                for k, v in sorted(contributors[p].items(), key=lambda kv: -kv[1])[:5]
            ],
        }
        for p in PHASES
    ]

    path_pids = [p for p, *_ in path]
    trees = {pid: import_tree(procs[pid]) for pid in path_pids}
    # the path's imports, each process's own part (a forked worker inherits what its
    # master imported; only what it imports itself is in its tree)
    roots = [n for pid in path_pids for n in trees[pid]]
    roots.sort(key=lambda n: -n["cum_ms"])
    flat = _flat(roots)
    slowest = sorted(flat, key=lambda n: -n["self_ms"])[:20]
    # imported while the first request ran, on any thread of the process that answered it
    lazy = [
        r["name"]
        for r in sorted(procs[serving]["imports"], key=lambda r: r["start"])
        if first_from <= r["start"] <= answered and r["depth"] == 0
    ]
    steady = raw["steady_ms"]
    steady_p50 = statistics.median(steady) if steady else None
    report: dict[str, Any] = {
        "command": raw["command"],
        "url": raw["url"],
        "total_ms": round(total_ns / 1e6, 3),
        "phases": phases,
        "phases_sum_ms": round(sum(phase_ns.values()) / 1e6, 3),
        "serving_pid": serving,
        "root_pid": root,
        "processes": [
            {
                "pid": pid,
                "ppid": p["header"]["ppid"],
                "kind": p["header"]["kind"],
                "argv": p["header"]["argv"][:8],
                "on_path": pid in path_pids,
                "spans": [
                    {
                        "name": s["name"],
                        "phase": _SPAN_PHASE.get(s["phase"], s["phase"]),
                        "start_ms": round((s["start"] - t0) / 1e6, 3),
                        "ms": round((s["end"] - s["start"]) / 1e6, 3),
                    }
                    for s in sorted(spans[pid], key=lambda s: s["start"])
                ],
            }
            for pid, p in sorted(procs.items())
        ],
        "imports": {
            "tree": [_strip(n) for n in roots[:40]],
            "slowest": [
                {
                    "name": n["name"],
                    "self_ms": round(n["self_ms"], 3),
                    "cum_ms": round(n["cum_ms"], 3),
                    "app": n["app"],
                }
                for n in slowest
            ],
            "count": len(flat),
            "total_ms": round(sum(n["cum_ms"] for n in roots), 3),
        },
        "first_request": {
            "ms": round((answered - first_from) / 1e6, 3),
            "waited_ms": round((first_from - sent) / 1e6, 3),
            "steady_p50_ms": round(steady_p50, 3) if steady_p50 is not None else None,
            "ratio": round((answered - first_from) / 1e6 / steady_p50, 2) if steady_p50 else None,
            "lazy_imports": lazy[:20],
        },
    }
    report["notes"] = _notes(report, procs, root, serving)
    return report


def _strip(node: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    return {
        "name": node["name"],
        "self_ms": round(node["self_ms"], 3),
        "cum_ms": round(node["cum_ms"], 3),
        "app": node["app"],
        "children": [_strip(c, depth + 1) for c in node["children"][:12]] if depth < 6 else [],
    }


def _notes(
    report: dict[str, Any], procs: dict[int, dict[str, Any]], root: int, serving: int
) -> list[str]:
    """What ran one after another that could overlap or be deferred."""
    notes = []
    by = {p["phase"]: p for p in report["phases"]}
    total = report["total_ms"] or 1.0
    imports = by["imports"]
    if imports["share"] >= 0.2:
        libs = ", ".join(f"{t['name']} ({t['ms']:.0f} ms)" for t in imports["top"][:3])
        notes.append(
            f"imports took {imports['ms']:.0f} ms ({imports['ms'] / total:.0%}) one after "
            f"another before the first answer; the largest: {libs}. Modules only some "
            "endpoints need can be imported inside them (deferred)."
        )
    # per worker (a process other than the launched one), its longest app-loading span
    loads: dict[int, float] = {}
    for pid, p in procs.items():
        if pid == root:
            continue
        for s in p["spans"]:
            if s["phase"] == "app" and s["start"] >= p["header"]["probe_ns"]:
                loads[pid] = max(loads.get(pid, 0.0), (s["end"] - s["start"]) / 1e6)
    if len(loads) > 1:
        each = sorted(loads.values())
        forked = all(procs[pid]["header"].get("kind") == "fork" for pid in loads)
        how = (
            "loading it once before forking (gunicorn --preload) does it once, at the cost of "
            "code reloads"
            if forked
            else "each is a new interpreter repeating every import; a pre-fork server that "
            "loads the app before forking (gunicorn --preload) does it once"
        )
        notes.append(
            f"{len(loads)} workers each loaded the app after starting ({each[0]:.0f}-"
            f"{each[-1]:.0f} ms each, in parallel, competing for CPU); {how}."
        )
    life = by["lifespan startup"]
    if life["ms"] >= 0.05 * total:
        notes.append(
            f"lifespan startup took {life['ms']:.0f} ms before the server listened: independent "
            "start-up steps in it can run concurrently (asyncio.gather) or after it serves."
        )
    fr = report["first_request"]
    if fr["ratio"] and fr["ratio"] >= 2:
        lazy = ", ".join(fr["lazy_imports"][:5]) or "none recorded"
        notes.append(
            f"the first request took {fr['ms']:.1f} ms, {fr['ratio']:.1f}x the steady "
            f"{fr['steady_p50_ms']:.1f} ms (cold caches; modules it imported: {lazy}); a "
            "warm-up request before taking traffic hides it."
        )
    return notes


# ---------------------------------------------------------------------------------- compare


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per phase and in total: before and after ms and the change (after minus before)."""
    b = {p["phase"]: p["ms"] for p in before.get("phases") or ()}
    a = {p["phase"]: p["ms"] for p in after.get("phases") or ()}
    rows = [
        {"phase": p, "before_ms": b.get(p, 0.0), "after_ms": a.get(p, 0.0),
         "change_ms": round(a.get(p, 0.0) - b.get(p, 0.0), 3)}
        for p in PHASES
    ]  # fmt: skip
    tb, ta = float(before.get("total_ms") or 0), float(after.get("total_ms") or 0)
    return {
        "phases": rows,
        "total": {
            "before_ms": tb,
            "after_ms": ta,
            "change_ms": round(ta - tb, 3),
            "change": round((ta - tb) / tb, 4) if tb else None,
        },
    }


# ---------------------------------------------------------------------------------- saved runs

RUNS_DIR = os.path.join("runs", "startup")


def save_run(data_dir: str, report: dict[str, Any]) -> str:
    """Keep a report in ``<data>/runs/startup/<UTC time>.json`` (for the UI and --compare);
    its name."""
    folder = os.path.join(data_dir, RUNS_DIR)
    os.makedirs(folder, exist_ok=True)
    name = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    n = 0
    while os.path.exists(os.path.join(folder, f"{name}{f'-{n}' if n else ''}.json")):
        n += 1
    name += f"-{n}" if n else ""
    report = {**report, "name": name}
    with open(os.path.join(folder, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)
    return name


def list_runs(data_dir: str, runs_dir: str = RUNS_DIR) -> list[dict[str, Any]]:
    """The saved reports, newest first: {name, report}."""
    folder = Path(data_dir) / runs_dir
    out = []
    for f in sorted(folder.glob("*.json"), reverse=True):
        try:
            out.append({"name": f.stem, "report": json.loads(f.read_text(encoding="utf-8"))})
        except (OSError, ValueError):
            continue
    return out


def read_run(data_dir: str, name: str, runs_dir: str = RUNS_DIR) -> dict[str, Any] | None:
    """A saved report by name (None when there is none; names are file stems only)."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    path = Path(data_dir) / runs_dir / f"{name}.json"
    try:
        report: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report
