"""outlier_tenant judges a tenant (or user) by its own latency distribution against the rest of
the endpoint (median ratio, time share against request share, a Mann-Whitney rank test), not by
how much the endpoint's p95 drops without it, and names the statement that runs only for them.

The real case: tests/apps/outlier_tenant_app.py under uvicorn and the agent, on PostgreSQL
(asyncpg). One tenant's reports run an audit statement nobody else runs, while an unrelated
event-loop blocker, hitting every tenant, sets the endpoint's p95; its clean twin has tenants
of naturally different but overlapping latency. Synthetic stores (the real wire encoder, the
real store) cover the thresholds.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from conftest import PG_DSN
from perfsleuth.analysis.config import Config
from perfsleuth.analysis.detectors.outlier_tenant import mann_whitney_greater
from perfsleuth.analysis.finding import Finding
from perfsleuth.analysis.findings import find
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import SegmentWriter, call, stored
from test_run_servers import APPS, Server, launched, uvicorn

APP = os.path.join(APPS, "outlier_tenant_app.py")
OTHERS = ("acme", "globex", "initech", "umbrella")
BIG = "bigco"
REQUESTS = 200
CONCURRENCY = 2


def line_of(path: str, marker: str) -> int:
    with open(path, encoding="utf-8") as fh:
        hits = [i for i, s in enumerate(fh.read().splitlines(), 1) if marker in s]
    assert len(hits) == 1, (path, marker, hits)
    return hits[0]


def _send(srv: Server, path: str, headers: dict[str, str]) -> None:
    status, body = srv.get(path, headers=headers)
    assert status == 200, (path, status, body[:300])


def _drive(srv: Server, jobs: list[tuple[str, dict[str, str]]]) -> None:
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda job: _send(srv, *job), jobs))


def report_traffic(route: str, big_share: bool) -> list[tuple[str, dict[str, str]]]:
    """REQUESTS requests: with ``big_share``, bigco sends 15 % of them (3 in 20), else every
    tenant a fifth; one in 20 asks for the blocking export (on /reports never bigco's, so the
    blocker is all the others' tail); sizes 0-6 in turn."""
    jobs = []
    for i in range(REQUESTS):
        turn = i + i // 20  # the blocked request (i % 20 == 10) moves from tenant to tenant
        if big_share:
            tenant = BIG if i % 20 in (0, 7, 14) else OTHERS[turn % len(OTHERS)]
        else:
            tenant = (*OTHERS, BIG)[turn % 5]
        export = int(i % 20 == 10)
        headers = {"X-Tenant": tenant, "X-User": f"user{i % 7}"}
        jobs.append((f"{route}?export={export}&size={(i // 5) % 7}", headers))
    return jobs


@pytest.fixture(scope="module")
def tenants_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DuckDBStore]:
    tmp = tmp_path_factory.mktemp("outlier-tenant")
    data = tmp / "data"
    with launched(
        tmp, data, uvicorn("outlier_tenant_app:app"), service="tenants", ready="/health",
        OUTLIER_PG_DSN=PG_DSN,
    ) as srv:  # fmt: skip
        # Warm-up without a tenant: the pool's connections, first-query set-up.
        _drive(srv, [("/reports", {}), ("/reports-even", {})] * 4)
        _drive(srv, report_traffic("/reports", big_share=True))
        _drive(srv, report_traffic("/reports-even", big_share=False))
        assert srv.stop() in (0, -15)  # a single uvicorn re-raises the SIGTERM it handled
    with DuckDBStore(str(data)) as store:
        store.ingest()
        yield store


@pytest.fixture(scope="module")
def tenant_findings(tenants_store: DuckDBStore) -> list[Finding]:
    return find(tenants_store, config=Config())


def per_tenant(store: DuckDBStore, endpoint: str) -> dict[str, dict[str, Any]]:
    rows = store.query(
        "SELECT tenant, count(*) AS n, median(duration_ms) AS p50, sum(duration_ms) AS ms "
        "FROM requests WHERE endpoint = ? AND tenant IS NOT NULL GROUP BY 1",
        [endpoint],
    )
    return {r["tenant"]: r for r in rows}


