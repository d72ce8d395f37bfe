"""Stack samples of an endpoint's slow requests, merged: top functions, a flame graph tree,
speedscope JSON and an SVG flame graph.

Frames are merged by function (file, function): a flame graph by line is too fragmented to
read; each node keeps the line it was most often on. The outermost frames every sample shares
(the server, the event loop, the framework's middleware) are cut and replaced by one root
named after the endpoint, so the graph starts where requests differ.
"""

from __future__ import annotations

import html
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from perfsleuth.analysis import frames
from perfsleuth.store.base import Store

FrameKey = tuple[str | None, str | None]  # (file, function)

# Samples of a request shipped while it was still running carry no endpoint: take the
# request's when it has finished, else method and path.
ENDPOINT_OF_SAMPLE = "coalesce(nullif(s.endpoint, ''), r.endpoint, s.method || ' ' || s.path)"

# A sample's state (agent.sampler): what its thread did since the previous sample.
STATES: dict[str, str] = {
    "cpu": "on the CPU",
    "starved": "runnable, waiting for a CPU",
    "gil": "waiting for the GIL",
    "wait": "waiting (I/O, a lock, a sleep, an await)",
    "call": "in a recorded DB / HTTP / cache call",
}
# The code computes: on a CPU, or runnable and waiting for one (a busy machine, a CPU quota).
CPU_BOUND = ("cpu", "starved")


@dataclass
class Verdict:
    """What a set of samples says about the code they are in: ``cpu`` (computing: on the CPU
    or starved of it), ``gil`` (waiting for another thread's interpreter lock) or ``wait``
    (blocked), with the shares of each state and the advice that fits."""

    kind: str
    shares: dict[str, float]
    advice: str

    def summary(self) -> str:
        """'60% on the CPU, 35% runnable, waiting for a CPU, 5% waiting (...)'."""
        return ", ".join(
            f"{self.shares[s]:.0%} {name}" for s, name in STATES.items() if self.shares.get(s)
        )


def verdict(states: dict[str, int]) -> Verdict:
    """The class of code whose samples have these states (``call`` samples left out: the
    recorded call explains them)."""
    counted = {s: n for s, n in states.items() if s != "call" and n}
    total = sum(counted.values())
    shares = {s: n / total for s, n in counted.items()} if total else {}
    cpu_bound = sum(shares.get(s, 0.0) for s in CPU_BOUND)
    gil = shares.get("gil", 0.0)
    if total and cpu_bound >= 0.5:
        advice = (
            "The code is CPU-bound: make the work smaller (cache, index, a better algorithm) "
            "or move it off the request."
        )
        if shares.get("starved", 0.0) >= shares.get("cpu", 0.0):
            advice += (
                " Its thread waited for a CPU more than it ran: the machine or the container's "
                "CPU quota is oversubscribed (more busy threads than cores), which stretches "
                "every CPU-bound request."
            )
        return Verdict("cpu", shares, advice)
    if gil and gil + cpu_bound >= 0.5:  # it would have computed, given the lock
        return Verdict(
            "gil",
            shares,
            "The thread waited for the interpreter lock (GIL) while other threads of the "
            "process computed: the process is CPU-bound; run more processes (workers) rather "
            "than threads, or make the other threads' work smaller.",
        )
    return Verdict(
        "wait",
        shares,
        "The time here is spent waiting, not computing: find what it waits on (a lock, a "
        "slow socket, a sleep) and give it a timeout or move it off the request.",
    )


@dataclass
class Node:
    file: str | None
    function: str | None
    value: int = 0  # samples through this node
    self_value: int = 0  # samples ending here
    lines: Counter[int | None] = field(default_factory=Counter)
    children: dict[FrameKey, Node] = field(default_factory=dict)

    @property
    def line(self) -> int | None:
        return self.lines.most_common(1)[0][0] if self.lines else None

    @property
    def name(self) -> str:
        return frames.label(self.file, self.line, self.function)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "value": self.value,
            "self": self.self_value,
            "children": [
                c.to_dict() for c in sorted(self.children.values(), key=lambda n: -n.value)
            ],
        }


