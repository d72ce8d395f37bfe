"""The agent's encoder: finished requests -> wire records (wire.batch's REQUESTS, and the
LOCATION, STACK and FINGERPRINT dictionary records they refer to).

:func:`encode_requests` is the one entry point for code outside the writer: tests use it to
write spools exactly the way the agent does (and :meth:`Encoder.stack` for the stacks of the
evidence records they write). The writer thread keeps one :class:`Encoder`
(its caches survive across segments) and one :class:`Interned` per segment (what the segment
holds already: each dictionary record is written once per segment, before the first record
using it).

Fingerprinting has a CPU budget (PERFSLEUTH_FINGERPRINT_CPU_PCT): past it a new statement is
written with a hash of its text in place of its normalised text (``fingerprints_skipped``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from perfsleuth.agent import recorder, stacks
from perfsleuth.agent.frameworks.common import Identity, identity
from perfsleuth.agent.recorder import stats
from perfsleuth.agent.spool import columns, targets
from perfsleuth.wire import FINGERPRINT, LOCATION, STACK
from perfsleuth.wire import calls as wcalls
from perfsleuth.wire import fingerprint as fpr
from perfsleuth.wire.calls import KIND_CODE, NULL, SYSTEM_CODE
from perfsleuth.wire.fingerprint import params_hash
from perfsleuth.wire.segment import encode_record

# Requests per REQUESTS record at most: damage to a record (a bad disk sector) loses all of its
# requests, and the per-record costs (framing, checksum, column names, the site table) are small
# beside 64.
BATCH_MAX = 64
SEEN_BYTES = 72  # an id in a segment's set of what it holds: the int and its slot
FLAT_MEMO_BYTES = 150  # an entry of Encoder.flats: its key, tuple and ints
# Characters of statements scanned in one release of the interpreter lock at most (their
# scratch memory: up to four bytes a character)
PRETOKENIZE_CHARS = 1 << 18
SHAPE_BYTES = 200  # an entry of Encoder.shapes beside its tokens
FPS_ENTRY_BYTES = 150  # an entry of Encoder.fps: its key tuple and ints (the value is shared)
ONCE_MAX = 8192  # hashes in Encoder.once at most
DEFAULT_CACHE_LIMIT = 4 << 20

_serials = itertools.count(1)


def encode_requests(
    requests: Sequence[recorder.ActiveRequest],
    into: Interned | None = None,
    *,
    encoder: Encoder | None = None,
) -> bytes:
    """The records the agent writes for these finished requests (recorder.ActiveRequest, as
    recorder.end hands them over): the dictionary records ``into`` does not hold yet, then
    REQUESTS records of at most BATCH_MAX requests each. Append them to a segment after its
    header (wire.segment.FILE_MAGIC and a HEADER record).

    ``into`` is what the segment holds already (pass the same one for every call writing to
    one segment; a new one by default: the records then stand alone). ``encoder`` carries the
    caches and the fingerprinting budget (a new one by default, without a budget: every
    statement is fingerprinted). A request that cannot be encoded is left out and counted
    (``internal_errors``)."""
    enc = encoder if encoder is not None else Encoder(fingerprint_cpu_pct=None)
    seen = into if into is not None else Interned()
    return b"".join(b"".join(records) for records, _ in enc.records(seen, requests))


class Interned:
    """What one segment holds already: the ids of its dictionary records."""

    def __init__(self) -> None:
        self.serial = next(_serials)  # tells segments apart, whatever their names
        self.locations: set[int] = set()
        self.stacks: set[int] = set()
        self.fingerprints: set[int] = set()


class Encoder:
    """Turns requests into records; caches survive across segments, emitted-sets do not."""

    def __init__(
        self,
        fingerprint_cpu_pct: float | None = 5.0,
        cache_limit: int = DEFAULT_CACHE_LIMIT,
    ) -> None:
        # Keyed by id(code): hashing code objects is not cached by CPython. Values keep the
        # code objects alive, so their ids stay unique while cached.
        self.locs: dict[tuple[int, int], tuple[int, dict[str, Any], Any]] = {}
        self.stack_ids: dict[tuple[int, ...], tuple[int, list[int], Any, int]] = {}
        # (kind, hash of the target): a statement's text is not kept as a key (distinct
        # statements would fill the cache with their literals); str hashes are cached by
        # CPython, so a hit costs no pass over the text.
        self.fps: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}
        # A statement's tokens (fpr.sql_tokens) -> its (id, FINGERPRINT body): statements
        # differing only in their literals share them, and the rest of the work.
        self.fp_tokens: dict[str, tuple[int, dict[str, Any]]] = {}
        # Hashes of the site keys seen once (see site): a statement is kept in the caches from
        # its second sighting on. At most ONCE_MAX (then cleared: a repeated statement is then
        # kept one sighting later).
        self.once: set[int] = set()
        # A batch's new statements -> their tokens, scanned together beforehand with the
        # interpreter lock released (_pretokenize); emptied after the batch.
        self.pre: dict[str, str | None] = {}
        # (tokens, id(stack tuple)) -> (the stack, kind, system, serial of the segment, its
        # sites entry): a new statement of a known shape at a known place resolves to the
        # sites entry made for the first one (see site); holds the stacks, so ids stay unique
        self.shapes: dict[tuple[str, int], tuple[Any, str, str, int, list[int]]] = {}
        # Bytes the caches hold (statements, fingerprint texts, stacks), estimated as they
        # are added; past the cache budget they are all cleared (cache_resets).
        self.cache_bytes = 0
        self.cache_limit = cache_limit
        # CPU budget of fingerprinting: the wall time spent normalising new targets (the
        # writer holds the interpreter lock meanwhile, so the application waits as long) in
        # the current second; past ``fp_budget_ns`` a new target is written with a hash of its
        # text in place of its fingerprint (fingerprints_skipped), until the next second. None:
        # no budget.
        self.fp_budget_ns = (
            None if fingerprint_cpu_pct is None else int(max(0.0, fingerprint_cpu_pct) * 10_000_000)
        )
        self.fp_window = 0
        self.fp_spent_ns = 0
        self.skipped = False  # the last fingerprint() was a hash only
        # site key (recorder.record_call) -> [the stack last seen there, its sites entry, kind,
        # system, serial of the segment holding its dictionary records]: most requests
        # repeat the sites of the previous ones
        self.sites: dict[Any, list[Any]] = {}
        self.unlisted = False  # a site had a kind or system the wire has no code for
        # id(stack tuple) -> (the tuple, serial of the segment, stack id, call-site location
        # id): the stacks of new sites by object (see site); holds the tuples, so ids stay
        # unique
        self.flats: dict[int, tuple[Any, int, int, int]] = {}
        # recorder.stacks_forgotten when flats and shapes were last emptied: the recorder's
        # stack cache emptied since, their stacks are never seen again (under distinct SQL
        # it is emptied every second or two, and they grew by a stack and its shapes each time)
        self.stacks_seen = recorder.stacks_forgotten

    def forget_stacks(self) -> None:
        """Empty what is remembered by stack object (flats, shapes): the recorder no longer
        hands those stacks out. A request still queued with one resolves its sites by the
        stack's frames, as a new stack would."""
        freed = len(self.flats) * FLAT_MEMO_BYTES
        freed += sum(SHAPE_BYTES + len(tokens) for tokens, _ in self.shapes)
        self.flats.clear()
        self.shapes.clear()
        self.cache_bytes = max(0, self.cache_bytes - freed)
        self.stacks_seen = recorder.stacks_forgotten

    def reset(self) -> None:
        """Empty the caches."""
        caches = (self.locs, self.stack_ids, self.fps, self.fp_tokens, self.sites, self.flats)
        for cache in (*caches, self.shapes, self.once):
            cache.clear()  # type: ignore[attr-defined]
        self.cache_bytes = 0
        stats["cache_resets"] += 1

    def location(self, seg: Interned, out: list[bytes], frame: tuple[Any, int]) -> int:
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

    def stack(self, seg: Interned, out: list[bytes], flat: tuple[Any, ...]) -> tuple[int, int]:
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

    def _over_budget(self) -> bool:
        """Whether this second's fingerprinting time is spent (a new second starts anew)."""
        now = _perf_ns()
        if now - self.fp_window >= 1_000_000_000:
            self.fp_window, self.fp_spent_ns = now, 0
        return self.fp_budget_ns is not None and self.fp_spent_ns >= self.fp_budget_ns

    def _pretokenize(self, reqs: Sequence[recorder.ActiveRequest]) -> None:
        """Scan the tokens of the batch's statements not met before (fpr.sql_tokens_many) in
        a few C calls that release the interpreter lock: the application's threads run on
        another core meanwhile, where scanning them one by one in fingerprint() would hold the
        lock throughout. The scanning's thread CPU time counts in the fingerprinting budget;
        statements past it are left to fingerprint() (which skips them)."""
        sites, fps = self.sites, self.fps
        todo: list[str] = []
        unique: dict[int, Any] = {}
        prev: Any = None
        for req in reqs:
            site_list = req.site_list
            if not req.calls or not site_list:
                continue
            # most requests repeat the last one's entries (the same objects): looked at once
            if not _same_entries(prev, site_list):
                unique.update(zip(map(id, site_list), site_list, strict=True))
                prev = site_list
        for e in unique.values():
            target = e[2]
            if (
                type(target) is str
                and e[0] == "db"
                and e[4] not in sites
                and ("db", hash(target)) not in fps
            ):
                todo.append(target)
        pre = self.pre
        if fpr._c_tokens is None:  # the Python tokenizer (PERFSLEUTH_SPEEDUPS=0): one by one
            for target in todo:
                if self._over_budget():
                    break
                now = _perf_ns()
                with contextlib.suppress(Exception):  # odd input: fingerprint() falls back
                    pre[target] = fpr.sql_tokens(target)
                self.fp_spent_ns += _perf_ns() - now
            return
        lo = 0
        while lo < len(todo) and not self._over_budget():
            hi, chars = lo, 0
            while hi < len(todo) and chars < PRETOKENIZE_CHARS:
                chars += len(todo[hi])
                hi += 1
            chunk = todo[lo:hi]
            res = fpr.sql_tokens_many(chunk)
            if res is None:
                return
            tokens, ns = res
            self.fp_spent_ns += ns
            pre.update(zip(chunk, tokens, strict=True))
            lo = hi

    def _seen_before(self, h: int) -> bool:
        """Whether the hash ``h`` (of a site key, of a call's own target) was seen before;
        remembers it if not (up to ONCE_MAX hashes, then starts again)."""
        once = self.once
        if h in once:
            return True
        if len(once) >= ONCE_MAX:
            self.cache_bytes -= len(once) * SEEN_BYTES
            once.clear()
        once.add(h)
        self.cache_bytes += SEEN_BYTES
        return False

    def fingerprint(
        self, seg: Interned, out: list[bytes], kind: str, target: Any, keep: bool = True
    ) -> int:
        """The fingerprint id of a call's target, its FINGERPRINT record added to ``out`` when
        the segment has not got it yet. ``keep``: remember the target (by a hash of its text)
        for the next time; a statement seen once is not kept (most such are one-offs: literals
        in their text), its tokens' fingerprint is."""
        self.skipped = False
        try:
            key = (kind, hash(target))
        except TypeError:  # an unhashable target (a list of URL parts): by its text
            key = (kind, hash(repr(target)))
        hit = self.fps.get(key)
        if hit is None:
            # a statement the batch's pass has scanned is finished whatever the budget: its
            # scan, the costly part, is spent already
            scanned = kind == "db" and type(target) is str and target in self.pre
            if not scanned and self._over_budget():
                # Over budget: detail goes, speed stays. Not cached, so the target gets its
                # fingerprint when it comes again within budget.
                stats["fingerprints_skipped"] += 1
                self.skipped = True
                fid, record = targets.unfingerprinted(kind, target, key[1])
                if fid not in seg.fingerprints:
                    seg.fingerprints.add(fid)
                    self.cache_bytes += SEEN_BYTES
                    out.append(record)
                return fid
            now = _perf_ns()
            hit = self._normalised(kind, target)
            if keep:
                self.fps[key] = hit
                self.cache_bytes += FPS_ENTRY_BYTES
                if kind != "db" or type(target) is not str:  # its own record, not a tokens'
                    self.cache_bytes += 250 + len(hit[1]["text"])
            self.fp_spent_ns += _perf_ns() - now
        if hit[0] not in seg.fingerprints:
            seg.fingerprints.add(hit[0])
            self.cache_bytes += SEEN_BYTES
            out.append(encode_record(FINGERPRINT, hit[1]))
        return hit[0]

    def _normalised(self, kind: str, target: Any) -> tuple[int, dict[str, Any]]:
        """(id, FINGERPRINT body) of a target. A statement's tokens (fpr.sql_tokens: the pass
        over its text; statements differing only in literals share them) are looked up first:
        the rest of the work (IN lists, VALUES rows, the id) is done once per tokens."""
        if kind == "db" and type(target) is str:
            tokens = self.pre.get(target)  # scanned by the batch's _pretokenize
            if tokens is None:
                try:
                    tokens = fpr.sql_tokens(target)
                except Exception:  # odd input: normalize_sql's own fallback below
                    tokens = None
            if tokens is not None:
                hit = self.fp_tokens.get(tokens)
                if hit is None:
                    try:
                        text = fpr.finish_sql(tokens)
                        hit = self._made(kind, text, fpr.sql_operation(text))
                    except Exception:
                        hit = self._made(kind, *targets.fingerprint_text(kind, target))
                    self.fp_tokens[tokens] = hit
                    self.cache_bytes += 250 + len(tokens) + len(hit[1]["text"])
                return hit
        return self._made(kind, *targets.fingerprint_text(kind, target))

    @staticmethod
    def _made(kind: str, text: str, op: str) -> tuple[int, dict[str, Any]]:
        fid = fpr.stable_id(kind, text)
        return fid, {"id": fid, "kind": kind, "text": text, "op": op}

    def site(self, seg: Interned, out: list[bytes], entry: tuple[Any, ...]) -> list[int]:
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
        # Kept in the caches from the second sighting of the site on: a statement with
        # literals in its text comes once, and would fill them (and its FINGERPRINT is found
        # by its tokens anyway).
        again = self._seen_before(hash(key))
        tokens = None
        # Seen once, tokens scanned for this batch: a statement of a shape already made at
        # this place (same tokens, same stack object) in this segment is that site.
        if not again and type(target) is str and self.pre:
            tokens = self.pre.get(target)
            if tokens is not None:
                shape = self.shapes.get((tokens, id(flat)))
                if (
                    shape is not None
                    and shape[0] is flat
                    and shape[1] is kind
                    and shape[2] is system
                    and shape[3] == seg.serial
                ):
                    return shape[4]  # type: ignore[no-any-return]
        # A new site: mostly a statement never seen (literals in its text) made where others
        # were, its stack the object the recorder captured there before (recorder._stack_cache).
        # That stack's ids are remembered by the object for the segment: no key of its frames
        # built and hashed again for each such statement.
        if flat:
            memo = self.flats.get(id(flat))
            if memo is not None and memo[0] is flat and memo[1] == seg.serial:
                sid, where = memo[2], memo[3]
            else:
                sid, where = self.stack(seg, out, flat)
                if memo is None:
                    self.cache_bytes += FLAT_MEMO_BYTES
                self.flats[id(flat)] = (flat, seg.serial, sid, where)
        else:
            sid = where = NULL
        fid = NULL if target is None else self.fingerprint(seg, out, kind, target, again)
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
        if tokens is not None and not skipped:
            skey = (tokens, id(flat))
            if skey not in self.shapes:
                self.cache_bytes += SHAPE_BYTES + len(tokens)
            self.shapes[skey] = (flat, kind, system, seg.serial, resolved)
        if again and not skipped:  # a site whose fingerprint was skipped: resolved again
            self.sites[key] = [flat, resolved, kind, system, seg.serial]
            # the statement and stack it keeps
            self.cache_bytes += 120 + 16 * len(flat) + (len(target) if type(target) is str else 0)
        return resolved

    def _intern_site(
        self, seg: Interned, out: list[bytes], kind: str, target: Any, flat: tuple[Any, ...]
    ) -> tuple[int, int, int]:
        """Write what a site needs into this segment: (fingerprint id, stack id, call-site
        location id), NULL for what it has not (a fingerprint: the calls carry their own
        targets)."""
        sid, where = self.stack(seg, out, flat) if flat else (NULL, NULL)
        return NULL if target is None else self.fingerprint(seg, out, kind, target), sid, where

    def _extras(
        self,
        seg: Interned,
        out: list[bytes],
        req: recorder.ActiveRequest,
        sites: list[list[int]],
        index: int,
        sparse: dict[str, Any],
    ) -> dict[str, dict[str, Any]]:
        """The ``cx`` entries of a request (wire.calls): the rarely set values of its calls
        (``req.more``) and the names of kinds and systems the wire has no code for. Hashes
        parameters the request path left unhashed straight into the calls' rows. The values
        a cx row holds (wire.batch: status, bytes, wait, hit, fingerprint, host) go to the
        batch's ``sparse["cxrows"]`` as rows of request ``index`` (hosts numbered in
        ``sparse["hosts"]``), not into the entries: only a call with an error or extra
        values keeps an entry of them all."""
        rows: list[tuple[int, ...]] = []  # the batch's once the request is whole (below)
        hosts: dict[str, int] = sparse["hosts"]
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
                # a call's own target (a URL, a cache key) is kept from its second sighting
                # on, as a site is: most carry an id and come once
                try:
                    h = hash((kind, target))
                except TypeError:  # an unhashable target (a list of URL parts): its text
                    h = hash((kind, repr(target)))
                x["fp"] = self.fingerprint(seg, out, kind, target, self._seen_before(h))
                if kind == "http":
                    x["host"] = targets.host_of(target)
            if "params" in more:
                ph = params_hash(more["params"])
                recorder.set_field(calls, i + recorder.PH, NULL if ph is None else ph)
            if not x:
                continue
            if "error" in x or "extra" in x:
                ext[str(i // recorder.ROW)] = x
                continue
            get = x.get
            hit, host = get("hit"), get("host")
            rows.append(
                (
                    index,
                    i // recorder.ROW,
                    get("fp", NULL),
                    get("status", NULL),
                    get("bytes", NULL),
                    get("wait", NULL),
                    NULL if hit is None else int(hit),
                    NULL if host is None else hosts.setdefault(host, len(hosts)),
                )
            )
        for slot, site in enumerate(sites):
            if site[3] == wcalls.OTHER or site[4] == wcalls.OTHER:  # rare: unlisted names
                kind, system = site_list[slot][:2]
                for i in range(0, len(calls), recorder.ROW):
                    if recorder.get_field(calls, i + recorder.SLOT) == slot:
                        x = ext.setdefault(str(i // recorder.ROW), {})
                        x["kind"], x["system"] = str(kind), str(system)
        sparse["cxrows"].extend(rows)
        return ext

    def records(
        self, seg: Interned, reqs: Sequence[recorder.ActiveRequest]
    ) -> Iterator[tuple[list[bytes], int]]:
        """(records, requests in them) of each BATCH_MAX requests of ``reqs`` in turn."""
        for lo in range(0, len(reqs), BATCH_MAX):
            yield self.batch(seg, reqs[lo : lo + BATCH_MAX])

    def batch(
        self, seg: Interned, reqs: Sequence[recorder.ActiveRequest]
    ) -> tuple[list[bytes], int]:
        """(records, requests in them) of finished requests: whatever they need interned in
        this segment, then one REQUESTS record (wire.batch). Per request, a row of references
        gathered into columns; the encoding is done once for all. A request that cannot be
        encoded is left out (and counted as an internal error)."""
        if recorder.stacks_forgotten != self.stacks_seen:
            self.forget_stacks()
        try:
            self._pretokenize(reqs)
        except Exception:
            recorder.internal_error()
        try:
            return self._batch(seg, reqs)
        finally:
            self.pre.clear()

    def _batch(
        self, seg: Interned, reqs: Sequence[recorder.ActiveRequest]
    ) -> tuple[list[bytes], int]:
        out: list[bytes] = []
        rows: list[tuple[Any, ...]] = []
        calls_of: list[bytearray] = []  # the agent rows of each request, in order
        sparse: dict[str, Any] = {
            "attrs": {},
            "tags": {},
            "cx": {},
            "site_table": [],
            "cxrows": [],
            "hosts": {},
        }
        table_of: dict[int, int] = {}  # id(site entry) -> its index in sparse["site_table"]
        # the last request's site list and its indexes into the site table: most requests of
        # a batch repeat the entries of the one before (recorder._site_cache shares them)
        last: list[Any] = [None, None]
        ident = identity()
        for req in reqs:
            try:
                row, calls = self._row(seg, out, req, ident, len(rows), sparse, table_of, last)
            except Exception:
                recorder.internal_error()
                continue
            rows.append(row)
            calls_of.append(calls)
        if not rows:
            return out, 0
        try:
            out.append(columns.requests_record(rows, calls_of, sparse))
            return out, len(rows)
        except Exception:  # an odd value somewhere: one record per request, losing only it
            recorder.internal_error()
        n = 0
        names = list(sparse["hosts"])
        for i, (row, calls) in enumerate(zip(rows, calls_of, strict=True)):
            key = str(i)
            mine: dict[str, Any] = {
                name: {"0": v[key]} for name in columns.SPARSE if key in (v := sparse[name])
            }
            mine["site_table"] = sparse["site_table"]
            # its own hosts only: one a record cannot hold (not UTF-8) loses only its request
            own: dict[str, int] = {}
            mine["cxrows"] = [
                (0, *r[1:7], NULL if r[7] == NULL else own.setdefault(names[r[7]], len(own)))
                for r in sparse["cxrows"]
                if r[0] == i
            ]
            mine["hosts"] = own
            try:
                out.append(columns.requests_record([row], [calls], mine))
                n += 1
            except Exception:
                recorder.internal_error()
        return out, n

    def _row(
        self,
        seg: Interned,
        out: list[bytes],
        req: recorder.ActiveRequest,
        ident: Identity,
        i: int,
        sparse: dict[str, Any],
        table_of: dict[int, int],
        last: list[Any],
    ) -> tuple[tuple[Any, ...], bytearray]:
        """One request's values (text columns, ints, sites: wire.batch) and its call rows; its
        attributes, tags and per-call extras go into ``sparse`` under its index ``i`` in the
        batch, its sites into the batch's site table (``table_of``: where each site entry is
        in it; requests share entries, recorder._site_cache). ``ident``: the identity
        headers. ``last``: [site list, its indexes] of the batch's last request with calls; a
        request whose site list holds the same entry objects shares that list of indexes."""
        values = columns.request_values(req, ident)
        if req.attrs:
            sparse["attrs"][str(i)] = {str(k): columns.scalar(v) for k, v in req.attrs.items()}
        if req.tags:
            sparse["tags"][str(i)] = req.tags
        calls = req.calls or columns.NO_CALLS
        sites = None
        if calls:
            table = sparse["site_table"]
            site_list = req.site_list or ()
            if _same_entries(last[0], site_list):
                sites = last[1]
            else:
                sites = []
                for entry in site_list:
                    j = table_of.get(id(entry))
                    if j is None:
                        # sites of one shape share their entry (Encoder.shapes): one in the table
                        resolved = self.site(seg, out, entry)
                        j = table_of.get(id(resolved))
                        if j is None:
                            j = table_of[id(resolved)] = len(table)
                            table.append(resolved)
                        table_of[id(entry)] = j
                    sites.append(j)
                last[0], last[1] = site_list, sites
            if req.more is not None or self.unlisted:
                ext = self._extras(seg, out, req, [table[j] for j in sites], i, sparse)
                if ext:
                    sparse["cx"][str(i)] = ext
        return (*values, sites), calls


_perf_ns = time.perf_counter_ns


def _same_entries(a: Any, b: Any) -> bool:
    """Whether two requests' site lists hold the same entries: list equality, which takes
    entries that are the same object as equal without comparing them (the common case: the
    recorder's site cache shares them); equal entries made apart are the same site too. An
    entry that cannot be compared makes them different."""
    try:
        return a is not None and a == b
    except Exception:
        return False
