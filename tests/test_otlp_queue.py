"""The server's queue of OTLP payloads (server.otlp_queue) on a real DuckDB store: payloads that
come while a commit runs share the next transaction; one that comes while the window of read
payloads is full waits (a bounded time) for room and is read once; an empty payload is
acknowledged quietly; a payload acknowledged before the server stopped is stored when it
starts again, once even when it had been stored; a commit that finds the disk full keeps its
payloads until there is room; a payload the store refuses is set aside with its reason while
the others of its group are stored; past its bound the queue refuses payloads with a 503 to
send again."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from perfsleuth.server import otlp_queue
from perfsleuth.server.app import create_app
from perfsleuth.server.backend import Backend
from perfsleuth.server.otlp_queue import QueueFull, write_payload
from tinyfs import tmpfs

T0 = 1_764_000_000_000_000_000
JSON = "application/json"
SQL = {"db.system": "postgresql", "db.query.text": "SELECT * FROM orders WHERE id = $1"}


def _kv(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": value}}


def _span(trace: int, span: int, parent: int, kind: int, attrs: dict[str, Any]) -> dict[str, Any]:
    out = {
        "traceId": f"{trace:032x}",
        "spanId": f"{span:016x}",
        "name": "span",
        "kind": kind,
        "startTimeUnixNano": str(T0 + trace * 10**9 + span * 10**6),
        "endTimeUnixNano": str(T0 + trace * 10**9 + span * 10**6 + 5 * 10**6),
        "attributes": [_kv(k, v) for k, v in attrs.items()],
    }
    if parent:
        out["parentSpanId"] = f"{parent:016x}"
    return out


def _request(trace: int, route: str = "/orders/:id") -> list[dict[str, Any]]:
    """A SERVER span with one DB call under it."""
    attrs = {"http.request.method": "GET", "http.route": route}
    return [_span(trace, 1, 0, 2, attrs), _span(trace, 2, 1, 3, SQL)]


def _body(service: str, spans: list[dict[str, Any]]) -> bytes:
    rs = {
        "resource": {"attributes": [_kv("service.name", service)]},
        "scopeSpans": [{"spans": spans}],
    }
    return json.dumps({"resourceSpans": [rs]}).encode()


def _count(be: Backend, sql: str) -> Any:
    with be.use() as store:
        return store.query(sql)


def _held(be: Backend, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The store's first transaction waits for ``release`` (``first_in`` set once it does)."""
    first_in, release = threading.Event(), threading.Event()
    real = be.store.insert_tables  # type: ignore[attr-defined]

    def held(batch: Any, tables: Any) -> None:
        if not first_in.is_set():
            first_in.set()
            assert release.wait(30)
        real(batch, tables)

    monkeypatch.setattr(be.store, "insert_tables", held)
    return first_in, release


def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_payloads_that_come_during_a_commit_share_the_next_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = Backend(str(tmp_path / "data"), ingest_every=3600)
    first_in, release = _held(be, monkeypatch)
    transactions: list[int] = []
    inner = be.store.insert_tables  # type: ignore[attr-defined]

    def counted(batch: Any, tables: Any) -> None:
        transactions.append(tables.requests)
        inner(batch, tables)

    monkeypatch.setattr(be.store, "insert_tables", counted)
    q = be.otlp
    assert q is not None
    q.accept(_body("shop", _request(1)), JSON, None, "")
    assert first_in.wait(30)
    for trace in range(2, 7):
        q.accept(_body("shop", _request(trace)), JSON, None, "")
    assert q.status()["queued"] == 6  # the first is still being committed
    release.set()
    rows = _count(be, "SELECT count(*) AS n FROM requests")  # waits for the acknowledged
    assert rows[0]["n"] == 6
    assert transactions == [1, 5]
    assert _count(be, "SELECT count(*) AS n FROM calls")[0]["n"] == 6
    assert not [n for n in os.listdir(tmp_path / "data" / "otlp") if n.endswith(".otlp")]
    assert q.status()["committed"] == 6
    be.close()


