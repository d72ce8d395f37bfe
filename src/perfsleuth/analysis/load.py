"""``perfsleuth load``: replay traffic against one target or two (A/B) and give a verdict.

Traffic comes from the store's captures (filtered by endpoint and time), a HAR file or a URL
list; only the path and query of each request are kept and sent to the given targets, never to
the hosts they were recorded from. Targets must be loopback addresses unless the caller allows
remote ones.

Pacing is open-loop at a fixed rate (one *tick* per 1/rate s; each tick sends the next request
to every side, so each target receives ``rate`` requests a second) or closed-loop with a fixed
number of workers. The sides of a tick are sent in a random order, interleaved, so that a
noisy machine affects both alike. The first ``warmup`` ticks are sent and not measured. A run
ends after ``requests`` ticks or ``duration`` seconds, whichever comes first.

Every request carries ``X-Perfsleuth-Load: <run id>;<side>``: under the agent it becomes the
tags ``load_run`` and ``load_side`` (``compare --by tag:load_side``).

The verdict per endpoint (b against a) is ``perfsleuth compare``'s (analysis.compare): a
two-sided Mann-Whitney test on the two latency samples, Benjamini-Hochberg across endpoints
(false discovery rate 1 %), ``faster``/``slower`` when significant and p50 or p95 moved by 5 %
or more, else ``same``; ``too_few`` under 20 measured requests on a side.

It is one module because its parts (the traffic sources, the target check, the pacing loop,
the summary) are each small and used only by this run; the statistics it shares live in
analysis.compare.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import random
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

LOAD_HEADER = "X-Perfsleuth-Load"
# Not sent as recorded: the client sets them for the request it sends.
_SKIP = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect",
     "x-perfsleuth-load", "accept-encoding"}
)  # fmt: skip
REDACTED = "[redacted]"
MAX_REQUESTS = 1_000_000
MAX_DURATION_S = 3600.0
MAX_CONCURRENCY = 1000


class LoadError(Exception):
    """A load run cannot start as asked (one sentence for the user)."""


@dataclass(frozen=True)
class Item:
    """One request to send: ``path`` includes the query; ``endpoint`` labels the results."""

    method: str
    path: str
    endpoint: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


@dataclass
class Result:
    side: str
    endpoint: str
    status: int  # 0: no response (connection error, timeout)
    duration_ms: float
    warmup: bool


@dataclass
class Plan:
    targets: dict[str, str]  # side -> base URL
    items: list[Item]
    rate: float | None = None  # ticks a second (each tick: one request to every side)
    concurrency: int | None = None
    requests: int = 1000  # ticks measured (warm-up ticks come on top)
    duration: float = 60.0  # seconds, warm-up included
    warmup: int = 0
    timeout: float = 30.0
    seed: int | None = None
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))


# ---------------------------------------------------------------------------------- sources


def _label(method: str, path: str) -> str:
    return f"{method.upper()} {path.split('?', 1)[0] or '/'}"


def _clean_headers(pairs: Sequence[Sequence[Any]]) -> tuple[tuple[str, str], ...]:
    out = []
    for p in pairs:
        if len(p) != 2:
            continue
        name, value = str(p[0]), str(p[1])
        if name.lower() in _SKIP or name.startswith(":") or value == REDACTED:
            continue
        out.append((name, value))
    return tuple(out)


def _path_of(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def from_captures(rows: Sequence[dict[str, Any]]) -> list[Item]:
    """Items from rows of the store's ``captures`` table (``headers`` as its JSON text or as
    pairs); a truncated body is left out (its request would not be the one recorded)."""
    import base64

    items = []
    for r in rows:
        if r.get("body_truncated"):
            continue
        headers = r.get("headers") or []
        if isinstance(headers, str):
            try:
                headers = json.loads(headers)
            except ValueError:
                headers = []
        method = str(r.get("method") or "GET").upper()
        path = _path_of(str(r.get("url") or "/"))
        items.append(
            Item(
                method=method,
                path=path,
                endpoint=str(r.get("endpoint") or _label(method, path)),
                headers=_clean_headers(headers),
                body=base64.b64decode(r.get("body_b64") or ""),
            )
        )
    return items


def from_har(path: str | Path) -> list[Item]:
    """Items from a HAR file's ``log.entries[].request``."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        entries = doc["log"]["entries"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LoadError(f"cannot read HAR file {path}: {e}") from e
    items = []
    for entry in entries:
        req = entry.get("request") or {}
        method = str(req.get("method") or "GET").upper()
        p = _path_of(str(req.get("url") or "/"))
        hdrs = [(h.get("name", ""), h.get("value", "")) for h in req.get("headers") or ()]
        text = (req.get("postData") or {}).get("text") or ""
        items.append(Item(method, p, _label(method, p), _clean_headers(hdrs), text.encode()))
    return items


