"""slow_request_hotspot: the application line where an endpoint's slow requests spend their
time, from the agent's stack samples (requests running longer than PERFSLEUTH_SAMPLE_AFTER_MS).

Each sample is attributed to its innermost application frame (the app's own line that led to
whatever library code was running); the finding is the line holding the largest share of the
endpoint's samples, when that share is high enough to be "the" hotspot.

The finding says what the line's samples were doing (agent.sampler's states): computing (on
the CPU, or runnable and waiting for a CPU on a busy machine), waiting for the GIL, or waiting
(I/O, a lock, a sleep, an await), with the advice that fits (analysis.profile.verdict).

Time other detectors already explain is left out: samples taken inside a recorded DB / HTTP /
cache call (state ``call``), samples at a recorded call site of the endpoint (within a few
lines: a statement spans lines, and fetching its rows happens right after it), and the samples
of requests that blocked the event loop (event_loop_blocker reports those, with their lines).
Samples inside Python's import system are start-up work (a lazy import on the first requests
of a process), not the endpoint's: they count neither way.

A line whose samples mostly waited for the GIL is no hotspot when the slow requests hardly ran
on the CPU (``max_bystander_cpu`` of their time, from ``requests.cpu_ms``): the request stood
there while another thread of the process computed, and that thread's line is the finding (a
clean endpoint beside a CPU-bound one on a busy machine was blamed at its ``with`` statement).
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from perfsleuth.analysis import frames, profile, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, file_key, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "slow_request_hotspot"

_SQL = f"""
SELECT {profile.ENDPOINT_OF_SAMPLE} AS endpoint, s.stack_id, s.state, count(*) AS n,
    min(s.ts) AS first_ts, max(s.ts) AS last_ts
FROM samples s LEFT JOIN requests r USING (trace_id)
WHERE (? IS NULL OR s.ts >= ?) AND (? IS NULL OR {profile.ENDPOINT_OF_SAMPLE} = ?)
    AND s.trace_id NOT IN (SELECT trace_id FROM blockers WHERE trace_id IS NOT NULL)
GROUP BY ALL
"""

_REQS = f"""
SELECT {profile.ENDPOINT_OF_SAMPLE} AS endpoint, s.trace_id, count(*) AS n,
    any_value(r.duration_ms) AS duration_ms, any_value(r.cpu_ms) AS cpu_ms
FROM samples s LEFT JOIN requests r USING (trace_id)
WHERE (? IS NULL OR s.ts >= ?) AND (? IS NULL OR {profile.ENDPOINT_OF_SAMPLE} = ?)
    AND s.trace_id NOT IN (SELECT trace_id FROM blockers WHERE trace_id IS NOT NULL)