def test_a_groups_payloads_are_mapped_as_one_and_a_span_sent_again_is_stored_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The payloads queued during a commit are mapped together, as one payload (one set of
    tables a transaction): a payload an exporter sent twice is stored once, and a call whose
    SERVER span comes in the next payload joins it."""
    be = Backend(str(tmp_path / "data"), ingest_every=3600)
    first_in, release = _held(be, monkeypatch)
    mapped: list[int] = []
    real = otlp_queue.map_spans

    def counted(spans: Any, *args: Any, **kwargs: Any) -> Any:
        mapped.append(len(spans))
        return real(spans, *args, **kwargs)

    monkeypatch.setattr(otlp_queue, "map_spans", counted)
    q = be.otlp
    assert q is not None
    q.accept(_body("shop", _request(1)), JSON, None, "")
    assert first_in.wait(30)
    again = _body("shop", _request(2))
    q.accept(again, JSON, None, "")
    q.accept(again, JSON, None, "")  # a retry while the first is still queued
    q.accept(_body("shop", [_span(3, 2, 1, 3, SQL)]), JSON, None, "")  # its SERVER span: next
    server = {"http.request.method": "GET", "http.route": "/orders/:id"}
    q.accept(_body("shop", [_span(3, 1, 0, 2, server)]), JSON, None, "")
    release.set()
    rows = _count(be, "SELECT trace_id FROM requests ORDER BY trace_id")
    assert [r["trace_id"] for r in rows] == [f"{t:032x}{1:016x}" for t in (1, 2, 3)]
    calls = _count(be, "SELECT trace_id FROM calls ORDER BY trace_id")
    assert [c["trace_id"] for c in calls] == [f"{t:032x}{1:016x}" for t in (1, 2, 3)]
    assert mapped == [2, 4]  # the first alone; then 2 + 1 + 1 spans (the retry's 2 left out)
    assert q.pending.size == 0
    assert q.status()["committed"] == 5
    be.close()


def _reads(q: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The payload files the queue reads again (their spans were not kept)."""
    read: list[str] = []
    real = q._read

    def counted(e: Any) -> Any:
        read.append(e.path)
        return real(e)

    monkeypatch.setattr(q, "_read", counted)
    return read


def _waiting(q: Any, monkeypatch: pytest.MonkeyPatch, thread: str) -> threading.Event:
    """Set once the thread named ``thread`` waits on the queue's condition."""
    waiting = threading.Event()
    real = q._cond.wait

    def wait(timeout: float | None = None) -> bool:
        if threading.current_thread().name == thread:
            waiting.set()
        return real(timeout)

    monkeypatch.setattr(q._cond, "wait", wait)
    return waiting


def _window_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Backend, Any, threading.Event, list[str]]:
    """A queue whose window of read payloads (2 here) is full: its first payload held in its
    commit (until ``release``), a second queued. Also the payload files read again."""
    monkeypatch.setattr(otlp_queue, "DECODED_WINDOW", 2)
    be = Backend(str(tmp_path / "data"), ingest_every=3600)
    first_in, release = _held(be, monkeypatch)
    q = be.otlp
    assert q is not None
    read = _reads(q, monkeypatch)
    q.accept(_body("shop", _request(1)), JSON, None, "")
    assert first_in.wait(30)
    q.accept(_body("shop", _request(2)), JSON, None, "")
    return be, q, release, read


def test_a_payload_past_the_window_of_read_payloads_waits_for_room_and_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exporters faster than the store: a payload that comes while the window of read payloads
    is full waits for the commit that makes room, then is read once (not queued with its spans
    dropped, to be read again from its file)."""
    be, q, release, read = _window_full(tmp_path, monkeypatch)
    waiting = _waiting(q, monkeypatch, "third")
    third = threading.Thread(
        target=q.accept, args=(_body("shop", _request(3)), JSON, None, ""), name="third"
    )
    third.start()
    assert waiting.wait(30)
    assert q.status()["accepted"] == 2  # not read nor queued while it waits
    release.set()
    third.join(30)
    assert not third.is_alive()
    assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 3
    assert read == []  # every payload read once, when it came
    assert q.status()["committed"] == 3
    be.close()


def test_a_store_that_does_not_make_room_only_delays_a_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait is bounded: with the commit held past ACCEPT_WAIT_S, the payload is queued
    with its spans dropped, read again from its file at its turn, and stored once."""
    monkeypatch.setattr(otlp_queue, "ACCEPT_WAIT_S", 0.2)
    be, q, release, read = _window_full(tmp_path, monkeypatch)
    q.accept(_body("shop", _request(3)), JSON, None, "")  # returns after the wait, queued
    assert q.status()["accepted"] == 3
    release.set()
    assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 3
    assert len(read) == 1 and read[0].endswith(otlp_queue.SUFFIX)
    assert q.status()["committed"] == 3
    be.close()