def from_urls(path: str | Path) -> list[Item]:
    """Items from a text file: one request a line, ``URL`` or ``METHOD URL`` (a URL may be a
    path); blank lines and lines starting with # are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LoadError(f"cannot read URL list {path}: {e}") from e
    items = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        method, url = (parts[0].upper(), parts[1]) if len(parts) >= 2 else ("GET", parts[0])
        p = _path_of(url)
        items.append(Item(method, p, _label(method, p)))
    return items


# ---------------------------------------------------------------------------------- targets


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_target(url: str, *, allow_remote: bool = False) -> str:
    """The base URL without a trailing slash; LoadError for a bad or (unless allowed) a
    non-loopback one."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadError(f"a target must be an http(s) URL like http://127.0.0.1:8000, not {url!r}")
    if not allow_remote and not _is_loopback(parts.hostname):
        raise LoadError(
            f"{parts.hostname} is not a loopback address: load sends many requests, so a remote "
            "target needs --allow-remote"
        )
    return url.rstrip("/")


# ---------------------------------------------------------------------------------- running


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending sequence (None when empty)."""
    if not sorted_values:
        return None
    k = max(0, math.ceil(q * len(sorted_values)) - 1)
    return float(sorted_values[min(k, len(sorted_values) - 1)])


@dataclass
class Progress:
    """What a progress display shows: ticks done of the planned ones, and per side the
    measured count, p50, p95 and errors so far."""

    done: int
    planned: int
    elapsed_s: float
    sides: dict[str, dict[str, Any]]


def _side_stats(results: list[Result]) -> dict[str, dict[str, Any]]:
    by: dict[str, list[Result]] = {}
    for r in results:
        if not r.warmup:
            by.setdefault(r.side, []).append(r)
    out = {}
    for side, rs in by.items():
        ds = sorted(r.duration_ms for r in rs)
        out[side] = {
            "count": len(rs),
            "p50_ms": percentile(ds, 0.5),
            "p95_ms": percentile(ds, 0.95),
            "errors": sum(1 for r in rs if r.status == 0 or r.status >= 500),
        }
    return out


async def _send(
    client: Any, plan: Plan, side: str, item: Item, warmup: bool, results: list[Result]
) -> None:
    import httpx

    headers = [*item.headers, (LOAD_HEADER, f"{plan.run_id};{side}")]
    t0 = time.perf_counter()
    try:
        resp = await client.request(
            item.method,
            plan.targets[side] + item.path,
            headers=headers,
            content=item.body or None,
        )
        await resp.aread()
        status = resp.status_code
    except httpx.HTTPError:
        status = 0
    results.append(Result(side, item.endpoint, status, (time.perf_counter() - t0) * 1000, warmup))


async def _run(plan: Plan, on_progress: Callable[[Progress], None] | None) -> dict[str, Any]:
    import httpx

    rng = random.Random(plan.seed)
    sides = list(plan.targets)
    total = plan.warmup + plan.requests
    results: list[Result] = []
    limit = plan.concurrency or MAX_CONCURRENCY
    clients = {
        s: httpx.AsyncClient(
            timeout=plan.timeout,
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
            follow_redirects=False,
        )
        for s in sides
    }
    start = time.monotonic()
    deadline = start + plan.duration
    ticks = 0
    measured_start: float | None = None if plan.warmup else start

    async def tick(i: int) -> None:
        item = plan.items[i % len(plan.items)]
        order = sides[:]
        rng.shuffle(order)
        for side in order:  # one after the other: the sides see the same moment
            await _send(clients[side], plan, side, item, i < plan.warmup, results)

    def report() -> None:
        if on_progress is not None:
            on_progress(Progress(ticks, total, time.monotonic() - start, _side_stats(results)))

    try:
        if plan.rate:
            interval = 1.0 / plan.rate
            pending: set[asyncio.Task[None]] = set()
            sem = asyncio.Semaphore(limit)
            last_report = 0.0
            last_sent = start
            while ticks < total:
                due = start + ticks * interval
                now = time.monotonic()
                if due >= deadline:
                    break
                if due > now:
                    await asyncio.sleep(due - now)
                if ticks == plan.warmup and measured_start is None:
                    measured_start = time.monotonic()
                await sem.acquire()

                async def one(i: int = ticks) -> None:
                    try:
                        await tick(i)
                    finally:
                        sem.release()

                t = asyncio.ensure_future(one())
                pending.add(t)
                t.add_done_callback(pending.discard)
                ticks += 1
                last_sent = time.monotonic()
                if time.monotonic() - last_report > 0.25:
                    last_report = time.monotonic()
                    report()
            sent_end = last_sent
            if pending:
                await asyncio.wait(pending, timeout=max(0.1, deadline - time.monotonic()))
                for t in pending:
                    t.cancel()
        else:
            workers = plan.concurrency or 1
            counter = iter(range(total))

            async def worker() -> None:
                nonlocal ticks, measured_start
                for i in counter:
                    if time.monotonic() >= deadline:
                        return
                    if i == plan.warmup and measured_start is None:
                        measured_start = time.monotonic()
                    ticks += 1
                    await tick(i)

            async def reporter() -> None:
                while True:
                    await asyncio.sleep(0.25)
                    report()

            rep = asyncio.ensure_future(reporter())
            await asyncio.gather(*(worker() for _ in range(workers)))
            rep.cancel()
            sent_end = time.monotonic()
    finally:
        for c in clients.values():
            await c.aclose()
    report()
    measured_ticks = max(0, ticks - plan.warmup)
    window = sent_end - measured_start if measured_start is not None else 0.0
    return {
        "results": results,
        "ticks": ticks,
        "measured_ticks": measured_ticks,
        "send_window_s": window,
        "elapsed_s": time.monotonic() - start,
    }


def run(plan: Plan, on_progress: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """Run the plan; the report (see :func:`summarize`)."""
    if not plan.items:
        raise LoadError("nothing to send: the traffic source gave no requests")
    if not plan.targets:
        raise LoadError("give a target: --a URL (and --b URL for an A/B run)")
    if plan.rate is None and plan.concurrency is None:
        raise LoadError("give a pace: --rate N (requests a second) or --concurrency N")
    if plan.rate is not None and not 0 < plan.rate <= 10_000:
        raise LoadError(f"--rate must be between 0 and 10000 a second (got {plan.rate:g})")
    if plan.concurrency is not None and not 0 < plan.concurrency <= MAX_CONCURRENCY:
        raise LoadError(f"--concurrency must be between 1 and {MAX_CONCURRENCY}")
    if not 0 < plan.requests <= MAX_REQUESTS:
        raise LoadError(f"--requests must be between 1 and {MAX_REQUESTS:,}")
    if not 0 < plan.duration <= MAX_DURATION_S:
        raise LoadError(f"--duration must be between 0 and {MAX_DURATION_S:g} s")
    if plan.warmup < 0:
        raise LoadError("--warmup cannot be negative")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raw = asyncio.run(_run(plan, on_progress))
    else:  # called from inside an event loop (a notebook, a browser driver): in a thread
        import threading

        out: dict[str, Any] = {}

        def work() -> None:
            try:
                out["raw"] = asyncio.run(_run(plan, on_progress))
            except BaseException as e:  # re-raised in the caller's thread
                out["error"] = e

        t = threading.Thread(target=work, name="perfsleuth-load")
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        raw = out["raw"]
    return summarize(plan, raw)


# ---------------------------------------------------------------------------------- verdict


def verdicts(
    samples: dict[str, dict[str, list[float]]],
    *,
    alpha: float | None = None,
    min_change: float | None = None,
    min_requests: int | None = None,
) -> list[dict[str, Any]]:
    """Per endpoint (``samples[endpoint][side]``: latencies in ms of sides "a" and "b"), the
    rows of ``perfsleuth compare`` (analysis.compare: quantiles with order-statistic intervals,
    the two-sided Mann-Whitney test, Benjamini-Hochberg q-values across endpoints and its
    verdict rule), slowest first."""
    import numpy as np

    from perfsleuth.analysis import compare as cmp

    def sorted_ms(values: list[float]) -> np.ndarray:
        return np.sort(np.asarray(values, dtype=np.float64))

    rows = cmp.endpoint_rows(
        {ep: (sorted_ms(s.get("a", [])), sorted_ms(s.get("b", []))) for ep, s in samples.items()},
        alpha=cmp.ALPHA if alpha is None else alpha,
        min_change=cmp.MIN_CHANGE if min_change is None else min_change,
        min_requests=cmp.MIN_REQUESTS if min_requests is None else min_requests,
    )
    cmp.sort_rows(rows)
    return rows


def verdict_line(rows: list[dict[str, Any]]) -> str:
    """compare's verdict line: "b is slower on 1 endpoint: GET /orders p95 +38 % (±9 %), ..."."""
    from perfsleuth.analysis import compare as cmp

    return cmp.verdict_line(rows, "b")


