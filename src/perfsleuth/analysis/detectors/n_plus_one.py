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
from perfsleuth.analysis.detectors import register
from perfsleuth.analysis.findings import Context, Finding, file_key, iso, stable_id

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
per AS (           -- one row per request x call kind x statement x call site
    SELECT endpoint, kind, fingerprint_id, any_value(site_id) AS site_id, trace_id,
        count(*) AS n, sum(duration_ms) AS ms, min(ts) AS ts,
        any_value(stack_id) AS stack_id    -- later calls of a site may carry no stack
    FROM (SELECT *, coalesce(site_id, -1) AS site_key FROM c) c
        SEMI JOIN cand USING (endpoint, kind, fingerprint_id, site_key)
    GROUP BY endpoint, kind, fingerprint_id, site_key, trace_id
    HAVING count(*) >= ?
),
hit AS (SELECT per.*, r.duration_ms AS req_ms FROM per JOIN r USING (trace_id)),
ep AS (SELECT endpoint, count(*) AS requests, sum(duration_ms) AS total_ms FROM r GROUP BY 1)
SELECT hit.endpoint, hit.kind, hit.fingerprint_id, any_value(hit.site_id) AS site_id,
    count(*) AS requests_hit, median(n) AS typical, max(n) AS max_n, sum(n) AS calls,
    sum(ms) AS ms, sum(ms - ms / n) AS excess_ms, sum(req_ms) AS req_ms,
    -- the stack of the worst request (a helper's site can be reached from several loops)
    max_by(stack_id, (n, stack_id)) FILTER (WHERE stack_id IS NOT NULL) AS stack_id,
    min(ts) AS first_ts, max(ts) AS last_ts,
    max_by(trace_id, (n, trace_id), 3) AS examples,
    any_value(ep.requests) AS ep_requests, any_value(ep.total_ms) AS ep_total_ms
FROM hit JOIN ep USING (endpoint)
GROUP BY hit.endpoint, hit.kind, hit.fingerprint_id, coalesce(hit.site_id, -1)
HAVING count(*) >= ? AND count(*) >= ? * any_value(ep.requests)
    AND (sum(ms) / count(*) >= ? OR sum(ms) >= ? * sum(req_ms) OR median(n) >= ?)
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
    stacks = frames.stacks(ctx.store, (r["stack_id"] for r in rows))
    sites = frames.locations(ctx.store, (r["site_id"] for r in rows))
    fps = ctx.fingerprints({r["fingerprint_id"] for r in rows})
    out = []
    for r in rows:
        site = sites.get(r["site_id"])
        loop, found = frames.looping_frame(stacks.get(r["stack_id"], []), site)
        if r["kind"] == "cache" and not found:
            continue  # cache reads in a row without a loop in sight: not worth a finding
        out.append(_finding(ctx, r, fps.get(r["fingerprint_id"]), loop, found, site))
    return out


def _finding(
    ctx: Context,
    r: dict[str, Any],
    fp: str | None,
    loop: frames.Frame | None,
    found: bool,
    site: frames.Frame | None,
) -> Finding:
    typical = float(r["typical"])
    callsite = loop.site() if loop is not None else None
    share_req = r["requests_hit"] / max(r["ep_requests"], 1)
    share_time = r["ms"] / r["ep_total_ms"] if r["ep_total_ms"] else 0.0
    noun = {"db": "query", "http": "HTTP call", "cache": "cache call"}.get(r["kind"], "call")
    where = f"the loop in {text.where(callsite)}" if found else f"{text.where(callsite)}"
    title = (
        f"{r['endpoint']} repeats the {noun} `{text.statement(fp, 70)}` "
        f"{text.count(typical)} times per request (up to {text.count(r['max_n'])}) from {where}, "
        f"in {text.pct(share_req)} of its requests: {text.ms(r['ms'])} in all, "
        f"{text.pct(share_time)} of the endpoint's time."
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
        impact_ms_per_min=ctx.per_min(r["excess_ms"]),
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
            "share_of_endpoint_time": share_time,
            "share_of_affected_requests_time": r["ms"] / r["req_ms"] if r["req_ms"] else None,
        },
    )
