"""OTLP traces into the store: OpenTelemetry spans of any language become requests and calls.

An ``ExportTraceServiceRequest`` (OTLP/HTTP protobuf or JSON, maybe gzip) is decoded with the
official ``opentelemetry-proto`` messages and mapped onto the records the agent writes, which
go through the spool ingest's own conversion (:class:`perfsleuth.store.records.Batch`) and the
store's insert path, one transaction per payload:

- a SERVER span is a request: ``http.route`` (else the templated ``url.path``) and the method
  are its endpoint (a CONSUMER span is a background task, named by the span); status,
  duration, error (its ``exception`` events, else an ERROR status), user and tenant from
  configurable attribute keys; service, host and version from the resource (``service.name``,
  ``host.name``, ``service.version``);
- the CLIENT spans under it (same trace; the nearest SERVER ancestor owns them) are its calls:
  ``db.system`` + ``db.query.text`` / ``db.statement`` a DB call fingerprinted by the agent's
  normaliser, with its rows (``db.response.returned_rows``) and a hash of its parameter values
  when the span shows them (redis and memcached: cache calls); HTTP client spans HTTP calls by
  host; a client span under another client span (a driver's span inside a library's) is not
  counted twice;
- ``code.*`` attributes give a call its site: one location and a one-frame stack. Spans without
  them have no site (the findings show the site as unknown, nothing is invented).

Children end before their parent, so an exporter may send a request's calls in an earlier
payload than its SERVER span: client spans whose SERVER ancestor has not arrived wait in a
bounded pool (:class:`Pending`) for a later payload of the same trace.

Duplicates: a request's id is its trace id followed by its span id (48 hex digits), and the
store keeps one request per id, so a payload sent twice is stored once.
"""

from __future__ import annotations

import gzip
import json
import re
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.store import records, schema, values
from perfsleuth.store.evidence import tables as evidence_tables
from perfsleuth.store.tables import Tables
from perfsleuth.wire import BLOCKER, FINGERPRINT, LOCATION, STACK, internal_sql
from perfsleuth.wire import fingerprint as fpr

MAX_BODY = 32 * 1024 * 1024  # bytes as sent (compressed or not)
MAX_DECODED = 128 * 1024 * 1024  # bytes after gunzip
SPAN_SERVER = 2
SPAN_CONSUMER = 5  # a message taken from a queue: a background task
REQUEST_KINDS = frozenset({SPAN_SERVER, SPAN_CONSUMER})
SPAN_CLIENT = 3
STATUS_ERROR = 2
CACHE_SYSTEMS = frozenset({"redis", "memcached"})
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


class OtlpError(Exception):
    """A payload refused: ``status`` is the HTTP status to answer, the message says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Keys:
    """Attribute keys read for the request's user and tenant, first present wins (span
    attributes, then the resource's)."""

    user: tuple[str, ...] = ("enduser.id", "user.id")
    tenant: tuple[str, ...] = ("tenant.id", "enduser.tenant", "tenant")


# ---------------------------------------------------------------------------------- decoding


def _messages() -> Any:
    """The opentelemetry-proto messages and protobuf's JSON mapping, imported on first use (a
    server that is never sent OTLP does not load protobuf)."""
    try:
        from google.protobuf import json_format
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    except ImportError as e:
        raise OtlpError(501, f"OTLP ingest needs the opentelemetry-proto package ({e})") from e
    return json_format, DecodeError, trace_service_pb2


def decode(body: bytes, content_type: str | None, content_encoding: str | None) -> Any:
    """The ExportTraceServiceRequest of an OTLP/HTTP body; OtlpError (400, 413, 415) when it
    is not one."""
    json_format, DecodeError, pb = _messages()
    if len(body) > MAX_BODY:
        raise OtlpError(413, f"the payload is {len(body)} bytes; at most {MAX_BODY} are taken")
    enc = (content_encoding or "identity").strip().lower()
    if enc == "gzip":
        try:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            body = d.decompress(body, MAX_DECODED)
            if d.unconsumed_tail:
                raise OtlpError(413, f"the payload is over {MAX_DECODED} bytes once unzipped")
            if not d.eof:
                raise OtlpError(400, "bad gzip body: it ends before the gzip stream does")
        except (zlib.error, EOFError, gzip.BadGzipFile) as e:
            raise OtlpError(400, f"bad gzip body: {e}") from None
    elif enc not in ("identity", ""):
        raise OtlpError(415, f"unsupported Content-Encoding {enc!r}: send gzip or none")
    ctype = (content_type or "").split(";", 1)[0].strip().lower()
    msg = pb.ExportTraceServiceRequest()
    if ctype == "application/x-protobuf":
        try:
            msg.ParseFromString(body)
        except (DecodeError, RecursionError, ValueError) as e:
            raise OtlpError(400, f"bad protobuf: not an ExportTraceServiceRequest ({e})") from None
    elif ctype == "application/json":
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise OtlpError(400, f"bad JSON: {e}") from None
        if not isinstance(obj, dict):
            raise OtlpError(400, "bad JSON: the body must be an object")
        try:
            _hex_ids_to_base64(obj)
            json_format.ParseDict(obj, msg, ignore_unknown_fields=True)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
            raise OtlpError(400, f"bad OTLP JSON: {e}"[:500]) from None
    else:
        raise OtlpError(
            415,
            f"unsupported Content-Type {ctype!r}: send application/x-protobuf or application/json",
        )
    return msg


