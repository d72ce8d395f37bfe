"""The writer half of the agent: a bounded queue and one background thread writing segments.

Request path: ``enqueue(req)`` appends to a deque if it holds fewer than ``queue_size``
requests, else counts a drop. Nothing else happens on the request path. Runtime evidence
(stack samples, loop blockers, GC pauses, captures) goes through ``emit``, a second bounded
queue of records built on the writer thread.

Writer thread: every ``flush_seconds`` it drains the queue, turns references into records
(code locations, stacks and fingerprints are interned once per segment), appends them to the
process's open segment ``DATA/spool/<host>-<pid>-<ns>-<seq>.open`` and rotates it to ``.seg``
by size or age. It also keeps ``DATA/agents/<host>-<pid>.json`` up to date with the counters,
so drops stay visible even when the spool itself cannot be written.

Durability (``PERFSLEUTH_FSYNC``): ``rotate`` (default) fsyncs a segment when it is closed,
so an application crash loses nothing already written (the OS has it) and a machine crash
loses at most the open segment; ``always`` fsyncs after every batch; ``never`` leaves it to
the OS. Write errors (disk full, permissions) drop the batch, count it, and retry with back-off.
"""

from __future__ import annotations

import array
import atexit
import collections
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from perfsleuth.agent import accel, recorder, stacks
from perfsleuth.agent.config import Config
from perfsleuth.agent.frameworks import common as frameworks_common
from perfsleuth.agent.frameworks.common import (
    LOAD_HEADER,
    Identity,
    content_length,
    identity,
    identity_value,
    load_tags,
)
from perfsleuth.wire import (
    CLOSED_SUFFIX,
    FINGERPRINT,
    FORMAT_VERSION,
    HEADER,
    LOCATION,
    OPEN_SUFFIX,
    REQUESTS,
    STACK,
)
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire import calls as wcalls
from perfsleuth.wire import fingerprint as fpr
from perfsleuth.wire.calls import KIND_CODE, NULL, SYSTEM_CODE
from perfsleuth.wire.fingerprint import params_hash
from perfsleuth.wire.segment import FILE_MAGIC, encode_json, encode_payload, encode_record

AGENT_VERSION = "0.1.0"
MAX_WRITER_RESTARTS = 3
# The writer also wakes when this many requests wait (else every PERFSLEUTH_FLUSH_SECONDS).
# Each wake has a cost of its own (a thread switch, the writer's code and data cold in the CPU's
# caches): measured in the overhead benchmark, the writer's CPU per request fell from 7.0 µs at
# 64 to 4.0 at 256 and 3.1 at 1024. Bigger batches keep more requests alive, which used to
# bring garbage collections closer; a queued request now holds few containers (recorder.end
# drops what the writer does not need), and the application's thread measured the same.
WAKE_AT = 512
# Requests per REQUESTS record at most: damage to a record (a bad disk sector) loses all of its
# requests, and the per-record costs (framing, checksum, column names, the site table) are small
# beside 64 (from 16 to 64, the writer's instructions per request fell by a tenth).
BATCH_MAX = 64

stats = recorder.stats
stats.update(
    {
        "requests_written": 0,
        "dropped_queue_full": 0,
        "dropped_write_error": 0,
        "dropped_spool_full": 0,
        "dropped_writer_dead": 0,
        "write_errors": 0,
        "writer_restarts": 0,
        "segments_written": 0,
        "events_written": 0,
        "dropped_events": 0,
        "dropped_memory": 0,
        "dropped_shutdown": 0,
        "dropped_spool_deleted": 0,
        "fingerprints_skipped": 0,
        "cache_resets": 0,
    }
)
last_error = ""

_cfg: Config | None = None
_queue: collections.deque[recorder.ActiveRequest] = collections.deque()

# The memory budget (PERFSLEUTH_MEMORY_BUDGET_MB), in bytes, shared out so that the parts
# together stay within it: 3/8 for the queued requests, 1/4 for request bodies held for
# captures (agent.capture), 1/8 for the writer's caches (statements, fingerprints, stacks),
# 1/8 for the statements of the recorder's site cache (bounded on the request path: a stalled
# writer must not let it grow) and 1/8 for the slice of the queue being encoded (the writer
# drains the queue in slices of at most that many bytes, never all of a backlog at once).
_queue_limit = 12 << 20
_cache_limit = 4 << 20
_slice_limit = 4 << 20
# The estimated bytes of each queued request (in _queue's order) and their sum. A request's
# estimate: its object and fields, its call rows, its attributes and, when it made site entries
# (the recorder's site cache grew: statements it ran for the first time), its statements and
# their entries. Repeated statements share their entries across requests: those cost nothing
# more, and their requests skip the look at their sites.
_sizes: collections.deque[int] = collections.deque()
_queue_bytes = 0
REQUEST_BYTES = 700  # an ActiveRequest, its strings and ints, the deque slots
SITE_ENTRY_BYTES = 400  # a site entry, its key and captured stack, beside the statement
_site_cache = recorder._site_cache
_sites_seen = 0  # len(_site_cache) at the last enqueue
_site_cache_bytes = 0  # what the entries added to it since it was last cleared hold
# (record type, build): ``build(intern)`` returns the record's JSON body on the writer thread;
# ``intern(flat_stack)`` gives the stack id of a stacks.capture()-style tuple.
Intern = Callable[[tuple[Any, ...]], int | None]
_events: collections.deque[tuple[bytes, Callable[[Intern], dict[str, Any] | None]]] = (
    collections.deque()
)
_wake = threading.Event()
_lock = threading.Lock()  # serialises writing (writer thread vs. flush at exit)
_thread: threading.Thread | None = None
_host = socket.gethostname().replace("-", "_")[:64] or "host"


