"""The official ``opentelemetry-proto`` messages as the mapping reads them: an
``ExportTraceServiceRequest`` whose spans keep their attributes and events as the
bytes of the official messages (:func:`messages`), and those bytes decoded with the official
messages, each distinct attribute once (:class:`AttributeCache`).

Why: upb makes a Python object for every key, value and ``AnyValue`` read, ~0.6 us an attribute
(about half of the mapping's time); services repeat their attributes (the same system, site,
route and statement in most spans), and a look-up of an attribute's bytes costs ~0.15 us.

The view is built from the official file descriptors in a pool of its own, with the same
names and field numbers; only the field types of ``Span.attributes`` and ``Span.events``
change (a message's bytes are a ``bytes`` field's value on the wire).
Whatever the mapping reads still goes through the official messages: the attributes met for
the first time are decoded together as one official ``KeyValueList``, an event as
the official ``Span.Event`` (the status is parsed with the payload, a message as in the
official one: a Status sent twice is merged); a malformed one fails its payload as a full parse
would (``DecodeError``).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any, NamedTuple


class Messages(NamedTuple):
    request: Any  # the ExportTraceServiceRequest view
    official: Any  # the official ExportTraceServiceRequest
    raw_list: Any  # RawKeyValues: `repeated bytes values = 1`, a KeyValueList's wire form
    key_value_list: Any  # the official KeyValueList
    key_value: Any  # the official KeyValue
    span_kinds: dict[str, int]  # Span.SpanKind's values by name
    status: Any  # the official Status
    event: Any  # the official Span.Event
    errors: tuple[type[BaseException], ...]  # what parsing raises for bytes that are not one


_BYTES_FIELDS = ("attributes", "events")  # (a Status stays a message: sent twice, merged)


@cache
def messages() -> Messages:
    """The view's and the official message classes (protobuf imported on first use)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2

    def proto(module: Any) -> Any:
        p = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(p)
        return p

    pool = descriptor_pool.DescriptorPool()
    common = proto(common_pb2)
    raw = common.message_type.add(name="RawKeyValues")
    raw.field.add(
        name="values",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    pool.Add(common)
    pool.Add(proto(resource_pb2))
    trace = proto(trace_pb2)
    (span,) = [m for m in trace.message_type if m.name == "Span"]
    for f in span.field:
        if f.name in _BYTES_FIELDS:
            f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            f.ClearField("type_name")
    pool.Add(trace)
    pool.Add(proto(trace_service_pb2))

    def cls(name: str) -> Any:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))

    return Messages(
        cls("opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest"),
        trace_service_pb2.ExportTraceServiceRequest,
        cls("opentelemetry.proto.common.v1.RawKeyValues"),
        common_pb2.KeyValueList,
        common_pb2.KeyValue,
        {v.name: v.number for v in trace_pb2.Span.DESCRIPTOR.enum_types_by_name["SpanKind"].values},
        trace_pb2.Status,
        trace_pb2.Span.Event,
        (DecodeError, RecursionError, ValueError),
    )


def as_view(msg: Any) -> Any:
    """``msg`` (an ExportTraceServiceRequest, official or the view) as the view."""
    m = messages()
    if isinstance(msg, m.request):
        return msg
    return m.request.FromString(msg.SerializeToString())


def decode_key_values(raw: list[bytes]) -> Any:
    """The official KeyValue messages of attributes' bytes, decoded together (DecodeError
    when one is not a KeyValue)."""
    m = messages()
    return m.key_value_list.FromString(m.raw_list(values=raw).SerializeToString()).values


# The decoded attributes kept between payloads, at most (then started over): their number and
# their bytes (the value is kept besides, about as large), and the longest kept (a longer one,
# a large statement, is decoded for its payload only).
MAX_ATTRIBUTES = 20_000
MAX_KEPT_BYTES = 4 * 1024 * 1024
MAX_ATTRIBUTE_BYTES = 1_024


class AttributeCache:
    """Attributes' bytes to what the mapping keeps of them: (key, value) for a wanted key
    (``convert`` makes the value), None for the others. ``params``: the bytes of those whose
    key has the parameters' prefix."""

    def __init__(self, wanted: frozenset[str], prefix: str, convert: Any) -> None:
        self.wanted = wanted
        self.prefix = prefix
        self.convert = convert
        self.known: dict[bytes, tuple[str, Any] | None] = {}
        self.params: set[bytes] = set()
        self.bytes = 0  # of the attributes known (those of a payload's too, until forgotten)

    def learn(self, lists: Iterable[Any]) -> list[bytes]:
        """Decode the attributes of ``lists`` not known yet (together: one official parse);
        returns the long ones, to :meth:`forget` after the payload."""
        known = self.known
        met = set().union(*lists)
        new = [kv for kv in met if kv not in known]
        if not new:
            return []
        size = sum(map(len, new))
        if len(known) + len(new) > MAX_ATTRIBUTES or self.bytes + size > MAX_KEPT_BYTES:
            known.clear()  # start over, with all of this payload's
            self.params.clear()
            self.bytes = 0
            new = list(met)
            size = sum(map(len, new))
        self.bytes += size
        wanted, prefix, convert = self.wanted, self.prefix, self.convert
        for raw, kv in zip(new, decode_key_values(new), strict=True):
            k = kv.key
            if k in wanted:
                known[raw] = (k, convert(kv.value))
            elif k.startswith(prefix):
                known[raw] = (k, convert(kv.value))
                self.params.add(raw)
            else:
                known[raw] = None
        return [kv for kv in new if len(kv) > MAX_ATTRIBUTE_BYTES]

    def forget(self, raw: list[bytes]) -> None:
        for kv in raw:
            if self.known.pop(kv, False) is not False:
                self.bytes -= len(kv)
            self.params.discard(kv)
        # a payload whose own distinct attributes are over the bounds is not kept after it
        if len(self.known) > MAX_ATTRIBUTES or self.bytes > MAX_KEPT_BYTES:
            self.known.clear()
            self.params.clear()
            self.bytes = 0