def test_a_payload_without_spans_is_acknowledged_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An exporter's empty batch: committed like any payload, nothing stored, no warning (its
    origin rows are none, not an error)."""
    be = Backend(str(tmp_path / "data"), ingest_every=3600)
    q = be.otlp
    assert q is not None
    with caplog.at_level("WARNING", logger="perfsleuth.server"):
        q.accept(json.dumps({"resourceSpans": []}).encode(), JSON, None, "")
        q.accept(_body("shop", []), JSON, None, "")
        assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 0
    assert q.status()["committed"] == 2
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    be.close()


def test_acknowledged_payloads_are_stored_after_a_restart_and_only_once(tmp_path: Path) -> None:
    """What a server killed with -9 leaves in DATA/otlp: a payload acknowledged and not
    committed, one committed and not yet removed (stored again: left out), a half-written
    ``.tmp`` (never acknowledged: removed) and a file whose header is damaged (set aside)."""
    data = tmp_path / "data"
    be = Backend(str(data), ingest_every=3600)
    assert be.otlp is not None
    stored_before = _body("shop", _request(1))
    be.otlp.accept(stored_before, JSON, None, "")
    assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 1
    be.close()
    queue = str(data / "otlp")
    write_payload(queue, 10, stored_before, JSON, None, "")
    write_payload(queue, 11, _body("shop", _request(2)), JSON, None, "team-a")
    (data / "otlp" / f"{12:016d}.otlp.tmp").write_bytes(b'{"ctype": "appl')
    (data / "otlp" / f"{13:016d}.otlp").write_bytes(b"not a header\n{}")

    be = Backend(str(data), ingest_every=3600)
    be.start()
    try:
        rows = _count(be, "SELECT trace_id FROM requests ORDER BY trace_id")
        assert [r["trace_id"] for r in rows] == [f"{1:032x}{1:016x}", f"{2:032x}{1:016x}"]
        assert _count(be, "SELECT count(*) AS n FROM calls")[0]["n"] == 2
        assert sorted(os.listdir(queue)) == ["failed"]
        assert sorted(os.listdir(os.path.join(queue, "failed"))) == [
            f"{13:016d}.otlp",
            f"{13:016d}.otlp.reason",
        ]
    finally:
        be.close()


def test_a_payload_the_store_refuses_is_set_aside_and_the_others_of_its_group_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group's commit fails, so each payload is committed on its own: the one refused
    alone goes to DATA/otlp/failed/ with its reason; the other is stored, and the client span
    it brought for a SERVER span still to come keeps waiting (the failed one's are undone)."""
    be = Backend(str(tmp_path / "data"), ingest_every=3600)
    first_in, release = _held(be, monkeypatch)
    inner = be.store.insert_tables  # type: ignore[attr-defined]

    def poisoned(batch: Any, tables: Any) -> None:
        services = {s for p in tables.days.values() for s in p["requests"]["service"].to_pylist()}
        if "poison" in services:
            raise ValueError("a value the store refuses")
        inner(batch, tables)

    monkeypatch.setattr(be.store, "insert_tables", poisoned)
    q = be.otlp
    assert q is not None
    q.accept(_body("first", _request(1)), JSON, None, "")
    assert first_in.wait(30)
    waiting = _span(9, 2, 1, 3, SQL)  # its SERVER span (9, 1) has not come
    q.accept(_body("shop", [*_request(2), waiting]), JSON, None, "")
    q.accept(_body("poison", [*_request(3), _span(8, 2, 1, 3, SQL)]), JSON, None, "")
    release.set()
    rows = _count(be, "SELECT service FROM requests ORDER BY service")
    assert [r["service"] for r in rows] == ["first", "shop"]
    failed = tmp_path / "data" / "otlp" / "failed"
    reasons = [p.read_text() for p in failed.glob("*.reason")]
    assert len(reasons) == 1 and "a value the store refuses" in reasons[0]
    assert q.status()["failed"] == 1
    assert q.pending.size == 1
    assert list(q.pending.traces) == [f"{9:032x}"]
    be.close()


