"""The request-path half of the agent: what is recorded while a request runs.

Everything here runs inside application requests, so it only stores integers and references
(timestamps, code objects, the statement string) and never raises: any internal error is
counted (``stats["internal_errors"]``) and swallowed. Encoding happens on the writer thread
(:mod:`perfsleuth.agent.spool.encode`). One module of ~700 lines because the request, its call
rows and its site path are one data structure and the operations on it, and the C accelerator
mirrors it function for function (``_speedups.c``); split, each call would pay a module
attribute look-up on the hot path.

**Calls as rows.** A request's outbound calls (DB statements, HTTP requests, cache commands)
are not objects: each is a row of five int64s (``ROW`` bytes, native byte order) appended to
one bytearray, ``ActiveRequest.calls``; the constants are their byte offsets in a row::

    SLOT   which *site* of the request made it: an index into ``ActiveRequest.site_list``,
           whose entries hold what the calls of one statement from one place share (kind,
           system, statement, call stack), captured once per request
    START  perf_counter_ns() when it started
    END    perf_counter_ns() when it ended (0 while running)
    ROWS   rows returned or affected (NULL: unknown)
    PH     hash of the bound parameters (NULL: none); the values are never kept

One bytearray per request instead of an object per call: an N+1 loop of 10,000 statements
keeps no Python object per statement alive (every live container brings the application's next
garbage collection closer, and every int is an allocation), and the writer copies the rows
as they are (they are wire.batch's rows). The rarely set values (HTTP status, response bytes,
cache hit, pool wait, error class, per-call targets, driver extras) live in
``ActiveRequest.more``, a dict by row offset, created by the first of them.

Instrumentation of a client library follows one pattern, with :class:`Call`, a small handle
on a row::

    call = recorder.start_call("db", "postgresql", sql, params)   # None when not in a request
    try:
        result = original(...)
    except BaseException as exc:
        if call is not None:
            call.error = type(exc).__name__
        raise
    finally:
        if call is not None:
            call.finish()

The hottest wrapper (sqlite3, where a statement takes microseconds) uses the row directly:
``req.record_call(...)`` gives the row offset ``i``, and ``set_field(req.calls, i + END,
_perf())`` ends the call (and its C version, agent/_speedups.c, writes the bytes itself).
"""

from __future__ import annotations

import contextvars
import functools
import random
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from perfsleuth.agent import accel, config, stacks
from perfsleuth.wire import counters

_perf = time.perf_counter_ns
_time_ns = time.time_ns
_getframe = sys._getframe
_code_kinds = stacks._kind
_classify = stacks.classify
_capture = stacks.capture
_same_stack = stacks.same
_template_key = stacks.template_key
_MAX_DEPTH = stacks.MAX_DEPTH
_getrandbits = random.getrandbits  # reseeded in forked children by the random module itself
_get_ident = threading.get_ident

# The layout of a call's row in ActiveRequest.calls (see the module docstring): native order,
# since struct converts Python ints to "<q" through a generic (4x slower) path; the writer
# swaps the bytes on a big-endian machine.
_ROW = struct.Struct("5q")
ROW = _ROW.size
SLOT, START, END, ROWS, PH = range(0, ROW, 8)
NULL = -(1 << 63)  # an absent ROWS / PH (the wire's NULL too)
_pack_row = _ROW.pack
_FIELD = struct.Struct("q")
set_field = _FIELD.pack_into  # set_field(calls, offset, value)
_get_field = _FIELD.unpack_from


def get_field(calls: bytearray, offset: int) -> int:
    return _get_field(calls, offset)[0]  # type: ignore[no-any-return]


def add_rows(calls: bytearray, offset: int, n: int) -> None:
    """Count ``n`` more rows on the call whose ROWS field is at ``offset``."""
    set_field(calls, offset, _get_field(calls, offset)[0] + n)


# Requests in flight, by id(request): read by the sampler, the loop watchdog and the GC hook
# on their own threads (iterate over a list() copy: the dict changes under them).
inflight: dict[int, ActiveRequest] = {}

_current: contextvars.ContextVar[ActiveRequest | None] = contextvars.ContextVar(
    "perfsleuth_request", default=None
)
current_get = _current.get  # the request being recorded in this context, or None