def summarize(plan: Plan, raw: dict[str, Any]) -> dict[str, Any]:
    results: list[Result] = raw["results"]
    measured = [r for r in results if not r.warmup]
    sides = list(plan.targets)
    samples: dict[str, dict[str, list[float]]] = {}
    statuses: dict[str, dict[str, int]] = {s: {} for s in sides}
    for r in measured:
        if r.status == 0 or r.status >= 500:
            key = "error" if r.status == 0 else str(r.status)
            statuses[r.side][key] = statuses[r.side].get(key, 0) + 1
            continue
        samples.setdefault(r.endpoint, {}).setdefault(r.side, []).append(r.duration_ms)
    window = raw["send_window_s"]
    # ticks per second between the first and the last measured send
    achieved = (raw["measured_ticks"] - 1) / window if window > 0 else None
    per_side = {}
    for s in sides:
        mine = [r for r in measured if r.side == s]
        ds = sorted(r.duration_ms for r in mine)
        per_side[s] = {
            "target": plan.targets[s],
            "count": len(mine),
            "errors": sum(statuses[s].values()),
            "error_statuses": statuses[s],
            "p50_ms": percentile(ds, 0.5),
            "p95_ms": percentile(ds, 0.95),
        }
    out: dict[str, Any] = {
        "run_id": plan.run_id,
        "header": LOAD_HEADER,
        "mode": "rate" if plan.rate else "concurrency",
        "rate": plan.rate,
        "concurrency": plan.concurrency,
        "warmup": plan.warmup,
        "ticks": raw["ticks"],
        "measured_ticks": raw["measured_ticks"],
        "send_window_s": round(window, 3),
        "achieved_rate": round(achieved, 3) if achieved is not None else None,
        "elapsed_s": round(raw["elapsed_s"], 3),
        "sides": per_side,
    }
    if len(sides) == 2:
        out["endpoints"] = verdicts({ep: {("a" if k == sides[0] else "b"): v for k, v in d.items()}
                                     for ep, d in samples.items()})  # fmt: skip
        out["verdict"] = verdict_line(out["endpoints"])
    else:
        out["endpoints"] = []
        for ep in sorted(samples):
            ds = sorted(samples[ep].get(sides[0], []))
            out["endpoints"].append(
                {"endpoint": ep, "count": len(ds), "p50_ms": percentile(ds, 0.5),
                 "p95_ms": percentile(ds, 0.95)}
            )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------- saved runs

RUNS_DIR = str(Path("runs") / "load")


def save_run(data_dir: str, report: dict[str, Any]) -> str:
    """Keep a report in ``<data>/runs/load/<run id>.json`` (for the UI); its name."""
    folder = Path(data_dir) / RUNS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{report['run_id']}"
    (folder / f"{name}.json").write_text(json.dumps({**report, "name": name}), encoding="utf-8")
    return name
