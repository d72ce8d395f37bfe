"""event_loop_blocker: code that kept an asyncio event loop from running anything else.

The agent's watchdog records every block of PERFSLEUTH_LOOP_BLOCK_MS or more with the loop
thread's most common stack, the request whose code ran and the other requests it delayed.
Blockers are grouped by endpoint and handler: the innermost application frame in an ``async
def`` (read from the source: a coroutine's line that made the synchronous call, the line to
wrap in ``asyncio.to_thread`` or to make ``def``), or, where the source cannot be read or no
coroutine of the application is on the stack, the innermost application frame called from
library code (the function the framework called). Frames of the app above it, such as the
script that started the server, are not where the fix goes. The finding points at the
handler's line, names the deepest application line (where the time went) as evidence and lists
the others, with count, total and longest block, requests delayed, and what the last call
before the block returned (a large result parsed on the loop).
"""

from __future__ import annotations

import ast
import os
from collections import Counter
from functools import lru_cache
from typing import Any

from perfsleuth.analysis import frames, loops, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, file_key, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "event_loop_blocker"

_ENDPOINT = "coalesce(nullif(b.endpoint, ''), r.endpoint, '<event loop>')"
_SQL = f"""
SELECT {_ENDPOINT} AS endpoint, b.stack_id, b.trace_id, b.ts, b.duration_ms, b.delayed,
    b.last_call, b.last_rows, b.last_bytes
FROM blockers b LEFT JOIN requests r USING (trace_id)
WHERE (? IS NULL OR b.ts >= ?) AND (? IS NULL OR {_ENDPOINT} = ?)
"""


def handler_frame(stack: list[frames.Frame]) -> frames.Frame | None:
    """The frame whose line made the call that blocked (``stack`` outermost first): the
    innermost application frame running an ``async def``, else the innermost application
    frame called from library code; None without application frames."""
    entry = None
    for i, f in enumerate(stack):
        if f.app and (i == 0 or not stack[i - 1].app):
            entry = f
    for f in reversed(stack):
        if f.app and in_async_def(f.file, f.line, f.function):
            return f
    return entry


def in_async_def(file: str | None, line: int | None, function: str | None) -> bool:
    """Whether ``line`` of ``file`` is in the body of an ``async def`` named like
    ``function`` (the last part of a qualified name; a comprehension's or lambda's frame is
    not its function's). False when the source cannot be read."""
    path = loops.resolve(file)
    if path is None or line is None or not function:
        return False
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return False
    defs = _function_defs(path, mtime)
    # the innermost function around the line: the latest to start of those containing it
    inner = max((d for d in defs if d[0] <= line <= d[1]), default=None)
    return inner is not None and inner[3] and inner[2] == function.rsplit(".", 1)[-1]


@lru_cache(maxsize=256)
def _function_defs(path: str, mtime_ns: int) -> tuple[tuple[int, int, str, bool], ...]:
    """(first body line, last line, name, async) of every function of a source file."""
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            name = getattr(node, "name", "<lambda>")
            first = node.body[0].lineno if isinstance(node.body, list) else node.lineno
            last = node.end_lineno or node.lineno
            out.append((first, last, name, isinstance(node, ast.AsyncFunctionDef)))
    return tuple(out)