# Counters shared with the shipper; plain ints mutated under the GIL (approximate is fine).
stats: dict[str, int] = dict.fromkeys(counters.RECORDER, 0)  # the names: wire.counters

MAX_ATTRS = 64
MAX_ATTR_CHARS = 1024
MAX_SITES = 20_000

# site key (statement, id(site code), f_lasti) -> the last site entry made for it (kind,
# system, statement, stack, key): shared by the requests, which keep references to the entries
# they use (so clearing it loses nothing but reuse)
_site_cache: dict[Any, tuple[Any, ...]] = {}
# where a statement is made, without the statement (id(site code), f_lasti[, template key]) ->
# the stack last captured there: a statement never made before (literals written into its
# text) at a known place takes that stack when the frames are the same, and is not captured
# again. Holds no statement text.
_stack_cache: dict[Any, tuple[Any, ...]] = {}

# Emptied with the site cache (forget_sites): other caches of site entries or stacks (the
# thread-pool hand-off's), which would otherwise keep statements and stacks the site cache let go.
forget_hooks: list[Callable[[], None]] = []
# How many times forget_sites ran: a stack captured before is never handed out again, so what
# the writer remembers by such a stack object's id (spool.encode: Encoder.flats, .shapes) can go.
stacks_forgotten = 0


def forget_sites() -> None:
    """Empty the caches of site entries and stacks together (the queue's share of the memory
    budget for them is used up, or the writer's caches were cleared). In place: the C
    accelerator holds the same dicts."""
    global stacks_forgotten
    stacks_forgotten += 1
    _site_cache.clear()
    _stack_cache.clear()
    forget_memo = getattr(speedups, "forget_memo", None)  # record_site's memo of places
    if forget_memo is not None:
        try:
            forget_memo()
        except Exception:
            internal_error()
    for hook in forget_hooks:
        try:
            hook()
        except Exception:
            internal_error()


# Set by the shipper when the agent starts; None means "agent not started": record nothing.
_sink: Callable[[ActiveRequest], None] | None = None
_max_rows = 20000 * ROW
_stacks_per_site = 1

# A request's CPU time is measured for a random sample of requests (PERFSLEUTH_CPU_SAMPLE): the
# thread's CPU clock is a system call (no vDSO for thread clocks), ~4.5 µs inside a request
# (the caches refilled after the kernel entry), ~1 a WSGI request and ~4 a FastAPI one, where
# the agent's whole request path in the burst benchmark costs ~10 µs. The draw is the trace
# id's low 32 bits (random bits begin draws anyway, from a generator reseeded in a forked
# child: the random module's here, the accelerator's own in C): a request is sampled when they
# are under CPU_SAMPLE_BITS * fraction (C and Python alike, so both make the same choice for
# the same trace id), whatever its endpoint.
CPU_SAMPLE_BITS = 1 << 32
_cpu_threshold = CPU_SAMPLE_BITS  # every request until configure() sets the share


def cpu_sampled(req: ActiveRequest) -> bool:
    """Whether ``req`` is one of the requests whose CPU time is measured (its trace id drew
    it): what begin(cpu=True) decides, for a request whose CPU time is counted elsewhere (the
    ASGI integration's meter), asked at its start."""
    return (req.trace_id & 0xFFFFFFFF) < _cpu_threshold


# The optional C accelerator of the sqlite3 cursor wrappers (agent/_speedups.c; built at
# install when a compiler is there). PERFSLEUTH_SPEEDUPS=0 leaves it out: the Python wrappers
# record the same values.
speedups: Any = accel.module


def _templates_in_c() -> None:
    """A template engine is loaded: the accelerator's site path looks for a template engine's
    frame above each new site, and hands the first call of a site under a template line to
    Python's (whose stacks have the template frames)."""
    if speedups is not None:
        engines = stacks.templates
        speedups.configure(
            template_key=_template_key,
            template_engines=engines._engine,
            engine_of=engines.engine_of,
        )


stacks.on_templates = _templates_in_c


