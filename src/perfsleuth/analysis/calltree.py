"""The call-site tree ("DB stack trie"): the stacks of all calls of one kind in an endpoint
(or one trace) merged into a weighted trie, frames outermost first.

Every node carries the calls whose stack passes through it and their total time, so a node's
numbers are the sums over its subtree (a node where some calls end, a call site that is also
on the way to deeper ones, keeps the difference as its own). Small branches are folded into
one "(N smaller paths)" node per parent so that the totals still add up, as a treemap needs.

A template frame (the agent adds the template lines being rendered: ``{% for c in checks %}``,
``{{ c.url }}``) is a node like any other, flagged ``template``.

Calls without a stack of their own (the agent keeps one per call site and request) take the
stack of the same site in the same trace. Only application frames are kept unless asked:
the frames of the server and the framework above them are the same for every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from perfsleuth.analysis import frames
from perfsleuth.analysis.config import Config
from perfsleuth.analysis.context import Context
from perfsleuth.store.base import Store

KINDS = ("db", "http", "cache")


class NotFound(LookupError):
    """An unknown trace (or an ambiguous prefix); the message is one sentence."""


@dataclass
class Node:
    name: str
    file: str | None = None
    line: int | None = None
    function: str | None = None
    calls: int = 0
    ms: float = 0.0
    children: dict[Any, Node] = field(default_factory=dict)
    template: bool = False  # a template line (tag or expression), not a Python frame

    def child(self, f: frames.Frame) -> Node:
        key = (f.file, f.line, f.function)
        node = self.children.get(key)
        if node is None:
            node = Node(frames.label(f.file, f.line, f.function), f.file, f.line, f.function)
            node.template = frames.is_template(f)
            self.children[key] = node
        return node

    def ordered(self) -> list[Node]:
        """Children, most time first (then most calls, then name: a stable order)."""
        return sorted(self.children.values(), key=lambda n: (-n.ms, -n.calls, n.name))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "calls": self.calls,
            "ms": round(self.ms, 6),  # ns resolution: sums in another order print the same
            "template": self.template,
            "children": [c.to_dict() for c in self.ordered()],
        }


_SQL = """
WITH x AS (
    SELECT trace_id, site_id, stack_id, count(*) AS n, sum(duration_ms) AS ms
    FROM c WHERE kind = ? {trace}
    GROUP BY ALL
),
filled AS (    -- a call without a stack takes the one of its site in the same trace
    SELECT coalesce(stack_id, max(stack_id) OVER (PARTITION BY trace_id, site_id)) AS stack_id,
        site_id, n, ms
    FROM x
)
SELECT stack_id, site_id, sum(n) AS calls, sum(ms) AS ms FROM filled GROUP BY ALL
ORDER BY stack_id NULLS FIRST, site_id NULLS FIRST
"""


def resolve_trace(store: Store, trace_id: str) -> str:
    prefix = trace_id.strip().lower()
    ids = [
        r["trace_id"]
        for r in store.query(
            "SELECT DISTINCT trace_id FROM requests WHERE starts_with(trace_id, ?) LIMIT 6",
            [prefix],
        )
    ]
    if not prefix or not ids:
        raise NotFound(f"no trace with id '{trace_id}'")
    if len(ids) > 1:
        raise NotFound(f"trace id prefix '{trace_id}' is ambiguous: it matches {len(ids)}+ traces")
    return str(ids[0])


def build(
    store: Store,
    endpoint: str | None = None,
    *,
    kind: str = "db",
    trace_id: str | None = None,
    since: timedelta | None = None,
    app_only: bool = True,
    min_share: float = 0.0,
) -> Node:
    """The merged tree of the stacks of ``kind`` calls in ``endpoint`` (and/or one trace).
    The root is named after the endpoint (or the trace) and holds the totals."""
    if kind not in KINDS:
        raise ValueError(f"unknown call kind {kind!r}; use one of: {', '.join(KINDS)}")
    ctx = Context(store, Config(), since=since, endpoint=endpoint)
    params: list[Any] = [kind]
    trace = ""
    if trace_id is not None:
        trace_id = resolve_trace(store, trace_id)
        trace = "AND trace_id = ?"
        params.append(trace_id)
    rows = ctx.query(_SQL.format(trace=trace), params)
    if trace_id is None:
        root = Node(endpoint or "all endpoints")
    else:
        root = Node(f"{endpoint} (trace {trace_id})" if endpoint else f"trace {trace_id}")
    stacks = frames.stacks(store, (r["stack_id"] for r in rows))
    sites = frames.locations(store, (r["site_id"] for r in rows))
    for r in rows:
        site = sites.get(r["site_id"])
        stack = stacks.get(r["stack_id"], [])
        if app_only:
            path = frames.app_frames(stack, site)
        else:
            path = list(stack)
            if site is not None and (not path or path[-1].id != site.id):
                path.append(site)
        calls, ms = int(r["calls"]), float(r["ms"] or 0.0)
        node = root
        node.calls += calls
        node.ms += ms
        for f in path:
            node = node.child(f)
            node.calls += calls
            node.ms += ms
    if min_share > 0:
        prune(root, min_share, root.calls, root.ms)
    return root


def prune(node: Node, share: float, total_calls: int, total_ms: float) -> None:
    """Fold the children below ``share`` of both the total calls and the total time into one
    "(N smaller paths)" child per parent, keeping the sums intact."""
    small = [
        c
        for c in node.children.values()
        if c.calls < share * total_calls and c.ms < share * total_ms
    ]
    if len(small) > 1 or (small and small[0].children):
        for c in small:
            del node.children[(c.file, c.line, c.function)]
        other = Node(f"({len(small)} smaller path{'s' if len(small) != 1 else ''})")
        other.calls = sum(c.calls for c in small)
        other.ms = sum(c.ms for c in small)
        node.children[("(other)", None, None)] = other
    for c in node.children.values():
        prune(c, share, total_calls, total_ms)
