"""OTLP payloads in the orders and repeats exporters send them, mapped (store.otlp's to_batch)
and committed (insert) into a real DuckDB store: links whichever payload comes first, a payload
sent twice stored once, payloads committed together (as the server's queue does) stored once
each. The server's queue of payloads, its group commits and failures: test_otlp_queue.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.store.otlp.batch import insert, insert_many, to_batch
from perfsleuth.store.otlp.links import links
from perfsleuth.store.otlp.payload import decode
from perfsleuth.store.otlp.spans import Pending

T0 = 1_764_000_000_000_000_000
TRACE = "7" * 32
A, B, C, D, E = ("a" * 16, "b" * 16, "c" * 16, "d" * 16, "e" * 16)
GET = {"http.request.method": "GET", "url.full": "http://billing:8080/invoices/7"}
SQL = {"db.system": "postgresql", "db.query.text": "SELECT * FROM orders WHERE id = 1"}


def _kv(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    return {"key": key, "value": {"stringValue": value}}


def _span(
    span: str, parent: str, kind: int, start_ms: float, dur_ms: float, attrs: dict[str, Any]
) -> dict[str, Any]:
    out = {
        "traceId": TRACE,
        "spanId": span,
        "name": "span",
        "kind": kind,
        "startTimeUnixNano": str(T0 + int(start_ms * 1e6)),
        "endTimeUnixNano": str(T0 + int((start_ms + dur_ms) * 1e6)),
        "attributes": [_kv(k, v) for k, v in attrs.items()],
    }
    if parent:
        out["parentSpanId"] = parent
    return out


def _msg(service: str, *spans: dict[str, Any]) -> Any:
    body = {
        "resourceSpans": [
            {
                "resource": {"attributes": [_kv("service.name", service)]},
                "scopeSpans": [{"spans": list(spans)}],
            }
        ]
    }
    return decode(json.dumps(body).encode(), "application/json", None)


# The caller: SERVER span A, requests' client span B under it, urllib3's C under B.
SERVER_A = _span(A, "", 2, 0, 100, {"http.request.method": "GET", "http.route": "/checkout"})
CLIENT_B = _span(B, A, 3, 5, 80, GET)
CLIENT_C = _span(C, B, 3, 6, 78, GET)
# The callee: SERVER span D, whose parent is the innermost client span C.
SERVER_D = _span(D, C, 2, 8, 70, {"http.request.method": "GET", "http.route": "/invoices/:id"})


def _store(tmp_path: Path, name: str = "data") -> DuckDBStore:
    return DuckDBStore(str(tmp_path / name))


def _post(store: DuckDBStore, pending: Pending, msg: Any) -> None:
    insert(store, to_batch(msg, pending=pending), pending)


def _downstream(store: DuckDBStore) -> list[tuple[str, str]]:
    found = links(store, TRACE + A)["downstream"]
    return [(d["service"], d["endpoint"]) for d in found]


@pytest.mark.parametrize("split", [False, True])
def test_nested_client_spans_before_their_server_span_still_link(
    tmp_path: Path, split: bool
) -> None:
    """The usual exporter order: the caller's client spans end (and are sent) before its
    SERVER span. The callee names the innermost client span (C) as its parent, so C must wait
    with B for A; the link is the same whether A comes in the same payload or a later one."""
    pending = Pending()
    with _store(tmp_path) as store:
        _post(store, pending, _msg("billing", SERVER_D))
        if split:
            _post(store, pending, _msg("shop", CLIENT_B, CLIENT_C))
            _post(store, pending, _msg("shop", SERVER_A))
        else:
            _post(store, pending, _msg("shop", CLIENT_B, CLIENT_C, SERVER_A))
        assert _downstream(store) == [("billing", "GET /invoices/:id")]
        calls = store.query("SELECT count(*) AS n FROM calls WHERE trace_id = ?", [TRACE + A])
        assert calls[0]["n"] == 1  # C is inside B's call, not a second one
    assert pending.size == 0


def test_a_payload_sent_twice_stores_its_loop_blocks_once(tmp_path: Path) -> None:
    """An exporter's retry of a payload already committed adds nothing: not its requests, not
    its calls, not its loop blocks."""
    block = _span(E, A, 1, 50, 30, {"perfsleuth.block.ms": 30.0, "perfsleuth.block.delayed": 1})
    query = _span(C, A, 3, 5, 10, SQL)
    with _store(tmp_path) as store:
        for _ in range(2):
            _post(store, Pending(), _msg("node-api", SERVER_A, query, block))
        counts = {
            t: store.query(f"SELECT count(*) AS n FROM {t}")[0]["n"]
            for t in ("requests", "calls", "blockers")
        }
    assert counts == {"requests": 1, "calls": 1, "blockers": 1}


def test_a_failed_commit_keeps_the_waiting_client_spans_for_the_retry(tmp_path: Path) -> None:
    """Client spans wait for their SERVER span; when the payload with it cannot be committed
    (a read-only store here; a full disk alike), the exporter sends it again, and the request
    is then stored with its calls."""
    pending = Pending()
    query = _span(C, A, 3, 5, 10, SQL)
    data = str(tmp_path / "data")
    with DuckDBStore(data) as store:
        _post(store, pending, _msg("shop", query))  # waits: nothing to commit
    assert pending.size == 1
    with DuckDBStore(data, read_only=True) as ro:
        mapped = to_batch(_msg("shop", SERVER_A), pending=pending)
        assert mapped.calls == 1
        with pytest.raises(Exception):  # noqa: B017 - the store's refusal, whatever its type
            insert(ro, mapped, pending)
    assert pending.size == 1  # the call waits again
    assert not pending.servers  # the request was not stored: no block may be filed under it
    with DuckDBStore(data) as store:
        _post(store, pending, _msg("shop", SERVER_A))
        rows = store.query("SELECT db_calls FROM requests WHERE trace_id = ?", [TRACE + A])
    assert [r["db_calls"] for r in rows] == [1]
    assert pending.size == 0


def test_a_block_sent_twice_after_its_request_is_stored_once(tmp_path: Path) -> None:
    """A loop block in a later payload than its request (filed under the stored request), and
    one under no request, each sent twice: one blocker each."""
    blocked = {"perfsleuth.block.ms": 30.0}
    late = _span(E, A, 1, 50, 30, blocked)
    alone = {**_span(B, "", 1, 500, 40, blocked), "traceId": "8" * 32}
    pending = Pending()
    with _store(tmp_path) as store:
        _post(store, pending, _msg("node-api", SERVER_A))
        for _ in range(2):
            _post(store, pending, _msg("node-api", late, alone))
        rows = store.query("SELECT trace_id FROM blockers ORDER BY trace_id NULLS LAST")
    assert [r["trace_id"] for r in rows] == [TRACE + A, None]


def test_payloads_committed_together_store_a_request_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Payloads of concurrent exporters share one transaction (insert_many): each request, call
    and dictionary row once, though a payload came twice and two of them name one statement."""
    query = _span(E, A, 3, 10, 5, SQL)
    shop = _msg("shop", SERVER_A, query)
    billing = _msg("billing", SERVER_D, _span("f" * 16, D, 3, 9, 2, SQL))
    store = _store(tmp_path)
    transactions: list[int] = []
    real = store.insert_tables

    def counted(batch: Any, tables: Any) -> None:
        transactions.append(tables.requests)
        real(batch, tables)

    monkeypatch.setattr(store, "insert_tables", counted)
    pending = Pending()
    mapped = [to_batch(m, pending=pending) for m in (shop, billing, shop)]
    insert_many(store, mapped, pending)
    assert len(transactions) == 1
    rows = store.query("SELECT service, endpoint FROM requests ORDER BY service")
    assert [(r["service"], r["endpoint"]) for r in rows] == [
        ("billing", "GET /invoices/:id"),
        ("shop", "GET /checkout"),
    ]
    assert store.query("SELECT count(*) AS n FROM calls")[0]["n"] == 2
    assert store.query("SELECT count(*) AS n, count(DISTINCT id) AS d FROM fingerprints") == [
        {"n": 1, "d": 1}
    ]
    store.close()