def configure(
    sink: Callable[[ActiveRequest], None] | None,
    *,
    max_calls: int,
    stacks_per_site: int,
    cpu_sample: float | None = None,
) -> None:
    """``cpu_sample``: as :func:`set_cpu_sample`."""
    global _sink, _max_rows, _stacks_per_site
    _sink = sink
    _max_rows = max(0, max_calls) * ROW
    _stacks_per_site = max(1, stacks_per_site)
    set_cpu_sample(cpu_sample)
    if speedups is not None:
        clock = time.get_clock_info("perf_counter").implementation
        speedups.configure(
            current=_current,
            internal_error=internal_error,
            max_rows=_max_rows,
            # the accelerator reads CLOCK_MONOTONIC itself when that is perf_counter's clock
            perf_counter=None if clock == "clock_gettime(CLOCK_MONOTONIC)" else _perf,
            code_kinds=_code_kinds,
            classify=_classify,
            site_cache=_site_cache,
            stack_cache=_stack_cache,
            max_depth=_MAX_DEPTH,
            max_sites=MAX_SITES,
            stacks_per_site=_stacks_per_site,
            sink=sink,
            inflight=inflight,
            stats=stats,
            no_sites=_NO_SITES,
            request_class=ActiveRequest,
        )
        stacks.check_engines()  # an engine loaded already: on_templates tells the accelerator


def set_cpu_sample(fraction: float | None) -> None:
    """Measure the CPU time of this share of the requests (0 to 1, see cpu_sampled); None: the
    environment's PERFSLEUTH_CPU_SAMPLE (config.cpu_sample_of)."""
    global _cpu_threshold
    share = config.cpu_sample_of() if fraction is None else config.clamp_share(fraction)
    _cpu_threshold = round(share * CPU_SAMPLE_BITS)
    if speedups is not None:
        speedups.configure(cpu_threshold=_cpu_threshold)


def internal_error() -> None:
    stats["internal_errors"] += 1


_new = object.__new__
# The sites of a request that has made no call yet: never written to (record_call's fast path
# looks sites up without a None check; its slow path makes the request its own dict).
_NO_SITES: dict[Any, int] = {}


