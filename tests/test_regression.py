"""The regression detector on synthetic histories written with the agent's wire encoder: planted
breakpoints are found within one bucket and named with what moved with them; flat noisy
histories stay silent; week over week compares with the same hours a week earlier."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from perfsleuth.analysis.config import Config
from perfsleuth.analysis.finding import Finding
from perfsleuth.analysis.findings import find
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import SegmentWriter, call

HOUR_NS = 3600 * 10**9
BUCKETS = 48


def hour_zero(hours_back: int) -> datetime:
    """The start of the hour ``hours_back`` hours ago (UTC, naive)."""
    now = datetime.now(UTC).replace(tzinfo=None, minute=0, second=0, microsecond=0)
    return now - timedelta(hours=hours_back)


def ns(t: datetime) -> int:
    return int(t.replace(tzinfo=UTC).timestamp() * 10**9)


def history(
    w: SegmentWriter,
    rng: random.Random,
    endpoint: str,
    start: datetime,
    *,
    median: float,
    per_bucket: int = 20,
    sigma: float = 0.4,
    step_at: int | None = None,
    factor: float = 1.5,
    after: Callable[[random.Random], dict[str, Any]] | None = None,
    before: Callable[[random.Random], dict[str, Any]] | None = None,
    spikes: float = 0.01,
) -> None:
    """BUCKETS hourly buckets of log-normal latencies with 1 % spikes at 5x; from bucket
    ``step_at`` on, latencies are ``factor`` times higher and requests take ``after``'s fields."""
    for b in range(BUCKETS):
        stepped = step_at is not None and b >= step_at
        for _ in range(per_bucket):
            dur = median * rng.lognormvariate(0.0, sigma)
            if rng.random() < spikes:
                dur *= 5
            extra: dict[str, Any] = {}
            if stepped:
                dur *= factor
                extra = after(rng) if after else {}
            elif before:
                extra = before(rng)
            ts = ns(start) + b * HOUR_NS + int(rng.uniform(0, 3590) * 10**9)
            w.request(endpoint, ts_ns=ts, dur_ms=dur, **extra)


def regressions(store: DuckDBStore, *settings: str) -> list[Finding]:
    cfg = Config()
    for s in settings:
        cfg.apply(s)
    return find(store, config=cfg, kinds=["regression"])


def test_planted_breakpoints_found_within_one_bucket_and_flat_histories_silent(
    synth: Any,
) -> None:
    start = hour_zero(BUCKETS + 1)
    planted = {"GET /a": 12, "GET /b": 24, "GET /c": 36}

    def new_release(rng: random.Random) -> dict[str, Any]:
        audit = [call("db", "SELECT * FROM audit WHERE order_id = ?", dur_ms=2.0) for _ in range(8)]
        return {"tags": {"release": "v2"}, "calls": audit}

    def fill(w: SegmentWriter) -> None:
        rng = random.Random(42)
        for ep, at in planted.items():
            after = new_release if ep == "GET /b" else None
            before = (lambda r: {"tags": {"release": "v1"}}) if ep == "GET /b" else None
            history(w, rng, ep, start, median=80.0, step_at=at, after=after, before=before)
        for i in range(20):  # flat and noisy; half of them with a steady 3 % over 1 s
            history(w, rng, f"GET /flat{i}", start, median=400.0 if i % 2 else 60.0, sigma=0.5)

    store = synth(fill)
    counts = {r["endpoint"]: r["n"] for r in store.query(
        "SELECT endpoint, count(*) AS n FROM requests GROUP BY 1")}  # fmt: skip
    assert len(counts) == 23 and set(counts.values()) == {BUCKETS * 20}  # all ingested
    found = {f.endpoint: f for f in regressions(store)}
    assert set(found) == set(planted), [f.title for f in found.values()]
    for ep, at in planted.items():
        f = found[ep]
        assert f.first_seen is not None
        started = datetime.fromisoformat(f.first_seen).replace(tzinfo=None)
        assert abs((started - start) / timedelta(hours=1) - at) <= 1, (ep, f.first_seen)
        assert f.evidence["metric"] == "p95"
        assert 1.3 < f.evidence["after"] / f.evidence["before"] < 1.8
        assert f.confidence is not None
    b = found["GET /b"]
    assert "tag release=v2" in b.title
    assert "DB calls per request 0.0 → 8.0" in b.title
    assert "new statement `SELECT * FROM audit WHERE order_id = ?`" in b.title
    assert b.fingerprint == "SELECT * FROM audit WHERE order_id = ?"
    assert "and stayed there (" in b.title and "buckets of 1 h)" in b.title