def test_a_commit_that_finds_the_disk_full_keeps_its_payloads_until_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real full filesystem (a 32 MB tmpfs) filled while the payloads wait for their
    commit: they stay queued, a read does not wait for them, and once there is room they are
    stored, each once."""
    with tmpfs(tmp_path / "small", "32m") as mnt:
        monkeypatch.setattr(otlp_queue, "RETRY_S", 0.2)
        be = None
        try:
            be = Backend(str(mnt / "data"), ingest_every=3600)
            q = be.otlp
            assert q is not None
            q.accept(_body("shop", _request(1)), JSON, None, "")
            assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 1
            first_in, release = _held(be, monkeypatch)
            spans = [s for t in range(2, 402) for s in _request(t)]
            q.accept(_body("shop", spans), JSON, None, "")
            assert first_in.wait(30)
            filler = mnt / "filler"
            with open(filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 65_536)
                except OSError:
                    pass
            release.set()
            _until(lambda: q.status()["stalled"] is not None, "the commit finds the disk full")
            assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 1
            assert q.status()["queued"] == 1
            filler.unlink()
            _until(lambda: q.status()["queued"] == 0, "stored once there is room")
            assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 401
            assert _count(be, "SELECT count(*) AS n FROM calls")[0]["n"] == 401
            assert q.status()["failed"] == 0
        finally:
            if be is not None:
                be.close()


def test_past_its_bound_the_queue_refuses_payloads_to_send_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(str(tmp_path / "data"), ingest_every=3600)
    be = app.state.backend
    first_in, release = _held(be, monkeypatch)
    body = _body("shop", _request(1))
    monkeypatch.setattr(otlp_queue, "MAX_QUEUED_BYTES", len(body) + 10)
    with TestClient(app) as client:
        ctype = {"Content-Type": JSON}
        assert client.post("/v1/traces", content=body, headers=ctype).status_code == 200
        assert first_in.wait(30)
        refused = client.post("/v1/traces", content=_body("shop", _request(2)), headers=ctype)
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"]
        assert "waiting to be stored" in refused.json()["error"]
        with pytest.raises(QueueFull):
            be.otlp.accept(_body("shop", _request(3)), JSON, None, "")
        release.set()
        assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 1
        again = client.post("/v1/traces", content=_body("shop", _request(2)), headers=ctype)
        assert again.status_code == 200
        assert _count(be, "SELECT count(*) AS n FROM requests")[0]["n"] == 2
        st = client.get("/api/status").json()["otlp"]
        assert (st["accepted"], st["committed"], st["failed"], st["queued"]) == (2, 2, 0, 0)
        assert st["stalled"] is None


def test_a_server_that_does_not_write_refuses_payloads_to_send_again(tmp_path: Path) -> None:
    """A store opened read-only (no ingest): spans get a 503 (nothing kept, no queue on its
    disk); a payload that is not OTLP still gets its 400, and one without spans a 200."""
    data = tmp_path / "data"
    Backend(str(data), ingest_every=3600).close()
    app = create_app(str(data), ingest_every=0)
    ctype = {"Content-Type": JSON}
    with TestClient(app) as client:
        got = client.post("/v1/traces", content=_body("shop", _request(1)), headers=ctype)
        assert got.status_code == 503, got.text
        assert "does not write" in got.json()["error"]
        assert client.post("/v1/traces", content=b"{", headers=ctype).status_code == 400
        assert client.post("/v1/traces", content=b"{}", headers=ctype).status_code == 200
        assert client.get("/api/status").json()["otlp"] is None
    assert app.state.backend.otlp is None
    assert not (data / "otlp").exists() or not os.listdir(data / "otlp")
