"""Proof that the detectors work: the zoo (tests/zoo/) plants one problem per small app, in
FastAPI, Flask and Django apps on real PostgreSQL and Redis, each next to a clean twin.

The whole zoo runs once for this module (three servers under ``perfsleuth run``, see
``zoo.harness``). Two sets of tests read it:

* what the agent recorded: each bad endpoint really carries its problem and its clean twin
  does not (so a missed finding is the detector's fault, not the zoo's);
* what ``perfsleuth findings --json`` reports: every planted problem is found, with the right
  kind, endpoint and, where a finding points at code, the ``# PLANTED`` line; no clean twin
  gets a finding of that kind.

Nothing here depends on how long anything took.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import store_engines
from zoo import harness, seed
from zoo.catalog import CALLSITE_KINDS, PLANTS, Plant
from zoo.harness import ZooRun

IDS = [p.name for p in PLANTS]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ZooRun]:
    return harness.run_zoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="module")
def findings_by_run(zoo: dict[str, ZooRun]) -> dict[str, list[dict[str, Any]]]:
    return {framework: run.findings() for framework, run in zoo.items()}


@pytest.fixture(scope="module")
def findings(findings_by_run: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    # One list: endpoint names do not overlap between the zoo apps.
    return [f for found in findings_by_run.values() for f in found]


# --------------------------------------------------------------------- what was recorded


@dataclass
class Profile:
    """One endpoint's recorded requests and calls, summed up per request."""

    requests: list[dict[str, Any]]  # measured ones (the harness's warm-up left out)
    calls: dict[str, list[dict[str, Any]]]  # by trace id
    lines: collections.Counter[tuple[str, str, int]]  # (trace id, file, line) -> calls
    traces: set[str]  # every request's trace id, warm-up included

    def per_request(self, fn: Callable[[list[dict[str, Any]]], Any]) -> list[Any]:
        return [fn(self.calls.get(r["trace_id"], [])) for r in self.requests]

    def top_repeat(self, *key: str) -> list[int]:
        """Per request: how often its most repeated call (by the given columns) was made."""

        def top(calls: list[dict[str, Any]]) -> int:
            counts = collections.Counter(tuple(c[k] for k in key) for c in calls)
            return max(counts.values(), default=0)

        return self.per_request(top)

    def calls_at(self, source: Path, line: int) -> list[int]:
        """Per request: its calls with ``source:line`` on their stack."""
        return [self.lines[(r["trace_id"], str(source), line)] for r in self.requests]

    def fingerprints(self) -> set[str]:
        return {c["text"] for calls in self.calls.values() for c in calls}