def test_outlier_tenant_found_though_a_blocker_sets_the_p95(
    tenants_store: DuckDBStore, tenant_findings: list[Finding]
) -> None:
    # What was recorded: bigco is 15 % of the requests and slow as a rule ...
    tenants = per_tenant(tenants_store, "GET /reports")
    assert tenants[BIG]["n"] == 30 and sum(t["n"] for t in tenants.values()) == REQUESTS
    others_p50 = max(tenants[t]["p50"] for t in OTHERS)
    assert tenants[BIG]["p50"] >= 5 * others_p50
    # ... and the unrelated blocker is there, on every tenant's requests.
    blockers = [
        f
        for f in tenant_findings
        if f.kind == "event_loop_blocker" and f.endpoint == "GET /reports"
    ]
    assert len(blockers) == 1 and blockers[0].evidence["blocks"] >= 5

    [f] = [
        f for f in tenant_findings if f.kind == "outlier_tenant" and f.endpoint == "GET /reports"
    ]
    ev = f.evidence
    assert (ev["dimension"], ev["tenant"]) == ("tenant", BIG)
    # everyone else: the other tenants and the warm-up's requests without a tenant
    assert ev["requests"] == 30 and ev["other_requests"] == ev["endpoint_requests"] - 30
    assert ev["endpoint_requests"] >= REQUESTS
    # The blocker sets the endpoint's p95: it barely moves without bigco (which is why a
    # p95-drop rule missed them).
    assert ev["endpoint_p95_ms_without_them"] >= 0.8 * ev["endpoint_p95_ms"]
    assert ev["their_median_ms"] >= 5 * ev["median_ms_of_others"]
    assert ev["rank_test_p_value"] < 1e-6
    assert ev["chance_slower_than_others"] > 0.9
    # The statement that runs only for them, at its line.
    stmt = ev["statement"]
    assert stmt["fingerprint"] == f.fingerprint and "audit_trail" in f.fingerprint
    assert stmt["others_calls_per_request"] == 0 and stmt["their_calls_per_request"] == 1
    assert stmt["their_ms_per_request"] >= 150
    assert f.callsite is not None and f.callsite["function"] == "reports"
    assert f.callsite["line"] == line_of(APP, "# PLANTED: only bigco's reports")
    assert "runs only for them" in f.title and "pg_sleep" in f.title
    assert f.confidence == "high"
    # Its users are not reported again (their tenant is).
    assert not [x for x in tenant_findings if x.kind == "outlier_tenant" and x is not f]


def test_tenants_of_different_but_overlapping_latency_are_no_outliers(
    tenants_store: DuckDBStore, tenant_findings: list[Finding]
) -> None:
    tenants = per_tenant(tenants_store, "GET /reports-even")
    # Ingested: every tenant, and their latency differs (bigco's data is the largest) ...
    assert set(tenants) == {*OTHERS, BIG} and all(t["n"] == 40 for t in tenants.values())
    assert tenants[BIG]["p50"] > tenants["acme"]["p50"]
    # ... the blocker too; but no tenant is an outlier.
    assert any(
        f.kind == "event_loop_blocker"
        and f.endpoint == "GET /reports-even"
        and f.evidence["blocks"] >= 5
        for f in tenant_findings
    )
    assert not [
        f for f in tenant_findings if f.kind == "outlier_tenant" and f.endpoint.endswith("even")
    ]


# ---------------------------------------------------------------------------- the rank test


def test_mann_whitney_matches_the_textbook() -> None:
    # scipy.stats.mannwhitneyu's documented example (asymptotic two-sided p = 0.11134688653)
    males, females = [19, 22, 16, 29, 24], [20, 11, 17, 12]
    values = sorted(males + females)
    rank_sum = sum(values.index(v) + 1 for v in males)  # no ties
    u, p = mann_whitney_greater(rank_sum, len(males), len(females), 0.0)
    assert u == 17 == sum(a > b for a, b in itertools.product(males, females))
    assert 2 * p == pytest.approx(0.11134688653314041)


def test_mann_whitney_with_ties_counts_pairs_and_stays_calm_on_equal_samples() -> None:
    rng = random.Random(7)
    a = [rng.choice((1, 2, 2, 3, 5)) for _ in range(40)]
    b = [rng.choice((1, 2, 3, 3)) for _ in range(60)]
    both = sorted(a + b)
    ranks = {v: (both.index(v) + 1 + len(both) - both[::-1].index(v)) / 2 for v in set(both)}
    ties = sum(both.count(v) ** 3 - both.count(v) for v in set(both))
    u, p = mann_whitney_greater(sum(ranks[v] for v in a), len(a), len(b), ties)
    pairs = sum((x > y) + 0.5 * (x == y) for x, y in itertools.product(a, b))
    assert u == pytest.approx(pairs)
    assert 0.0 < p < 1.0
    # 60 equal values, 30 on each side: no evidence either way
    assert mann_whitney_greater(sum(range(1, 61)) / 2, 30, 30, 60**3 - 60.0)[1] == 1.0


# ------------------------------------------------------------------------ synthetic stores


