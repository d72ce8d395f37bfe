"""Test helper: write spool segments the way the agent does.

Requests are the agent's own objects (:class:`perfsleuth.agent.recorder.ActiveRequest`, with
their calls as the recorder's rows and site entries) encoded by the agent's encoder
(:func:`perfsleuth.agent.spool.encode.encode_requests`): REQUESTS records, each preceded by the
LOCATION, STACK and FINGERPRINT records it needs, so what tests ingest is what production
ingests. Fingerprints, operations and HTTP hosts are the agent's too (from the statement,
URL or cache command a call spec gives). The stacks evidence records name are interned by the
same encoder; evidence and counter records themselves are written with the wire's record
encoder, as the agent's evidence threads write them.

Stack frames are given as (file, line, function, app); the agent tells library code from
application code by its directory (site-packages, the standard library), so the directory of
a frame given as library code (app False) is added to the agent's library directories.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from perfsleuth.agent import recorder, stacks
from perfsleuth.agent.spool.encode import Encoder, Interned, encode_requests
from perfsleuth.store.spool import local_host
from perfsleuth.wire import HEADER, STATS
from perfsleuth.wire.batch import INT_COLUMNS, SPARSE, STRING_COLUMNS
from perfsleuth.wire.segment import FILE_MAGIC, encode_record

MS = 1_000_000  # ns
NULL = recorder.NULL
T0 = 10**12  # the perf_counter ns a request starts at (a process clock: only differences count)
# what a call spec may set beside timings and rows: the values of the call's ``more`` entry
_MORE = ("status", "bytes", "wait", "hit", "error", "extra")
# the request's values the agent records (``finished(**fields)``): the wire's columns less
# those finished() takes as parameters or works out itself
_REQUEST_FIELDS = frozenset((*STRING_COLUMNS, *INT_COLUMNS, *SPARSE)) - {
    "kind",
    "endpoint",
    "id",
    "ts",
    "dur",
    "status",
    "t0",
    "ncalls",
    "cx",
}


def call(
    kind: str = "db",
    text: str = "SELECT * FROM items WHERE id = ?",
    *,
    dur_ms: float = 1.0,
    off_ms: float = 0.0,
    system: str | None = None,
    site: tuple[str, int, str] | str | None = "default",
    stack: list[tuple[str, int, str, bool]] | None = None,
    rows: int | None = None,
    ph: int | None = None,
    host: str | None = None,
    unfinished: bool = False,
    **more: Any,
) -> dict[str, Any]:
    """A call spec for SegmentWriter.request. ``text``: the statement (db), ``"METHOD
    host/path"`` (http) or ``"COMMAND key"`` (cache), as the application would issue it; the
    agent fingerprints it. ``stack``: the frames of the call, outermost first; ``site``: the
    application frame making the call, which to the agent is the stack's innermost
    application frame (by default, that of ``stack``, else app/views.py:10 ``show``; None:
    no stack). ``host`` (http): checked against the URL's, which is what the agent stores.
    ``more``: status, bytes, wait, hit, error, extra."""
    unknown = set(more) - set(_MORE)
    if unknown:
        raise TypeError(f"the agent records no {sorted(unknown)} for a call")
    if stack:
        innermost = next((f[:3] for f in reversed(stack) if f[3]), None)
        if site == "default":
            site = innermost
        elif site is not None and tuple(site) != innermost:
            raise ValueError(f"to the agent the call site is the innermost app frame {innermost}")
    elif site == "default":
        site = ("app/views.py", 10, "show")
    if host is not None and kind == "http" and _url_host(text) != host:
        raise ValueError(f"the agent takes an HTTP call's host from its URL: {text!r}")
    return {
        "kind": kind,
        "text": text,
        "dur_ms": dur_ms,
        "off_ms": off_ms,
        "system": system or {"db": "postgresql", "http": "http", "cache": "redis"}.get(kind, kind),
        "site": site,
        "stack": stack,
        "rows": rows,
        "ph": ph,
        "unfinished": unfinished,
        "more": {k: v for k, v in more.items() if v is not None},
    }


def _sent(c: dict[str, Any]) -> dict[str, Any]:
    """A call spec as what was sent: kind, system, off and dur in ns, and the values given."""
    out = {
        "kind": c["kind"],
        "system": c["system"],
        "off": round(c["off_ms"] * MS),
        "dur": round(c["dur_ms"] * MS),
    }
    out.update({k: c[k] for k in ("rows", "ph") if c[k] is not None})
    return {**out, **c["more"], **({"unfinished": True} if c["unfinished"] else {})}


def _url_host(text: str) -> str:
    return text.partition(" ")[2].split("/", 1)[0]


def _target(kind: str, text: str) -> Any:
    """What the application hands the agent for a call: the statement (a site's target), or
    the per-call target of an HTTP request or cache command."""
    if kind == "http":
        method, _, rest = text.partition(" ")
        return (method, f"https://{rest}")
    if kind == "cache":
        command, _, key = text.partition(" ")
        return (command, key or None)
    return text


_codes: dict[tuple[str, str], Any] = {}


def _code(file: str, function: str, app: bool) -> Any:
    """A code object standing for ``function`` in ``file``, classified by the agent's rule as
    ``app`` says (see the module docstring)."""
    key = (file, function)
    code = _codes.get(key)
    if code is None:
        if not app and stacks.is_app_file(file):
            stacks._LIB = (*stacks._LIB, os.path.dirname(file) + os.sep)
        name = function.rsplit(".", 1)[-1]
        code = compile("None", file, "eval").replace(co_name=name, co_qualname=function)
        _codes[key] = code
    if stacks.is_app_file(file) != app:
        raise ValueError(f"{file} is {'not ' if app else ''}application code to the agent")
    return code


def _flat(frames: list[tuple[str, int, str, bool]]) -> tuple[Any, ...]:
    """Frames (outermost first) as the agent's captured stack: (code, line, ...) innermost
    first (agent.stacks.capture, lines given as themselves)."""
    out: list[Any] = []
    for file, line, function, app in reversed(frames):
        out += [_code(file, function, app), line]
    return tuple(out)


def _trace_id(trace_id: str | None) -> int:
    if trace_id is None:
        return random.getrandbits(64) or 1
    if len(trace_id) != 16:
        raise ValueError(f"a trace id is 16 hex digits (64 bits), not {trace_id!r}")
    return int(trace_id, 16)


class SegmentWriter:
    """One segment file, DATA/spool/<host>-<pid>-<ns>-<seq>.open, renamed .seg by close()."""

    def __init__(
        self,
        data_dir: str,
        *,
        service: str = "shop",
        pid: int = 4242,
        seq: int = 1,
        host: str | None = None,
        header: bool = True,
    ) -> None:
        spool = os.path.join(data_dir, "spool")
        os.makedirs(spool, exist_ok=True)
        self.base = os.path.join(spool, f"{host or local_host()}-{pid}-{time.time_ns()}-{seq:06d}")
        self.path = self.base + ".open"
        self.service = service
        self.requests: list[dict[str, Any]] = []  # the values of those written
        self.interned = Interned()  # what this segment holds, as the agent's writer keeps it
        self.encoder = Encoder(fingerprint_cpu_pct=None)
        data = FILE_MAGIC
        if header:
            data += encode_record(
                HEADER,
                {"v": 1, "host": "testbox", "pid": pid, "service": service, "agent": "test"},
            )
        self.write(data)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def write(self, data: bytes) -> None:
        with open(self.path, "ab") as fh:
            fh.write(data)

    def request(self, endpoint: str = "GET /items", **spec: Any) -> dict[str, Any]:
        """Append one finished request (and the dictionary records it needs first), encoded
        by the agent's encoder; see :meth:`finished` for ``spec``. Returns the request's
        values (``id`` as the store shows it, ``ts`` in ns, ``calls`` as sent...)."""
        return self.write_requests([dict(spec, endpoint=endpoint)])[0]

    def write_requests(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Append finished requests as the agent's writer does with the requests it takes from
        its queue at once: REQUESTS records of up to BATCH_MAX requests each."""
        built = [self.finished(**spec) for spec in specs]
        before = recorder.stats["internal_errors"]
        self.write(encode_requests([r for r, _ in built], self.interned, encoder=self.encoder))
        if recorder.stats["internal_errors"] != before:
            raise ValueError("the agent's encoder could not encode a request")
        self.requests.extend(body for _, body in built)
        return [body for _, body in built]

    def finished(
        self,
        endpoint: str = "GET /items",
        *,
        ts_ns: int | None = None,
        dur_ms: float = 10.0,
        status: int | None = 200,
        calls: list[dict[str, Any]] = (),  # type: ignore[assignment]
        kind: str = "web",
        trace_id: str | None = None,
        **fields: Any,
    ) -> tuple[recorder.ActiveRequest, dict[str, Any]]:
        """A finished request as the recorder hands it to the writer, and its values.
        ``fields``: values the agent records for a request (user, tenant, attrs, tags,
        cpu_ns, req_bytes, resp_bytes, gc_ns with gc_count, error...)."""
        unknown = set(fields) - _REQUEST_FIELDS
        if unknown:
            raise TypeError(f"the agent records no {sorted(unknown)} for a request")
        method, _, path = endpoint.partition(" ")
        req = self._active_request(kind, method if kind == "web" else "TASK", path or endpoint)
        req.trace_id = _trace_id(trace_id)
        req.start_wall = ts_ns if ts_ns is not None else time.time_ns()
        req.end = req.start + round(dur_ms * MS)
        req.endpoint = endpoint
        req.status = status
        for name, value in fields.items():
            setattr(req, name, value)
        if calls:
            self._calls(req, calls)
        body = {
            "id": f"{req.trace_id:016x}",
            "ts": req.start_wall,
            "dur": req.end - req.start,
            "kind": kind,
            "method": req.method,
            "endpoint": endpoint,
            "path": req.path,
            "status": status,
            "calls": [_sent(c) for c in calls],
            **fields,
        }
        return req, body

    @staticmethod
    def _active_request(kind: str, method: str, path: str) -> recorder.ActiveRequest:
        """A request as recorder.begin makes it, then ended (recorder.end): no context, no
        sink."""
        req: recorder.ActiveRequest = recorder._new(recorder.ActiveRequest)
        req.start = T0
        req.calls_dropped = req.gc_ns = req.gc_count = 0
        req.kind, req.method, req.path = kind, method, path
        req.cpu_start = req.cpu_ns = req.status = req.error = req.req_bytes = None
        req.resp_bytes = req.user = req.tenant = req.attrs = req.tags = req.headers = None
        req.calls = req.site_list = req.more = None
        req.sites = {}
        req.task = req.worker = req.keep = req.token = None
        req.thread = 0
        return req

    def _calls(self, req: recorder.ActiveRequest, calls: list[dict[str, Any]]) -> None:
        """The calls as the recorder keeps them: a row each (slot, start, end, rows, params
        hash), a site entry per call site (kind, system, statement, stack, key), the rarely
        set values and per-call targets in ``more``."""
        rows = req.calls = bytearray()
        site_list: list[tuple[Any, ...]] = []
        req.site_list = site_list
        slots: dict[Any, int] = {}
        more: dict[int, dict[str, Any]] = {}
        for c in calls:
            kind, system = c["kind"], c["system"]
            target = _target(kind, c["text"])
            statement = target if type(target) is str else None
            site = c["site"]
            key = (statement or kind, site)
            slot = slots.get(key)
            if slot is None:
                frames = list(c["stack"] or ([(*site, True)] if site is not None else ()))
                slot = slots[key] = len(site_list)
                site_list.append((kind, system, statement, _flat(frames), key))
            start = req.start + round(c["off_ms"] * MS)
            end = 0 if c["unfinished"] else start + round(c["dur_ms"] * MS)
            i = len(rows)
            rows += recorder._ROW.pack(
                slot,
                start,
                end,
                NULL if c["rows"] is None else c["rows"],
                NULL if c["ph"] is None else c["ph"],
            )
            entry = dict(c["more"])
            if statement is None:
                entry["target"] = target
            if entry:
                more[i] = entry
        req.more = more or None

    def stack(self, frames: list[tuple[str, int, str, bool]]) -> int:
        """Append the records of a stack ((file, line, function, app), outermost first) as the
        agent interns one for its evidence records, and return its id."""
        out: list[bytes] = []
        sid, _ = self.encoder.stack(self.interned, out, _flat(frames))
        self.write(b"".join(out))
        return sid

    def event(self, rtype: bytes, body: Any) -> None:
        """Append one runtime-evidence record (samples, blocker, GC, capture) as given."""
        self.write(encode_record(rtype, body))

    def stats(self, counters: dict[str, int]) -> None:
        self.write(encode_record(STATS, dict(counters, ts=time.time_ns())))

    def close(self) -> str:
        os.replace(self.path, self.base + ".seg")
        self.path = self.base + ".seg"
        return self.path


def stored(store: Any) -> dict[str, tuple[int, int]]:
    """Per endpoint, (requests, calls) the store holds. A test that expects no finding asserts
    this first: on an empty store every detector finds nothing."""
    calls = {r["endpoint"]: r["n"] for r in store.query(_CALLS_PER_ENDPOINT)}
    return {
        r["endpoint"]: (r["n"], calls.get(r["endpoint"], 0)) for r in store.query(_PER_ENDPOINT)
    }


_PER_ENDPOINT = "SELECT endpoint, count(*) AS n FROM requests GROUP BY endpoint"
_CALLS_PER_ENDPOINT = "SELECT endpoint, count(*) AS n FROM calls GROUP BY endpoint"
