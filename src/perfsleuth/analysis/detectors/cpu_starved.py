"""cpu_starved: the service's code is slowed by a lack of CPU, not by itself: its cgroup's CPU
quota throttles it, or its request threads wait in the run queue a large share of the time they
are runnable (a machine with more busy threads than cores).

The figures are the agent's process counters (agent.sampler, shipped as STATS records into
``agent_stats``): the time on the CPU and in the run queue (schedstat) of the threads serving
requests (while any request is in flight on them, short ones too), the cgroup's throttled
periods and time (``cpu.stat``), the CPUs the process may use and the load average. Counters
are cumulative per process: the window's share is the newest value in the window less the
newest before it. Processes on one host share its cgroup, so throttling counts once per host
(the largest of its processes').
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from perfsleuth.analysis import text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "cpu_starved"
SERVICE = "<service>"  # the endpoint of a service-wide finding

COUNTERS = (
    "sched_run_ns",
    "sched_queue_ns",
    "sched_wall_ns",
    "cgroup_periods",
    "cgroup_throttled",
    "cgroup_throttled_us",
)
GAUGES = ("cpus_milli", "load1_milli")

_SQL = f"""
WITH s AS (
    SELECT service, host, pid, name, ts, value FROM agent_stats
    WHERE name IN ({", ".join(f"'{n}'" for n in COUNTERS + GAUGES)})
), inside AS (
    SELECT service, host, pid, name, arg_max(value, ts) AS last, max(value) AS peak,
        min(ts) AS first_ts, max(ts) AS last_ts
    FROM s WHERE ? IS NULL OR ts >= ? GROUP BY ALL
), before AS (
    SELECT service, host, pid, name, arg_max(value, ts) AS last
    FROM s WHERE ? IS NOT NULL AND ts < ? GROUP BY ALL
)
SELECT i.service, i.host, i.pid, i.name, i.last - coalesce(b.last, 0) AS delta, i.peak,
    i.last, i.first_ts, i.last_ts
FROM inside i LEFT JOIN before b USING (service, host, pid, name)
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    rows = ctx.store.query(_SQL, [ctx.cutoff] * 4)
    if not rows:
        return []
    per_svc: dict[str, dict[str, Any]] = {}
    for r in rows:
        svc = per_svc.setdefault(
            r["service"],
            {
                "sums": defaultdict(int),
                "hosts": defaultdict(lambda: defaultdict(int)),
                "cpus": 0.0,
                "load": 0.0,
                "first": r["first_ts"],
                "last": r["last_ts"],
            },
        )
        svc["first"] = min(svc["first"], r["first_ts"])
        svc["last"] = max(svc["last"], r["last_ts"])
        name, delta = r["name"], max(0, int(r["delta"] or 0))
        if name.startswith("sched_"):
            svc["sums"][name] += delta
        elif name.startswith("cgroup_"):
            host = svc["hosts"][r["host"]]
            host[name] = max(host[name], delta)
        elif name == "cpus_milli":
            svc["cpus"] = max(svc["cpus"], (r["last"] or 0) / 1000)
        elif name == "load1_milli":
            svc["load"] = max(svc["load"], (r["peak"] or 0) / 1000)
    min_runnable_ms = float(ctx.t(KIND, "min_runnable_ms"))
    min_queue_share = float(ctx.t(KIND, "min_queue_share"))
    min_throttled_ms = float(ctx.t(KIND, "min_throttled_ms"))
    min_throttled_share = float(ctx.t(KIND, "min_throttled_share"))
    out = []
    for service, svc in sorted(per_svc.items()):
        sums = svc["sums"]
        run_ms = sums["sched_run_ns"] / 1e6
        queue_ms = sums["sched_queue_ns"] / 1e6
        runnable_ms = run_ms + queue_ms
        queue_share = queue_ms / runnable_ms if runnable_ms else 0.0
        periods = sum(h["cgroup_periods"] for h in svc["hosts"].values())
        throttled = sum(h["cgroup_throttled"] for h in svc["hosts"].values())
        throttled_ms = sum(h["cgroup_throttled_us"] for h in svc["hosts"].values()) / 1000
        throttled_share = throttled / periods if periods else 0.0
        queued = runnable_ms >= min_runnable_ms and queue_share >= min_queue_share
        quota = throttled_ms >= min_throttled_ms and throttled_share >= min_throttled_share
        if not (queued or quota):
            continue
        cpus, load = svc["cpus"], svc["load"]
        parts = []
        if queued:
            parts.append(
                f"its request threads waited for a CPU {text.pct(queue_share)} of the time they "
                f"were runnable ({queue_ms / 1000:,.1f} s in the run queue, "
                f"{run_ms / 1000:,.1f} s on the CPU)"
            )
        if quota:
            parts.append(
                f"its cgroup's CPU quota throttled it in {text.pct(throttled_share)} of the "
                f"periods ({throttled:,} of {periods:,}, {throttled_ms / 1000:,.1f} s throttled)"
            )
        graded: dict[str, float] = {}  # what the finding rests on (config.EVIDENCE_FLOORS)
        if queued:
            graded["runnable_ms"] = runnable_ms
        if quota:
            graded["throttled_ms"] = throttled_ms
        load_note = f"; load average {load:.1f} on {cpus:g} CPUs" if cpus else ""
        title = f"{service} is starved of CPU: " + " and ".join(parts) + load_note + "."
        out.append(
            Finding(
                id=stable_id(KIND, SERVICE, service),
                kind=KIND,
                endpoint=SERVICE,
                title=title,
                # Throttled time is run-queue wait too: the larger of the two, not their sum.
                impact_ms_per_min=ctx.per_min(max(queue_ms, throttled_ms)),
                first_seen=iso(svc["first"]),
                last_seen=iso(svc["last"]),
                suggestion=(
                    "Every CPU-bound request takes longer than its code needs: give the service "
                    "more CPU (a larger quota, fewer busy processes or workers per core, a "
                    "bigger machine) before optimising its lines; samples in state 'starved' "
                    "(`perfsleuth profile --state starved`) show what was waiting for a CPU."
                ),
                evidence={
                    "service": service,
                    "run_ms": run_ms,
                    "run_queue_ms": queue_ms,
                    "run_queue_share": queue_share,
                    "cgroup_periods": periods,
                    "cgroup_throttled_periods": throttled,
                    "cgroup_throttled_ms": throttled_ms,
                    "cgroup_throttled_share": throttled_share,
                    "cpus": cpus,
                    "load1": load,
                    **graded,
                },
                example_trace_ids=_most_starved(ctx, service),
            )
        )
    return out


def _most_starved(ctx: Context, service: str, limit: int = 3) -> list[str]:
    """The requests with the most samples that waited for a CPU: what to look at first."""
    rows = ctx.store.query(
        "SELECT trace_id, count(*) AS n FROM samples WHERE service = ? AND state = 'starved'"
        " AND (? IS NULL OR ts >= ?) GROUP BY trace_id ORDER BY n DESC, trace_id LIMIT ?",
        [service, ctx.cutoff, ctx.cutoff, limit],
    )
    return [r["trace_id"] for r in rows]