@pytest.fixture(scope="module")
def recorded(zoo: dict[str, ZooRun]) -> dict[str, Profile]:
    """Profiles of every endpoint of the zoo (three queries per run: each is a subprocess)."""
    requests: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    traces: dict[str, set[str]] = collections.defaultdict(set)
    calls: dict[str, dict[str, list[dict[str, Any]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    lines: dict[str, collections.Counter[tuple[str, str, int]]] = collections.defaultdict(
        collections.Counter
    )
    for run in zoo.values():
        for r in run.sql('SELECT endpoint, trace_id, status, tenant, "user", req_bytes '
                         "FROM requests ORDER BY ts"):  # fmt: skip
            traces[r["endpoint"]].add(r["trace_id"])
            if r["user"] is not None:  # not the harness's anonymous warm-up requests
                requests[r["endpoint"]].append(r)
        for c in run.sql(
            "SELECT c.endpoint, c.trace_id, c.fingerprint_id, c.params_hash, c.rows, f.text "
            "FROM calls c JOIN fingerprints f ON f.id = c.fingerprint_id"
        ):
            # Calls without parameters have no hash: never "the same parameters" as another.
            if c["params_hash"] is None:
                c["params_hash"] = object()
            calls[c["endpoint"]][c["trace_id"]].append(c)
        # Each call's zoo frames (the stack is recorded per call: N+1 repeats share one).
        for f in run.sql(
            "WITH frames AS (SELECT s.id, l.file, l.line FROM stacks s, "
            "unnest(s.frames) AS u(loc) JOIN locations l ON l.id = u.loc "
            "WHERE l.file LIKE '%/zoo/%') "
            "SELECT c.endpoint, c.trace_id, f.file, f.line, count(*) AS n "
            "FROM calls c JOIN frames f ON f.id = c.stack_id GROUP BY ALL"
        ):
            lines[f["endpoint"]][(f["trace_id"], f["file"], f["line"])] += f["n"]
    return {
        ep: Profile(
            reqs, {r["trace_id"]: calls[ep][r["trace_id"]] for r in reqs}, lines[ep], traces[ep]
        )
        for ep, reqs in requests.items()
    }


@pytest.mark.parametrize("plant", PLANTS, ids=IDS)
def test_zoo_records_the_planted_problem(recorded: dict[str, Profile], plant: Plant) -> None:
    bad, clean = recorded[plant.bad], recorded[plant.clean]
    n = harness.REQUESTS_PER_ENDPOINT
    per_tenant = n // len(seed.TENANTS)
    for p in (bad, clean):
        assert [r["status"] for r in p.requests] == [200] * n
        tenants = collections.Counter(r["tenant"] for r in p.requests)
        assert tenants == dict.fromkeys(seed.TENANTS, per_tenant)

    # The planted line makes the calls it is said to make, in every bad request.
    assert bad.calls_at(plant.source, plant.planted_line()) == [plant.per_request] * n

    match plant.kind:
        case "n_plus_one":
            assert bad.top_repeat("fingerprint_id") == [plant.per_request] * n
            assert max(clean.top_repeat("fingerprint_id")) <= 2
        case "repeated_query":
            assert bad.top_repeat("fingerprint_id", "params_hash") == [3] * n
            assert clean.top_repeat("fingerprint_id", "params_hash") == [1] * n
        case "oversized_result":
            most_rows = bad.per_request(lambda calls: max(c["rows"] or 0 for c in calls))
            assert min(most_rows) >= 20_000
            assert max(clean.per_request(lambda calls: max(c["rows"] or 0 for c in calls))) <= 20
        case "slow_query":
            assert any("pg_sleep" in text for text in bad.fingerprints())
            assert not any("pg_sleep" in text for text in clean.fingerprints())
        case "upstream_latency":
            assert any("/quotes/slow" in text for text in bad.fingerprints())
            assert not any("/quotes/slow" in text for text in clean.fingerprints())
        case "outlier_tenant":
            pass  # the tenants' traffic is checked above; their data sizes are in zoo.seed
        case "chatty_endpoint":
            distinct = bad.per_request(lambda calls: len({c["fingerprint_id"] for c in calls}))
            assert min(distinct) >= 60
            assert bad.top_repeat("fingerprint_id") == [1] * n
            # its own dashboard queries only: Django may add a connection set-up statement
            own = clean.per_request(lambda calls: sum("zoo_chatty" in c["text"] for c in calls))
            assert max(own) <= 8
        case "large_request_body":
            sizes = [r["req_bytes"] for r in bad.requests]
            assert min(sizes) >= 200_000 and max(sizes) <= 2_100_000
            assert len(set(sizes)) >= 8  # sizes vary, so size can be seen to drive latency
            assert max(r["req_bytes"] for r in clean.requests) <= 10_000
        case _:
            pytest.fail(f"no recorded-data check for {plant.kind}")


# ---------------------------------------------------------------------- what was found


# The fields of a finding (issue 3).
CONTRACT = (
    "id kind endpoint title impact_ms_per_min callsite fingerprint count_per_request "
    "example_trace_ids first_seen last_seen suggestion"
).split()


def summary(findings: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{f['kind']} on {f['endpoint']}" for f in findings)


def test_findings_follow_the_contract(findings_by_run: dict[str, list[dict[str, Any]]]) -> None:
    for found in findings_by_run.values():
        for f in found:
            assert set(CONTRACT) <= set(f), f
        impacts = [f["impact_ms_per_min"] for f in found]
        assert impacts == sorted(impacts, reverse=True)  # highest impact first


@pytest.mark.parametrize("plant", PLANTS, ids=IDS)
def test_planted_problem_is_found(
    recorded: dict[str, Profile], findings: list[dict[str, Any]], plant: Plant
) -> None:
    mine = [f for f in findings if f["kind"] == plant.kind and f["endpoint"] == plant.bad]
    assert mine, f"no {plant.kind} on {plant.bad}; found: {summary(findings)}"
    traces = recorded[plant.bad].traces
    for f in mine:
        assert f["id"] and f["title"] and f["suggestion"] and f["impact_ms_per_min"] > 0
        assert f["example_trace_ids"] and set(f["example_trace_ids"]) <= traces
        if plant.kind not in CALLSITE_KINDS:
            continue
        # The line to fix: for an N+1 the loop's line in the view, even when the statement
        # itself sits in a helper (flask_n1_sql); otherwise the line issuing the call.
        site = f["callsite"]
        assert site is not None and f["fingerprint"] is not None, f
        assert site["file"].endswith(f"zoo/{plant.module}"), site
        assert site["line"] == plant.planted_line(), (site, plant.module)
        if plant.kind in ("n_plus_one", "repeated_query"):
            assert f["count_per_request"] == pytest.approx(plant.per_request), f


@pytest.mark.parametrize("plant", PLANTS, ids=IDS)
def test_clean_twin_has_no_such_finding(findings: list[dict[str, Any]], plant: Plant) -> None:
    wrong = [f for f in findings if f["kind"] == plant.kind and f["endpoint"] == plant.clean]
    assert not wrong, wrong


@pytest.mark.skipif(not store_engines.chdb_available(), reason="no clickhouse extra (chdb)")
def test_clickhouse_finds_what_duckdb_finds(zoo: dict[str, ZooRun]) -> None:
    """Each zoo app's store copied into ClickHouse's engine (chDB): the same findings (issue
    20; tests/test_clickhouse.py does the same for the demo)."""
    from perfsleuth.analysis import find
    from perfsleuth.store import open_store

    for framework, run in zoo.items():
        duck = open_store(str(run.data), read_only=True, url="duckdb")
        ch = store_engines.copy_into_chdb(duck)
        try:
            found = [f.to_dict() for f in find(duck)]
            assert found, framework
            store_engines.same(found, [f.to_dict() for f in find(ch)], framework)
        finally:
            duck.close()
            ch.close()