def _hex_ids_to_base64(obj: dict[str, Any]) -> None:
    """OTLP JSON spells trace and span ids in hex where protobuf's JSON mapping of ``bytes``
    expects base64: rewrite them in place (ValueError for an id that is not hex)."""
    import base64

    def fix(d: dict[str, Any]) -> None:
        for k in _ID_FIELDS:
            v = d.get(k)
            if isinstance(v, str):
                try:
                    d[k] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise ValueError(f"{k} {v[:40]!r} is not hex") from None

    for rs in _list(obj, "resourceSpans"):
        for ss in _list(rs, "scopeSpans"):
            for span in _list(ss, "spans"):
                fix(span)
                for link in _list(span, "links"):
                    fix(link)


def _list(d: Any, key: str) -> list[Any]:
    v = d.get(key) if isinstance(d, dict) else None
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def response(content_type: str | None) -> tuple[bytes, str]:
    """An empty ExportTraceServiceResponse (full success) in the request's encoding."""
    ctype = (content_type or "").split(";", 1)[0].strip().lower()
    if ctype == "application/json":
        return b"{}", "application/json"
    response = _messages()[2].ExportTraceServiceResponse()
    return response.SerializeToString(), "application/x-protobuf"


# ----------------------------------------------------------------------------------- mapping


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
_PARAMETER = "db.query.parameter."
_SCALAR = frozenset({"string_value", "int_value", "double_value", "bool_value"})
# Attributes (kind LINK) that link a request to the call of another service that made it.
LINK = "link"
PARENT_SPAN = "otlp.parent_span"
CALL_SPAN = "otlp.call_span"


def _attrs(kvs: Any, wanted: frozenset[str] | None = None) -> dict[str, Any]:
    """Attributes as a dict (those in ``wanted``, and parameters, when given): converting
    every attribute of every span would cost more than the rest of the mapping."""
    if wanted is None:
        return {kv.key: _value(kv.value) for kv in kvs}
    return {
        kv.key: _value(kv.value) for kv in kvs if kv.key in wanted or kv.key.startswith(_PARAMETER)
    }