@dataclass
class Profile:
    endpoint: str
    requests: int  # requests with samples
    samples: int
    states: dict[str, int]  # samples by state (STATES)
    stacks: list[tuple[list[frames.Frame], int]]  # (frames outermost first, samples)
    # (frames outermost first, samples, state)
    stacks_by_state: list[tuple[list[frames.Frame], int, str]] = field(default_factory=list)

    def trimmed(self) -> list[tuple[list[frames.Frame], int]]:
        """The stacks without the outermost frames they all share."""
        if not self.stacks:
            return []
        keys = [[(f.file, f.function) for f in st] for st, _ in self.stacks]
        common = 0
        shortest = min(len(k) for k in keys)
        while common < shortest - 1 and all(k[common] == keys[0][common] for k in keys):
            common += 1
        return [(st[common:], n) for st, n in self.stacks]

    def tree(self) -> dict[str, Any]:
        """A d3 hierarchy: {name, file, line, function, value, self, children}."""
        return self._root().to_dict() | {"name": self.endpoint}

    def _root(self) -> Node:
        root = Node(None, self.endpoint)
        for st, n in self.trimmed():
            root.value += n
            node = root
            for f in st:
                key = (f.file, f.function)
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = Node(f.file, f.function)
                child.value += n
                child.lines[f.line] += n
                node = child
            node.self_value += n
        return root

    def top(self, n: int = 15) -> list[dict[str, Any]]:
        """Functions by samples ending in them (self) and passing through them (total)."""
        self_c: Counter[FrameKey] = Counter()
        total_c: Counter[FrameKey] = Counter()
        lines: dict[FrameKey, Counter[int | None]] = {}
        for st, k in self.stacks:
            if not st:
                continue
            leaf = st[-1]
            self_c[(leaf.file, leaf.function)] += k
            for key in {(f.file, f.function) for f in st}:
                total_c[key] += k
            for f in st:
                lines.setdefault((f.file, f.function), Counter())[f.line] += k
        out: list[dict[str, Any]] = []
        for key, total in total_c.items():
            file, func = key
            out.append(
                {
                    "function": func,
                    "file": file,
                    "line": lines[key].most_common(1)[0][0],
                    "self": self_c.get(key, 0),
                    "total": total,
                    "self_share": self_c.get(key, 0) / self.samples if self.samples else 0.0,
                    "total_share": total / self.samples if self.samples else 0.0,
                }
            )
        out.sort(key=lambda r: (-r["self"], -r["total"], str(r["function"])))
        return out[:n]

    def hotspot(self) -> tuple[frames.Frame | None, int]:
        """The application line most samples are in (their innermost application frame), and
        how many samples: where the endpoint's own code spends its slow time."""
        c: Counter[frames.Frame] = Counter()
        for st, k in self.stacks:
            app = [f for f in st if f.app]
            if app:
                c[app[-1]] += k
        if not c:
            return None, 0
        f, n = c.most_common(1)[0]
        return f, n

    def verdict(self) -> Verdict:
        return verdict(self.states)

    def hotspot_verdict(self, hot: frames.Frame) -> Verdict:
        """The class of the samples whose innermost application frame is ``hot``."""
        c: Counter[str] = Counter()
        for st, k, state in self.stacks_by_state:
            app = [f for f in st if f.app]
            if app and app[-1] == hot:
                c[state] += k
        return verdict(dict(c))

    def speedscope(self) -> dict[str, Any]:
        """The speedscope file format (https://www.speedscope.app/file-format-schema.json):
        one sampled profile whose weights are sample counts."""
        index: dict[FrameKey, int] = {}
        shared: list[dict[str, Any]] = []
        samples: list[list[int]] = []
        weights: list[int] = []
        for st, n in self.trimmed():
            ids = []
            for f in st:
                key = (f.file, f.function)
                if key not in index:
                    index[key] = len(shared)
                    shared.append({"name": f.function or "?", "file": f.file, "line": f.line})
                ids.append(index[key])
            samples.append(ids)
            weights.append(n)
        return {
            "$schema": "https://www.speedscope.app/file-format-schema.json",
            "name": f"perfsleuth: {self.endpoint}",
            "exporter": "perfsleuth",
            "activeProfileIndex": 0,
            "shared": {"frames": shared},
            "profiles": [
                {
                    "type": "sampled",
                    "name": self.endpoint,
                    "unit": "none",
                    "startValue": 0,
                    "endValue": sum(weights),
                    "samples": samples,
                    "weights": weights,
                }
            ],
        }

    def svg(self, width: int = 1200, row: int = 18) -> str:
        """A static flame graph (root at the bottom, as Brendan Gregg draws them)."""
        root = self._root()
        depth = _depth(root)
        height = (depth + 1) * row + 30
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="monospace" font-size="11">',
            f'<text x="4" y="14">{html.escape(self.endpoint)}: {self.samples} samples of '
            f"{self.requests} slow requests</text>",
        ]
        total = max(root.value, 1)

        def draw(node: Node, x: float, level: int) -> None:
            w = node.value / total * width
            if w < 0.5:
                return
            y = height - (level + 1) * row
            label = self.endpoint if level == 0 else node.name
            share = node.value / total
            hue = 10 + zlib.crc32(str(node.function).encode()) % 40 if level else 200
            parts.append(
                f"<g><title>{html.escape(label)}: {node.value} samples ({share:.1%})</title>"
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
                f'fill="hsl({hue},85%,60%)" rx="2"/>'
            )
            chars = int(w / 7)
            if chars >= 3:
                text = label if len(label) <= chars else label[: chars - 2] + ".."
                parts.append(f'<text x="{x + 3:.1f}" y="{y + row - 5}">{html.escape(text)}</text>')
            parts.append("</g>")
            cx = x
            for c in sorted(node.children.values(), key=lambda n: -n.value):
                draw(c, cx, level + 1)
                cx += c.value / total * width

        draw(root, 0.0, 0)
        parts.append("</svg>")
        return "\n".join(parts)