class ActiveRequest:
    """A request (or background task) in flight; handed to the writer when it ends.

    Made by :func:`begin` without an ``__init__`` (a Python ``__init__`` call costs more than
    the stores it does)."""

    __slots__ = (
        "attrs",
        "calls",
        "calls_dropped",
        "cpu_ns",
        "cpu_start",
        "end",
        "endpoint",
        "error",
        "gc_count",
        "gc_ns",
        "headers",
        "keep",
        "kind",
        "method",
        "more",
        "path",
        "req_bytes",
        "resp_bytes",
        "site_list",
        "sites",
        "start",
        "start_wall",
        "status",
        "tags",
        "task",
        "tenant",
        "thread",
        "token",
        "trace_id",
        "user",
        "worker",
    )

    trace_id: int
    start_wall: int  # time.time_ns() at the start
    start: int  # perf_counter_ns() at the start
    end: int  # 0 while in flight
    cpu_start: int | None
    cpu_ns: int | None
    kind: str  # "web" | "background"
    method: str
    path: str
    endpoint: str
    status: int | None
    error: str | None
    req_bytes: int | None
    resp_bytes: int | None
    user: str | None
    tenant: str | None
    # The raw ASGI header list: the user, tenant and Content-Length are read from it by the
    # writer thread (off the request path)
    headers: Any
    # Created on first use: every container a request keeps alive until the writer takes it
    # counts towards the garbage collector's next collection.
    attrs: dict[str, Any] | None
    tags: dict[str, Any] | None
    calls: bytearray | None  # ROW bytes per call
    # (statement or kind, id(site code), site f_lasti) -> index into site_list
    sites: dict[Any, int]
    # (kind, system, statement or None, flat stack, site key) per site, see record_call
    site_list: list[tuple[Any, ...]] | None
    more: dict[int, dict[str, Any]] | None  # row offset -> rarely set values of that call
    calls_dropped: int
    token: contextvars.Token[ActiveRequest | None] | None
    # Where the request's code runs, for the sampler and the loop watchdog: its thread (the
    # event loop's for async requests), its asyncio task, and a worker thread while a sync
    # endpoint runs in a thread pool.
    thread: int
    task: Any
    worker: int | None
    gc_ns: int  # time in garbage collections while in flight (agent.gcwatch)
    gc_count: int
    keep: str | None  # why to keep a replayable capture (agent.capture)

    def record_call(self, kind: str, system: str, target: Any, params: Any, up: int) -> int:
        """Start a call: the offset of its row in ``self.calls``, or -1 when the request
        already holds ``PERFSLEUTH_MAX_CALLS`` calls (the call is only counted). Never raises.

        ``target`` is the statement (a str: calls of one statement from one place share a
        site), or what this call alone addresses (HTTP, cache: a tuple, or None and set later
        through ``Call.target``). ``params``: the bound parameters, hashed, never kept.
        ``up``: the frame the call comes from, counted from the caller of ``record_call``; a
        wrapper passes 2 (its own caller): ``sys._getframe`` makes a frame object for the
        frame it returns, and the wrapper's would be a new one at every call."""
        # The fast path, every opcode counted (it runs for every statement of an N+1 loop):
        # a statement this request already made from the same line of the same application
        # frame, its parameters in a tuple (or none). Anything else takes _record_call, in C
        # when the accelerator is there.
        try:
            f = _getframe(up)
            slot = self.sites.get((target, id(f.f_code), f.f_lasti))
            if slot is not None and type(params) is tuple:
                calls = self.calls
                # Hashed here (~0.1 µs) so the request does not keep the app's values alive.
                # ``+=`` then ``len``: no thread switch can come between them (no
                # eval-breaker check), so the offset is this call's even when two threads
                # share the request.
                calls += _pack_row(slot, _perf(), 0, NULL, hash(params) if params else NULL)  # type: ignore[operator]
                i = len(calls) - ROW  # type: ignore[arg-type]
                if i < _max_rows:
                    return i
                del calls[i:]
                return self._dropped()
        except Exception:  # an unhashable target or parameters: the slow path copes
            pass
        if _c_record_call is not None:
            try:
                i = _c_record_call(self, kind, system, target, params, up)
            except Exception:
                i = -1
            if i != -1:
                return i if i >= 0 else -1
        return self._record_call(kind, system, target, params, up + 1)

    def _record_call(self, kind: str, system: str, target: Any, params: Any, up: int) -> int:
        """:meth:`record_call`, all cases: finds the call site, captures the site's stack
        the first time, hashes what can be hashed here, notes per-call targets."""
        try:
            if self.end:  # a call after the request ended (work it left running): not its
                return -1
            calls = self.calls
            site_list = self.site_list
            if calls is None or site_list is None:
                calls = self.calls = bytearray()
                site_list = self.site_list = []
                self.sites = {}
            elif len(calls) >= _max_rows:
                return self._dropped()
            # The call site: the first application frame above the wrapper (else the first
            # frame that is not the agent's).
            frame = _getframe(up)
            f: Any = frame
            leaf = None
            depth = 0
            while f is not None and depth < _MAX_DEPTH:
                code = f.f_code
                hit = _code_kinds.get(id(code))
                k = hit[1] if hit is not None else _classify(code)
                if k:
                    break
                if k is not None and leaf is None:
                    leaf = f
                f = f.f_back
                depth += 1
            if f is None or depth == _MAX_DEPTH:
                f = leaf
            # ids, not code objects: hashing a code object is not cached (stacks.classify);
            # the site entry holds the stack, and so the code, so the id stays unique.
            where = (0, 0) if f is None else (id(f.f_code), f.f_lasti)
            statement = type(target) is str
            key = (target, *where) if statement else (kind, *where, None)
            if stacks.templates_on:
                # under a template, one Python line serves many template lines: their
                # calls are sites of their own (and never on the fast paths' 3-tuple keys)
                tkey = _template_key(frame)
                if tkey is not None:
                    key = (*key, tkey)
            sites = self.sites
            slot = sites.get(key)
            if slot is None:
                # A site's stack is captured once per request: an N+1 loop repeats the same
                # stack thousands of times. With PERFSLEUTH_STACKS_PER_SITE = n, its first n
                # calls get a stack each (the site is known to the fast path after that).
                # Most requests repeat the stacks of the requests before them: the site's
                # last entry is reused when the frames are the same (compared, not copied).
                entry = _site_cache.get(key)
                if (
                    entry is None
                    or entry[0] is not kind
                    or entry[1] is not system
                    or _stacks_per_site > 1
                    or not _same_stack(frame, entry[3])
                ):
                    flat = None
                    if statement and _stacks_per_site == 1:
                        place = key[1:]
                        flat = _stack_cache.get(place)
                        if flat is None or not _same_stack(frame, flat):
                            flat = _capture(frame)
                            if len(_stack_cache) >= MAX_SITES:
                                _stack_cache.clear()
                            _stack_cache[place] = flat
                    else:
                        flat = _capture(frame)
                    entry = (kind, system, target if statement else None, flat, key)
                    if len(_site_cache) >= MAX_SITES:
                        _site_cache.clear()
                    _site_cache[key] = entry
                site_list.append(entry)
                slot = len(site_list) - 1
                n = 1 if _stacks_per_site == 1 else sites.get((key, "n"), 0) + 1
                if n >= _stacks_per_site:
                    sites[key] = slot
                else:
                    sites[(key, "n")] = n
            other = None
            if type(params) is tuple:
                try:
                    ph = hash(params) if params else NULL
                except Exception:
                    ph = NULL
            else:  # None, or a dict, a list, ...: hashed by the writer
                ph = NULL
                other = params
            calls += _pack_row(slot, _perf(), 0, NULL, ph)
            i = len(calls) - ROW
            if other is not None:
                self._note(i, "params", other)
            if target is not None and not statement:  # a per-call target
                self._note(i, "target", target)
            return i
        except Exception:
            internal_error()
            return -1

    def _dropped(self) -> int:
        self.calls_dropped += 1
        stats["calls_dropped"] += 1
        return -1

    def _note(self, i: int, name: str, value: Any) -> None:
        more = self.more
        if more is None:
            more = self.more = {}
        entry = more.get(i)
        if entry is None:
            more[i] = {name: value}
        else:
            entry[name] = value

    def fail_call(self, i: int, exc: BaseException) -> None:
        """End call ``i`` with the class name of the exception it raised. Never raises."""
        try:
            set_field(self.calls, i + END, _perf())  # type: ignore[arg-type]
            self._note(i, "error", type(exc).__name__)
        except Exception:
            internal_error()

    def call_value(self, i: int, name: str) -> Any:
        """A rarely set value of the call at row offset ``i`` (None when unset)."""
        more = self.more
        entry = None if more is None else more.get(i)
        return None if entry is None else entry.get(name)

    def call_target(self, i: int) -> Any:
        """What call ``i`` addressed: its statement, or its own target (HTTP, cache)."""
        own = self.call_value(i, "target")
        if own is not None:
            return own
        return self.site_list[get_field(self.calls, i + SLOT)][2]  # type: ignore[index, arg-type]

    def open_call(self) -> bool:
        """Whether the request's latest call is still running (read by the sampler)."""
        calls = self.calls
        return bool(calls) and get_field(calls, len(calls) - ROW + END) == 0  # type: ignore[arg-type]

    def last_finished_call(self, by: int, look: int = 50) -> dict[str, Any] | None:
        """The latest of the last ``look`` calls that had ended by ``by`` (perf ns), as
        ``{"kind", "target", "rows", "bytes", "start", "end"}`` (read by the watchdog)."""
        calls = self.calls
        if not calls:
            return None
        last = len(calls) - ROW
        for i in range(last, max(-1, last - look * ROW), -ROW):
            slot, start, end, rows, _ = _ROW.unpack_from(calls, i)
            if end and end <= by:
                return {
                    "kind": self.site_list[slot][0],  # type: ignore[index]
                    "target": self.call_target(i),
                    "rows": None if rows == NULL else rows,
                    "bytes": self.call_value(i, "bytes"),
                    "start": start,
                    "end": end,
                }
        return None