def outliers(store: DuckDBStore, *settings: str) -> list[Finding]:
    cfg = Config()
    for s in settings:
        cfg.apply(s)
    return [f for f in find(store, config=cfg) if f.kind == "outlier_tenant"]


def test_a_blocker_setting_the_p95_does_not_hide_the_tenant(synth: Any) -> None:
    """The shape of the real case: 15 % of the requests at 190 ms running a statement no one
    else runs, 7 % of everyone's at 600 ms (the blocker), the rest at 15 ms."""

    def fill(w: SegmentWriter) -> None:
        for i in range(200):
            big = i % 20 in (0, 7, 14)
            blocked = i % 14 == 3
            dur = 600.0 if blocked else 190.0 if big else 15.0 + i % 5
            calls = (
                [call("db", "SELECT * FROM audit WHERE tenant = ?", dur_ms=170.0)] if big else []
            )
            w.request("GET /report", dur_ms=dur, calls=calls,
                      tenant="bigco" if big else f"t{i % 4}")  # fmt: skip

    [f] = outliers(synth(fill))
    assert f.evidence["tenant"] == "bigco"
    assert f.evidence["endpoint_p95_ms_without_them"] == pytest.approx(600.0)
    assert f.fingerprint == "SELECT * FROM audit WHERE tenant = ?"
    assert f.evidence["statement"]["their_ms_per_request"] == pytest.approx(170.0)
    assert "runs only for them (170 ms per request)" in f.title


def test_outlier_tenant_needs_an_absolute_effect(synth: Any) -> None:
    """Same shares on a sub-millisecond endpoint: 0.5 against 0.1 ms is no finding."""

    def fill(w: SegmentWriter) -> None:
        for i in range(100):
            big = i % 10 == 0
            w.request("GET /ping", dur_ms=0.5 if big else 0.1,
                      tenant="megacorp" if big else f"t{i % 3}")  # fmt: skip

    store = synth(fill)
    assert stored(store) == {"GET /ping": (100, 0)}
    assert outliers(store) == []
    [f] = outliers(store, "outlier_tenant.min_median_gap_ms=0.1")
    assert (f.endpoint, f.evidence["tenant"]) == ("GET /ping", "megacorp")
    assert f.evidence["statement"] is None and f.fingerprint is None


def test_outlier_tenant_needs_to_be_slow_as_a_rule(synth: Any) -> None:
    """A tenant whose requests met a busy moment of the machine (5 of its 12 at 60 ms, the rest
    as fast as everyone's) is noise: its median is everyone's and its ranks are not far off."""

    def fill(w: SegmentWriter, spikes: int) -> None:
        for i in range(60):
            odd = i % 5 == 0  # 12 requests
            slow = odd and i // 5 < spikes
            w.request("GET /health", dur_ms=60.0 if slow else 2.0 + (i % 3) * 0.1,
                      tenant="t-odd" if odd else f"t{i % 3}")  # fmt: skip

    noisy = synth(lambda w: fill(w, 5))
    assert stored(noisy) == {"GET /health": (60, 0)}
    assert outliers(noisy) == []
    # the median rule alone tells them apart, and the rank test alone does too
    assert outliers(noisy, "outlier_tenant.max_p_value=1") == []
    lax = ("outlier_tenant.min_median_ratio=0", "outlier_tenant.min_median_gap_ms=0")
    assert outliers(noisy, *lax) == []
    assert [
        f.evidence["tenant"] for f in outliers(noisy, *lax, "outlier_tenant.max_p_value=1")
    ] == ["t-odd"]
    # the same tenant slow on most of its requests is an outlier
    [f] = outliers(synth(lambda w: fill(w, 9)))
    assert f.evidence["tenant"] == "t-odd"
    assert f.evidence["their_median_ms"] == pytest.approx(60.0)


def test_outlier_tenant_needs_requests_on_both_sides(synth: Any) -> None:
    """A tenant with nearly all of an endpoint's requests has no "rest" to be compared with."""

    def fill(w: SegmentWriter) -> None:
        for i in range(40):
            few = i % 8 == 0  # 5 requests of others
            w.request("GET /mine", dur_ms=2.0 if few else 200.0 + i,
                      tenant=f"t{i % 2}" if few else "whale")  # fmt: skip

    store = synth(fill)
    assert stored(store) == {"GET /mine": (40, 0)}
    assert outliers(store, "outlier_tenant.min_ratio=1") == []
    [f] = outliers(store, "outlier_tenant.min_ratio=1", "outlier_tenant.min_other_requests=5")
    assert (f.evidence["tenant"], f.evidence["other_requests"]) == ("whale", 5)
    assert f.confidence == "low"  # 5 requests to compare with: at the floor
