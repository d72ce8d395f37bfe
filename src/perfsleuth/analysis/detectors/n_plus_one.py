"""n_plus_one: one statement issued again and again from a loop in one request.

Per request, calls are grouped by (kind, fingerprint, call site); a group of ``min_repeats``
or more is one occurrence. Occurrences are then rolled up per endpoint, kept when they happen
in a meaningful part of the endpoint's traffic and cost real time (or repeat so often that the
count alone is the problem), and the looping
application frame is found in the source (see :mod:`perfsleuth.analysis.loops`): the call site
the agent records is the innermost application frame, often a helper called from the loop.
"""

from __future__ import annotations

from typing import Any

from perfsleuth.analysis import frames, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, file_key, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "n_plus_one"

_SQL = """
WITH cand AS (     -- statements issued more often than once per request somewhere (cheap:
                   -- approximate distinct requests; see the ratio in detect())
    SELECT endpoint, kind, fingerprint_id, coalesce(site_id, -1) AS site_key
    FROM c
    WHERE fingerprint_id IS NOT NULL AND list_contains(?, kind)
    GROUP BY ALL
    HAVING count(*) >= ? AND count(*) >= ? * approx_count_distinct(trace_id)
),
pat AS (           -- the candidates' calls, each with the start of the next call (calls are
                   -- numbered in the order they started)
    SELECT p.endpoint, p.kind, p.fingerprint_id, p.site_id, p.site_key, p.trace_id, p.seq,
        p.duration_ms, p.ts, p.stack_id, nx.offset_ms - p.offset_ms AS slot
    FROM (SELECT *, coalesce(site_id, -1) AS site_key FROM c) p
        SEMI JOIN cand USING (endpoint, kind, fingerprint_id, site_key)
        LEFT JOIN (SELECT trace_id, seq, offset_ms FROM c) nx
            ON nx.trace_id = p.trace_id AND nx.seq = p.seq + 1
),
per AS (           -- one row per request x call kind x statement x call site
    SELECT endpoint, kind, fingerprint_id, any_value(site_id) AS site_id, trace_id,
        count(*) AS n, sum(duration_ms) AS ms, min(ts) AS ts,
        any_value(stack_id) AS stack_id,    -- later calls of a site may carry no stack
        -- What the loop costs: each of its calls with the work that follows it up to the
        -- next call of any statement (the ORM's and the driver's work around the query, the
        -- rest of the iteration), the last one without what follows the loop; less one of
        -- them (what one batched query would take). Other statements' calls in the loop get
        -- their own share, so two N+1s in one loop do not both count the whole loop. Never
        -- less than the calls' own time beyond the first (calls that overlap in time).
        greatest(
            coalesce(sum(slot), 0) - arg_max(coalesce(slot, 0), seq)
                + arg_max(coalesce(duration_ms, 0), seq) - coalesce(median(slot), 0),
            sum(duration_ms) - sum(duration_ms) / count(*)
        ) AS cost_ms
    FROM pat
    GROUP BY endpoint, kind, fingerprint_id, site_key, trace_id
    HAVING count(*) >= ?
),
hit AS (SELECT per.*, r.duration_ms AS req_ms FROM per JOIN r USING (trace_id)),
ep AS (SELECT endpoint, count(*) AS requests, sum(duration_ms) AS total_ms FROM r GROUP BY 1)
SELECT hit.endpoint, hit.kind, hit.fingerprint_id, any_value(hit.site_id) AS site_id,
    count(*) AS requests_hit, median(n) AS typical, max(n) AS max_n, sum(n) AS calls,
    sum(ms) AS ms, sum(ms - ms / n) AS excess_ms, sum(req_ms) AS req_ms,
    sum(cost_ms) AS cost_ms, median(cost_ms) AS cost_p50, median(req_ms) AS req_p50,
    -- the stack of the worst request (a helper's site can be reached from several loops)
    max_by(stack_id, (n, stack_id)) FILTER (WHERE stack_id IS NOT NULL) AS stack_id,
    min(ts) AS first_ts, max(ts) AS last_ts,
    max_by(trace_id, (n, trace_id), 3) AS examples,
    any_value(ep.requests) AS ep_requests, any_value(ep.total_ms) AS ep_total_ms
FROM hit JOIN ep USING (endpoint)
GROUP BY hit.endpoint, hit.kind, hit.fingerprint_id, coalesce(hit.site_id, -1)
HAVING count(*) >= ? AND count(*) >= ? * any_value(ep.requests)
    AND (sum(cost_ms) / count(*) >= ? OR sum(cost_ms) >= ? * sum(req_ms) OR median(n) >= ?)
"""

