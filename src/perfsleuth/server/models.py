"""The API's replies as pydantic models: the OpenAPI schema (/api/openapi.json) describes them,
and ``web/src/api.gen.ts`` (the UI's types) is generated from that schema by
``scripts/openapi_ts.py`` (``make lint`` and tests/test_api_models.py fail when it is stale).

The routes name these models as their ``response_model`` but answer with JSON they encode
themselves (:func:`perfsleuth.server.deps.ok`): replies are not re-validated on every call (a
trace can hold thousands of calls). tests/test_api_models.py validates real replies against the
models (no unknown keys allowed), so a key added to a query without its model fails there.

Numbers from SQL aggregates are ``| None``: an empty group gives NULL.

About 500 lines, one class per reply and part of a reply: they are kept in one module, in the
order of the API's areas, so that the whole schema the UI is typed by reads in one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# ---------------------------------------------------------------------------------- shared


class ApiErrorBody(Model):
    """Every error reply."""

    error: str
    status: int
    candidates: list[str] | None = Field(
        default=None, description="An ambiguous id prefix: the first ids it matches."
    )


class Frame(Model):
    file: str | None
    line: int | None
    function: str | None
    app: bool | None = None


class TimeWindow(Model):
    since: str
    start: int = Field(description="Unix seconds.")
    end: int
    step: int = Field(description="Chart bucket, seconds.")


class TopRow(Model):
    """store.top's row for one endpoint, with its share of all request time."""

    endpoint: str
    count: int
    rate_per_min: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    error_rate: float
    db_calls_per_request: float
    http_calls_per_request: float
    cache_calls_per_request: float
    db_share: float
    http_share: float
    cache_share: float
    gc_share: float
    total_ms: float
    time_share: float


class TraceRow(Model):
    trace_id: str
    ts: str = Field(description="ISO 8601.")
    endpoint: str
    method: str | None
    path: str | None
    status: int | None
    duration_ms: float | None
    db_calls: int | None
    db_ms: float | None
    http_calls: int | None
    http_ms: float | None
    cache_calls: int | None
    cache_ms: float | None
    user: str | None
    tenant: str | None


# ---------------------------------------------------------------------------------- status


class IngestState(Model):
    at: float | None = Field(description="Unix seconds of the last ingest, null before one.")
    requests: int
    error: str | None


class OtlpQueueState(Model):
    """OTLP payloads this server acknowledged, and what became of them since it started."""

    accepted: int = Field(description="Payloads acknowledged (written to DATA/otlp/).")
    committed: int = Field(description="Payloads stored.")
    failed: int = Field(description="Payloads the store refused, set aside in DATA/otlp/failed/.")
    commits: int = Field(description="Transactions the payloads were stored in.")
    queued: int = Field(description="Payloads acknowledged and waiting to be stored.")
    queued_bytes: int
    stalled: str | None = Field(description="Why the queue waits (a full disk), or null.")


class Status(Model):
    data: str
    first: str | None
    last: str | None
    endpoints: int
    ingest: IngestState
    ingest_every_s: float
    drops: dict[str, int | float | str | None] = Field(
        description="The agents' counters summed (requests_recorded, dropped_* by reason, ...)"
        " and last_error."
    )
    otlp: OtlpQueueState | None = Field(
        description="The OTLP queue (null: this server does not write its store)."
    )


class FleetSource(Model):
    """A host and service with requests in the window, and who sent them."""

    host: str = Field(description="'' when the requests carry no host.")
    service: str
    requests: int
    processes: int | None = Field(
        description="Distinct process ids (None when rollups answered: a long window)."
    )
    first: str | None = Field(description="First request (None when rollups answered).")
    last: str | None = Field(description="Last request (None when rollups answered).")
    tokens: list[str] = Field(description="Names of the tokens that sent from it (--tokens).")
    via: list[str] = Field(description="'agent' (spool segments) and/or 'otlp'.")


class FleetToken(Model):
    """What one token sent, by route."""

    token: str = Field(description="The token's name ('' without tokens).")
    via: str = Field(description="'agent' or 'otlp'.")
    segments: int = Field(description="Agent segments, or OTLP sources (service/host/pid) a day.")
    hosts: list[str]
    services: list[str]
    first_received: str | None
    last_received: str | None


class Fleet(Model):
    window: dict[str, str]
    source: Literal["raw", "rollups"] = Field(description="What the request counts came from.")
    sources: list[FleetSource]
    tokens: list[FleetToken]
    hosts: list[str] = Field(description="The hosts of ``sources``: the UI's host filter.")
    services: list[str] = Field(description="The services of ``sources``: the service filter.")


