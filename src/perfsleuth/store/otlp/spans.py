"""The spans of a decoded payload as the mapping reads them: one pass that keeps the wanted
attributes (:func:`read`), the walk from every span up to its request (:func:`ancestry`), and
:class:`Pending`, the bounded pool of client spans whose request has not arrived yet."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from perfsleuth.store import values
from perfsleuth.store.otlp.payload import OtlpError
from perfsleuth.store.otlp.view import AttributeCache, as_view, messages

SPAN_SERVER = 2
SPAN_CONSUMER = 5  # a message taken from a queue: a background task
REQUEST_KINDS = frozenset({SPAN_SERVER, SPAN_CONSUMER})
SPAN_CLIENT = 3
STATUS_ERROR = 2


@dataclass(frozen=True)
class Keys:
    """Attribute keys read for the request's user and tenant, first present wins (span
    attributes, then the resource's)."""

    user: tuple[str, ...] = ("enduser.id", "user.id")
    tenant: tuple[str, ...] = ("tenant.id", "enduser.tenant", "tenant")


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which)


# An event-loop block (the perfsleuth-node package, node/): a span under the one whose code held
# the loop, lasting as long as the block, with the in-flight requests it delayed.
BLOCK_MS = "perfsleuth.block.ms"
BLOCK_DELAYED = "perfsleuth.block.delayed"

# The span attributes the mapping reads (besides the user and tenant keys, and parameters).
SPAN_KEYS = frozenset(
    {
        *("code.file.path", "code.filepath", "code.function", "code.function.name"),
        *("code.line.number", "code.lineno", "code.namespace"),
        *("db.operation", "db.operation.name", "db.query.text", "db.response.returned_rows"),
        *("db.statement", "db.system", "db.system.name"),
        *("http.method", "http.request.method", "http.route", "http.target", "url.path"),
        *("http.request.body.size", "http.request_content_length", "http.response.body.size"),
        *("http.response_content_length", "http.response.status_code", "http.status_code"),
        *("http.url", "url.full", "net.peer.name", "net.peer.port", "server.address"),
        "server.port",
        *(BLOCK_MS, BLOCK_DELAYED),
    }
)
# The prefix of the attributes holding a statement's parameter values (read with the wanted keys).
PARAMETER = "db.query.parameter."


def _attrs(kvs: Any, wanted: frozenset[str] | None = None) -> dict[str, Any]:
    """Attributes as a dict (those in ``wanted``, and parameters, when given): converting
    every attribute of every span would cost more than the rest of the mapping."""
    if wanted is None:
        return {kv.key: _value(kv.value) for kv in kvs}
    return {
        kv.key: _value(kv.value) for kv in kvs if kv.key in wanted or kv.key.startswith(PARAMETER)
    }


