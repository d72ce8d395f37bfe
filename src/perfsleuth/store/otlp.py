"""OTLP traces into the store: OpenTelemetry spans of any language become requests and calls.

An ``ExportTraceServiceRequest`` (OTLP/HTTP protobuf or JSON, maybe gzip) is decoded with the
official ``opentelemetry-proto`` messages and mapped onto the records the agent writes, which
go through the spool ingest's own conversion (:class:`perfsleuth.store.ingest.Batch`) and the
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
from typing import Any

from perfsleuth.store import ingest as ing
from perfsleuth.wire import FINGERPRINT, LOCATION, REQUEST, STACK
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
    }
)
_PARAMETER = "db.query.parameter."


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


@dataclass
class Span:
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


@dataclass
class Pending:
    """Client spans waiting for their SERVER ancestor, by trace, oldest trace first; at most
    ``max_spans`` in all and each for ``max_age_s`` (then dropped, and counted)."""

    max_spans: int = 50_000
    max_age_s: float = 120.0
    traces: OrderedDict[str, tuple[float, list[Span]]] = field(default_factory=OrderedDict)
    size: int = 0
    dropped: int = 0

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
    batch: ing.Batch
    spans: int = 0
    requests: int = 0
    calls: int = 0
    waiting: int = 0  # client spans held for a SERVER span still to come


def _spans(msg: Any, keys: Keys) -> list[Span]:
    wanted = SPAN_KEYS | set(keys.user) | set(keys.tenant)
    out: list[Span] = []
    for rs in msg.resource_spans:
        res = _attrs(rs.resource.attributes)
        source = (
            ing._str(res.get("service.name")) or "unknown_service",
            ing._str(res.get("host.name")) or "",
            ing._str(res.get("service.version")) or "",
        )
        for ss in rs.scope_spans:
            for sp in ss.spans:
                attrs = _attrs(sp.attributes, wanted)
                error = None
                for ev in sp.events:
                    if ev.name == "exception":
                        ea = _attrs(ev.attributes)
                        error = ing._str(_first(ea, "exception.type", "exception.message"))
                        break
                if error is None and sp.status.code == STATUS_ERROR:
                    error = sp.status.message or "error"
                out.append(
                    Span(
                        sp.trace_id.hex(),
                        sp.span_id.hex(),
                        sp.parent_span_id.hex(),
                        int(sp.kind),
                        sp.name,
                        int(sp.start_time_unix_nano),
                        int(sp.end_time_unix_nano),
                        attrs,
                        error,
                        source,
                        res,
                    )
                )
    return out


def to_batch(msg: Any, keys: Keys = Keys(), pending: Pending | None = None) -> Mapped:
    """The records of an ExportTraceServiceRequest as an ingest batch: one request per
    SERVER span, with its calls, locations, stacks and fingerprints."""
    now = time.monotonic()
    pending = pending if pending is not None else Pending()
    spans = _spans(msg, keys)
    out = Mapped(ing.Batch(), spans=len(spans))
    servers = [s for s in spans if s.kind in REQUEST_KINDS]
    by_id: dict[tuple[str, str], Span] = {(s.trace, s.span): s for s in spans}
    for trace in {s.trace for s in servers}:
        for s in pending.take(trace):
            by_id.setdefault((s.trace, s.span), s)
    calls: dict[tuple[str, str], list[Span]] = {(s.trace, s.span): [] for s in servers}
    # A call whose ancestry stops at a span not seen yet waits, with the spans between
    # (a framework's INTERNAL spans), for a later payload of its trace.
    waiting: dict[tuple[str, str], Span] = {}
    for s in by_id.values():
        if s.kind in REQUEST_KINDS or not _is_call(s):
            continue
        owner, nested, complete = _owner(s, by_id)
        if nested:
            continue
        if owner is not None:
            calls[(owner.trace, owner.span)].append(s)
        elif not complete:
            cur: Span | None = s
            while cur is not None and (cur.trace, cur.span) not in waiting:
                waiting[cur.trace, cur.span] = cur
                cur = by_id.get((cur.trace, cur.parent)) if cur.parent else None
    pending.add(list(waiting.values()), now)
    out.waiting = len(waiting)
    segments: dict[tuple[str, str, str], ing.SegmentState] = {}
    dictionary: Dictionary = {}
    for srv in servers:
        seg = segments.get(srv.source)
        if seg is None:
            service, host, version = srv.source
            base = f"otlp/{service}/{host}"
            seg = segments[srv.source] = ing.SegmentState(base, base, 0, service, host)
            seg.version = version
        own = sorted(calls[(srv.trace, srv.span)], key=lambda c: c.start)
        req = _request(srv, own, keys, dictionary)
        # As the agent's JSON record: the batch reads these in bulk with Arrow's JSON reader.
        out.batch.add_raw(seg, REQUEST, json.dumps(req, ensure_ascii=False).encode(), 0, 0)
        out.requests += 1
        out.calls += len(own)
    for (rtype, _), obj in dictionary.items():
        out.batch.add(next(iter(segments.values())), rtype, obj)
    return out


def _is_call(s: Span) -> bool:
    a = s.attrs
    if s.kind == SPAN_CLIENT:
        return True
    return "db.system" in a or "db.system.name" in a  # some drivers report INTERNAL spans


def _owner(s: Span, by_id: dict[tuple[str, str], Span]) -> tuple[Span | None, bool, bool]:
    """(nearest SERVER ancestor, whether a client span lies between, whether the ancestry
    is complete: it ends at a root rather than at a span not seen yet)."""
    nested = False
    cur = s
    for _ in range(256):  # a cycle of parent ids must not hang ingest
        if not cur.parent:
            return None, nested, True
        up = by_id.get((cur.trace, cur.parent))
        if up is None:
            return None, nested, False
        if up.kind in REQUEST_KINDS:
            return up, nested, True
        if up.kind == SPAN_CLIENT or _is_call(up):
            nested = True
        cur = up
    return None, nested, True


# The location, stack and fingerprint records a payload's calls use, by (type, id).
Dictionary = dict[tuple[bytes, int], dict[str, Any]]
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


def _request(srv: Span, calls: list[Span], keys: Keys, dictionary: Dictionary) -> dict[str, Any]:
    a = srv.attrs
    method = _method(a)
    target = ing._str(_first(a, "url.path", "http.target")) or ""
    path = target.split("?", 1)[0] or None
    route = ing._str(_first(a, "http.route"))
    if srv.kind == SPAN_CONSUMER:
        endpoint = srv.name or "<unknown>"
    elif route:
        endpoint = f"{method} {route}" if method else route
    elif path:
        endpoint = f"{method or 'GET'} {fpr.url_template(path)}"
    else:
        endpoint = srv.name or "<unknown>"
    return {
        "id": srv.trace + srv.span,
        "ts": srv.start,
        "dur": max(srv.end - srv.start, 0),
        "kind": "web" if srv.kind == SPAN_SERVER else "background",
        "method": method,
        "endpoint": endpoint,
        "path": path,
        "status": ing.as_int(_first(a, "http.response.status_code", "http.status_code")),
        "error": srv.error,
        "user": ing._str(_first(a, *keys.user) or _first(srv.resource, *keys.user)),
        "tenant": ing._str(_first(a, *keys.tenant) or _first(srv.resource, *keys.tenant)),
        "req_bytes": ing.as_int(_first(a, "http.request.body.size", "http.request_content_length")),
        "resp_bytes": ing.as_int(
            _first(a, "http.response.body.size", "http.response_content_length")
        ),
        "calls": [_call(c, srv.start, dictionary) for c in calls],
    }


def _call(c: Span, t0: int, dictionary: Dictionary) -> dict[str, Any]:
    a = c.attrs
    system = ing._str(_first(a, "db.system.name", "db.system"))
    out: dict[str, Any] = {"off": c.start - t0, "dur": max(c.end - c.start, 0), "error": c.error}
    if system is not None:
        system = system.lower()
        statement = ing._str(_first(a, "db.query.text", "db.statement"))
        operation = ing._str(_first(a, "db.operation.name", "db.operation"))
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
        out["rows"] = ing.as_int(_first(a, "db.response.returned_rows"))
        out["ph"] = _params_hash(statement or "", text, a)
    else:
        kind, system = "http", "http"
        method = _method(a) or "GET"
        url = ing._str(_first(a, "url.full", "http.url")) or ""
        rest = url.split("://", 1)[-1]
        url_host, _, url_path = rest.partition("/")
        url_host = url_host.rsplit("@", 1)[-1]  # never keep credentials in a URL
        host = ing._str(_first(a, "server.address", "net.peer.name")) or url_host
        port = _first(a, "server.port", "net.peer.port")
        if host and port is not None and ":" not in host:
            host = f"{host}:{port}"
        host = host or c.name
        text, op = f"{method} {host}{fpr.url_template('/' + url_path)}", method
        out["host"] = host
        out["status"] = ing.as_int(_first(a, "http.response.status_code", "http.status_code"))
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
    params = sorted((k, str(v)) for k, v in a.items() if k.startswith(_PARAMETER))
    if params:
        return _stable_id(*(x for kv in params for x in kv))
    if not statement or _PLACEHOLDER.search(statement):
        return None
    if "?" in text or "(...)" in text:
        return _stable_id(statement)
    return None


def _site(a: dict[str, Any]) -> tuple[str, int, str] | None:
    """(file, line, function) of the ``code.*`` attributes (old and current names)."""
    file = ing._str(_first(a, "code.file.path", "code.filepath"))
    line = ing.as_int(_first(a, "code.line.number", "code.lineno"))
    func = ing._str(_first(a, "code.function.name", "code.function"))
    if file is None and func is None:
        return None
    ns = ing._str(_first(a, "code.namespace"))
    if func and ns and "." not in func:
        func = f"{ns}.{func}"
    return file or "?", line if line is not None and 0 <= line < 2**31 else 0, func or "?"
