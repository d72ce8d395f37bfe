"""A slow statement gets one finding, the one saying why it is slow (issue 21, seen on the zoo
on an oversubscribed machine): slow_query yields to oversized_result (fetching 25,000 rows
into Python is client CPU, which a starved machine stretches past slow_query's p95) and to
outlier_tenant (one tenant's data makes its calls slow) on the same endpoint and statement,
where it advised "look at its plan (EXPLAIN ANALYZE)"."""

from __future__ import annotations

from typing import Any

from perfsleuth.analysis.config import Config
from perfsleuth.analysis.findings import find
from spoolwrite import SegmentWriter, call


def kinds(found: list[Any]) -> set[tuple[str, str]]:
    return {(f.kind, f.endpoint) for f in found}


def test_a_statement_slow_for_its_rows_is_reported_as_oversized_not_slow(synth: Any) -> None:
    def fill(w: SegmentWriter) -> None:
        for i in range(20):
            d = 300.0 if i % 2 else 120.0  # p95 300 ms: over slow_query's 250
            many = call(text="SELECT id, name FROM product", dur_ms=d, rows=25_000)
            one = call(text="SELECT sum(total) FROM sale", dur_ms=d, rows=1)
            w.request("GET /export", dur_ms=d + 20, calls=[many])
            w.request("GET /report", dur_ms=d + 20, calls=[one])

    store = synth(fill)
    found = kinds(find(store, config=Config()))
    assert ("oversized_result", "GET /export") in found
    assert ("slow_query", "GET /export") not in found
    assert ("slow_query", "GET /report") in found  # slow with one row: the query itself
    # With oversized_result switched off, the slow statement is slow_query's again.
    cfg = Config()
    cfg.set("oversized_result", "enabled", False)
    assert ("slow_query", "GET /export") in kinds(find(store, config=cfg))


def test_a_statement_slow_for_one_tenant_is_reported_as_the_tenant_s(synth: Any) -> None:
    def fill(w: SegmentWriter) -> None:
        for i in range(200):
            big = i % 20 in (0, 7, 14)
            calls = [call(text="SELECT * FROM audit WHERE tenant = ?", dur_ms=300.0)] if big else []
            w.request("GET /report", dur_ms=320.0 if big else 15.0 + i % 5, calls=calls,
                      tenant="bigco" if big else f"t{i % 4}")  # fmt: skip

    store = synth(fill)
    found = find(store, config=Config())
    assert kinds(found) == {("outlier_tenant", "GET /report")}
    cfg = Config()
    cfg.set("outlier_tenant", "enabled", False)
    assert kinds(find(store, config=cfg)) == {("slow_query", "GET /report")}
