"""The writer thread: every ``flush_seconds`` (or when the queue fills up) it drains the queues
in slices of bounded bytes, encodes them (agent.spool.encode), appends them to the process's
open segment and rotates it by size or age. Write errors (disk full, permissions) drop the
batch, count it and retry with back-off; a spool over its cap drops what comes until it
shrinks. The thread never raises into the app: it dies quietly on a bug and is restarted
(``MAX_WRITER_RESTARTS``) when the request path next finds the queue full.

The encoder and the segment's modules are imported by the thread when it first has something
to write, not at the agent's start: a process that never serves a request (a prefork server's
master) never loads them, and a worker loads them after its first response, not before.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from perfsleuth.agent import cpushare, recorder
from perfsleuth.agent.config import Config
from perfsleuth.agent.recorder import stats
from perfsleuth.agent.spool import queue, status

TYPE_CHECKING = False
if TYPE_CHECKING:
    from perfsleuth.agent.spool.encode import Encoder
    from perfsleuth.agent.spool.segment import Segment

MAX_WRITER_RESTARTS = 3

lock = threading.Lock()  # serialises writing (writer thread vs. flush at exit)
writer: Writer | None = None
thread: threading.Thread | None = None

# Held while the encoder's modules are imported; a fork waits for it. Forked mid-import (a
# prefork master starting a worker while its writer thread writes a first GC record), the
# child would hold a half-run module whose import lock belongs to a thread it does not have,
# and hang at its own first write.
_importing = threading.Lock()
os.register_at_fork(
    before=_importing.acquire,
    after_in_parent=_importing.release,
    after_in_child=_importing.release,
)


def _encoding() -> tuple[type[Encoder], type[Segment], Callable[[bytes, Any], bytes]]:
    """The encoder, the segment file and the record encoder, imported on first use (see the
    module docstring)."""
    with _importing:
        from perfsleuth.agent.spool.encode import Encoder
        from perfsleuth.agent.spool.segment import Segment
        from perfsleuth.wire.segment import encode_record
    return Encoder, Segment, encode_record


class Writer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.seq = 0
        self.seg: Segment | None = None
        self._enc: Encoder | None = None
        self.retry_at = 0.0
        self.backoff = 0.5
        self.last_status = 0.0
        self.spool_checked = 0.0
        self.spool_is_full = False

    @property
    def enc(self) -> Encoder:
        enc = self._enc
        if enc is None:
            encoder = _encoding()[0]
            enc = self._enc = encoder(self.cfg.fingerprint_cpu_pct, queue.cache_limit)
        return enc

    def _open_live(self) -> Segment | None:
        """The open segment, or a new one when its file was deleted under us: what was
        written to the deleted file is lost, and counted (dropped_spool_deleted)."""
        if self.seg is not None and self._lost(self.seg):
            self.seg = None
        return self._open()

    @staticmethod
    def _lost(seg: Segment) -> bool:
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

    def _open(self) -> Segment | None:
        if self.seg is not None:
            return self.seg
        if time.monotonic() < self.retry_at:
            return None
        segment = _encoding()[1]
        try:
            self.seq += 1
            self.seg = segment(self.cfg, self.seq)
            self.backoff = 0.5
        except OSError as e:
            self._failed(e)
        return self.seg

    def _failed(self, e: BaseException) -> None:
        stats["write_errors"] += 1
        status.error(f"{type(e).__name__}: {e}")
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
        left = queue.queued()  # what came later waits for the next round
        while left > 0:
            batch = queue.take(queue.slice_limit)
            if not batch:
                break
            left -= len(batch)
            self._write_batch(batch)
        if queue.has_events():
            self._write_events()
        if self.seg is not None and self.seg.due():
            self._rotate()
        now = time.monotonic()
        if now - self.last_status >= 1.0:
            self.last_status = now
            write_status()

    def _write_batch(self, batch: list[recorder.ActiveRequest]) -> None:
        if self._enc is not None and self._enc.cache_bytes > self._enc.cache_limit:
            # Past the cache budget: the caches start again (the recorder's site cache too:
            # its keys hold the same statements), and so does the segment (its sets of the
            # ids it holds grow with every distinct statement).
            self._rotate()
            self._enc.reset()
            queue.forget_sites()
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
        for recs, n in self.enc.records(seg, batch):
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
        encode_record = _encoding()[2]
        events = queue.take_events()
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
        write_status()


def write_status() -> None:
    """Rewrite this process's status file (agent.spool.status) with what is queued now."""
    w = writer
    if w is not None:
        status.write(w.cfg, queued=queue.queued(), writer_dead=dead())


def dead() -> bool:
    """Whether the writer thread has died (a bug, or an injected fault)."""
    t = thread
    return t is not None and not t.is_alive()


def start(cfg: Config) -> None:
    """Make this process's writer and start its thread (at the agent's start, and in a forked
    child: the parent's lock and thread are not the child's)."""
    global writer, lock
    lock = threading.Lock()
    writer = Writer(cfg)
    queue.on_full = check
    _start_thread()


def check() -> None:
    """Restart a writer thread that died (bounded), so a bug cannot silently stop shipping."""
    if dead() and stats["writer_restarts"] < MAX_WRITER_RESTARTS:
        stats["writer_restarts"] += 1
        _start_thread()


def _start_thread() -> None:
    global thread
    t = threading.Thread(target=_run, name="perfsleuth-writer", daemon=True)
    t.start()
    thread = t


def _run() -> None:
    try:
        _loop()
    except BaseException as e:  # the thread dies, quietly: nothing lands in the app's stderr
        status.error(f"writer thread died: {type(e).__name__}: {e}")
        recorder.internal_error()


def _loop() -> None:
    w = writer
    if w is None:
        return
    cfg = w.cfg
    if cfg.fault == "writer_crash":
        raise RuntimeError("injected writer crash")  # dies like a real bug would
    while True:
        wake = queue.wake
        wake.wait(cfg.flush_seconds)
        wake.clear()
        with lock:
            try:
                w.drain()
            except Exception as e:  # a bug in encoding must not kill shipping
                recorder.internal_error()
                status.error(f"{type(e).__name__}: {e}")
            cpushare.tick()  # the share of requests whose CPU time is measured (auto)