# Every stack the calls of the reported patterns carry (a few dozen at most): where they come
# from, when they part ways. Apart from _SQL: only the reported patterns need them.
_STACKS = """
SELECT endpoint, kind, fingerprint_id, coalesce(site_id, -1) AS site_key,
    list(DISTINCT stack_id ORDER BY stack_id)[:64] AS stack_ids
FROM c
WHERE list_contains(?, fingerprint_id) AND stack_id IS NOT NULL
GROUP BY ALL
"""

_SUGGEST = {
    "db": (
        "Load them in one query before the loop (a JOIN or WHERE ... IN (...)), or prefetch "
        "the relation in the ORM (select_related / prefetch_related / selectinload)."
    ),
    "http": (
        "Fetch them in one batch request if the API has one, or concurrently, or cache the "
        "responses; do not call the API once per item."
    ),
    "cache": ("Read the keys in one round trip (MGET / get_many / a pipeline) before the loop."),
}


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    kinds = list(ctx.t(KIND, "kinds"))
    repeats = int(ctx.t(KIND, "min_repeats"))
    share = float(ctx.t(KIND, "min_request_share"))
    # A statement of which share s of the requests issue k or more calls (the others at
    # least one) averages at least 1 + s * (k - 1) calls per request that has it; 0.9 leaves
    # room for the error of the approximate distinct count.
    ratio = 0.9 * (1.0 + share * max(repeats - 1, 0))
    rows = ctx.query(
        _SQL,
        [
            kinds,
            repeats,
            ratio,
            repeats,
            int(ctx.t(KIND, "min_requests")),
            share,
            float(ctx.t(KIND, "min_ms_per_request")),
            float(ctx.t(KIND, "min_time_share")),
            int(ctx.t(KIND, "min_repeats_any_cost")),
        ],
    )
    if not rows:
        return []
    seen_by = {
        (s["endpoint"], s["kind"], s["fingerprint_id"], s["site_key"]): s["stack_ids"]
        for s in ctx.query(_STACKS, [sorted({r["fingerprint_id"] for r in rows})])
    }
    for r in rows:
        key = (
            r["endpoint"],
            r["kind"],
            r["fingerprint_id"],
            -1 if r["site_id"] is None else r["site_id"],
        )
        r["stack_ids"] = seen_by.get(key) or []
    stacks = frames.stacks(ctx.store, (i for r in rows for i in [r["stack_id"], *r["stack_ids"]]))
    sites = frames.locations(ctx.store, (r["site_id"] for r in rows))
    fps = ctx.fingerprints({r["fingerprint_id"] for r in rows})
    out = []
    for r in rows:
        site = sites.get(r["site_id"])
        stack = stacks.get(r["stack_id"], [])
        loop, found = frames.looping_frame(stack, site)
        if r["kind"] == "cache" and not found:
            continue  # cache reads in a row without a loop in sight: not worth a finding
        # A helper reached from several loops: every loop's line. Without a loop in sight,
        # the lines of the caller's code where the calls part ways.
        seen = [stacks[i] for i in r["stack_ids"] if i in stacks]
        paths = [frames.app_frames(s, site) for s in seen]
        lines: list[frames.Frame] = []
        how: str | None = None
        if found:
            loops_seen = {
                (f.file, f.line): f for f in (frames.looping_frame(s, site)[0] for s in seen) if f
            }
            if len(loops_seen) > 1:
                lines, how = (
                    sorted(loops_seen.values(), key=lambda f: (f.file or "", f.line or 0)),
                    "stacks",
                )
        else:
            lines = frames.parting_frames(paths)
            how = "stacks" if lines else None
            if not lines and paths:
                lines = frames.caller_lines(paths[0])
                how = "source" if lines else None
        tpl = frames.template_context(stack, site)
        out.append(
            _finding(ctx, r, fps.get(r["fingerprint_id"]), loop, found, site, tpl, lines, how)
        )
    return out


