"""OTLP payloads accepted and not stored yet: a queue on the server's disk, and the thread that
stores it, many payloads to a transaction.

Why a queue: a DuckDB transaction costs milliseconds whatever it holds (a 1,100-span payload
alone: ~30 ms CPU of insert; in groups of 32: ~3.5 ms each), and an OTLP exporter sends one
payload at a time and waits for its answer. So ``POST /v1/traces`` decodes the payload (a
payload that is not OTLP is refused there, 400), writes it to ``DATA/otlp/`` (written, fsynced,
renamed) and answers; this thread maps and stores whatever has queued since its last commit,
up to MAX_GROUP payloads, in one transaction, mapped together as one payload (one set of Arrow
tables: their fixed cost a payload was a third of its mapping). The payload's spans are read
when it comes (a span that is not OTLP refuses it, 400) and kept in memory for the next
groups' payloads (DECODED_WINDOW); the others are read from their files again when their turn
comes.

- Backpressure: a payload that comes while the window is full waits (up to ACCEPT_WAIT_S,
  before it is read) for this thread to store a group. Exporters that send faster than the
  store takes their spans then wait for their answers, instead of having every payload past
  the window read twice (~5 ms of CPU per 1,100 spans, spent when the server is busiest). A
  store that does not move in that time (a long commit, a full disk) only delays them: the
  payload is queued as before, its spans read again at its turn.

- A payload file is removed once its payload is committed. A server stopped or killed before
  that stores it when it starts again; one killed between the commit and the removal stores it
  again, and the store leaves out the requests it holds already, so nothing is doubled.
- The disk is full: a payload that cannot be written is refused (503, Retry-After: exporters
  send it again); a commit that fails for want of room keeps its payloads queued and is tried
  again every RETRY_S.
- A payload that fails alone for another reason (a value the store refuses) is moved to
  ``DATA/otlp/failed/`` with the reason beside it, logged and counted; the others are stored.
- Bounded: past MAX_QUEUED_BYTES of payloads waiting, new ones are refused (503, Retry-After).
- Reads see what was acknowledged before them: :meth:`OtlpQueue.wait` (``Backend.use``) waits
  until those payloads are committed, or for at most WAIT_S, or not at all while commits fail.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from perfsleuth.server.fleet import OtlpOrigins
from perfsleuth.store import gc_pause
from perfsleuth.store.base import StoreFull, disk_full
from perfsleuth.store.otlp.batch import Mapped, insert_many, map_spans, read_spans, rollback
from perfsleuth.store.otlp.payload import OtlpError, decode
from perfsleuth.store.otlp.spans import Keys, Pending, Span

log = logging.getLogger("perfsleuth.server")

SUFFIX = ".otlp"
MAX_GROUP = 32  # payloads a transaction
MAX_GROUP_BYTES = 64 << 20  # ... and bytes of their bodies
MAX_QUEUED_BYTES = 512 << 20  # payloads waiting on disk; past it new ones are refused
DECODED_WINDOW = MAX_GROUP * 2  # queued payloads whose spans are kept read, in memory
ACCEPT_WAIT_S = 5.0  # the longest a payload waits for room in that window
RETRY_S = 5.0  # a commit that failed for want of room is tried again after this
WAIT_S = 10.0  # a read waits at most this long for the payloads acknowledged before it
RETRY_AFTER_S = 30  # what a refused exporter is asked to wait


class QueueFull(Exception):
    """Too many payloads are waiting to be stored: refuse this one (503, Retry-After)."""


def keys_from_env() -> Keys:
    """User and tenant attribute keys from ``PERFSLEUTH_OTLP_USER_KEYS`` and
    ``PERFSLEUTH_OTLP_TENANT_KEYS`` (comma-separated, first present wins)."""

    def split(name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        got = tuple(k.strip() for k in os.environ.get(name, "").split(",") if k.strip())
        return got or default

    d = Keys()
    return Keys(
        user=split("PERFSLEUTH_OTLP_USER_KEYS", d.user),
        tenant=split("PERFSLEUTH_OTLP_TENANT_KEYS", d.tenant),
    )


@dataclass
class Entry:
    """A payload on the queue: its file and what its header says; ``spans`` its spans while
    they are kept in memory (None: the file is read again)."""

    seq: int
    path: str
    size: int
    token: str
    spans: list[Span] | None = None


@dataclass
class Payload:
    """An entry mapped for a commit; ``error`` what failed it (None: stored)."""

    entry: Entry
    mapped: Mapped
    error: BaseException | None = None


def write_payload(
    directory: str, seq: int, body: bytes, ctype: str | None, encoding: str | None, token: str
) -> str:
    """Write one payload file (a JSON header line, then the body as received) so that it is
    whole on disk before it has its name: the path. Raises OSError (a partial file removed)."""
    head = json.dumps(
        {"ctype": ctype, "encoding": encoding, "token": token, "received": time.time()}
    ).encode()
    path = os.path.join(directory, f"{seq:016d}{SUFFIX}")
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(head + b"\n" + body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return path


def read_payload(path: str) -> tuple[dict[str, Any], bytes]:
    """A payload file's header and body."""
    with open(path, "rb") as fh:
        data = fh.read()
    head, _, body = data.partition(b"\n")
    return json.loads(head), body