def starting_a_thread(stack: list[frames.Frame]) -> bool:
    """Whether the loop was caught inside ``threading.Thread.start``: waiting for a thread it
    started (a thread pool growing: anyio's workers, an executor's) to be scheduled. That
    takes microseconds unless the machine has no CPU to give it; the block is the machine's
    (cpu_starved reports it), not the endpoint's code, and no line of the app can fix it."""
    return any(
        f.function == "Thread.start" and (f.file or "").endswith("threading.py") for f in stack
    )


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    rows = ctx.store.query(_SQL, [ctx.cutoff, ctx.cutoff, ctx.endpoint, ctx.endpoint])
    if not rows:
        return []
    min_count = int(ctx.t(KIND, "min_count"))
    single_ms = float(ctx.t(KIND, "single_ms"))
    stacks = frames.stacks(ctx.store, (r["stack_id"] for r in rows))
    groups: dict[tuple[str, str | None, str | None], list[dict[str, Any]]] = {}
    leaves: dict[tuple[str, str | None, str | None], Counter[frames.Frame]] = {}
    no_app: list[tuple[tuple[str, str | None, str | None], dict[str, Any]]] = []
    handlers: dict[tuple[str, str | None, str | None], Counter[frames.Frame]] = {}
    for r in rows:
        st = stacks.get(r["stack_id"], [])
        if starting_a_thread(st):
            continue
        app = [f for f in st if f.app]
        f = app[-1] if app else (st[-1] if st else frames.UNKNOWN)
        entry = handler_frame(st) or f
        key = (r["endpoint"], entry.file, entry.function)
        if not app:
            no_app.append((key, r))
            continue
        groups.setdefault(key, []).append(r)
        leaves.setdefault(key, Counter())[f] += 1
        handlers.setdefault(key, Counter())[entry] += 1
    # A block caught with no application frame on the loop, in an endpoint whose own code also
    # blocked, is the tail of that block: the handler returned and the loop is freeing or
    # serialising what it built. It counts with the handler (largest by blocked time), not as
    # a second finding pointing at a library line.
    after_return: Counter[tuple[str, str | None, str | None]] = Counter()
    app_keys = list(groups)
    for key, r in no_app:
        own = [k for k in app_keys if k[0] == key[0]]
        if own:
            key = max(own, key=lambda k: sum(float(x["duration_ms"] or 0) for x in groups[k]))
            after_return[key] += 1
        else:
            st = stacks.get(r["stack_id"], [])
            leaves.setdefault(key, Counter())[st[-1] if st else frames.UNKNOWN] += 1
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        ep = key[0]
        leaf: frames.Frame | None = leaves[key].most_common(1)[0][0]
        if leaf is frames.UNKNOWN:
            leaf = None
        total = sum(float(r["duration_ms"] or 0) for r in rs)
        longest = max(float(r["duration_ms"] or 0) for r in rs)
        if len(rs) < min_count and longest < single_ms:
            continue
        delayed = sum(int(r["delayed"] or 0) for r in rs)
        handler = handlers[key].most_common(1)[0][0] if key in handlers else leaf
        at = handler if handler is not None else leaf
        where = f"{file_key(at.file)}:{at.line}" if at is not None else "an unknown line"
        func = key[2] or (at.function if at is not None else None) or "?"
        deepest = ""
        if leaf is not None and handler is not None and leaf != handler:
            deepest = f", the time going in {frames.label(leaf.file, leaf.line, leaf.function)}"
        big = max(rs, key=lambda r: r["last_bytes"] or r["last_rows"] or 0)
        parsed = ""
        if big["last_rows"] or big["last_bytes"]:
            size = (
                f"{text.size(big['last_bytes'])}"
                if big["last_bytes"]
                else f"{big['last_rows']:,} rows"
            )
            parsed = f" right after `{text.statement(big['last_call'], 50)}` returned {size}"
        tail = (
            f" ({after_return[key]:,} of them after it returned, freeing or sending its result)"
            if after_return[key]
            else ""
        )
        # Blocks reported without a stack (OTLP spans of perfsleuth-node) name no line.
        who = f"{func} ({where})" if at is not None else "Code (no stack was recorded)"
        title = (
            f"{who} blocked the event loop in {ep} {len(rs):,} time(s){tail}, "
            f"{text.ms(total)} in all, up to {text.ms(longest)}{parsed}{deepest}; "
            f"{delayed:,} other in-flight request(s) waited."
        )
        examples = [r["trace_id"] for r in sorted(rs, key=lambda r: -float(r["duration_ms"] or 0))]
        out.append(
            Finding(
                id=stable_id(KIND, ep, (file_key(key[1]), key[2])),
                kind=KIND,
                endpoint=ep,
                title=title,
                impact_ms_per_min=ctx.per_min(total),
                callsite=at.site() if at is not None else None,
                count_per_request=None,
                example_trace_ids=[t for t in examples if t][:3],
                first_seen=iso(min(r["ts"] for r in rs)),
                last_seen=iso(max(r["ts"] for r in rs)),
                suggestion=(
                    "Move this work off the loop (`await asyncio.to_thread(...)` or a process "
                    "pool), make it smaller (fetch fewer rows, stream the parse), or make the "
                    "endpoint sync so the server runs it in a thread. `perfsleuth replay` "
                    "re-sends the request that blocked."
                ),
                evidence={
                    "blocks": len(rs),
                    "blocked_ms": total,
                    "longest_ms": longest,
                    "delayed_requests": delayed,
                    "after_return": after_return[key],
                    "last_call": big["last_call"],
                    "last_rows": big["last_rows"],
                    "last_bytes": big["last_bytes"],
                    "handler": handler.site() if handler is not None else None,
                    "lines": [{**f.site(), "blocks": n} for f, n in leaves[key].most_common(5)],
                },
            )
        )
    return out