def test_loop_blocks_two_payloads_of_one_commit_bring_are_stored_once(tmp_path: Path) -> None:
    """The same payload twice in one group commit: a block filed under a stored request, and
    one under no request, one blocker each."""
    blocked = {"perfsleuth.block.ms": 30.0}
    late = _span(E, A, 1, 50, 30, blocked)
    alone = {**_span(B, "", 1, 500, 40, blocked), "traceId": "8" * 32}
    pending = Pending()
    with _store(tmp_path) as store:
        _post(store, pending, _msg("node-api", SERVER_A))
        twice = [to_batch(_msg("node-api", late, alone), pending=pending) for _ in range(2)]
        insert_many(store, twice, pending)
        rows = store.query("SELECT trace_id FROM blockers ORDER BY trace_id NULLS LAST")
    assert [r["trace_id"] for r in rows] == [TRACE + A, None]


def test_a_late_loop_block_committed_with_its_request_is_kept(tmp_path: Path) -> None:
    """One group commit of the payload with the request and a later payload with only a loop
    block of that request: the block is stored (only a request a payload sends again is left
    out of it, not the blocks of requests other payloads bring)."""
    late = _span(E, A, 1, 50, 30, {"perfsleuth.block.ms": 30.0})
    pending = Pending()
    with _store(tmp_path) as store:
        group = [to_batch(_msg("node-api", SERVER_A), pending=pending)]
        group.append(to_batch(_msg("node-api", late), pending=pending))
        insert_many(store, group, pending)
        rows = store.query("SELECT trace_id FROM blockers")
        assert store.query("SELECT count(*) AS n FROM requests")[0]["n"] == 1
    assert [r["trace_id"] for r in rows] == [TRACE + A]