class OtlpQueue:
    """The queue of one server's store (``backend``: its ``use(fresh=False)`` gives the store
    under its lock). ``keys``: the user and tenant attribute keys; ``pending``: the client
    spans waiting for their server span, across payloads (mapped by this thread only, in the
    order payloads came)."""

    def __init__(self, backend: Any, directory: str, keys: Keys | None = None) -> None:
        self.backend = backend
        self.dir = directory
        self.failed_dir = os.path.join(directory, "failed")
        self.keys = keys or keys_from_env()
        self.pending = Pending()
        self.pending_lock = threading.Lock()
        self.origins = OtlpOrigins()
        self.stats = {"accepted": 0, "committed": 0, "failed": 0, "commits": 0}
        self.stalled: str | None = None  # why the last commit kept its payloads queued
        self._cond = threading.Condition()
        self._queue: list[Entry] = []
        self._bytes = 0
        self._seq = time.time_ns() // 1000  # names that sort, and differ from a past run's
        self._stop = False
        self._thread: threading.Thread | None = None
        os.makedirs(directory, exist_ok=True)
        self._recover()

    # ------------------------------------------------------------------ the request side

    def accept(self, body: bytes, ctype: str | None, encoding: str | None, token: str) -> None:
        """Decode ``body`` and read its spans (OtlpError: refuse it), then queue it on disk;
        returns once it is there. QueueFull when too much waits; StoreFull when the disk has
        no room. Waits first while the window of read payloads is full (see the module)."""
        self._wait_for_room()
        spans = self._spans(body, ctype, encoding)
        with self._cond:
            if self._bytes + len(body) > MAX_QUEUED_BYTES and self._queue:
                raise QueueFull(
                    f"{len(self._queue)} payloads ({self._bytes >> 20} MB) are waiting to be "
                    "stored: send it again later"
                )
            self._seq += 1
            seq = self._seq
            self._bytes += len(body)  # counted now so that concurrent payloads see it
        try:
            path = write_payload(self.dir, seq, body, ctype, encoding, token)
        except OSError as e:
            with self._cond:
                self._bytes -= len(body)
            full = disk_full(self.dir, e)
            if full is not None:
                raise full from e
            raise
        entry = Entry(seq, path, len(body), token, spans)
        with self._cond:
            # in seq order: a payload written later than a concurrent one may queue first
            at = len(self._queue)
            while at and self._queue[at - 1].seq > seq:
                at -= 1
            self._queue.insert(at, entry)
            if len(self._queue) > DECODED_WINDOW:  # only the next groups keep theirs read
                self._queue[-1].spans = None
            self.stats["accepted"] += 1
            self._cond.notify_all()
        self.start()

    def _wait_for_room(self) -> None:
        """Until the window of read payloads has room, this thread stops or stalls, or
        ACCEPT_WAIT_S have passed. No wait while the thread has not started: nothing would
        make room."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    len(self._queue) < DECODED_WINDOW
                    or self._thread is None
                    or self._stop
                    or self.stalled is not None
                ),
                ACCEPT_WAIT_S,
            )

    def wait(self, timeout: float = WAIT_S) -> None:
        """Return once the payloads acknowledged before this call are committed (or failed),
        after ``timeout`` seconds, or at once while commits keep failing (``stalled``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seq = self._seq
            while self._queue and self._queue[0].seq <= seq and self.stalled is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return
                self._cond.wait(left)

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {
                **self.stats,
                "queued": len(self._queue),
                "queued_bytes": self._bytes,
                "stalled": self.stalled,
            }

    # ------------------------------------------------------------------ the commit thread

    def start(self) -> None:
        with self._cond:
            if self._thread is not None or self._stop:
                return
            self._thread = threading.Thread(target=self._run, name="perfsleuth-otlp", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Store what is queued (for at most ``timeout`` seconds; the rest stays on disk for
        the next start), then stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                group: list[Entry] = []
                size = 0
                for e in self._queue:
                    if len(group) >= MAX_GROUP or (group and size + e.size > MAX_GROUP_BYTES):
                        break
                    group.append(e)
                    size += e.size
            try:
                kept = self.store_group(group)
            except Exception:  # never let the thread die: say why, try again later
                log.exception("OTLP commit failed")
                kept = True
            if kept:
                with self._cond:
                    if self._stop:
                        return  # what is queued stays on disk for the next start
                    self._cond.wait(RETRY_S)

    def store_group(self, group: list[Entry]) -> bool:
        """Map and commit ``group``; True when its payloads stay queued (a full disk). The
        payloads of one token are mapped together, as one payload (:func:`together`), and
        committed in one transaction; should that fail, each is mapped and committed on its
        own (:meth:`_store_each`), so that only a payload that fails alone is set aside."""
        done: list[Entry] = []
        read: list[tuple[Entry, list[Span]]] = []
        for e in group:
            try:
                read.append((e, e.spans if e.spans is not None else self._read(e)))
            except Exception as err:
                self._fail(e, err)
                done.append(e)
        kept = False
        # consecutive payloads of one token (in order: payloads are mapped as they came)
        for _, same_token in groupby(read, key=lambda item: item[0].token):
            run = list(same_token)
            outcome = self._store_together(run) if len(run) > 1 else None
            run_kept, run_done = outcome if outcome is not None else self._store_each(run)
            kept |= run_kept
            done.extend(run_done)
        self.stats["commits"] += 1
        gc_pause.thaw()  # what reading and mapping the group made is gone
        with self._cond:
            gone = {id(e) for e in done}
            self._queue = [e for e in self._queue if id(e) not in gone]
            self._bytes -= sum(e.size for e in done)
            self.stalled = None if not kept else f"the disk holding the store is full ({self.dir})"
            self._cond.notify_all()
        return kept

    def _store_together(
        self, run: list[tuple[Entry, list[Span]]]
    ) -> tuple[bool, list[Entry]] | None:
        """Map the payloads of ``run`` (one token's) as one and commit them in one
        transaction: (kept for want of room, the entries stored), or None when that failed
        otherwise (its changes to ``pending`` undone: each is tried on its own then). One
        mapping of many payloads builds one set of Arrow tables: built per payload, their
        fixed cost was a third of a 1,100-span payload's mapping."""
        with self.pending_lock:
            try:
                mapped = map_spans(together([spans for _, spans in run]), self.keys, self.pending)
            except Exception:
                return None
        try:
            with self.backend.use(fresh=False) as store:
                insert_many(store, [mapped], self.pending, self.pending_lock, undo=False)
                self.origins.record(store, mapped.tables, run[0][0].token)  # who sent what
        except Exception as err:
            with self.pending_lock:
                rollback(mapped, self.pending)
            if disk_full(self.dir, err) is not None:
                return True, []
            log.warning("OTLP commit of %d payloads failed (%s): one by one", len(run), err)
            return None
        for entry, _ in run:
            self._remove(entry.path)
            self.stats["committed"] += 1
        return False, [entry for entry, _ in run]

    def _store_each(self, run: list[tuple[Entry, list[Span]]]) -> tuple[bool, list[Entry]]:
        """Map each payload of ``run`` on its own and commit them (:meth:`_commit`): (kept
        for want of room, the entries done: stored, or set aside with the reason)."""
        payloads: list[Payload] = []
        done: list[Entry] = []
        with self.pending_lock:
            for e, spans in run:
                try:
                    mapped = map_spans(spans, self.keys, self.pending)
                except Exception as err:
                    self._fail(e, err)
                    done.append(e)
                    continue
                payloads.append(Payload(e, mapped))
        if payloads:
            self._commit(payloads)
        kept = False
        for p in payloads:
            if p.error is None:
                self._remove(p.entry.path)
                self.stats["committed"] += 1
                done.append(p.entry)
            elif isinstance(p.error, StoreFull):
                kept = True
            else:
                self._fail(p.entry, p.error)
                done.append(p.entry)
        return kept, done

    def _commit(self, group: list[Payload]) -> None:
        """Store ``group`` in one transaction and record which token sent each payload. When
        that fails for a group of several, each payload is committed on its own and only those
        that fail alone get their ``error``: one bad payload does not cost the others'
        spans. A payload not stored has its changes to ``pending`` undone (it is mapped again
        when it is tried again)."""
        stored: list[Payload] = []
        try:
            with self.backend.use(fresh=False) as store:
                try:
                    insert_many(store, [p.mapped for p in group], self.pending, self.pending_lock,
                                undo=False)  # fmt: skip
                    stored = list(group)
                except Exception as e:
                    full = disk_full(self.dir, e)
                    if len(group) == 1 or full is not None:
                        for p in group:
                            p.error = full or e
                        return
                    log.warning("OTLP commit of %d payloads failed (%s): one by one", len(group), e)
                    for p in group:
                        try:
                            insert_many(store, [p.mapped], self.pending, self.pending_lock,
                                        undo=False)  # fmt: skip
                            stored.append(p)
                        except Exception as alone:
                            p.error = disk_full(self.dir, alone) or alone
                for p in stored:
                    self.origins.record(store, p.mapped.tables, p.entry.token)  # who sent what
        finally:
            kept = {id(p) for p in stored}
            with self.pending_lock:
                for p in reversed(group):
                    if id(p) not in kept:
                        if p.error is None:
                            p.error = RuntimeError("not stored")
                        rollback(p.mapped, self.pending)

    # ------------------------------------------------------------------ files

    def _spans(self, body: bytes, ctype: str | None, encoding: str | None) -> list[Span]:
        return read_spans(decode(body, ctype, encoding), self.keys)

    def _read(self, e: Entry) -> list[Span]:
        head, body = read_payload(e.path)
        return self._spans(body, head.get("ctype"), head.get("encoding"))

    def _fail(self, e: Entry, err: BaseException) -> None:
        """Move a payload that cannot be stored out of the queue, with the reason beside it."""
        self.stats["failed"] += 1
        reason = err.reason if isinstance(err, OtlpError) else f"{type(err).__name__}: {err}"
        log.error("OTLP payload %s not stored, kept in %s: %s", e.path, self.failed_dir, reason)
        try:
            os.makedirs(self.failed_dir, exist_ok=True)
            target = os.path.join(self.failed_dir, os.path.basename(e.path))
            os.replace(e.path, target)
            with open(target + ".reason", "w", encoding="utf-8") as fh:
                fh.write(reason + "\n")
        except OSError as moved:
            log.error("could not move %s to %s: %s", e.path, self.failed_dir, moved)
            self._remove(e.path)

    def _remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:  # stored already: a later start stores it again, left out then
            log.warning("could not remove %s: %s", path, e)

    def _recover(self) -> None:
        """Queue the payload files a previous run acknowledged and did not store (files half
        written, ``.tmp``, were never acknowledged: removed)."""
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if name.endswith(SUFFIX + ".tmp"):
                self._remove(path)
                continue
            if not name.endswith(SUFFIX) or not name[: -len(SUFFIX)].isdigit():
                continue
            seq = int(name[: -len(SUFFIX)])
            try:
                head, _ = read_payload(path)
                size = os.path.getsize(path)
            except (OSError, ValueError) as e:
                self._fail(Entry(seq, path, 0, ""), e)
                continue
            entry = Entry(seq, path, size, str(head.get("token") or ""))
            self._queue.append(entry)
            self._bytes += size
            self._seq = max(self._seq, seq)
        if self._queue:
            n = len(self._queue)
            log.info("OTLP: %d payloads acknowledged before a restart are stored now", n)


def together(payloads: list[list[Span]]) -> list[Span]:
    """The spans of several payloads as one payload's: a span that a later payload sends
    again (same trace and span id: an exporter's retry) is left out, so that a request two
    payloads bring is stored once, from the first, as when they are stored one after the
    other."""
    out = list(payloads[0])
    seen = {s.trace + s.span for s in out}
    for spans in payloads[1:]:
        ids = [s.trace + s.span for s in spans]
        out.extend(s for s, i in zip(spans, ids, strict=True) if i not in seen)
        seen.update(ids)
    return out