def _finding(
    ctx: Context,
    r: dict[str, Any],
    fp: str | None,
    loop: frames.Frame | None,
    found: bool,
    site: frames.Frame | None,
    tpl: dict[str, Any] | None,
    lines: list[frames.Frame],
    how: str | None,
) -> Finding:
    typical = float(r["typical"])
    callsite = loop.site() if loop is not None else None
    share_req = r["requests_hit"] / max(r["ep_requests"], 1)
    cost = float(r["cost_ms"] or 0.0)
    share_time = cost / r["ep_total_ms"] if r["ep_total_ms"] else 0.0
    per_request = cost / max(r["requests_hit"], 1)
    noun = {"db": "query", "http": "HTTP call", "cache": "cache call"}.get(r["kind"], "call")
    in_template = loop is not None and frames.is_template(loop)
    if in_template and tpl is not None and len(lines) > 1:
        # one statement from several lines of a template loop: each line, then the loop
        where = f"the template's {frames.lines_text(lines)}"
        if tpl.get("loop"):
            loop_site = tpl["loop"]
            where += " in " + frames.label(
                loop_site["file"], loop_site["line"], loop_site["function"]
            )
    elif in_template and tpl is not None:
        where = f"the template's {frames.template_text(tpl)}"
    elif len(lines) > 1:
        where = "the loops in " if found else ""
        where += frames.lines_text(lines)
    else:
        where = f"the loop in {text.where(callsite)}" if found else f"{text.where(callsite)}"
    if tpl is not None and not in_template:
        # a Python loop (or none) under a template expression: name the template too
        where += f" (rendering the template's {frames.template_text(tpl)})"
    title = (
        f"{r['endpoint']} repeats the {noun} `{text.statement(fp, 70)}` "
        f"{text.count(typical)} times per request (up to {text.count(r['max_n'])}) from {where}, "
        f"in {text.pct(share_req)} of its requests: the loop takes {text.ms(per_request)} per "
        f"request with the work around each call ({text.ms(r['ms'] / max(r['requests_hit'], 1))} "
        f"in the calls themselves), {text.pct(share_time)} of the endpoint's time."
    )
    key = (
        r["kind"],
        fp,
        file_key(callsite["file"] if callsite else None),
        callsite["function"] if callsite else None,
    )
    return Finding(
        id=stable_id(KIND, r["endpoint"], key),
        kind=KIND,
        endpoint=r["endpoint"],
        title=title,
        impact_ms_per_min=ctx.per_min(cost),
        callsite=callsite,
        fingerprint=fp,
        count_per_request=typical,
        example_trace_ids=list(r["examples"] or []),
        first_seen=iso(r["first_ts"]),
        last_seen=iso(r["last_ts"]),
        suggestion=_SUGGEST.get(r["kind"], _SUGGEST["db"]),
        evidence={
            "call_kind": r["kind"],
            "loop_found_in_source": found,
            "call_site": site.site() if site is not None else None,
            "requests_with_pattern": r["requests_hit"],
            "endpoint_requests": r["ep_requests"],
            "request_share": share_req,
            "typical_count": typical,
            "max_count": r["max_n"],
            "calls": r["calls"],
            "ms": r["ms"],
            "ms_beyond_first": r["excess_ms"],
            # The loop's cost: first to last call, less one call (see _SQL)
            "loop_ms": cost,
            "loop_ms_per_request": per_request,
            "loop_ms_per_request_median": r["cost_p50"],
            "request_ms_median": r["req_p50"],
            "share_of_endpoint_time": share_time,
            "share_of_affected_requests_time": cost / r["req_ms"] if r["req_ms"] else None,
            "template": tpl,
            "call_lines": [f.site() for f in lines] or None,
            "call_lines_from": how,
        },
    )