# ---------------------------------------------------------------------------------- overview


class Totals(Model):
    requests: int
    endpoints: int
    errors: int


class P95Series(Model):
    endpoint: str
    values: list[float | None]


class P95Chart(Model):
    x: list[int]
    series: list[P95Series]


class Throughput(Model):
    x: list[int]
    requests: list[int]
    errors: list[int]


class SlowTotal(Model):
    threshold_ms: int
    now: int
    week_ago: int


class SlowChart(Model):
    x: list[int]
    thresholds: list[int]
    now: dict[str, list[int]] = Field(description="Threshold (ms, as text) -> counts per bucket.")
    week_ago: dict[str, list[int]]
    totals: list[SlowTotal]


class Answered(Model):
    """What answered a page: raw rows, or rollups (store.rollups) for long windows."""

    source: Literal["raw", "rollups"] = Field(description="What the endpoint table came from.")
    resolution_s: int | None = Field(description="Finest rollup period read; None: raw rows.")
    start: str | None = Field(description="Start of the rows read (ISO 8601); None: all.")
    charts: Literal["raw", "rollups"] = Field(description="What the charts came from.")


class Overview(Model):
    window: TimeWindow
    source: Answered
    totals: Totals
    endpoints: list[TopRow]
    p95: P95Chart
    throughput: Throughput
    slow: SlowChart


# ---------------------------------------------------------------------------------- endpoint


class Percentiles(Model):
    x: list[int]
    p50: list[float | None]
    p95: list[float | None]
    p99: list[float | None]
    count: list[int | None]


class HistogramBin(Model):
    lo_ms: float
    hi_ms: float
    count: int


class FingerprintRow(Model):
    fingerprint_id: str = Field(description="63-bit id as text (beyond JS numbers).")
    kind: str | None
    statement: str | None
    calls: int
    requests: int
    total_ms: float | None
    p95_ms: float | None
    avg_rows: float | None
    calls_per_request: float | None


class HostRow(Model):
    host: str
    calls: int
    total_ms: float | None
    p95_ms: float | None
    errors: int


class WhoRow(Model):
    name: str
    count: int
    total_ms: float | None
    p95_ms: float | None


class EndpointDetail(Model):
    endpoint: str
    window: TimeWindow
    source: Answered
    summary: TopRow | None
    percentiles: Percentiles
    histogram: list[HistogramBin]
    fingerprints: list[FingerprintRow]
    hosts: list[HostRow]
    slowest: list[TraceRow]
    users: list[WhoRow]
    tenants: list[WhoRow]


# ---------------------------------------------------------------------------------- evidence


class CallTreeNode(Model):
    """One call site of the call-site trie; ``template``: the node folds a templated path."""

    name: str
    file: str | None
    line: int | None
    function: str | None
    calls: int
    ms: float
    template: bool
    children: list[CallTreeNode]


class ProfileNode(Model):
    """A d3 hierarchy of stack samples: ``value`` samples through the frame, ``self`` in it."""

    name: str
    file: str | None
    line: int | None
    function: str | None
    value: int
    self_: int = Field(alias="self")
    children: list[ProfileNode]


class ProfileTop(Model):
    function: str | None
    file: str | None
    line: int | None
    self_: int = Field(alias="self")
    total: int
    self_share: float
    total_share: float


class Profile(Model):
    endpoint: str
    requests: int
    samples: int
    states: dict[str, int] = Field(description="Samples per state: cpu, wait, starved.")
    top: list[ProfileTop]
    tree: ProfileNode


# ---------------------------------------------------------------------------------- trace


class Call(Model):
    seq: int
    kind: str
    system: str | None
    offset_ms: float | None
    duration_ms: float | None
    fingerprint: str | None
    fingerprint_id: int | str | None = None
    op: str | None
    rows: int | None
    bytes: int | None
    host: str | None
    status: int | None
    hit: bool | None
    wait_ms: float | None
    error: str | None
    params_hash: str | int | None = Field(
        default=None,
        description="Equal within a request when the call's parameters are equal (compare it "
        "only between calls of one trace: its values mean nothing across requests).",
    )
    unfinished: bool | None
    site: Frame | None
    stack: list[Frame]


class StackSample(Model):
    offset_ms: float
    state: str
    stack: list[Frame]


class BlockerEvent(Model):
    ts: str
    trace_id: str | None
    endpoint: str | None
    duration_ms: float
    delayed: int | None
    stack_samples: int | None
    samples: int | None
    last_kind: str | None
    last_call: str | None
    last_rows: int | None
    last_bytes: int | None
    last_ms: float | None
    pid: int | None
    stack: list[Frame]


