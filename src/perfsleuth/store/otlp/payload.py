"""OTLP/HTTP bodies: an ``ExportTraceServiceRequest`` decoded (protobuf or JSON, maybe gzip)
with the official ``opentelemetry-proto`` messages, refusals as :class:`OtlpError` with the
HTTP status to answer, and the empty success response."""

from __future__ import annotations

import base64
import json
from typing import Any

from perfsleuth.store.otlp.view import as_view, messages
from perfsleuth.wire.inflate import GZIP, InflateError, inflate

MAX_BODY = 32 * 1024 * 1024  # bytes as sent (compressed or not)
MAX_DECODED = 128 * 1024 * 1024  # bytes after gunzip


_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


class OtlpError(Exception):
    """A payload refused: ``status`` is the HTTP status to answer, the message says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


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
    """The ExportTraceServiceRequest of an OTLP/HTTP body, as the view
    (:mod:`perfsleuth.store.otlp.view`); OtlpError (400, 413, 415) when it is not one. Its
    spans' attributes, statuses and events are decoded when read (``spans.read``, which
    raises the 400 for a malformed one)."""
    json_format, DecodeError, pb = _messages()
    if len(body) > MAX_BODY:
        raise OtlpError(413, f"the payload is {len(body)} bytes; at most {MAX_BODY} are taken")
    enc = (content_encoding or "identity").strip().lower()
    if enc == "gzip":
        try:
            body = inflate(body, GZIP, MAX_DECODED)
        except InflateError as e:
            if e.too_large:
                over = f"the payload is over {MAX_DECODED} bytes once unzipped"
                raise OtlpError(413, over) from None
            raise OtlpError(400, f"bad gzip body: {e}") from None
    elif enc not in ("identity", ""):
        raise OtlpError(415, f"unsupported Content-Encoding {enc!r}: send gzip or none")
    ctype = (content_type or "").split(";", 1)[0].strip().lower()
    msg = pb.ExportTraceServiceRequest()
    if ctype == "application/x-protobuf":
        try:
            msg = messages().request.FromString(body)
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
            taken = _take_ids_and_attributes(obj, json_format)
            json_format.ParseDict(obj, msg, ignore_unknown_fields=True)
            msg = as_view(msg)
            _put_ids_and_attributes(msg, taken)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
            raise OtlpError(400, f"bad OTLP JSON: {e}"[:500]) from None
    else:
        raise OtlpError(
            415,
            f"unsupported Content-Type {ctype!r}: send application/x-protobuf or application/json",
        )
    return msg


def _int32(v: int) -> bool:
    return -(2**31) <= v < 2**31


def _hex_to_base64(d: dict[str, Any]) -> None:
    """OTLP JSON spells trace and span ids in hex where protobuf's JSON mapping of ``bytes``
    expects base64: rewrite those of ``d`` (a link) in place (ValueError for one not hex)."""
    for k in _ID_FIELDS:
        v = d.get(k)
        if isinstance(v, str):
            d[k] = base64.b64encode(_from_hex(k, v)).decode()


def _from_hex(k: str, v: str) -> bytes:
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise ValueError(f"{k} {v[:40]!r} is not hex") from None


# A span's ids in OTLP JSON (hex) and the same fields' names in the message (which protobuf's
# JSON mapping takes too); then its name, kind and times, the values of those as ParseDict
# takes them: a kind as a number or a SpanKind name, times as digits or a number.
_SPAN_IDS = (
    ("traceId", "trace_id"),
    ("spanId", "span_id"),
    ("parentSpanId", "parent_span_id"),
)
_SPAN_FIELDS = (
    ("name", "name"),
    ("kind", "kind"),
    ("startTimeUnixNano", "start_time_unix_nano"),
    ("endTimeUnixNano", "end_time_unix_nano"),
)


# The KeyValue bytes of OTLP JSON attributes met lately, by key and value (services repeat
# their attributes), at most this many and bytes; longer ones are not kept.
_json_attributes: dict[tuple[Any, ...], bytes] = {}
_JSON_ATTRIBUTES_MAX = 20_000
_JSON_ATTRIBUTES_BYTES = 4 * 1024 * 1024
_json_attributes_size = 0


Taken = list[tuple[list[tuple[str, Any]], list[bytes]]]


def _take_ids_and_attributes(obj: dict[str, Any], json_format: Any) -> Taken:
    """Every span's ids (hex) and attributes taken out of the OTLP JSON (in place), in order:
    the ids as bytes (None: not taken), the attributes as the bytes of their official KeyValue
    messages, each distinct attribute parsed once by protobuf's JSON mapping (``ParseDict``,
    which spent ~85 % of a payload's decoding on attributes, ~17 us each, and ~30 % of the
    rest on the ids, base64 both ways). Links' ids are rewritten in base64 for ParseDict. A
    ParseError or ValueError for an attribute that is not a KeyValue or an id not hex."""
    global _json_attributes_size
    kv_type, kinds = messages().key_value, messages().span_kinds
    known = _json_attributes
    out: Taken = []
    for rs in _list(obj, "resourceSpans"):
        for ss in _list(rs, "scopeSpans"):
            for span in _list(ss, "spans"):
                fields: list[tuple[str, Any]] = []
                for k, name in _SPAN_IDS:
                    v = span.get(k)
                    if not isinstance(v, str):
                        continue
                    if name in span:  # the field twice: ParseDict's to sort out
                        span[k] = base64.b64encode(_from_hex(k, v)).decode()
                    else:
                        fields.append((name, _from_hex(k, v)))
                        del span[k]
                for k, name in _SPAN_FIELDS:
                    v = span.get(k)
                    if v is None or (name != k and name in span):
                        continue
                    t = v.__class__
                    if k == "kind":  # (a number beyond int32: ParseDict leaves it out)
                        v = kinds.get(v) if t is str else v if t is int and _int32(v) else None
                    elif k != "name":  # the times
                        if t is str and v.isascii() and v.isdigit():
                            v = int(v)
                        elif t is not int or v < 0:
                            v = None
                    elif t is not str:
                        v = None
                    if v is not None:  # else ParseDict says what is wrong with it
                        fields.append((name, v))
                        del span[k]
                for link in _list(span, "links"):
                    _hex_to_base64(link)
                items = span.pop("attributes", None)
                if items is None:
                    out.append((fields, []))
                    continue
                if not isinstance(items, list):
                    raise ValueError("a span's attributes are not a list")
                kvs = []
                for item in items:
                    value = item.get("value") if isinstance(item, dict) else None
                    key: tuple[Any, ...] | None = None
                    if isinstance(value, dict) and len(item) <= 2:
                        # (a float by its repr: -0.0 == 0.0, and their bytes differ)
                        key = (
                            item.get("key"),
                            *(
                                (k, v.__class__, repr(v) if v.__class__ is float else v)
                                for k, v in value.items()
                            ),
                        )
                        try:
                            raw = known.get(key)
                        except TypeError:  # an array or map value: parsed each time
                            key, raw = None, None
                        if raw is not None:
                            kvs.append(raw)
                            continue
                    raw = json_format.ParseDict(
                        item, kv_type(), ignore_unknown_fields=True
                    ).SerializeToString()
                    kvs.append(raw)
                    if key is not None and len(raw) <= 1024:
                        if (
                            len(known) >= _JSON_ATTRIBUTES_MAX
                            or _json_attributes_size + len(raw) > _JSON_ATTRIBUTES_BYTES
                        ):
                            known.clear()
                            _json_attributes_size = 0
                        known[key] = raw
                        _json_attributes_size += len(raw)
                out.append((fields, kvs))
    return out


def _put_ids_and_attributes(msg: Any, taken: Taken) -> None:
    """What :func:`_take_ids_and_attributes` took, given back to the spans of ``msg`` (the
    view parsed from the rest of the JSON, spans in the same order)."""
    spans = [sp for rs in msg.resource_spans for ss in rs.scope_spans for sp in ss.spans]
    if len(spans) != len(taken):  # (cannot be: the JSON was parsed)
        raise ValueError("the spans parsed are not the spans sent")
    for sp, (fields, kvs) in zip(spans, taken, strict=True):
        for name, v in fields:
            setattr(sp, name, v)
        if kvs:
            sp.attributes.extend(kvs)


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