GROUP BY ALL
"""


def _importing(f: frames.Frame) -> bool:
    return (f.file or "").startswith("<frozen importlib")


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    scope = [ctx.cutoff, ctx.cutoff, ctx.endpoint, ctx.endpoint]
    rows = ctx.store.query(_SQL, scope)
    if not rows:
        return []
    min_share = float(ctx.t(KIND, "min_share"))
    min_samples = int(ctx.t(KIND, "min_samples"))
    min_requests = int(ctx.t(KIND, "min_requests"))
    max_bystander_cpu = float(ctx.t(KIND, "max_bystander_cpu"))
    stacks = frames.stacks(ctx.store, (r["stack_id"] for r in rows))
    per_ep: dict[str, Counter[frames.Frame]] = {}
    states: dict[tuple[str, frames.Frame], Counter[str]] = {}
    totals: Counter[str] = Counter()
    seen: dict[str, tuple[datetime, datetime]] = {}
    for r in rows:
        ep = r["endpoint"]
        if any(_importing(f) for f in stacks.get(r["stack_id"], ())):
            continue
        totals[ep] += r["n"]
        first, last = seen.get(ep, (r["first_ts"], r["last_ts"]))
        seen[ep] = (min(first, r["first_ts"]), max(last, r["last_ts"]))
        app = [f for f in stacks.get(r["stack_id"], []) if f.app]
        if not app or r["state"] == "call":
            continue
        per_ep.setdefault(ep, Counter())[app[-1]] += r["n"]
        states.setdefault((ep, app[-1]), Counter())[r["state"] or "?"] += r["n"]
    near_calls = _call_sites(ctx)
    reqs: dict[str, list[dict[str, Any]]] = {}
    for r in ctx.store.query(_REQS, scope):
        reqs.setdefault(r["endpoint"], []).append(r)
    out = []
    for ep, counter in per_ep.items():
        total = totals[ep]
        ep_reqs = reqs.get(ep, [])
        if total < min_samples or len(ep_reqs) < min_requests:
            continue
        sites = near_calls.get(ep, set())
        bystander = _ran_little(ep_reqs, max_bystander_cpu)
        ranked = [
            (f, k)
            for f, k in counter.most_common()
            if not _near(f, sites)
            and not (bystander and profile.verdict(dict(states[(ep, f)])).kind == "gil")
        ]
        if not ranked:
            continue
        hot, n = ranked[0]
        share = n / total
        if share < min_share:
            continue
        slow_ms = sum(float(r["duration_ms"] or 0) for r in ep_reqs)
        v = profile.verdict(dict(states[(ep, hot)]))
        # most samples first; ties by id, so that every engine names the same requests
        ranked_reqs = sorted(ep_reqs, key=lambda r: (-int(r["n"]), str(r["trace_id"])))
        examples = [str(r["trace_id"]) for r in ranked_reqs[:3]]
        first, last = seen[ep]
        where = f"{file_key(hot.file)}:{hot.line}"
        title = (
            f"Slow requests of {ep} spend {text.pct(share)} of their sampled time in "
            f"{hot.function} ({where}): {v.summary()} "
            f"({n:,} of {total:,} samples over {len(ep_reqs):,} slow requests)."
        )
        how = f'perfsleuth profile "{ep}"' + ("" if v.kind == "cpu" else f" --state {v.kind}")
        out.append(
            Finding(
                id=stable_id(KIND, ep, (file_key(hot.file), hot.function, hot.line)),
                kind=KIND,
                endpoint=ep,
                title=title,
                impact_ms_per_min=ctx.per_min(share * slow_ms),
                callsite=hot.site(),
                example_trace_ids=examples,
                first_seen=iso(first),
                last_seen=iso(last),
                suggestion=f"{v.advice} `{how}` shows the flame graph.",
                evidence={
                    "samples": total,
                    "hotspot_samples": n,
                    "share": share,
                    "class": v.kind,
                    "cpu_share": v.shares.get("cpu", 0.0),
                    "starved_share": v.shares.get("starved", 0.0),
                    "gil_share": v.shares.get("gil", 0.0),
                    "wait_share": v.shares.get("wait", 0.0),
                    "slow_requests": len(ep_reqs),
                    "slow_requests_ms": slow_ms,
                },
            )
        )
    return out


def _ran_little(reqs: list[dict[str, Any]], max_cpu: float) -> bool:
    """Whether these requests ran on the CPU for at most ``max_cpu`` of their time (False when
    none measured its CPU time: OTLP spans, an agent before cpu_ms)."""
    timed = [r for r in reqs if r["cpu_ms"] is not None and r["duration_ms"]]
    if not timed:
        return False
    cpu = sum(float(r["cpu_ms"]) for r in timed)
    return cpu <= max_cpu * sum(float(r["duration_ms"]) for r in timed)


SITE_LINES = 3  # a call site "covers" this many lines after it (multi-line statement, fetch)


def _call_sites(ctx: Context) -> dict[str, set[tuple[str | None, str | None, int]]]:
    """endpoint -> (file, function, line) of its recorded call sites."""
    rows = ctx.query("SELECT DISTINCT endpoint, site_id FROM c WHERE site_id IS NOT NULL")
    locs = frames.locations(ctx.store, (r["site_id"] for r in rows))
    out: dict[str, set[tuple[str | None, str | None, int]]] = {}
    for r in rows:
        f = locs.get(r["site_id"])
        if f is not None and f.line is not None:
            out.setdefault(r["endpoint"], set()).add((f.file, f.function, f.line))
    return out


def _near(f: frames.Frame, sites: set[tuple[str | None, str | None, int]]) -> bool:
    if f.line is None:
        return False
    return any((f.file, f.function, f.line - d) in sites for d in range(SITE_LINES + 1))