def first(attrs: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        v = attrs.get(k)
        if v is not None and v != "":
            return v
    return None


class Span(NamedTuple):
    """What the mapping needs of one span."""

    trace: str
    span: str
    parent: str
    kind: int
    name: str
    start: int
    end: int
    attrs: dict[str, Any]
    error: str | None
    source: tuple[str, str, str]  # (service, host, version) of its resource
    resource: dict[str, Any]  # the resource's attributes


@dataclass(frozen=True)
class Served:
    """A request stored from a SERVER span: what a loop block in it is filed under."""

    id: str
    endpoint: str
    method: str | None
    path: str | None
    start: int
    end: int
    source: tuple[str, str, str]


@dataclass
class Pending:
    """Client spans waiting for their SERVER ancestor, by trace, oldest trace first; at most
    ``max_spans`` in all and each for ``max_age_s`` (then dropped, and counted). ``servers``:
    the requests of the latest ``max_servers`` traces (a loop block reported after its request
    was stored finds it there). ``stored``: the fingerprints, locations and stacks committed
    (a payload adds only those the store does not hold yet)."""

    max_spans: int = 50_000
    max_age_s: float = 120.0
    max_servers: int = 20_000
    traces: OrderedDict[str, tuple[float, list[Span]]] = field(default_factory=OrderedDict)
    servers: OrderedDict[str, list[Served]] = field(default_factory=OrderedDict)
    stored: set[tuple[bytes, int]] = field(default_factory=set)
    size: int = 0
    dropped: int = 0

    def served(self, trace: str, req: Served) -> None:
        hit = self.servers.get(trace)
        if hit is None:
            hit = self.servers[trace] = []
            if len(self.servers) > self.max_servers:
                self.servers.popitem(last=False)
        hit.append(req)

    def add(self, spans: list[Span], now: float) -> None:
        for s in spans:
            hit = self.traces.get(s.trace)
            if hit is None:
                hit = self.traces[s.trace] = (now, [])
            hit[1].append(s)
            self.size += 1
        self.expire(now)

    def take(self, trace: str) -> list[Span]:
        hit = self.traces.pop(trace, None)
        if hit is None:
            return []
        self.size -= len(hit[1])
        return hit[1]

    def undo(
        self,
        taken: dict[str, tuple[float, list[Span]]],
        parked: list[Span],
        served: list[tuple[str, Served]],
    ) -> None:
        """Back to before a mapping whose tables were not committed: the spans it ``parked``
        leave, those it ``took`` (by trace, with when they began waiting) wait again, and the
        requests it recorded as ``served`` are forgotten."""
        gone = {id(s) for s in parked}
        for trace in {s.trace for s in parked}:
            hit = self.traces.get(trace)
            if hit is None:
                continue
            keep = [s for s in hit[1] if id(s) not in gone]
            self.size -= len(hit[1]) - len(keep)
            if keep:
                self.traces[trace] = (hit[0], keep)
            else:
                del self.traces[trace]
        for trace, (born, spans) in taken.items():
            hit = self.traces.get(trace)
            if hit is None:
                self.traces[trace] = (born, list(spans))
                self.traces.move_to_end(trace, last=False)  # among the oldest: expires first
            else:
                self.traces[trace] = (min(born, hit[0]), hit[1] + spans)
            self.size += len(spans)
        for trace, req in served:
            reqs = self.servers.get(trace)
            if reqs is not None and req in reqs:
                reqs.remove(req)
                if not reqs:
                    del self.servers[trace]

    def expire(self, now: float) -> None:
        while self.traces:
            trace, (born, spans) = next(iter(self.traces.items()))
            if self.size <= self.max_spans and now - born <= self.max_age_s:
                return
            del self.traces[trace]
            self.size -= len(spans)
            self.dropped += len(spans)


_caches: dict[frozenset[str], AttributeCache] = {}


def _cache(wanted: frozenset[str]) -> AttributeCache:
    hit = _caches.get(wanted)
    if hit is None:
        if len(_caches) >= 8:  # one per setting of the user and tenant keys
            _caches.clear()
        hit = _caches[wanted] = AttributeCache(wanted, PARAMETER, _value)
    return hit


def _error(sp: Any) -> str | None:
    """A span's error: its first ``exception`` event's type (else message), else the message
    of an ERROR status. Every event is parsed (the status is a message of the view): a
    malformed one fails the payload, as a full parse does."""
    error = None
    if sp.events:
        event = messages().event
        for raw in sp.events:
            ev = event.FromString(raw)
            if error is None and ev.name == "exception":
                ea = _attrs(ev.attributes)
                error = values.as_str(first(ea, "exception.type", "exception.message"))
    if error is None and sp.status.code == STATUS_ERROR:
        error = sp.status.message or "error"
    return error


def read(msg: Any, keys: Keys) -> list[Span]:
    """Every span of the payload with what the mapping reads: the wanted keys' attributes
    (and parameters), each distinct attribute decoded once (:mod:`perfsleuth.store.otlp.view`;
    ``msg`` is the view or an official message)."""
    wanted = SPAN_KEYS | set(keys.user) | set(keys.tenant)
    attrs_of = _cache(wanted)
    out: list[Span] = []
    new = tuple.__new__  # Span(...) without its Python-level __new__
    for rs in as_view(msg).resource_spans:
        res = _attrs(rs.resource.attributes)
        source = (
            values.as_str(res.get("service.name")) or "unknown_service",
            values.as_str(res.get("host.name")) or "",
            values.as_str(res.get("service.version")) or "",
        )
        spans = [sp for ss in rs.scope_spans for sp in ss.spans]
        lists = [list(sp.attributes) for sp in spans]
        try:
            long = attrs_of.learn(lists)
        except messages().errors as e:
            raise OtlpError(400, f"bad protobuf: an attribute is not a KeyValue ({e})") from None
        known, params = attrs_of.known, attrs_of.params
        pick = known.__getitem__
        try:
            for sp, kvs in zip(spans, lists, strict=True):
                attrs: dict[str, Any] = dict(filter(None, map(pick, kvs)))
                if params and not params.isdisjoint(kvs):
                    attrs[PARAMETER] = True  # the span has parameters
                try:
                    error = _error(sp) if sp.events or sp.HasField("status") else None
                except messages().errors as e:
                    raise OtlpError(400, f"bad protobuf: a span's status or event ({e})") from None
                out.append(
                    new(
                        Span,
                        (
                            sp.trace_id.hex(),
                            sp.span_id.hex(),
                            sp.parent_span_id.hex(),
                            sp.kind,
                            sp.name,
                            sp.start_time_unix_nano,
                            sp.end_time_unix_nano,
                            attrs,
                            error,
                            source,
                            res,
                        ),
                    )
                )
        finally:  # (also when a span is refused: the cache stays bounded)
            attrs_of.forget(long)
    return out


# Where the walk from a span up to its request ended.
FOUND, ROOT, MISSING = 1, 2, 3


def ancestry(
    spans: list[Span], index: dict[str, int], is_req: np.ndarray, callish: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every span at once (``index``: each span's position by trace + span id): (its
    parent's index: -1 not seen, -2 none; its nearest request ancestor, -1 none; where the
    walk ended: FOUND, ROOT (at a root, no request above) or MISSING (at a span not seen
    yet); whether a call lies between)."""
    par = np.array(
        [index.get(s.trace + s.parent, -1) if s.parent else -2 for s in spans], dtype=np.int64
    )
    n = len(spans)
    owner = np.full(n, -1, dtype=np.int64)
    state = np.zeros(n, dtype=np.int8)
    nested = np.zeros(n, dtype=bool)
    idx = np.nonzero(~is_req)[0]
    cur = par[idx]
    for _ in range(256):  # a cycle of parent ids must not hang ingest
        if not len(idx):
            break
        state[idx[cur == -2]] = ROOT
        state[idx[cur == -1]] = MISSING
        up = cur >= 0
        idx, cur = idx[up], cur[up]
        found = is_req[cur]
        owner[idx[found]] = cur[found]
        state[idx[found]] = FOUND
        idx, cur = idx[~found], cur[~found]
        nested[idx] |= callish[cur]
        cur = par[cur]
    state[idx] = ROOT
    return par, owner, state, nested


def nanos(spans: list[Span], field: int) -> np.ndarray:
    """A span time (uint64 ns) as int64; those beyond int64 become 0 (no clock says so)."""
    t = np.array([s[field] for s in spans], dtype=np.uint64)
    return np.where(t > np.uint64(values.INT64_MAX), np.uint64(0), t).astype(np.int64)


def is_call(s: Span) -> bool:
    a = s.attrs
    if s.kind == SPAN_CLIENT:
        return True
    return "db.system" in a or "db.system.name" in a  # some drivers report INTERNAL spans


def http_method(a: dict[str, Any]) -> str | None:
    m = first(a, "http.request.method", "http.method")
    return str(m).upper() if m is not None else None
