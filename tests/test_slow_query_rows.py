"""slow_query leaves a statement slow for the rows it returns to oversized_result (issue 21,
seen on the zoo's oversized plant on an oversubscribed machine): fetching 25,000 rows into
Python is client CPU, which a starved machine stretches past slow_query's p95; the finding
said "look at its plan (EXPLAIN ANALYZE)" where the remedy is to fetch fewer rows, which
oversized_result already says for the same statement."""

from __future__ import annotations

from typing import Any

from perfsleuth.analysis.config import Config
from perfsleuth.analysis.findings import find
from spoolwrite import SegmentWriter, call


def fill(w: SegmentWriter) -> None:
    for i in range(20):
        d = 300.0 if i % 2 else 120.0  # p95 300 ms: over slow_query's 250
        w.request(
            "GET /export",
            dur_ms=d + 20,
            calls=[call(text="SELECT id, name FROM product", dur_ms=d, rows=25_000)],
        )
        w.request("GET /report", dur_ms=d + 20,
                  calls=[call(text="SELECT sum(total) FROM sale", dur_ms=d, rows=1)])  # fmt: skip


def kinds(found: list[Any]) -> set[tuple[str, str]]:
    return {(f.kind, f.endpoint) for f in found}


def test_a_statement_slow_for_its_rows_is_reported_as_oversized_not_slow(synth: Any) -> None:
    store = synth(fill)
    found = kinds(find(store, config=Config()))
    assert ("oversized_result", "GET /export") in found
    assert ("slow_query", "GET /export") not in found
    assert ("slow_query", "GET /report") in found  # slow with one row: the query itself
    # With oversized_result switched off, the slow statement is slow_query's again.
    cfg = Config()
    cfg.set("oversized_result", "enabled", False)
    assert ("slow_query", "GET /export") in kinds(find(store, config=cfg))