def _depth(node: Node) -> int:
    return 1 + max((_depth(c) for c in node.children.values()), default=0)


class NoSamples(LookupError):
    """No samples for the question asked; the message says why in one sentence."""


def load(
    store: Store,
    endpoint: str,
    since: timedelta | None = None,
    state: str | None = None,
    trace_id: str | None = None,
) -> Profile:
    """The samples of ``endpoint``'s slow requests (or of one trace), merged."""
    conds = [f"{ENDPOINT_OF_SAMPLE} = ?"]
    params: list[Any] = [endpoint]
    if since is not None:
        conds.append("s.ts >= ?")
        params.append(datetime.now(UTC).replace(tzinfo=None) - since)
    if state is not None:
        conds.append("s.state = ?")
        params.append(state)
    if trace_id is not None:
        conds.append("s.trace_id = ?")
        params.append(trace_id)
    rows = store.query(
        f"""
        SELECT s.stack_id, s.state, count(*) AS n, count(DISTINCT s.trace_id) AS reqs,
            any_value(s.trace_id) AS example
        FROM samples s LEFT JOIN requests r USING (trace_id)
        WHERE {" AND ".join(conds)}
        GROUP BY 1, 2
        """,
        params,
    )
    reqs = store.query(
        f"""SELECT count(DISTINCT s.trace_id) AS n FROM samples s
        LEFT JOIN requests r USING (trace_id) WHERE {" AND ".join(conds)}""",
        params,
    )[0]["n"]
    resolved = frames.stacks(store, (r["stack_id"] for r in rows))
    merged: Counter[int] = Counter()
    states: Counter[str] = Counter()
    by_state: list[tuple[list[frames.Frame], int, str]] = []
    for r in rows:
        if r["stack_id"] is not None:
            merged[r["stack_id"]] += r["n"]
            by_state.append((resolved.get(r["stack_id"], []), r["n"], r["state"] or "?"))
        states[r["state"] or "?"] += r["n"]
    stacks = [(resolved.get(sid, []), n) for sid, n in merged.most_common()]
    return Profile(endpoint, int(reqs or 0), sum(merged.values()), dict(states), stacks, by_state)