class Replay(Model):
    """The captured request: ``curl`` is cut when longer than the page shows (``complete``
    false: fetch /api/traces/{id}/curl for it)."""

    reason: str | None
    method: str | None
    url: str | None
    body_size: int | None
    body_truncated: bool | None
    redacted: list[str]
    note: str | None = Field(description="Why it is not an exact replay, or null.")
    curl: str
    complete: bool


class Trace(TraceRow):
    """One request: its row of the traces list and all the rest."""

    service: str | None
    host: str | None
    pid: int | None
    kind: str | None
    error: str | None
    cpu_ms: float | None
    req_bytes: int | None
    resp_bytes: int | None
    calls_dropped: int | None
    gc_ms: float | None
    gc_count: int | None
    version: str | None
    attributes: dict[str, Any]
    tags: dict[str, str]
    calls: list[Call]
    samples: int
    blockers: int
    capture: str | None = Field(description="Why the request was captured, or null.")
    links: dict[str, Any] | None = Field(
        default=None,
        description="OTLP: the call of another service that made this request (upstream) and"
        " the requests other services served for its calls (downstream), or null.",
    )
    stack_samples: list[StackSample]
    profile: ProfileNode | None
    blocker_events: list[BlockerEvent]
    replay: Replay | None


# ---------------------------------------------------------------------------------- findings


class ConfidenceCount(Model):
    count: float
    floor: float


class Finding(Model):
    id: str
    kind: str
    endpoint: str
    title: str
    impact_ms_per_min: float
    callsite: Frame | None
    fingerprint: str | None
    count_per_request: float | None
    example_trace_ids: list[str]
    first_seen: str | None
    last_seen: str | None
    suggestion: str
    evidence: dict[str, Any] = Field(description="The detector's own numbers.")
    confidence: Literal["high", "medium", "low"] | None
    confidence_basis: dict[str, ConfidenceCount] = Field(
        description="Evidence count name -> its count and its detector's floor."
    )


class FindingDetail(Finding):
    source_line: str | None = Field(description="The call site's line of source, when readable.")


# ---------------------------------------------------------------------------------- sql


class SqlResult(Model):
    columns: list[str]
    truncated: bool
    truncated_by: Literal["rows", "bytes"] | None
    limit: int
    max_bytes: int
    bytes: int
    elapsed_ms: float
    rows: list[list[Any]]


# ---------------------------------------------------------------------------------- compare

Verdict = Literal["faster", "slower", "same", "too_few"]


class SideStats(Model):
    count: int
    ci: dict[str, list[float | None]] = Field(
        description="p50_ms, p95_ms, p99_ms -> [low, high] of the confidence interval."
    )
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    mean_ms: float | None


class Moved(Model):
    a: float | None
    b: float | None
    change: float | None


class FindingBrief(Model):
    id: str
    kind: str
    endpoint: str
    title: str
    endpoint_verdict: Verdict | None = None


class CompareRow(Model):
    endpoint: str
    a: SideStats
    b: SideStats
    p50_change: float | None
    p50_change_pm: float | None
    p95_change: float | None
    p95_change_pm: float | None
    p99_change: float | None
    p99_change_pm: float | None
    p_value: float | None
    delta: float | None
    q_value: float | None
    significant: bool
    verdict: Verdict
    moved: dict[str, Moved]
    findings_appeared: list[FindingBrief] | None = None
    findings_gone: list[FindingBrief] | None = None


class CompareSettings(Model):
    alpha: float
    min_change: float
    min_requests: int


class FindingChanges(Model):
    appeared: list[FindingBrief]
    gone: list[FindingBrief]


class Histogram(Model):
    edges: list[float]
    a: list[float]
    b: list[float]


class CompareResult(Model):
    a: str
    b: str
    settings: CompareSettings
    endpoints: list[CompareRow]
    findings: FindingChanges
    verdict: str
    summary: dict[str, int] = Field(description="Endpoints per verdict.")
    histograms: dict[str, Histogram] = Field(description="Endpoint -> both distributions.")


class CompareValue(Model):
    value: str | None
    requests: int
    first: str | None


# ---------------------------------------------------------------------------------- runs


class StartupRunBrief(Model):
    name: str
    total_ms: float | None
    command: list[str] | None
    url: str | None


class LoadRunBrief(Model):
    name: str
    run_id: str | None
    verdict: str | None
    targets: dict[str, str | None]
    achieved_rate: float | None