class Call:
    """A handle on one call's row: what the instrumentation wrappers fill in.

    Most fields live in the request's row (``start``, ``end``, ``rows``); the rest in its
    ``more`` entry. A handle is a temporary: it keeps nothing alive after the wrapper."""

    __slots__ = ("i", "req")

    req: ActiveRequest
    i: int  # the row offset in req.calls

    def finish(self) -> None:
        set_field(self.req.calls, self.i + END, _perf())  # type: ignore[arg-type]

    def _row(self, field: int, value: int | None) -> None:
        set_field(self.req.calls, self.i + field, NULL if value is None else value)  # type: ignore[arg-type]

    def _get(self, field: int) -> int | None:
        v = get_field(self.req.calls, self.i + field)  # type: ignore[arg-type]
        return None if v == NULL else v

    start = property(lambda c: c._get(START), lambda c, v: c._row(START, v))
    end = property(lambda c: c._get(END), lambda c, v: c._row(END, v))
    rows = property(lambda c: c._get(ROWS), lambda c, v: c._row(ROWS, v))
    target = property(
        lambda c: c.req.call_target(c.i), lambda c, v: c.req._note(c.i, "target", v)
    )  # HTTP: (method, url); cache: (command, key)
    bytes = property(lambda c: c.req.call_value(c.i, "bytes"), lambda c, v: c._set("bytes", v))
    status = property(lambda c: c.req.call_value(c.i, "status"), lambda c, v: c._set("status", v))
    hit = property(lambda c: c.req.call_value(c.i, "hit"), lambda c, v: c._set("hit", v))
    wait = property(lambda c: c.req.call_value(c.i, "wait"), lambda c, v: c._set("wait", v))
    error = property(lambda c: c.req.call_value(c.i, "error"), lambda c, v: c._set("error", v))
    extra = property(lambda c: c.req.call_value(c.i, "extra"), lambda c, v: c._set("extra", v))

    def _set(self, name: str, value: Any) -> None:
        if value is not None:
            self.req._note(self.i, name, value)