def test_flat_noisy_histories_with_various_seeds_stay_silent(synth: Any) -> None:
    """20 flat histories in their own store each (the series and the window differ)."""
    start = hour_zero(BUCKETS + 1)

    def fill(w: SegmentWriter) -> None:
        for seed in range(20):
            rng = random.Random(1000 + seed)
            history(w, rng, f"GET /noisy{seed}", start, median=rng.uniform(5, 500),
                    sigma=rng.uniform(0.2, 0.8), per_bucket=rng.randint(6, 40),
                    spikes=rng.uniform(0.0, 0.03))  # fmt: skip

    store = synth(fill)
    assert store.query("SELECT count(DISTINCT endpoint) AS n FROM requests")[0]["n"] == 20
    assert regressions(store) == []


def test_a_share_over_a_second_that_rose_is_a_regression_though_p95_held(synth: Any) -> None:
    start = hour_zero(BUCKETS + 1)

    def fill(w: SegmentWriter) -> None:
        rng = random.Random(9)
        for b in range(BUCKETS):
            for i in range(50):
                slow = b >= 30 and i in (7, 31)  # 4 % from bucket 30 on: too few to move p95
                dur = 1500.0 if slow else 50.0 * rng.lognormvariate(0.0, 0.3)
                ts = ns(start) + b * HOUR_NS + int(rng.uniform(0, 3590) * 10**9)
                w.request("GET /tail", ts_ns=ts, dur_ms=dur)

    [f] = regressions(synth(fill))
    assert f.evidence["metric"] == "over_1000ms"
    started = datetime.fromisoformat(f.first_seen or "").replace(tzinfo=None)
    assert abs((started - start) / timedelta(hours=1) - 30) <= 1
    assert "GET /tail: requests over 1,000 ms went from 0% to 4.0% of its traffic" in f.title


def test_week_over_week_compares_the_same_hours_last_week(synth: Any) -> None:
    now = hour_zero(1)
    week = timedelta(days=7)

    def fill(w: SegmentWriter) -> None:
        rng = random.Random(3)
        for base, slower in ((now - week, False), (now, True)):
            for i in range(120):
                ts = ns(base) + int(i * 30 * 10**9)
                d = 40.0 * rng.lognormvariate(0.0, 0.3)
                w.request("GET /weekly", ts_ns=ts, dur_ms=d * (1.6 if slower else 1.0))
                w.request("GET /steady", ts_ns=ts + 1000, dur_ms=40.0 * rng.lognormvariate(0, 0.3))

    [f] = regressions(synth(fill))
    assert f.endpoint == "GET /weekly"
    assert f.evidence["baseline"] == "same hours last week"
    assert f.evidence["requests_before"] == f.evidence["requests_after"] == 120
    assert "in the same hours last week" in f.title


def test_the_release_deployed_at_the_breakpoint_is_named(tmp_path: Path) -> None:
    from perfsleuth.wire import HEADER
    from perfsleuth.wire.segment import encode_record

    start = hour_zero(BUCKETS + 1)
    data = str(tmp_path / "data")
    rng = random.Random(12)
    for k, version in enumerate(("2.0.0", "2.1.0")):
        w = SegmentWriter(data, pid=10 + k, seq=10 + k, header=False)
        w.write(encode_record(HEADER, {"v": 1, "host": "testbox", "pid": 10 + k,
                                       "service": "shop", "version": version}))  # fmt: skip
        for b in range(BUCKETS):
            if (b >= 20) != bool(k):
                continue
            for _ in range(20):
                ts = ns(start) + b * HOUR_NS + int(rng.uniform(0, 3590) * 10**9)
                dur = 60.0 * rng.lognormvariate(0.0, 0.3) * (1.6 if k else 1.0)
                w.request("GET /deployed", ts_ns=ts, dur_ms=dur)
        w.close()
    with DuckDBStore(data) as store:
        store.ingest()
        [f] = regressions(store)
    started = datetime.fromisoformat(f.first_seen or "").replace(tzinfo=None)
    assert abs((started - start) / timedelta(hours=1) - 20) <= 1
    assert "with it: release 2.1.0" in f.title
    assert f.evidence["changes"][0]["change"] == "release 2.1.0"