def enqueue(req: recorder.ActiveRequest) -> None:
    global _queue_bytes, _sites_seen, _site_cache_bytes
    cfg = _cfg
    if cfg is None:
        return
    if len(_queue) >= cfg.queue_size:
        stats["dropped_queue_full"] += 1
        _check_writer()
        return
    calls = req.calls
    size = REQUEST_BYTES
    if calls is not None:
        size += len(calls)
        if len(_site_cache) != _sites_seen:
            grew = 0
            for entry in req.site_list or ():
                target = entry[2]
                grew += SITE_ENTRY_BYTES + (len(target) if type(target) is str else 0)
            size += grew
            _site_cache_bytes += grew
            if _site_cache_bytes > _cache_limit:
                _site_cache.clear()  # loses reuse only: requests hold their own entries
                _site_cache_bytes = 0
                stats["cache_resets"] += 1
            _sites_seen = len(_site_cache)
    if req.attrs is not None:
        size += 128 * len(req.attrs)
    if _queue_bytes + size > _queue_limit:
        stats["dropped_memory"] += 1
        _wake.set()
        _check_writer()
        return
    _queue_bytes += size
    _sizes.append(size)
    _queue.append(req)
    if len(_queue) == WAKE_AT:
        _wake.set()


def _take(max_bytes: int) -> list[recorder.ActiveRequest]:
    """Pop queued requests up to ``max_bytes`` of estimated size (at least one)."""
    global _queue_bytes
    taken: list[recorder.ActiveRequest] = []
    total = 0
    while _queue and total < max_bytes:
        taken.append(_queue.popleft())
        total += _sizes.popleft() if _sizes else 0
    _queue_bytes = sum(_sizes) if len(_sizes) < 4096 else max(0, _queue_bytes - total)
    return taken


def emit(rtype: bytes, build: Callable[[Intern], dict[str, Any] | None]) -> bool:
    """Queue one event record (a wire.EVENT_TYPES type); never blocks. ``build`` runs on the
    writer thread, so the caller hands over references and does no encoding. Returns False
    (and counts ``dropped_events``) when the agent is off or the queue is full."""
    cfg = _cfg
    if cfg is None:
        return False
    if len(_events) >= cfg.queue_size:
        stats["dropped_events"] += 1
        return False
    _events.append((rtype, build))
    return True


def _check_writer() -> None:
    """Restart a writer thread that died (bounded), so a bug cannot silently stop shipping."""
    t = _thread
    if t is not None and not t.is_alive() and stats["writer_restarts"] < MAX_WRITER_RESTARTS:
        stats["writer_restarts"] += 1
        _start_thread()


_serials = itertools.count(1)