def current() -> ActiveRequest | None:
    return _current.get()


def begin(
    kind: str,
    method: str = "",
    path: str = "",
    *,
    cpu: bool = False,
    cls: type[ActiveRequest] = ActiveRequest,
) -> ActiveRequest | None:
    """Start recording a request in the current context. None when the agent is off or when a
    request is already being recorded here (nested frameworks record the outer one only).
    ``cpu``: measure its CPU time on this thread, when it is in the sample (cpu_sampled; else
    ``cpu_start`` and ``cpu_ns`` stay None and no clock is read). ``cls``: a subclass with
    more slots (the ASGI integration's)."""
    if _sink is None:
        return None
    running = _current.get()
    if running is not None:
        # nested: the outer framework records; unless that request has ended (a stale read
        # of CPython 3.11's variable cache: see _speedups.c's begin): cleared, recorded
        if not getattr(running, "end", 0):
            return None
        _current.set(None)
    try:
        req = _new(cls)
        req.trace_id = _getrandbits(64) or 1
        req.start_wall = _time_ns()
        req.end = req.calls_dropped = req.gc_ns = req.gc_count = 0
        req.kind = kind
        req.method = method
        req.path = path
        req.endpoint = ""
        req.cpu_start = req.cpu_ns = req.status = req.error = req.req_bytes = None
        req.resp_bytes = req.user = req.tenant = req.attrs = req.tags = req.headers = None
        req.calls = req.site_list = req.more = None
        req.sites = _NO_SITES
        req.task = req.worker = req.keep = None
        req.thread = _get_ident()
        if cpu and (req.trace_id & 0xFFFFFFFF) < _cpu_threshold:
            # The thread's last reading plus the wall time since, when under REQUEST_GAP_NS
            # old, else a reading of its own (the C begin does the same: _speedups.c says why).
            last = _last_cpu
            now = _perf()
            if now - last.wall < REQUEST_GAP_NS:
                req.cpu_start = last.cpu + (now - last.wall)
            else:
                req.cpu_start = last.cpu = time.thread_time_ns()
                last.wall = now
        req.token = _current.set(req)
        inflight[id(req)] = req
        req.start = _perf()
        return req
    except Exception:
        internal_error()
        return None


def end(req: ActiveRequest) -> None:
    """Finish ``req``: duration, context reset, hand-off to the writer. Never raises."""
    try:
        req.end = _perf()
        inflight.pop(id(req), None)
        if req.cpu_start is not None:
            # Shorter than SHORT_RUN_NS: its wall time (one system call a request, not two;
            # too short to have waited in a way that matters). Else the thread's CPU clock,
            # clamped to [0, wall time]. The C end does the same.
            wall = req.end - req.start
            if req.start and 0 <= wall < SHORT_RUN_NS:
                req.cpu_ns = wall
            else:
                last = _last_cpu
                last.cpu = now = time.thread_time_ns()
                last.wall = req.end
                cpu = now - req.cpu_start
                req.cpu_ns = 0 if cpu < 0 else wall if 0 <= wall < cpu else cpu
        if req.token is not None:
            try:
                _current.reset(req.token)
            except ValueError:  # ended from another context: just clear ours
                _current.set(None)
            req.token = None
        # What the writer does not need goes now: every container the queued requests keep
        # alive is looked at by the application's garbage collections until it is written.
        req.task = None
        req.sites = _NO_SITES
        stats["requests_recorded"] += 1
        sink = _sink
        if sink is not None:
            sink(req)
    except Exception:
        internal_error()


