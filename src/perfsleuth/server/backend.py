"""The server's one store (:class:`Backend`): its lock, the background ingest, the queue of
OTLP payloads waiting to be stored, the findings cache and the SQL console's slots.

DuckDB allows one writing process per database, and a connection is not meant for concurrent
use, so the server holds one store, guarded by a lock: API calls and the background ingest
(every ``ingest_every`` seconds) take turns. SQL console statements run on cursors of their own
(DuckDB connections to the same database, see :mod:`perfsleuth.server.console`), at most
CONSOLE_SLOTS at a time, so that the rest of the API answers while one runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from perfsleuth.server import console
from perfsleuth.server.otlp_queue import OtlpQueue
from perfsleuth.store import open_store
from perfsleuth.store.base import Store

if TYPE_CHECKING:
    from perfsleuth.server.window import Window

log = logging.getLogger("perfsleuth.server")

CONSOLE_SLOTS = 2  # console statements running at once; more are refused (429)
FINDINGS_TTL_S = 30.0


class Busy(Exception):
    """Every console slot is taken; the message says so."""


class Backend:
    """The one store of the server process, its lock, and the background ingest."""

    def __init__(self, data_dir: str, ingest_every: float = 3.0) -> None:
        """``ingest_every`` <= 0: no ingest, and the store is opened read-only, so that CLI
        commands on the same data can run beside the server (DuckDB lets many processes read
        a file, or one write it)."""
        self.data_dir = os.path.abspath(data_dir)
        self.store: Store = open_store(self.data_dir, read_only=ingest_every <= 0)
        # The SQL console must not read or write files of the machine (read_csv, COPY, ...):
        # nothing else of the server needs external access, and it cannot be switched back on.
        # (a ClickHouse store runs console statements itself: console.run_on_store)
        duckdb_engine = getattr(self.store, "engine", "duckdb") == "duckdb"
        con = getattr(self.store, "_con", None) if duckdb_engine else None
        self._console_con = None
        self._temp_views: list[str] = []
        if con is not None:
            console.sandbox(con)
            # The console's cursors come from this one (made before any other thread runs).
            self._console_con = con.cursor()
            # A read-only store's views are temporary, seen by its own connection only: the
            # console's cursors make them again.
            self._temp_views = console.temp_views(con)
        self._console_lock = threading.Lock()
        self.console_slots = threading.BoundedSemaphore(CONSOLE_SLOTS)
        self.console_running = 0
        self.lock = threading.Lock()
        self.ingest_every = ingest_every
        self.last_ingest: dict[str, Any] = {"at": None, "requests": 0, "error": None}
        self._stop = threading.Event()
        self._findings: dict[tuple[str, str | None], tuple[float, list[Any]]] = {}
        self._thread: threading.Thread | None = None
        # segments_received rows waiting for the store's lock (routes.ingest adds them; the
        # next chunk or ingest round that holds the lock writes them).
        self.received: list[dict[str, Any]] = []
        self.received_lock = threading.Lock()
        # OTLP payloads acknowledged and not stored yet (None: this server does not write)
        self.otlp: OtlpQueue | None = None
        if ingest_every > 0 and hasattr(self.store, "insert_tables"):
            self.otlp = OtlpQueue(self, os.path.join(self.data_dir, "otlp"))

    @contextmanager
    def use(self, *, fresh: bool = True) -> Iterator[Store]:
        """The store, under the lock. ``fresh``: after the OTLP payloads acknowledged before
        this call are stored (what an exporter was told is kept, a read sees)."""
        if fresh and self.otlp is not None:
            self.otlp.wait()
        with self.lock:
            yield self.store

    def findings(self, store: Store, w: Window, endpoint: str | None = None) -> list[Any]:
        """The detectors' findings, kept for FINDINGS_TTL_S: they cost seconds over millions of
        requests, and every page refresh and every "evidence" click asks again."""
        from perfsleuth.analysis import find

        key = (w.label, endpoint)
        hit = self._findings.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        found = find(store, since=w.since, endpoint=endpoint)
        if len(self._findings) > 64:
            self._findings.clear()
        self._findings[key] = (now + FINDINGS_TTL_S, found)
        return found

    def ingest_once(self) -> None:
        try:
            with self.lock:
                report = self.store.ingest()
                self.record_received()
            self.last_ingest = {
                "at": time.time(),
                "requests": report.requests,
                "error": None,
            }
        except Exception as e:  # keep serving what is there; say why ingest failed
            log.warning("ingest failed: %s", e)
            self.last_ingest = {"at": time.time(), "requests": 0, "error": str(e)}

    def record_received(self) -> None:
        """Write the pending ``segments_received`` rows; the caller holds the store's lock.
        A failure keeps them for the next try (DATA/incoming/received.jsonl has them too)."""
        with self.received_lock:
            if not self.received or getattr(self.store, "read_only", False):
                return
            try:
                self.store.record_received(self.received)
                self.received.clear()
            except Exception as e:
                log.warning("could not record received segments: %s", e)

    def start(self) -> None:
        if self.otlp is not None:
            self.otlp.start()  # payloads a previous run acknowledged are stored first
        if self.ingest_every <= 0 or self._thread is not None:
            return

        def loop() -> None:
            # The first round may be a long backlog: the server listens meanwhile (calls wait
            # for the lock, then see it all).
            while True:
                self.ingest_once()
                if self._stop.wait(self.ingest_every):
                    return

        self._thread = threading.Thread(target=loop, name="perfsleuth-ingest", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self.otlp is not None:
            self.otlp.close()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self.lock:
            with self._console_lock:
                if self._console_con is not None:
                    self._console_con.close()
                    self._console_con = None
            self.store.close()

    def console(self, query: str, limit: int, max_bytes: int, time_limit: float) -> console.Result:
        """Run a console statement on a cursor of its own (no store lock: the rest of the API
        answers meanwhile); Busy when every slot is taken, ConsoleError when refused, failed
        or too long."""
        if not self.console_slots.acquire(blocking=False):
            raise Busy(f"{CONSOLE_SLOTS} SQL console queries are running: try again when one ends")
        if self.otlp is not None:
            self.otlp.wait()  # as use(): the OTLP payloads acknowledged before are stored
        try:
            if getattr(self.store, "engine", "duckdb") != "duckdb":
                with self.lock:
                    return console.run_on_store(
                        self.store, query, limit, max_bytes, time_limit=time_limit
                    )
            with self._console_lock:
                if self._console_con is None:
                    raise console.ConsoleError("the server is shutting down")
                cur = self._console_con.cursor()
                self.console_running += 1

            try:
                return console.run(
                    cur,
                    query,
                    limit=limit,
                    max_bytes=max_bytes,
                    time_limit=time_limit,
                    prepare=console.make_views(self._temp_views),
                )
            finally:
                with self._console_lock:
                    self.console_running -= 1
        finally:
            self.console_slots.release()