def _first(attrs: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        v = attrs.get(k)
        if v is not None and v != "":
            return v
    return None


# The location, stack and fingerprint records a payload's calls use, by (type, id).
Dictionary = dict[tuple[bytes, int], dict[str, Any]]


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

    def expire(self, now: float) -> None:
        while self.traces:
            trace, (born, spans) = next(iter(self.traces.items()))
            if self.size <= self.max_spans and now - born <= self.max_age_s:
                return
            del self.traces[trace]
            self.size -= len(spans)
            self.dropped += len(spans)


@dataclass
class Mapped:
    batch: records.Batch
    tables: Tables | None = None  # None: nothing to store
    spans: int = 0
    requests: int = 0
    calls: int = 0
    blockers: int = 0
    waiting: int = 0  # client spans held for a SERVER span still to come
    new: list[tuple[bytes, int]] = field(default_factory=list)  # dictionary rows it adds


def insert(store: Any, mapped: Mapped, pending: Pending) -> None:
    """Commit a payload's tables (``store.insert_tables``), in one transaction, and remember
    its dictionary rows as stored. Its segments are not recorded: they stand for the payload's
    sources, which have no spool offsets to keep."""
    if mapped.tables is None:
        return
    store.insert_tables(records.Batch(), mapped.tables)
    if len(pending.stored) > _MAX_CACHED * 5:
        pending.stored.clear()
    pending.stored.update(mapped.new)


def _spans(msg: Any, keys: Keys) -> list[Span]:
    """Every span of the payload with what the mapping reads: one pass over the decoded
    messages, the only per-attribute work (the wanted keys, and parameters)."""
    wanted = SPAN_KEYS | set(keys.user) | set(keys.tenant)
    scalar = _SCALAR
    param = _PARAMETER
    out: list[Span] = []
    append = out.append
    new = tuple.__new__  # Span(...) without its Python-level __new__
    for rs in msg.resource_spans:
        res = _attrs(rs.resource.attributes)
        source = (
            values.as_str(res.get("service.name")) or "unknown_service",
            values.as_str(res.get("host.name")) or "",
            values.as_str(res.get("service.version")) or "",
        )
        for ss in rs.scope_spans:
            for sp in ss.spans:
                attrs: dict[str, Any] = {}
                for kv in sp.attributes:
                    k = kv.key
                    if k in wanted:
                        v = kv.value
                        text = v.string_value  # most are strings: one call
                        if text:
                            attrs[k] = text
                        else:
                            which = v.WhichOneof("value")
                            attrs[k] = getattr(v, which) if which in scalar else _value(v)
                    elif k.startswith(param):
                        attrs[k] = _value(kv.value)
                        attrs[param] = True  # the span has parameters
                error = None
                if sp.events:
                    for ev in sp.events:
                        if ev.name == "exception":
                            ea = _attrs(ev.attributes)
                            error = values.as_str(_first(ea, "exception.type", "exception.message"))
                            break
                if error is None and sp.status.code == STATUS_ERROR:
                    error = sp.status.message or "error"
                append(
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
    return out


# Where the walk from a span up to its request ended.
_FOUND, _ROOT, _MISSING = 1, 2, 3


def _ancestry(
    spans: list[Span], is_req: np.ndarray, callish: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every span at once: (its parent's index: -1 not seen, -2 none; its nearest request
    ancestor, -1 none; where the walk ended: _FOUND, _ROOT (at a root, no request above) or
    _MISSING (at a span not seen yet); whether a call lies between)."""
    index = {s.trace + s.span: i for i, s in enumerate(spans)}
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
        state[idx[cur == -2]] = _ROOT
        state[idx[cur == -1]] = _MISSING
        up = cur >= 0
        idx, cur = idx[up], cur[up]
        found = is_req[cur]
        owner[idx[found]] = cur[found]
        state[idx[found]] = _FOUND
        idx, cur = idx[~found], cur[~found]
        nested[idx] |= callish[cur]
        cur = par[cur]
    state[idx] = _ROOT
    return par, owner, state, nested


def _nanos(spans: list[Span], field: int) -> np.ndarray:
    """A span time (uint64 ns) as int64; those beyond int64 become 0 (no clock says so)."""
    t = np.array([s[field] for s in spans], dtype=np.uint64)
    return np.where(t > np.uint64(values.INT64_MAX), np.uint64(0), t).astype(np.int64)


def to_batch(msg: Any, keys: Keys = Keys(), pending: Pending | None = None) -> Mapped:
    """The rows of an ExportTraceServiceRequest: one request per SERVER (or CONSUMER) span
    with its calls, fingerprints, locations, stacks, links and loop blocks, as the store's
    Arrow tables (``Mapped.tables``), built column by column; ``Mapped.batch`` holds the
    segments standing for the payload's sources."""
    now = time.monotonic()
    pending = pending if pending is not None else Pending()
    spans = _spans(msg, keys)
    out = Mapped(records.Batch(), spans=len(spans))
    for trace in {s.trace for s in spans if s.kind in REQUEST_KINDS}:
        spans.extend(pending.take(trace))
    if not spans:
        return out
    n = len(spans)
    kind = np.array([s.kind for s in spans], dtype=np.int64)
    is_req = (kind == SPAN_SERVER) | (kind == SPAN_CONSUMER)
    is_block = np.array([BLOCK_MS in s.attrs for s in spans], dtype=bool) & ~is_req
    callish = np.array([_is_call(s) for s in spans], dtype=bool) & ~is_req & ~is_block
    par, owner, state, nested = _ancestry(spans, is_req, callish)
    # One request per id (trace + span): the last of a span sent twice.
    last = {s.trace + s.span: i for i, s in enumerate(spans)}
    servers = [
        i for i in np.nonzero(is_req)[0].tolist() if last[spans[i].trace + spans[i].span] == i
    ]
    row_of = np.full(n + 1, -1, dtype=np.int64)  # row_of[-1]: no request
    row_of[servers] = np.arange(len(servers))
    # A call or block whose ancestry stops at a span not seen yet waits, with the spans
    # between (a framework's INTERNAL spans), for a later payload of its trace; a block of a
    # request stored before goes to it.
    early: list[tuple[Span, Served | None]] = []
    waiting: dict[int, Span] = {}
    lone = ((callish & ~nested) | is_block) & (state == _MISSING)
    for i in np.nonzero(lone | (is_block & (state == _ROOT)))[0].tolist():
        s = spans[i]
        if is_block[i]:
            stored = _served(s, pending)
            if stored is not None or state[i] == _ROOT:
                early.append((s, stored))
                continue
        j = i
        while j >= 0 and j not in waiting:
            waiting[j] = spans[j]
            j = int(par[j])
    pending.add(list(waiting.values()), now)
    out.waiting = len(waiting)

    start, end = _nanos(spans, 5), _nanos(spans, 6)
    calls = np.nonzero(callish & ~nested & (state == _FOUND) & (row_of[owner] >= 0))[0]
    crow = row_of[owner[calls]]
    order = np.lexsort((start[calls], crow))
    calls, crow = calls[order], crow[order]
    segments: dict[tuple[str, str, str], records.SegmentState] = {}
    dictionary: Dictionary = {}
    reqs = _requests([spans[i] for i in servers], keys, segments, out.batch)
    call_spans = [spans[i] for i in calls.tolist()]
    cols = _calls(call_spans, dictionary)
    req_start = start[servers]
    cols["off"] = start[calls] - req_start[crow]
    cols["dur"] = np.maximum(end[calls] - start[calls], 0)
    seq = np.arange(len(calls)) - np.searchsorted(crow, crow)
    for trace, served in zip(reqs["trace"], reqs["served"], strict=True):
        pending.served(trace, served)
    blocks = np.nonzero(is_block & (state == _FOUND))[0].tolist()
    for i in blocks:
        row = int(row_of[owner[i]])
        if row < 0:
            continue
        b = spans[i]
        lo, hi = np.searchsorted(crow, [row, row + 1])
        done = [k for k in range(lo, hi) if int(end[calls[k]]) <= b.start]
        last_call = None
        if done:
            k = max(done, key=lambda k: int(end[calls[k]]))
            fp = dictionary.get((FINGERPRINT, cols["fp"][k]), {})
            last_call = {
                "kind": cols["kind"][k],
                "text": fp.get("text"),
                "rows": cols["rows"][k],
                "ms": int(cols["dur"][k]) / 1e6,
            }
        out.batch.add(_segment(segments, b), BLOCKER, _blocker(b, reqs["served"][row], last_call))
        out.blockers += 1
    for b, stored in early:
        out.batch.add(_segment(segments, b), BLOCKER, _blocker(b, stored, None))
        out.blockers += 1
    links = _links([spans[i] for i in servers], call_spans, crow, seq, cols)
    links += _inner_links(
        spans, par, calls, crow, seq, cols, callish & nested & (kind == SPAN_CLIENT)
    )
    out.requests, out.calls = len(servers), len(calls)
    if servers or out.blockers:
        times = (req_start, end[servers])
        out.new = [k for k in dictionary if k not in pending.stored]
        out.tables = _tables(out.batch, reqs, times, cols, crow, seq, links, dictionary, out.new)
    return out


def _requests(
    servers: list[Span],
    keys: Keys,
    segments: dict[tuple[str, str, str], records.SegmentState],
    batch: records.Batch,
) -> dict[str, list[Any]]:
    """The request columns of the SERVER and CONSUMER spans (and the segment of each)."""
    cols: dict[str, list[Any]] = {k: [] for k in _REQUEST_COLUMNS}
    for srv in servers:
        seg = _segment(segments, srv)
        a = srv.attrs
        method = _method(a)
        target = values.as_str(_first(a, "url.path", "http.target")) or ""
        path = target.split("?", 1)[0] or None
        route = values.as_str(_first(a, "http.route"))
        if srv.kind == SPAN_CONSUMER:
            endpoint = srv.name or "<unknown>"
        elif route:
            endpoint = f"{method} {route}" if method else route
        elif path:
            endpoint = f"{method or 'GET'} {fpr.url_template(path)}"
        else:
            endpoint = srv.name or "<unknown>"
        rid = srv.trace + srv.span
        cols["trace"].append(srv.trace)
        cols["id"].append(rid)
        cols["seg"].append(batch.touch(seg))
        cols["kind"].append("web" if srv.kind == SPAN_SERVER else "background")
        cols["method"].append(method)
        cols["endpoint"].append(values.text(endpoint))
        cols["path"].append(values.text(path) if path else None)
        cols["status"].append(
            values.as_int32(_first(a, "http.response.status_code", "http.status_code"))
        )
        cols["error"].append(srv.error)
        cols["user"].append(
            values.as_str(_first(a, *keys.user) or _first(srv.resource, *keys.user))
        )
        cols["tenant"].append(
            values.as_str(_first(a, *keys.tenant) or _first(srv.resource, *keys.tenant))
        )
        cols["req_bytes"].append(
            values.as_int(_first(a, "http.request.body.size", "http.request_content_length"))
        )
        cols["resp_bytes"].append(
            values.as_int(_first(a, "http.response.body.size", "http.response_content_length"))
        )
        cols["served"].append(Served(rid, endpoint, method, path, srv.start, srv.end, srv.source))
    return cols


_REQUEST_COLUMNS = (
    "trace", "id", "seg", "kind", "method", "endpoint", "path", "status", "error", "user",
    "tenant", "req_bytes", "resp_bytes", "served",
)  # fmt: skip


# What a call is, but its rows and status, by its span's name and other attributes: services
# repeat their calls, and working one out (normalising a statement) costs far more than a look-up.
Shape = tuple[str, str, int, int | None, str | None, int | None, int | None, Dictionary]
_shapes: dict[tuple[Any, ...], Shape] = {}
_ROWS = "db.response.returned_rows"
_VARYING = frozenset({_ROWS, "http.response.status_code", "http.status_code"})


def _shape(c: Span) -> Shape:
    a = c.attrs
    if _VARYING.isdisjoint(a):
        key: tuple[Any, ...] = (c.name, *a.items())
    else:
        key = (c.name, *(kv for kv in a.items() if kv[0] not in _VARYING))
    try:
        hit = _shapes.get(key)
    except TypeError:  # a list or map value: not cached
        key, hit = (), None
    if hit is None:
        entries: Dictionary = {}
        got = _call(c, 0, entries)
        hit = (
            got["kind"],
            got["system"],
            got["fp"],
            got.get("ph"),
            got.get("host"),
            got.get("site"),
            got.get("stack"),
            entries,
        )
        if key:
            if len(_shapes) >= _MAX_CACHED:
                _shapes.clear()
            _shapes[key] = hit
    return hit


def _calls(calls: list[Span], dictionary: Dictionary) -> dict[str, Any]:
    """The call columns (but times) of the client spans, in order."""
    names = ("kind", "system", "fp", "ph", "host", "site", "stack")
    cols: dict[str, list[Any]] = {k: [] for k in (*names, "rows", "status", "error")}
    kind, system, fp, ph, host, site, stack = (cols[k] for k in names)
    rows, status, error = cols["rows"], cols["status"], cols["error"]
    for c in calls:
        k, sy, f, p, h, si, st, entries = _shape(c)
        dictionary.update(entries)
        kind.append(k)
        system.append(sy)
        fp.append(f)
        ph.append(p)
        host.append(h)
        site.append(si)
        stack.append(st)
        error.append(c.error)
        a = c.attrs
        if k == "http":
            rows.append(None)
            status.append(
                values.as_int32(_first(a, "http.response.status_code", "http.status_code"))
            )
        else:
            rows.append(values.as_int(a.get(_ROWS)) if _ROWS in a else None)
            status.append(None)
    return cols


def _links(
    servers: list[Span], calls: list[Span], crow: np.ndarray, seq: np.ndarray, cols: dict[str, Any]
) -> list[tuple[int, str, str, int | None]]:
    """The span ids that link a request to the call of another service that made it: (row,
    key, trace + span id, call seq). A request's parent span (``otlp.parent_span``); an HTTP
    call's own span (``otlp.call_span``), which the callee's request names as its parent."""
    out: list[tuple[int, str, str, int | None]] = []
    for row, s in enumerate(servers):
        if s.parent:
            out.append((row, PARENT_SPAN, s.trace + s.parent, None))
    for k, c in enumerate(calls):
        if cols["kind"][k] == "http":
            out.append((int(crow[k]), CALL_SPAN, c.trace + c.span, int(seq[k])))
    return out


def _inner_links(
    spans: list[Span],
    par: np.ndarray,
    calls: np.ndarray,
    crow: np.ndarray,
    seq: np.ndarray,
    cols: dict[str, Any],
    inner: np.ndarray,
) -> list[tuple[int, str, str, int | None]]:
    """The ``otlp.call_span`` rows of client spans inside an HTTP call (a transport's span in
    a library's): the service called names the innermost as its parent."""
    out: list[tuple[int, str, str, int | None]] = []
    at = {int(i): k for k, i in enumerate(calls.tolist())}
    for i in np.nonzero(inner)[0].tolist():
        j = int(par[i])
        for _ in range(256):
            if j < 0 or j in at:
                break
            j = int(par[j])
        k = at.get(j)
        if k is not None and cols["kind"][k] == "http":
            s = spans[i]
            out.append((int(crow[k]), CALL_SPAN, s.trace + s.span, int(seq[k])))
    return out


def links(store: Any, trace_id: str) -> dict[str, Any]:
    """The requests of other services a request is linked with by OTLP span ids: ``upstream``,
    the call of another service's request that made it (None: none reported), and
    ``downstream``, for each of its calls that another reporting service served, that
    request with where its time went (its calls by kind, and the statement or call that
    took most of it)."""
    cols = (
        "r.trace_id, r.service, r.endpoint, r.duration_ms, r.status, r.error, r.db_calls,"
        " r.db_ms, r.http_calls, r.http_ms, r.cache_calls, r.cache_ms"
    )
    prefix = trace_id[:32]
    down = store.query(
        f"""
        SELECT CAST(c.num AS INTEGER) AS seq, {cols}
        FROM attributes c
        JOIN attributes p ON p.kind = '{LINK}' AND p.key = '{PARENT_SPAN}' AND p.value = c.value
            AND starts_with(p.trace_id, ?)
        JOIN requests r ON r.trace_id = p.trace_id
        WHERE c.kind = '{LINK}' AND c.key = '{CALL_SPAN}' AND c.trace_id = ?
        ORDER BY seq
        """,
        [prefix, trace_id],
    )
    up = store.query(
        f"""
        SELECT CAST(c.num AS INTEGER) AS seq, {cols}
        FROM attributes p
        JOIN attributes c ON c.kind = '{LINK}' AND c.key = '{CALL_SPAN}' AND c.value = p.value
            AND starts_with(c.trace_id, ?)
        JOIN requests r ON r.trace_id = c.trace_id
        WHERE p.kind = '{LINK}' AND p.key = '{PARENT_SPAN}' AND p.trace_id = ?
        LIMIT 1
        """,
        [prefix, trace_id],
    )
    for d in down:
        top = store.query(
            """
            SELECT f.text, c.kind, count(*) AS calls, sum(c.duration_ms) AS ms
            FROM calls c LEFT JOIN fingerprints f ON f.id = c.fingerprint_id
            WHERE c.trace_id = ? GROUP BY 1, 2 ORDER BY ms DESC LIMIT 1
            """,
            [d["trace_id"]],
        )
        d["top_call"] = top[0] if top else None
    return {"upstream": up[0] if up else None, "downstream": down}


def link_lines(found: dict[str, Any], calls: list[dict[str, Any]]) -> list[str]:
    """``links`` in words, for a request whose calls are ``calls`` (by seq)."""
    out = []
    up = found.get("upstream")
    if up:
        out.append(
            f"called by {up['service']} {up['endpoint']} (its call #{up['seq']}, "
            f"trace {up['trace_id']})"
        )
    by_seq = {c.get("seq"): c for c in calls}
    for d in found.get("downstream") or []:
        call = by_seq.get(d["seq"]) or {}
        what = call.get("fingerprint") or "the call"
        spent = [
            f"{label} {float(d[k + '_ms'] or 0):.0f} ms in {d[k + '_calls']} calls"
            for k, label in (("db", "DB"), ("http", "HTTP"), ("cache", "cache"))
            if d[k + "_calls"]
        ]
        line = (
            f"call #{d['seq']} {what} -> {d['service']} {d['endpoint']} "
            f"{float(d['duration_ms'] or 0):.0f} ms"
        )
        if spent:
            line += ": " + ", ".join(spent)
        top = d.get("top_call")
        if top and top["text"]:
            line += f"; most in `{top['text'][:80]}` x{top['calls']} ({float(top['ms']):.0f} ms)"
        out.append(line + f" (trace {d['trace_id']})")
    return out


def _tables(
    batch: records.Batch,
    reqs: dict[str, list[Any]],
    times: tuple[np.ndarray, np.ndarray],
    cols: dict[str, Any],
    crow: np.ndarray,
    seq: np.ndarray,
    links: list[tuple[int, str, str, int | None]],
    dictionary: Dictionary,
    new: list[tuple[bytes, int]],
) -> Tables:
    """The store's tables for the mapped rows: requests (with their calls' counts and time by
    kind), calls, the link attributes, dictionaries and loop blocks, split by day."""
    now_ns = time.time_ns()
    out = Tables()
    n, m = len(reqs["id"]), len(crow)
    segs = batch.segments
    seg = np.asarray(reqs["seg"], dtype=np.int64)
    ts_ns, end_ns = times
    dur = np.maximum(end_ns - ts_ns, 0).astype(np.float64) / 1e6
    bad = (ts_ns <= 0) | (ts_ns >= values.TS_MAX)
    ts_ns = np.where(bad, now_ns, ts_ns)
    day = ts_ns // values.NS_PER_DAY
    ts = pa.array(ts_ns // 1000, pa.timestamp("us"))
    service = pa.array([(segs[i].service or "unknown") for i in seg.tolist()], pa.string())
    endpoint = pa.array(reqs["endpoint"], pa.string())
    trace_id = pa.array(reqs["id"], pa.string())

    internal = {
        fid
        for (rtype, fid), obj in dictionary.items()
        if rtype == FINGERPRINT and obj["kind"] == "db" and _internal(obj["text"])
    }
    ckind = [
        internal_sql.INTERNAL_KIND if k == "db" and fp in internal else k
        for k, fp in zip(cols["kind"], cols["fp"], strict=True)
    ]
    cdur = np.asarray(cols["dur"], dtype=np.float64) / 1e6
    agg: dict[str, pa.Array] = {}
    kinds = np.array(ckind, dtype=object)
    for k in ("db", "http", "cache"):
        mask = kinds == k if m else np.zeros(0, dtype=bool)
        agg[f"{k}_calls"] = pa.array(np.bincount(crow[mask], minlength=n).astype(np.int32))
        agg[f"{k}_ms"] = pa.array(np.bincount(crow[mask], weights=cdur[mask], minlength=n))
    req = pa.table(
        {
            "ts": ts,
            "trace_id": trace_id,
            "service": service,
            "host": pa.array([segs[i].host or None for i in seg.tolist()], pa.string()),
            "pid": pa.array([segs[i].pid for i in seg.tolist()], pa.int32()),
            "kind": pa.array(reqs["kind"], pa.string()),
            "method": pa.array(reqs["method"], pa.string()),
            "endpoint": endpoint,
            "path": pa.array(reqs["path"], pa.string()),
            "status": pa.array(reqs["status"], pa.int32()),
            "error": pa.array(reqs["error"], pa.string()),
            "duration_ms": pa.array(dur),
            "cpu_ms": pa.nulls(n, pa.float64()),
            "req_bytes": pa.array(reqs["req_bytes"], pa.int64()),
            "resp_bytes": pa.array(reqs["resp_bytes"], pa.int64()),
            "user": pa.array(reqs["user"], pa.string()),
            "tenant": pa.array(reqs["tenant"], pa.string()),
            **agg,
            "calls_dropped": pa.array(np.zeros(n, dtype=np.int32)),
            "gc_ms": pa.nulls(n, pa.float64()),
            "gc_count": pa.nulls(n, pa.int32()),
            "version": pa.array([segs[i].version or None for i in seg.tolist()], pa.string()),
        },
        schema=schema.REQUESTS.arrow_schema(),
    )
    crow_pa = pa.array(crow, pa.int64())
    call = pa.table(
        {
            "ts": pc.take(ts, crow_pa),
            "trace_id": pc.take(pc.dictionary_encode(trace_id), crow_pa),
            "service": pc.take(pc.dictionary_encode(service), crow_pa),
            "endpoint": pc.take(pc.dictionary_encode(endpoint), crow_pa),
            "seq": pa.array(seq.astype(np.int32)),
            "kind": pa.array(ckind, pa.string()),
            "system": pa.array(cols["system"], pa.string()),
            "fingerprint_id": pa.array(cols["fp"], pa.int64()),
            "offset_ms": pa.array(np.asarray(cols["off"], dtype=np.float64) / 1e6),
            "duration_ms": pa.array(cdur),
            "rows": pa.array(cols["rows"], pa.int64()),
            "bytes": pa.nulls(m, pa.int64()),
            "params_hash": pa.array(cols["ph"], pa.int64()),
            "stack_id": pa.array(cols["stack"], pa.int64()),
            "site_id": pa.array(cols["site"], pa.int64()),
            "host": pa.array(cols["host"], pa.string()),
            "status": pa.array(cols["status"], pa.int32()),
            "hit": pa.nulls(m, pa.bool_()),
            "wait_ms": pa.nulls(m, pa.float64()),
            "error": pa.array(cols["error"], pa.string()),
            "unfinished": pa.nulls(m, pa.bool_()),
        }
    )
    lrow = pa.array([r for r, *_ in links], pa.int64())
    attrs = pa.table(
        {
            "ts": pc.take(ts, lrow),
            "trace_id": pc.take(trace_id, lrow),
            "service": pc.take(service, lrow),
            "endpoint": pc.take(endpoint, lrow),
            "kind": pa.array([LINK] * len(links), pa.string()),
            "key": pa.array([k for _, k, _, _ in links], pa.string()),
            "value": pa.array([v for _, _, v, _ in links], pa.string()),
            "num": pa.array([s for *_, s in links], pa.float64()),
        },
        schema=schema.ATTRIBUTES.arrow_schema(),
    )
    out.requests, out.calls = n, m
    days = np.unique(day)
    for d in days.tolist():
        key = values.EPOCH + timedelta(days=d)
        if len(days) == 1:
            out.days[key] = {"requests": req, "calls": call, "attributes": attrs}
            continue
        in_day = day == d
        out.days[key] = {
            "requests": req.filter(pa.array(in_day)),
            "calls": call.filter(pa.array(in_day[crow])),
            "attributes": attrs.filter(
                pa.array(in_day[np.asarray([r for r, *_ in links], np.int64)])
            ),
        }
    if batch.events:
        for d, parts in evidence_tables(batch, now_ns).items():
            out.days.setdefault(d, {}).update(parts)
    _dictionary_tables(out, {k: dictionary[k] for k in new}, internal)
    return out


def _dictionary_tables(out: Tables, dictionary: Dictionary, internal: set[int]) -> None:
    fps = [o for (t, _), o in dictionary.items() if t == FINGERPRINT]
    locs = [o for (t, _), o in dictionary.items() if t == LOCATION]
    stacks = [o for (t, _), o in dictionary.items() if t == STACK]
    if fps:
        out.fingerprints = pa.table(
            {
                "id": [o["id"] for o in fps],
                "kind": [
                    internal_sql.INTERNAL_KIND if o["id"] in internal else o["kind"] for o in fps
                ],
                "op": [o["op"] for o in fps],
                "text": [values.text(o["text"]) for o in fps],
            },
            schema=schema.FINGERPRINTS.arrow_schema(),
        )
    if locs:
        out.locations = pa.table(
            {
                "id": [o["id"] for o in locs],
                "file": [values.text(o["file"]) for o in locs],
                "line": [o["line"] for o in locs],
                "function": [values.text(o["func"]) for o in locs],
                "app": [True] * len(locs),
            },
            schema=schema.LOCATIONS.arrow_schema(),
        )
    if stacks:
        out.stacks = pa.table(
            {"id": [o["id"] for o in stacks], "frames": [o["frames"] for o in stacks]},
            schema=schema.STACKS.arrow_schema(),
        )


_internals: dict[str, bool] = {}


def _internal(text: str) -> bool:
    hit = _internals.get(text)
    if hit is None:
        if len(_internals) >= _MAX_CACHED:
            _internals.clear()
        hit = _internals[text] = internal_sql.is_internal(text)
    return hit


def _segment(
    segments: dict[tuple[str, str, str], records.SegmentState], s: Span
) -> records.SegmentState:
    """The segment standing for a span's source (service, host, version; the process id)."""
    seg = segments.get(s.source)
    if seg is None:
        service, host, version = s.source
        base = f"otlp/{service}/{host}"
        seg = segments[s.source] = records.SegmentState(base, base, 0, service, host)
        seg.version = version
        pid = values.as_int(s.resource.get("process.pid"))
        seg.pid = pid if pid is not None and 0 <= pid < 2**31 else None
    return seg


def _served(block: Span, pending: Pending) -> Served | None:
    """The stored request of a block's trace and service: the one whose span holds the block,
    else the trace's only request of that service."""
    mine = [r for r in pending.servers.get(block.trace, ()) if r.source == block.source]
    inside = [r for r in mine if r.start <= block.start <= r.end]
    if inside:
        return inside[-1]
    return mine[0] if len(mine) == 1 else None


def _blocker(b: Span, req: Served | None, last_call: dict[str, Any] | None) -> dict[str, Any]:
    """A loop block as the agent's BLOCKER record (store.evidence): the request whose code
    held the loop and the last call it finished before the block (a large result parsed next).
    No stack: the span does not say which line blocked."""
    out: dict[str, Any] = {
        "ts": b.start,
        "dur": max(b.end - b.start, 0),
        "delayed": values.as_int(b.attrs.get(BLOCK_DELAYED)),
        "stacks": [],
    }
    if req is not None:
        out.update(id=req.id, endpoint=req.endpoint, method=req.method, path=req.path)
        if last_call is not None:
            out["last_call"] = last_call
    return out


def _is_call(s: Span) -> bool:
    a = s.attrs
    if s.kind == SPAN_CLIENT:
        return True
    return "db.system" in a or "db.system.name" in a  # some drivers report INTERNAL spans


_MAX_CACHED = 20_000
# Normalised text and operation of statements met lately (normalising costs far more than a
# look-up, and services repeat their statements).
_normalized: dict[str, tuple[str, str]] = {}


_ids: dict[tuple[str | int, ...], int] = {}


def _stable_id(*parts: str | int) -> int:
    """fpr.stable_id (the agent's ids for the same text or location), for parts met lately."""
    hit = _ids.get(parts)
    if hit is None:
        if len(_ids) >= _MAX_CACHED:
            _ids.clear()
        hit = _ids[parts] = fpr.stable_id(*parts)
    return hit


def _normalize(statement: str) -> tuple[str, str]:
    hit = _normalized.get(statement)
    if hit is None:
        text = fpr.normalize_sql(statement)
        if len(_normalized) >= _MAX_CACHED:
            _normalized.clear()
        hit = _normalized[statement] = (text, fpr.sql_operation(text))
    return hit


def _method(a: dict[str, Any]) -> str | None:
    m = _first(a, "http.request.method", "http.method")
    return str(m).upper() if m is not None else None


def _call(c: Span, t0: int, dictionary: Dictionary) -> dict[str, Any]:
    a = c.attrs
    system = values.as_str(_first(a, "db.system.name", "db.system"))
    out: dict[str, Any] = {"off": c.start - t0, "dur": max(c.end - c.start, 0), "error": c.error}
    if system is not None:
        system = system.lower()
        statement = values.as_str(_first(a, "db.query.text", "db.statement"))
        operation = values.as_str(_first(a, "db.operation.name", "db.operation"))
        if system in CACHE_SYSTEMS:
            kind = "cache"
            words = (statement or operation or c.name).split()
            cmd = words[0].upper() if words else "?"
            key = fpr.cache_key_template(words[1]) if len(words) > 1 else ""
            text, op = f"{cmd} {key}".strip(), cmd
        else:
            kind = "db"
            if statement:
                text, op = _normalize(statement)
            else:
                text = (operation or c.name).upper()
                op = text.split()[0] if text.split() else "OTHER"
        out["rows"] = values.as_int(_first(a, "db.response.returned_rows"))
        out["ph"] = _params_hash(statement or "", text, a)
    else:
        kind, system = "http", "http"
        method = _method(a) or "GET"
        url = values.as_str(_first(a, "url.full", "http.url")) or ""
        rest = url.split("://", 1)[-1]
        url_host, _, url_path = rest.partition("/")
        url_host = url_host.rsplit("@", 1)[-1]  # never keep credentials in a URL
        host = values.as_str(_first(a, "server.address", "net.peer.name")) or url_host
        port = _first(a, "server.port", "net.peer.port")
        if host and port is not None and ":" not in host:
            host = f"{host}:{port}"
        host = host or c.name
        text, op = f"{method} {host}{fpr.url_template('/' + url_path)}", method
        out["host"] = host
        out["status"] = values.as_int(_first(a, "http.response.status_code", "http.status_code"))
    fid = _stable_id(kind, text)
    if (FINGERPRINT, fid) not in dictionary:
        dictionary[FINGERPRINT, fid] = {"id": fid, "kind": kind, "text": text, "op": op}
    out.update(kind=kind, system=system, fp=fid)
    site = _site(a)
    if site is not None:
        lid = _stable_id(*site)
        sid = _stable_id(lid)
        file, line, func = site
        if (STACK, sid) not in dictionary:
            dictionary[LOCATION, lid] = {
                "id": lid,
                "file": file,
                "line": line,
                "func": func,
                "app": True,
            }
            dictionary[STACK, sid] = {"id": sid, "frames": [lid]}
        out.update(site=lid, stack=sid)
    return out


_PLACEHOLDER = re.compile(r"\$\d+|%s|%\(\w+\)s|\?|(?<![:\w]):[A-Za-z_]\w*")


def _params_hash(statement: str, text: str, a: dict[str, Any]) -> int | None:
    """What the agent's params_hash says (the same statement with the same values, within a
    request): the ``db.query.parameter.*`` values when reported; else the statement itself
    when its values are written into it (literals the fingerprint replaced); None when the
    values are unknown (placeholders without parameters) or there are none."""
    if _PARAMETER in a:
        params = sorted(
            (k, str(v)) for k, v in a.items() if k.startswith(_PARAMETER) and k != _PARAMETER
        )
        if params:
            return _stable_id(*(x for kv in params for x in kv))
    if not statement or _PLACEHOLDER.search(statement):
        return None
    if "?" in text or "(...)" in text:
        return _stable_id(statement)
    return None


def _site(a: dict[str, Any]) -> tuple[str, int, str] | None:
    """(file, line, function) of the ``code.*`` attributes (old and current names)."""
    file = values.as_str(_first(a, "code.file.path", "code.filepath"))
    line = values.as_int(_first(a, "code.line.number", "code.lineno"))
    func = values.as_str(_first(a, "code.function.name", "code.function"))
    if file is None and func is None:
        return None
    ns = values.as_str(_first(a, "code.namespace"))
    if func and ns and "." not in func:
        func = f"{ns}.{func}"
    return file or "?", line if line is not None and 0 <= line < 2**31 else 0, func or "?"