# A request shorter than this counts its wall time as its CPU time (frameworks.asgi's
# SHORT_STEP_NS for a step, _speedups.c's SHORT_RUN_NS).
SHORT_RUN_NS = 50_000
# A request's start takes the thread's last CPU clock reading when it is younger than this
# (_speedups.c's REQUEST_GAP_NS).
REQUEST_GAP_NS = 20_000


class _LastCpuReading(threading.local):
    """The thread's last CPU clock reading (ns) and the perf_counter_ns it was taken at."""

    cpu = 0
    wall = -REQUEST_GAP_NS


_last_cpu = _LastCpuReading()

# begin and end in C when the accelerator is there (agent/_speedups.c: the same, field by
# field; these Python ones are the reference): they run for every request.
python_begin, python_end = begin, end
# record_call's site path in C (speedups.record_call: a str statement): the call site found
# and the stack compared or captured without a Python frame per stack frame.
_c_record_call: Callable[..., int] | None = None
if speedups is not None:
    begin = speedups.begin
    end = speedups.end
    _c_record_call = getattr(speedups, "record_call", None)


def start_call(kind: str, system: str, target: Any, params: Any = None, up: int = 1) -> Call | None:
    """Record the start of an outbound call from the current request: its handle, or None
    outside a request (or past the request's call limit). ``up`` as in
    :meth:`ActiveRequest.record_call`, counted from the caller of ``start_call``."""
    req = _current.get()
    if req is None:
        return None
    i = req.record_call(kind, system, target, params, up + 1)
    if i < 0:
        return None
    call = _new(Call)
    call.req = req
    call.i = i
    return call


def attr(name: str, value: Any) -> None:
    """Attach a custom attribute (number or short string) to the current request. Not to an
    ended request left current (ended from another context): the writer has it, and the C
    end() may have left it to reference counting alone (a value put in after that could
    close a cycle the collector never sees)."""
    req = _current.get()
    if req is None or req.end:
        return
    try:
        if req.attrs is None:
            req.attrs = {}
        if len(req.attrs) < MAX_ATTRS or name in req.attrs:
            if isinstance(value, str) and len(value) > MAX_ATTR_CHARS:
                value = value[:MAX_ATTR_CHARS]
            req.attrs[str(name)] = value
    except Exception:
        internal_error()


def tag(name: str, value: Any) -> None:
    """Tag the current request (e.g. a feature-flag variant) for later comparison (not an
    ended one left current: see :func:`attr`)."""
    req = _current.get()
    if req is None or req.end:
        return
    try:
        if req.tags is None:
            req.tags = {}
        if len(req.tags) < MAX_ATTRS or name in req.tags:
            req.tags[str(name)] = str(value)[:MAX_ATTR_CHARS]
    except Exception:
        internal_error()


def set_user(user: Any = None, tenant: Any = None) -> None:
    """Name the user and/or tenant of the current request from application code."""
    req = _current.get()
    if req is None:
        return
    if user is not None:
        req.user = str(user)[:256]
    if tenant is not None:
        req.tenant = str(tenant)[:256]


F = TypeVar("F", bound=Callable[..., Any])


class task:
    """Record a unit of background work as a request of kind ``background``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._req: ActiveRequest | None = None

    def __enter__(self) -> task:
        self._req = begin("background", "TASK", self.name, cpu=True)
        if self._req is not None:
            self._req.endpoint = self.name
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        req, self._req = self._req, None
        if req is not None:
            req.status = 500 if exc_type is not None else 200
            if exc_type is not None:
                req.error = exc_type.__name__
            end(req)

    def __call__(self, fn: F) -> F:
        name = self.name
        if _is_coroutine_function(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                with task(name):
                    return await fn(*args, **kwargs)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with task(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def _is_coroutine_function(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


@contextmanager
def suppressed() -> Iterator[None]:
    """Run a block without recording (the agent's own I/O, for instance)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)
