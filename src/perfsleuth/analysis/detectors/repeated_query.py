"""repeated_query: the same read with the same parameters, twice or more in one request, when
the repeats cost a notable share of the endpoint's time or enough per request.

Identical statement (fingerprint) *and* identical bound parameters (``params_hash``): a
request-scoped cache would remove every repeat. Statements without parameters are left out,
as their fingerprint hides literals that may differ; writes are left out, as a cache cannot
remove them.
"""

from __future__ import annotations

from perfsleuth.analysis import frames, text
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, file_key, iso, stable_id
from perfsleuth.analysis.registry import register

KIND = "repeated_query"

_SQL = """
WITH reads AS (SELECT id FROM fingerprints WHERE list_contains(?, upper(op))),
rep AS (           -- (request, statement, parameters) seen repeatedly: one cheap integer key
    SELECT hash(trace_id, fingerprint_id, params_hash) AS k
    FROM c SEMI JOIN reads ON reads.id = c.fingerprint_id
    WHERE params_hash IS NOT NULL AND list_contains(?, kind)
    GROUP BY k HAVING count(*) >= ?
),
per AS (           -- the details, for those calls only
    SELECT c.endpoint, c.kind, c.fingerprint_id, c.params_hash, c.trace_id,
        count(*) AS n, sum(c.duration_ms) AS ms,
        sum(c.duration_ms) - arg_min(c.duration_ms, c.seq) AS excess_ms,
        mode(c.site_id) AS site_id, min(c.ts) AS ts,
        list(DISTINCT c.stack_id) FILTER (WHERE c.stack_id IS NOT NULL) AS stack_ids
    FROM c
    WHERE params_hash IS NOT NULL
        AND hash(trace_id, fingerprint_id, params_hash) IN (SELECT k FROM rep)
    GROUP BY c.endpoint, c.kind, c.fingerprint_id, c.params_hash, c.trace_id
),
byreq AS (         -- a request may repeat several parameter sets of the same statement
    SELECT endpoint, kind, fingerprint_id, trace_id, sum(n) AS n, sum(ms) AS ms,
        sum(excess_ms) AS excess_ms, mode(site_id) AS site_id, min(ts) AS ts,
        count(*) AS param_sets, flatten(list(stack_ids)) AS stack_ids
    FROM per GROUP BY ALL
),
ep AS (SELECT endpoint, count(*) AS requests, sum(duration_ms) AS total_ms FROM r GROUP BY 1)
SELECT b.endpoint, b.kind, b.fingerprint_id, mode(b.site_id) AS site_id,
    count(*) AS requests_hit, median(b.n) AS typical, max(b.n) AS max_n,
    median(b.param_sets) AS param_sets, sum(b.ms) AS ms, sum(b.excess_ms) AS excess_ms,
    min(b.ts) AS first_ts, max(b.ts) AS last_ts,
    max_by(b.trace_id, (b.n, b.trace_id), 3) AS examples,
    -- the stacks of the repeats (a few requests' worth), to find where they part ways
    list_distinct(flatten(list(b.stack_ids)))[:64] AS stack_ids,
    any_value(ep.requests) AS ep_requests, any_value(ep.total_ms) AS ep_total_ms
FROM byreq b JOIN ep USING (endpoint)
GROUP BY b.endpoint, b.kind, b.fingerprint_id
HAVING count(*) >= ? AND count(*) >= ? * any_value(ep.requests)
"""


@register(KIND)
def detect(ctx: Context) -> list[Finding]:
    rows = ctx.query(
        _SQL,
        [
            [op.upper() for op in ctx.t(KIND, "read_ops")] or [""],
            list(ctx.t(KIND, "kinds")) or [""],
            int(ctx.t(KIND, "min_repeats")),
            int(ctx.t(KIND, "min_requests")),
            float(ctx.t(KIND, "min_request_share")),
        ],
    )
    if not rows:
        return []
    stacks = frames.stacks(ctx.store, (i for r in rows for i in r["stack_ids"] or []))
    sites = frames.locations(ctx.store, (r["site_id"] for r in rows))
    min_share = float(ctx.t(KIND, "min_time_share"))
    min_ms = float(ctx.t(KIND, "min_ms_per_request"))
    rows = [
        r
        for r in rows
        if r["excess_ms"] >= min_share * (r["ep_total_ms"] or 0.0)
        or r["excess_ms"] >= min_ms * r["requests_hit"]
    ]
    out = []
    for r, fp, callsite in ctx.with_statements(rows):
        typical = float(r["typical"])
        share_req = r["requests_hit"] / max(r["ep_requests"], 1)
        noun = "query" if r["kind"] == "db" else "cache read"
        # Where the repeats come from: the lines of the callers' code where their stacks part
        # ways (a helper called from three lines), and the template expression, if any.
        site = sites.get(r["site_id"])
        seen = [stacks[i] for i in sorted(r["stack_ids"] or []) if i in stacks]
        lines, how = frames.calling_lines(seen, site)
        tpl = frames.template_context(seen[0], site) if seen else None
        origin = f"from {text.where(callsite)}"
        if lines:
            origin += f", called from {frames.lines_text(lines)}"
        elif tpl is not None:
            origin += f", for the template's {frames.template_text(tpl)}"
        title = (
            f"{r['endpoint']} runs the same {noun} `{text.statement(fp, 70)}` with the same "
            f"parameters {text.count(typical)} times per request (up to "
            f"{text.count(r['max_n'])}) in {text.pct(share_req)} of its requests, {origin}; "
            f"the repeats cost {text.ms(r['excess_ms'])} in all."
        )
        key = (r["kind"], fp, file_key(callsite["file"] if callsite else None))
        out.append(
            Finding(
                id=stable_id(KIND, r["endpoint"], key),
                kind=KIND,
                endpoint=r["endpoint"],
                title=title,
                impact_ms_per_min=ctx.per_min(r["excess_ms"]),
                callsite=callsite,
                fingerprint=fp,
                count_per_request=typical,
                example_trace_ids=list(r["examples"] or []),
                first_seen=iso(r["first_ts"]),
                last_seen=iso(r["last_ts"]),
                suggestion=(
                    "Keep the first result for the rest of the request (pass it along, or a "
                    "request-scoped cache such as functools.cache on a per-request object)."
                ),
                evidence={
                    "call_kind": r["kind"],
                    "requests_with_repeats": r["requests_hit"],
                    "endpoint_requests": r["ep_requests"],
                    "request_share": share_req,
                    "typical_count": typical,
                    "max_count": r["max_n"],
                    "parameter_sets_repeated_per_request": float(r["param_sets"]),
                    "ms": r["ms"],
                    "ms_beyond_first": r["excess_ms"],
                    "share_of_endpoint_time": (
                        r["excess_ms"] / r["ep_total_ms"] if r["ep_total_ms"] else None
                    ),
                    "call_lines": [f.site() for f in lines] or None,
                    "call_lines_from": how,
                    "template": tpl,
                },
            )
        )
    return out