class _Segment:
    """The open segment file and what has been interned in it."""

    def __init__(self, cfg: Config, seq: int) -> None:
        self.cfg = cfg
        self.base = os.path.join(cfg.spool_dir, f"{_host}-{os.getpid()}-{time.time_ns()}-{seq:06d}")
        self.path = self.base + OPEN_SUFFIX
        self.opened = time.monotonic()
        self.size = 0
        self.partial = 0
        self.serial = next(_serials)  # tells segments apart, whatever their names
        self.locations: set[int] = set()
        self.stacks: set[int] = set()
        self.fingerprints: set[int] = set()
        os.makedirs(cfg.spool_dir, exist_ok=True)
        self.fh = open(self.path, "ab", buffering=0)  # noqa: SIM115 - lives across batches
        st = os.fstat(self.fh.fileno())
        self.file_id = (st.st_dev, st.st_ino)
        self.requests = 0  # written into this file: lost with it if it is deleted
        self.events = 0
        header = {
            "v": FORMAT_VERSION,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "service": cfg.service,
            "version": cfg.version,
            "agent": AGENT_VERSION,
            "started_ns": time.time_ns(),
        }
        try:
            self.write(FILE_MAGIC + encode_record(HEADER, header))
        except OSError:  # a full disk: no empty segment left behind by each retry
            self.fh.close()
            _unlink(self.path)
            raise
        self.header_size = self.size

    def write(self, data: bytes) -> None:
        """Write all of ``data``; on failure ``self.partial`` says how much did land."""
        view = memoryview(data)
        self.partial = 0
        while view:
            n = self.fh.write(view)
            if not n:
                raise OSError("short write")
            view = view[n:]
            self.partial += n
            self.size += n

    def gone(self) -> bool:
        """Whether the file was deleted under us (its spool directory removed, say): what is
        written to it then lands nowhere."""
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != self.file_id

    def due(self) -> bool:
        return (
            self.size >= self.cfg.segment_bytes
            or time.monotonic() - self.opened >= self.cfg.segment_seconds
        )

    def close(self, *, complete: bool = True) -> None:
        try:
            if self.cfg.fsync != "never":
                os.fsync(self.fh.fileno())
        finally:
            self.fh.close()
            if complete and self.size <= self.header_size:
                _unlink(self.path)  # a header and nothing else: nothing to read
            elif complete:
                os.replace(self.path, self.base + CLOSED_SUFFIX)
                stats["segments_written"] += 1


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class _Encoder:
    """Turns requests into records; caches survive across segments, emitted-sets do not."""

    def __init__(self, fingerprint_cpu_pct: float = 5.0) -> None:
        # Keyed by id(code): hashing code objects is not cached by CPython. Values keep the
        # code objects alive, so their ids stay unique while cached.
        self.locs: dict[tuple[int, int], tuple[int, dict[str, Any], Any]] = {}
        self.stack_ids: dict[tuple[int, ...], tuple[int, list[int], Any, int]] = {}
        # (kind, hash of the target): a statement's text is not kept as a key (distinct
        # statements would fill the cache with their literals); str hashes are cached by
        # CPython, so a hit costs no pass over the text.
        self.fps: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}
        # Bytes the caches hold (statements, fingerprint texts, stacks), estimated as they
        # are added; past the cache budget they are all cleared (cache_resets).
        self.cache_bytes = 0
        self.cache_limit = _cache_limit
        # CPU budget of fingerprinting: the wall time spent normalising new targets (the
        # writer holds the interpreter lock meanwhile, so the application waits as long) in
        # the current second; past ``fp_budget_ns`` a new target is written with a hash of its
        # text in place of its fingerprint (fingerprints_skipped), until the next second.
        self.fp_budget_ns = int(max(0.0, fingerprint_cpu_pct) * 10_000_000)
        self.fp_window = 0
        self.fp_spent_ns = 0
        self.skipped = False  # the last fingerprint() was a hash only
        # site key (recorder.record_call) -> [the stack last seen there, its sites entry, kind,
        # system, serial of the segment holding its dictionary records]: most requests
        # repeat the sites of the previous ones
        self.sites: dict[Any, list[Any]] = {}
        self.unlisted = False  # a site had a kind or system the wire has no code for

    def reset(self) -> None:
        """Empty the caches (the recorder's site cache too: its keys hold the same
        statements)."""
        global _site_cache_bytes
        for cache in (self.locs, self.stack_ids, self.fps, self.sites, _site_cache):
            cache.clear()  # type: ignore[attr-defined]
        _site_cache_bytes = 0
        self.cache_bytes = 0
        stats["cache_resets"] += 1

    def location(self, seg: _Segment, out: list[bytes], frame: tuple[Any, int]) -> int:
        code, where = frame
        key = (id(code), where)
        hit = self.locs.get(key)
        if hit is None:
            line = stacks.line(code, where)
            fn = code.co_filename
            func = getattr(code, "co_qualname", code.co_name)
            lid = fpr.stable_id(fn, line, func)
            rec = {"id": lid, "file": fn, "line": line, "func": func, "app": stacks.is_app_file(fn)}
            hit = self.locs[key] = (lid, rec, code)
            self.cache_bytes += 300 + len(fn) + len(func)
        if hit[0] not in seg.locations:
            seg.locations.add(hit[0])
            self.cache_bytes += SEEN_BYTES
            out.append(encode_record(LOCATION, hit[1]))
        return hit[0]

    def stack(self, seg: _Segment, out: list[bytes], flat: tuple[Any, ...]) -> tuple[int, int]:
        """(stack id, call-site location id) of a captured stack: ``flat`` is (code, where,
        code, where, ...) innermost first (stacks.capture); the call site is its first
        application frame (else its innermost frame)."""
        key = (*map(id, flat[::2]), *flat[1::2])
        hit = self.stack_ids.get(key)
        if hit is None:
            # The agent's own wrappers can sit mid-stack (a thread-pool hand-off): drop them
            # here, once per distinct stack, rather than on the request path.
            frames = [
                fr
                for fr in zip(flat[::2], flat[1::2], strict=True)
                if stacks.classify(fr[0]) is not None
            ]
            ids = [self.location(seg, out, fr) for fr in reversed(frames)]  # outermost first
            site = next((i for i, fr in enumerate(frames) if stacks.classify(fr[0])), 0)
            site_id = ids[len(ids) - 1 - site] if ids else NULL
            hit = self.stack_ids[key] = (fpr.stable_id(*ids), ids, flat, site_id)
            self.cache_bytes += 200 + 48 * len(flat)
        if hit[0] not in seg.stacks:
            for fr in zip(flat[::2], flat[1::2], strict=True):
                if stacks.classify(fr[0]) is not None:
                    self.location(seg, out, fr)
            seg.stacks.add(hit[0])
            self.cache_bytes += SEEN_BYTES
            out.append(encode_record(STACK, {"id": hit[0], "frames": hit[1]}))
        return hit[0], hit[3]

    def fingerprint(self, seg: _Segment, out: list[bytes], kind: str, target: Any) -> int:
        self.skipped = False
        try:
            key = (kind, hash(target))
        except TypeError:  # an unhashable target (a list of URL parts): by its text
            key = (kind, hash(repr(target)))
        hit = self.fps.get(key)
        if hit is None:
            now = _perf_ns()
            if now - self.fp_window >= 1_000_000_000:
                self.fp_window, self.fp_spent_ns = now, 0
            if self.fp_spent_ns >= self.fp_budget_ns:
                # Over budget: detail goes, speed stays. Not cached, so the target gets its
                # fingerprint when it comes again within budget.
                stats["fingerprints_skipped"] += 1
                self.skipped = True
                fid, record = _unfingerprinted(kind, target, key[1])
                if fid not in seg.fingerprints:
                    seg.fingerprints.add(fid)
                    self.cache_bytes += SEEN_BYTES
                    out.append(record)
                return fid
            else:
                text, op = _fingerprint_text(kind, target)
                fid = fpr.stable_id(kind, text)
                hit = self.fps[key] = (fid, {"id": fid, "kind": kind, "text": text, "op": op})
                self.cache_bytes += 250 + len(text)
                self.fp_spent_ns += _perf_ns() - now
        if hit[0] not in seg.fingerprints:
            seg.fingerprints.add(hit[0])
            self.cache_bytes += SEEN_BYTES
            out.append(encode_record(FINGERPRINT, hit[1]))
        return hit[0]

    def site(self, seg: _Segment, out: list[bytes], entry: tuple[Any, ...]) -> list[int]:
        """The ``sites`` entry of a request's site (recorder.ActiveRequest.site_list):
        [fingerprint, stack, call-site location, kind code, system code]."""
        kind, system, target, flat, key = entry
        # A site of another request with the same key has mostly the same stack: equal
        # tuples compare in C, element by element (code objects by identity).
        hit = self.sites.get(key)
        if hit is not None and hit[0] == flat and hit[2] is kind and hit[3] is system:
            if hit[4] != seg.serial:  # its dictionary records are not in this segment yet
                self._intern_site(seg, out, kind, target, flat)
                hit[4] = seg.serial
            return hit[1]  # type: ignore[no-any-return]
        fid, sid, where = self._intern_site(seg, out, kind, target, flat)
        skipped = self.skipped and target is not None
        resolved = [
            fid,
            sid,
            where,
            KIND_CODE.get(kind, wcalls.OTHER),
            SYSTEM_CODE.get(system, wcalls.OTHER),
        ]
        if resolved[3] == wcalls.OTHER or resolved[4] == wcalls.OTHER:
            self.unlisted = True
        if not skipped:  # a site whose fingerprint was skipped is resolved again next time
            self.sites[key] = [flat, resolved, kind, system, seg.serial]
            # the statement and stack it keeps
            self.cache_bytes += 120 + 16 * len(flat) + (len(target) if type(target) is str else 0)
        return resolved

    def _intern_site(
        self, seg: _Segment, out: list[bytes], kind: str, target: Any, flat: tuple[Any, ...]
    ) -> tuple[int, int, int]:
        """Write what a site needs into this segment: (fingerprint id, stack id, call-site
        location id), NULL for what it has not (a fingerprint: the calls carry their own
        targets)."""
        sid, where = self.stack(seg, out, flat) if flat else (NULL, NULL)
        return NULL if target is None else self.fingerprint(seg, out, kind, target), sid, where

    def _extras(
        self,
        seg: _Segment,
        out: list[bytes],
        req: recorder.ActiveRequest,
        sites: list[list[int]],
    ) -> dict[str, dict[str, Any]]:
        """The ``cx`` entries of a request (wire.calls): the rarely set values of its calls
        (``req.more``) and the names of kinds and systems the wire has no code for. Hashes
        parameters the request path left unhashed straight into the calls' rows."""
        calls = req.calls
        site_list = req.site_list
        assert calls is not None and site_list is not None
        ext: dict[str, dict[str, Any]] = {}
        for i, more in (req.more or {}).items():
            if i < 0 or i >= len(calls):
                continue
            kind = site_list[recorder.get_field(calls, i + recorder.SLOT)][0]
            x: dict[str, Any] = {}
            for name in ("status", "bytes", "wait"):
                v = more.get(name)
                if type(v) is int:
                    x[name] = v
            if "hit" in more:
                x["hit"] = bool(more["hit"])
            if "error" in more:
                x["error"] = str(more["error"])[:200]
            if more.get("extra"):
                x["extra"] = more["extra"]
            target = more.get("target")
            if target is not None:
                x["fp"] = self.fingerprint(seg, out, kind, target)
                if kind == "http":
                    x["host"] = _host_of(target)
            if "params" in more:
                ph = params_hash(more["params"])
                recorder.set_field(calls, i + recorder.PH, NULL if ph is None else ph)
            if x:
                ext[str(i // recorder.ROW)] = x
        for slot, site in enumerate(sites):
            if site[3] == wcalls.OTHER or site[4] == wcalls.OTHER:  # rare: unlisted names
                kind, system = site_list[slot][:2]
                for i in range(0, len(calls), recorder.ROW):
                    if recorder.get_field(calls, i + recorder.SLOT) == slot:
                        x = ext.setdefault(str(i // recorder.ROW), {})
                        x["kind"], x["system"] = str(kind), str(system)
        return ext

    def batch(self, seg: _Segment, reqs: list[recorder.ActiveRequest]) -> tuple[list[bytes], int]:
        """(records, requests in them) of finished requests: whatever they need interned in
        this segment, then one REQUESTS record (wire.batch). Per request, a row of references
        gathered into columns; the encoding is done once for all. A request that cannot be
        encoded is left out (and counted as an internal error)."""
        out: list[bytes] = []
        rows: list[tuple[Any, ...]] = []
        calls_of: list[bytearray] = []  # the agent rows of each request, in order
        sparse: dict[str, Any] = {"attrs": {}, "tags": {}, "cx": {}, "site_table": []}
        table_of: dict[int, int] = {}  # id(site entry) -> its index in sparse["site_table"]
        ident = identity()
        for req in reqs:
            try:
                row, calls = self._row(seg, out, req, ident, len(rows), sparse, table_of)
            except Exception:
                recorder.internal_error()
                continue
            rows.append(row)
            calls_of.append(calls)
        if not rows:
            return out, 0
        try:
            out.append(_requests_record(rows, calls_of, sparse))
            return out, len(rows)
        except Exception:  # an odd value somewhere: one record per request, losing only it
            recorder.internal_error()
        n = 0
        for i, (row, calls) in enumerate(zip(rows, calls_of, strict=True)):
            key = str(i)
            mine = {name: {"0": v[key]} for name in SPARSE if key in (v := sparse[name])}
            mine["site_table"] = sparse["site_table"]
            try:
                out.append(_requests_record([row], [calls], mine))
                n += 1
            except Exception:
                recorder.internal_error()
        return out, n

    def _row(
        self,
        seg: _Segment,
        out: list[bytes],
        req: recorder.ActiveRequest,
        ident: Identity,
        i: int,
        sparse: dict[str, Any],
        table_of: dict[int, int],
    ) -> tuple[tuple[Any, ...], bytearray]:
        """One request's values (text columns, ints, sites: wire.batch) and its call rows; its
        attributes, tags and per-call extras go into ``sparse`` under its index ``i`` in the
        batch, its sites into the batch's site table (``table_of``: where each site entry is
        in it; requests share entries, recorder._site_cache). ``ident``: the identity
        headers."""
        values = _c_row(req, ident.user_b, ident.tenant_b) if _c_row is not None else None
        if values is None or values is NotImplemented:
            values = _row_values(req)
        key = str(i)
        if req.attrs:
            sparse["attrs"][key] = {str(k): _scalar(v) for k, v in req.attrs.items()}
        if req.tags:
            sparse["tags"][key] = req.tags
        calls = req.calls or _NO_CALLS
        sites = None
        if calls:
            sites = []
            table = sparse["site_table"]
            for entry in req.site_list or ():
                j = table_of.get(id(entry))
                if j is None:
                    j = table_of[id(entry)] = len(table)
                    table.append(self.site(seg, out, entry))
                sites.append(j)
            if req.more is not None or self.unlisted:
                ext = self._extras(seg, out, req, [table[j] for j in sites])
                if ext:
                    sparse["cx"][key] = ext
        return (*values, sites), calls


def _row_values(req: recorder.ActiveRequest) -> tuple[Any, ...]:
    """A request's values for wire.batch's text columns, in order, then its integer columns
    as wire bytes (the C accelerator's row() gives the same)."""
    if req.headers is not None:
        _read_headers(req)
    gc = req.gc_count
    ints = (
        req.trace_id,
        req.start_wall,
        max(0, req.end - req.start),
        req.status,
        req.cpu_ns,
        req.req_bytes,
        req.resp_bytes,
        req.calls_dropped or None,
        req.gc_ns if gc else None,
        gc or None,
        req.start,
        len(req.calls or _NO_CALLS) // recorder.ROW,
    )
    return (
        req.kind,
        req.method,
        req.endpoint or f"{req.method} <unmatched>",
        req.path,
        req.user,
        req.tenant,
        req.error,
        wbatch.pack_ints(ints),
    )


_c_row = accel.pick("row", None)


SPARSE = ("attrs", "tags", "cx")


def _requests_record(
    rows: list[tuple[Any, ...]], calls_of: list[bytearray], sparse: dict[str, Any]
) -> bytes:
    """One REQUESTS record (wire.batch) of rows made by _Encoder._row."""
    body: dict[str, Any] = {"v": wbatch.VERSION, "n": len(rows)}
    columns = list(zip(*rows, strict=True))
    names = (*wbatch.STRING_COLUMNS, "sites")
    for name, col in zip(names, (*columns[: len(wbatch.STRING_COLUMNS)], columns[-1]), strict=True):
        # The requests of a batch mostly share their kind, method, endpoint, tenant, error and
        # sites: one value then, not one per request (JSON encoding was a third of the writer's
        # work). ``count`` compares by identity first: shared strings cost next to nothing.
        first = col[0]
        body[name] = {"all": first} if col.count(first) == len(col) else col
    for name, values in sparse.items():
        if values:
            body[name] = values
    ints = b"".join(columns[-2])  # packed little-endian by row()
    rows_bytes = b"".join(calls_of)  # the agent's rows are the wire's, in native order
    if _BIG_ENDIAN:
        swapped = array.array("q", rows_bytes)
        swapped.byteswap()
        rows_bytes = swapped.tobytes()
    return encode_payload(REQUESTS, encode_json(body) + wcalls.SEPARATOR + ints + rows_bytes)


_NO_CALLS = bytearray()
_BIG_ENDIAN = sys.byteorder == "big"


_LOAD_HEADER = LOAD_HEADER.encode("latin-1")


def _read_headers(req: recorder.ActiveRequest) -> None:
    """The user, tenant and declared body size of an ASGI request from its raw header list
    (read here rather than on the request path). Values set by the application win."""
    headers = dict(req.headers)  # ASGI header names are lower case
    req.headers = None
    ident = identity()
    if req.user is None:
        req.user = identity_value(headers.get(ident.user_b))
    if req.tenant is None:
        req.tenant = identity_value(headers.get(ident.tenant_b))
    if req.req_bytes is None:
        cl = headers.get(b"content-length")
        req.req_bytes = 0 if cl is None else content_length(cl) or 0
    load = headers.get(_LOAD_HEADER)
    if load is not None:
        load_tags(req, load)


def _scalar(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float)):
        return v
    return str(v)[: recorder.MAX_ATTR_CHARS]


def _host_of(target: Any) -> str:
    url = str(target[1]) if isinstance(target, tuple) and len(target) >= 2 else str(target)
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit("@", 1)[-1]


_perf_ns = time.perf_counter_ns
SEEN_BYTES = 72  # an id in a segment's set of what it holds: the int and its slot


def _unfingerprinted(kind: str, target: Any, text_hash: int) -> tuple[int, bytes]:
    """(id, FINGERPRINT record) of a target the writer had no CPU left to normalise: named by
    a hash of its text (statements differing in a literal differ here too), never the text
    itself. Made in a few string operations: skipping must cost far less than normalising
    (the text's hash is cached by the str; it differs between processes, as do these ids)."""
    size = len(target) if type(target) is str else 0
    fid = hash((kind, text_hash, size)) & MASK63
    kind_json = _KIND_JSON.get(kind) or _KIND_JSON.setdefault(kind, encode_json(str(kind)))
    body = b'{"id":%d,"kind":%s,"text":"[not fingerprinted: %d chars, hash %016x]","op":"OTHER"}'
    return fid, encode_payload(FINGERPRINT, body % (fid, kind_json, size, text_hash & MASK64))


_KIND_JSON: dict[str, bytes] = {}
MASK63 = (1 << 63) - 1
MASK64 = (1 << 64) - 1


def call_text(kind: str, target: Any) -> str:
    """The fingerprint text of a call (normalised SQL, URL template, cache command)."""
    return _fingerprint_text(kind, target)[0]


def _fingerprint_text(kind: str, t: Any) -> tuple[str, str]:
    if kind == "db":
        text = fpr.normalize_sql(str(t))
        return text, fpr.sql_operation(text)
    if kind == "http":
        method, url = (t[0], t[1]) if isinstance(t, tuple) else ("GET", str(t))
        rest = str(url).split("://", 1)[-1]
        host, _, path = rest.partition("/")
        host = host.rsplit("@", 1)[-1]  # never keep credentials in a URL
        return f"{str(method).upper()} {host}{fpr.url_template('/' + path)}", str(method).upper()
    if isinstance(t, tuple):
        cmd = str(t[0]).upper()
        key = fpr.cache_key_template(str(t[1])) if len(t) > 1 and t[1] is not None else ""
        return (f"{cmd} {key}".strip(), cmd)
    return (str(t).upper(), str(t).upper())


class _Writer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.seq = 0
        self.seg: _Segment | None = None
        self.enc = _Encoder(cfg.fingerprint_cpu_pct)
        self.retry_at = 0.0
        self.backoff = 0.5
        self.last_status = 0.0
        self.spool_checked = 0.0
        self.spool_is_full = False

    def _open_live(self) -> _Segment | None:
        """The open segment, or a new one when its file was deleted under us: what was
        written to the deleted file is lost, and counted (dropped_spool_deleted)."""
        if self.seg is not None and self._lost(self.seg):
            self.seg = None
        return self._open()

    @staticmethod
    def _lost(seg: _Segment) -> bool:
        """Whether ``seg``'s file was deleted under us; if so its requests and events are
        counted as lost (no longer as written) and the file is closed."""
        if not seg.gone():
            return False
        stats["requests_written"] -= seg.requests
        stats["dropped_spool_deleted"] += seg.requests
        stats["events_written"] -= seg.events
        stats["dropped_events"] += seg.events
        with contextlib.suppress(OSError):
            seg.fh.close()
        return True

    def _open(self) -> _Segment | None:
        if self.seg is not None:
            return self.seg
        if time.monotonic() < self.retry_at:
            return None
        try:
            self.seq += 1
            self.seg = _Segment(self.cfg, self.seq)
            self.backoff = 0.5
        except OSError as e:
            self._failed(e)
        return self.seg

    def _failed(self, e: BaseException) -> None:
        global last_error
        stats["write_errors"] += 1
        last_error = f"{type(e).__name__}: {e}"
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 30.0)
        seg, self.seg = self.seg, None
        if seg is not None:
            try:
                seg.close(complete=True)  # keep what was written; readers skip a torn tail
            except OSError:
                pass

    def _spool_full(self) -> bool:
        """Whether the spool holds more than its cap (re-checked every few seconds only)."""
        now = time.monotonic()
        if now - self.spool_checked >= 5.0:
            self.spool_checked = now
            try:
                total = sum(e.stat().st_size for e in os.scandir(self.cfg.spool_dir) if e.is_file())
            except OSError:
                total = 0
            self.spool_is_full = total >= self.cfg.spool_max_bytes
        return self.spool_is_full

    def drain(self) -> None:
        """Write everything queued (in slices of bounded bytes: a backlog is never encoded
        into one buffer); called by the writer thread and at exit."""
        left = len(_queue)  # what came later waits for the next round
        while left > 0 and _queue:
            batch = _take(_slice_limit)
            left -= len(batch)
            self._write_batch(batch)
        if _events:
            self._write_events()
        if self.seg is not None and self.seg.due():
            self._rotate()
        now = time.monotonic()
        if now - self.last_status >= 1.0:
            self.last_status = now
            write_status(self.cfg)

    def _write_batch(self, batch: list[recorder.ActiveRequest]) -> None:
        if self.enc.cache_bytes > self.enc.cache_limit:
            # Past the cache budget: the caches start again, and so does the segment (its sets
            # of the ids it holds grow with every distinct statement).
            self._rotate()
            self.enc.reset()
        seg = self._open_live()
        if seg is None:
            stats["dropped_write_error"] += len(batch)
            return
        if self._spool_full():
            stats["dropped_spool_full"] += len(batch)
            return
        chunks: list[bytes] = []
        ends: list[tuple[int, int]] = []  # (byte offset where a record ends, its requests)
        size = 0
        for lo in range(0, len(batch), BATCH_MAX):
            recs, n = self.enc.batch(seg, batch[lo : lo + BATCH_MAX])
            chunks.extend(recs)
            size += sum(map(len, recs))
            ends.append((size, n))
        try:
            seg.write(b"".join(chunks))
            if self.cfg.fsync == "always":
                os.fsync(seg.fh.fileno())
            written = sum(n for _, n in ends)
            stats["requests_written"] += written
            seg.requests += written
        except OSError as e:
            # Records that landed whole before the error are written; readers skip the torn
            # tail. The segment's interned sets may now be ahead of the file, so the next
            # batch starts a new segment.
            landed = sum(n for end, n in ends if end <= seg.partial)
            stats["requests_written"] += landed
            stats["dropped_write_error"] += sum(n for _, n in ends) - landed
            self._failed(e)

    def _write_events(self) -> None:
        events = []
        while _events:
            events.append(_events.popleft())
        seg = self._open_live()
        if seg is None or self._spool_full():
            stats["dropped_events"] += len(events)
            return
        out: list[bytes] = []
        written = 0
        for rtype, build in events:
            try:
                body = build(lambda flat: self.enc.stack(seg, out, flat)[0] if flat else None)
                if body is None:
                    continue
                out.append(encode_record(rtype, body))
                written += 1
            except Exception:  # records it interned stay: the segment's sets now name them
                stats["dropped_events"] += 1
                recorder.internal_error()
        try:
            seg.write(b"".join(out))
            stats["events_written"] += written
            seg.events += written
        except OSError as e:
            stats["dropped_events"] += written
            self._failed(e)

    def _rotate(self) -> None:
        seg, self.seg = self.seg, None
        if seg is None or self._lost(seg):
            return
        try:
            seg.close()
        except OSError as e:
            self._failed(e)

    def close(self) -> None:
        self._rotate()
        write_status(self.cfg)


_writer: _Writer | None = None


def _run() -> None:
    global last_error
    try:
        _loop()
    except BaseException as e:  # the thread dies, quietly: nothing lands in the app's stderr
        last_error = f"writer thread died: {type(e).__name__}: {e}"
        recorder.internal_error()


def _loop() -> None:
    global last_error
    w = _writer
    cfg = _cfg
    if w is None or cfg is None:
        return
    if cfg.fault == "writer_crash":
        raise RuntimeError("injected writer crash")  # dies like a real bug would
    while True:
        _wake.wait(cfg.flush_seconds)
        _wake.clear()
        with _lock:
            try:
                w.drain()
            except Exception as e:  # a bug in encoding must not kill shipping
                recorder.internal_error()
                last_error = f"{type(e).__name__}: {e}"


def _start_thread() -> None:
    global _thread
    t = threading.Thread(target=_run, name="perfsleuth-writer", daemon=True)
    t.start()
    _thread = t


# A status file is padded to this size (JSON allows trailing spaces), so that on a full disk it
# can still be overwritten in place, in the blocks it already has.
STATUS_BYTES = 4096
status_written = True  # whether the last status update reached the file


def write_status(cfg: Config) -> None:
    """Replace DATA/agents/<host>-<pid>.json with the current counters (best effort). When
    the disk is full, the file is overwritten in place; the counters stay in memory and are
    written by the next update that succeeds, and shutdown() reports drops on stderr."""
    global status_written
    status_written = False
    try:
        os.makedirs(cfg.agents_dir, exist_ok=True)
        path = os.path.join(cfg.agents_dir, f"{_host}-{os.getpid()}.json")
        body: dict[str, Any] = dict(stats)
        body["dropped_writer_dead"] = stats["dropped_writer_dead"] + (
            len(_queue) if _thread is not None and not _thread.is_alive() else 0
        )
        body.update(
            pid=os.getpid(),
            host=socket.gethostname(),
            service=cfg.service,
            updated_ns=time.time_ns(),
            last_error=last_error,
            queued=len(_queue),
        )
        data = json.dumps(body).encode()
        data += b" " * (STATUS_BYTES - len(data) - 1) + b"\n"
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)
            if len(data) > STATUS_BYTES:
                raise
            with open(path, "r+b") as fh:  # no new blocks needed: a full disk allows it
                fh.write(data)
        status_written = True
    except Exception:
        pass  # nowhere to report to: the in-memory counters still hold the truth


def start(cfg: Config) -> None:
    global _cfg, _writer, _queue_limit, _cache_limit, _slice_limit
    budget = max(1 << 20, int(cfg.memory_budget_mb * (1 << 20)))
    _queue_limit, _cache_limit, _slice_limit = budget * 3 // 8, budget // 8, budget // 8
    _cfg = cfg
    _writer = _Writer(cfg)
    recorder.configure(enqueue, max_calls=cfg.max_calls, stacks_per_site=cfg.stacks_per_site)
    frameworks_common.configure(cfg)
    from perfsleuth.agent import capture

    capture.configure(cfg, emit)
    _start_thread()
    _install_sigterm()
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:  # else when it is imported (instrument.registry)
        hook_multiprocessing(mp_util)


def hook_multiprocessing(mp_util: Any) -> None:
    """Make multiprocessing's children flush at exit (see _MultiprocessingHook); called with
    ``multiprocessing.util`` when it is imported, so the agent's start does not import it."""
    try:
        mp_util.register_after_fork(_mp_hook, _MultiprocessingHook.after_fork)
    except Exception:
        recorder.internal_error()


def flush(timeout: float = 5.0) -> None:
    """Write everything queued now (called at exit; also handy in tests and benchmarks)."""
    w = _writer
    if w is None or _cfg is None:
        return
    if _thread is not None and not _thread.is_alive():
        # Writer died (bug or injected fault): do not run its code on the caller's thread;
        # account for what it will never write and leave a status file behind.
        stats["dropped_writer_dead"] += len(_queue)
        _queue.clear()
        _sizes.clear()
        write_status(_cfg)
        return
    if not _lock.acquire(timeout=timeout):
        return
    try:
        w.drain()
        if w.seg is not None and _cfg.fsync == "always":
            os.fsync(w.seg.fh.fileno())
        write_status(_cfg)
    except Exception:
        recorder.internal_error()
    finally:
        _lock.release()


def shutdown() -> None:
    """Flush and close the open segment (renamed to .seg), then say on stderr how many
    requests could not be written, if any. Registered with atexit."""
    global _writer
    w, cfg = _writer, _cfg
    if w is None or cfg is None:
        return
    flush()
    if _lock.acquire(timeout=5.0):
        try:
            if _queue:  # still queued: could not be written in time
                stats["dropped_shutdown"] = stats.get("dropped_shutdown", 0) + len(_queue)
                _queue.clear()
                _sizes.clear()
            w.close()
            _writer = None  # once: atexit after a SIGTERM flush has nothing left to do
        except Exception:
            recorder.internal_error()
        finally:
            _lock.release()
    else:
        stats["dropped_shutdown"] = stats.get("dropped_shutdown", 0) + len(_queue)
        write_status(cfg)
    report_drops(cfg)


def report_drops(cfg: Config) -> None:
    """One line on stderr when requests recorded in this process were dropped: the status file
    may not say so (a full disk), and the counters die with the process."""
    drops = {k[8:]: v for k, v in stats.items() if k.startswith("dropped_") and v}
    total = sum(v for k, v in drops.items() if k != "events")
    if total <= 0:
        return
    reasons = ", ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in drops.items())
    where = "" if status_written else " (the status file could not be updated)"
    line = f"perfsleuth: {total:,} requests were not written ({reasons}){where}"
    if last_error:
        line += f"; last error: {last_error}"
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM in a process that left it at its default: write what is queued, then die of
    it as the default would have (atexit does not run on a signal death)."""
    try:
        evidence = sys.modules.get("perfsleuth.agent.evidence")
        if evidence is not None:
            evidence.flush()
        shutdown()
    except Exception:
        recorder.internal_error()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    """Flush on SIGTERM where the application has no handler of its own (Django's runserver,
    a plain script); one installed later replaces this one, as it should."""
    try:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError, AttributeError):
        pass


def _after_fork_in_child() -> None:
    """A forked worker (gunicorn, multiprocessing) gets its own queue, segment and thread.

    Requests queued in the parent at fork time are the parent's to write: drop our copy.
    """
    global _lock, _wake, _writer, _queue_bytes
    _queue.clear()
    _sizes.clear()
    _queue_bytes = 0
    _events.clear()
    _lock = threading.Lock()
    _wake = threading.Event()
    for k in stats:
        stats[k] = 0
    if _cfg is not None:
        _writer = _Writer(_cfg)
        _start_thread()


class _MultiprocessingHook:
    """multiprocessing children leave through os._exit, which skips atexit. They run
    multiprocessing's finalizers first, but clear the inherited ones after fork: so register a
    finalizer from multiprocessing's own after-fork hook (this object must stay alive)."""

    @staticmethod
    def after_fork(_: object) -> None:
        try:
            import multiprocessing.util

            multiprocessing.util.Finalize(None, shutdown, exitpriority=100)
        except Exception:
            recorder.internal_error()


_mp_hook = _MultiprocessingHook()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)
