"""large_request_body on what a busy machine records: durations blurred by waits for a CPU,
CPU time measured for a share of the requests only (``cpu_ms`` NULL for the rest), and few
requests. The demo's planted ``POST /admin/notes`` went unfound that way in CI (issue 21).

The figures are built, not timed: a body's parse costs 5 ms + 35 ms per MB of CPU (the demo's
form parse on a quiet machine), and a busy machine multiplies a request's duration by 1 to 6
and stalls some by 1.5 s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from perfsleuth.analysis import Config, find
from perfsleuth.analysis.detectors.large_request_body import p_value
from spoolwrite import SegmentWriter

MS = 1_000_000  # ns
WAITS = (1.0, 3.0, 1.5, 6.0, 2.0, 1.2, 4.0, 2.5)  # a busy machine's factor on a duration


def parse_cpu_ms(size: int) -> float:
    return 5.0 + 35.0 * size / 1e6


def sizes(n: int, stride: int) -> list[int]:
    """``n`` body sizes from 300 KB to 3 MB (evenly spread in log), sent in a fixed shuffled
    order (``stride`` prime to ``n``), so size and time of sending are unrelated."""
    return [int(300_000 * 10 ** (((k * stride) % n) / (n - 1))) for k in range(n)]


def findings_of(synth: Any, fill: Callable[[SegmentWriter], None]) -> list[Any]:
    return [f for f in find(synth(fill), config=Config()) if f.kind == "large_request_body"]


def test_size_driven_latency_is_found_through_load_delays_with_few_cpu_times(synth: Any) -> None:
    """16 requests, CPU time measured for 1 in 8 (2: too few to fit), durations blurred and two
    stalled: the size still orders the durations (rank correlation 0.71), although the stalls
    pull their Pearson correlation to 0.42 (under the 0.5 floor: the finding was missed)."""

    def fill(w: SegmentWriter) -> None:
        for k, size in enumerate(sizes(16, 7)):
            cpu = parse_cpu_ms(size)
            dur = cpu * WAITS[k % len(WAITS)] + (1500.0 if k in (3, 9) else 0.0)
            timed = {"cpu_ns": round(cpu * MS)} if k % 8 == 0 else {}
            w.request("POST /notes", dur_ms=dur, req_bytes=size, **timed)

    [f] = findings_of(synth, fill)
    assert f.endpoint == "POST /notes"
    ev = f.evidence
    assert ev["correlated_with"] == "duration_ms"
    assert ev["correlation_method"] == "spearman"
    assert ev["requests_fitted"] == 16
    assert ev["correlation"] == pytest.approx(0.709, abs=0.001)
    assert ev["p_value"] < 0.05
    assert "rank correlation 0.71 over 16 requests" in f.title


def test_cpu_time_is_fitted_over_the_requests_that_have_it(synth: Any) -> None:
    """40 requests, CPU time for 1 in 4 (10, one of them inflated 4x as a busy machine does),
    durations dominated by waits: the fit is on the 10 CPU times, not on the NULLs."""

    def fill(w: SegmentWriter) -> None:
        for k, size in enumerate(sizes(40, 13)):
            cpu = parse_cpu_ms(size) * (4.0 if k == 4 else 1.0)
            dur = cpu + (40.0, 900.0, 150.0, 1500.0, 300.0, 60.0)[k % 6]
            timed = {"cpu_ns": round(cpu * MS)} if k % 4 == 0 else {}
            w.request("POST /notes", dur_ms=dur, req_bytes=size, **timed)

    [f] = findings_of(synth, fill)
    ev = f.evidence
    assert ev["correlated_with"] == "cpu_ms"
    assert ev["requests_fitted"] == 10
    assert ev["requests_with_known_size"] == 40
    assert ev["correlation"] == pytest.approx(0.745, abs=0.001)
    assert "CPU time grows" in f.title


def test_a_tie_between_the_fits_goes_to_cpu_time_on_both_engines(synth: Any) -> None:
    """Every request timed, its duration its CPU time plus a wait that keeps the order (the
    quiet demo, whose process measures every request): both fits rank the requests alike, so
    their correlations are equal up to the engine's last bits. DuckDB and chDB then named
    different measures for the demo's POST /admin/notes (the fresh-clone CI); a tie is the CPU
    fit's, on both."""

    def fill(w: SegmentWriter) -> None:
        for k, size in enumerate(sizes(12, 5)):
            cpu = parse_cpu_ms(size) + 0.37 * k % 3  # not a multiple of the duration
            w.request("POST /notes", dur_ms=cpu * 1.13 + 3.0, req_bytes=size,
                      cpu_ns=round(cpu * MS))  # fmt: skip

    [f] = findings_of(synth, fill)
    assert f.evidence["correlated_with"] == "cpu_ms"
    assert "CPU time grows" in f.title


def test_five_size_blind_requests_whose_times_happen_to_line_up_raise_nothing(
    synth: Any,
) -> None:
    """Five large uploads whose times do not depend on their size but happen to rank 0.6 alike
    (Pearson 0.59): five unrelated requests do that one time in six. The p-value floor holds
    it back (p = 0.12); the correlation floor alone raised it."""

    def fill(w: SegmentWriter) -> None:
        sizes_ = (400_000, 500_000, 600_000, 700_000, 800_000)
        for size, dur in zip(sizes_, (30.0, 25.0, 35.0, 40.0, 33.0), strict=True):
            w.request("POST /upload", dur_ms=dur, req_bytes=size)

    assert findings_of(synth, fill) == []


def test_the_p_value_of_a_rank_correlation() -> None:
    assert p_value(0.0, 10) == pytest.approx(0.5)
    assert p_value(0.6, 5) == pytest.approx(0.1151, abs=1e-4)  # z = 1.2
    assert p_value(0.5, 12) == pytest.approx(0.0487, abs=1e-4)  # z = 1.66
    assert p_value(1.0, 1) == 1.0


def test_a_fit_without_variation_leaves_the_decision_to_the_other_fit(synth: Any) -> None:
    """Every duration the same (their rank correlation is NaN): the CPU fit decides, on both
    engines (on ClickHouse nullIf(x, NaN) kept the NaN, which beat nothing: no finding)."""

    def fill(w: SegmentWriter) -> None:
        for size in sizes(12, 5):
            w.request(
                "POST /notes", dur_ms=100.0, req_bytes=size, cpu_ns=round(parse_cpu_ms(size) * MS)
            )

    fs = findings_of(synth, fill)
    assert [f.evidence["correlated_with"] for f in fs] == ["cpu_ms"]
    assert fs[0].evidence["requests_fitted"] == 12


# Ranks (0-11) of the durations and CPU times of 12 size-blind requests, by size: the durations
# rank 0.55 alike with the sizes (one-sided p = 0.033), the CPU times 0.0.
BLIND_DUR = (5, 3, 0, 10, 1, 4, 2, 6, 9, 8, 11, 7)
BLIND_CPU = (6, 0, 10, 11, 3, 1, 7, 8, 2, 5, 9, 4)


def _blind(w: SegmentWriter) -> None:
    for k in sizes(12, 5):  # (in a shuffled order)
        i = sorted(sizes(12, 5)).index(k)
        w.request(
            "POST /upload",
            dur_ms=50.0 + 10.0 * BLIND_DUR[i],
            req_bytes=k,
            cpu_ns=(20 + 3 * BLIND_CPU[i]) * MS,
        )


def test_the_better_of_two_fits_is_held_to_half_the_p_value(synth: Any) -> None:
    """12 size-blind requests, all with a CPU time: the duration fit's p = 0.033 passes a 5 %
    test on its own, but it is the better of two fits tried, so it is held to 2.5 % (the
    better of two at 5 % raised a size-blind endpoint about one time in ten). At 10 % it is
    found, with its p-value doubled."""
    assert findings_of(synth, _blind) == []
    config = Config()
    config.set("large_request_body", "max_p_value", 0.1)
    [f] = [x for x in find(synth(_blind), config=config) if x.kind == "large_request_body"]
    assert f.evidence["correlated_with"] == "duration_ms"
    assert f.evidence["correlation"] == pytest.approx(0.5524, abs=1e-4)
    assert f.evidence["p_value"] == pytest.approx(2 * p_value(0.5524, 12), abs=1e-4)


def test_a_max_p_value_of_zero_finds_nothing(synth: Any) -> None:
    """max_p_value 0: no correlation is that sure (it meant no check at all)."""

    def fill(w: SegmentWriter) -> None:
        for size in sizes(12, 5):
            w.request("POST /notes", dur_ms=parse_cpu_ms(size), req_bytes=size)

    assert [f.evidence["p_value"] < 0.001 for f in findings_of(synth, fill)] == [True]
    config = Config()
    config.set("large_request_body", "max_p_value", 0.0)
    assert [f for f in find(synth(fill), config=config) if f.kind == "large_request_body"] == []


def _spearman(x: list[float], y: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5


def test_over_2000_requests_the_same_are_fitted_on_both_engines(synth: Any) -> None:
    """2,500 requests: the rank correlation is over every 2nd in the order of their trace ids,
    the same requests on both engines (it was by hash(trace_id), which is cityHash64 on
    ClickHouse: other requests, another count and correlation)."""
    import random

    rnd = random.Random(5)
    reqs = []
    for _ in range(2_500):
        size = int(300_000 * 10 ** rnd.random())
        reqs.append((f"{rnd.getrandbits(64):016x}", size, parse_cpu_ms(size) * rnd.uniform(1, 6)))

    def fill(w: SegmentWriter) -> None:
        for i in range(0, len(reqs), 500):
            w.write_requests(
                [
                    {"endpoint": "POST /notes", "trace_id": t, "dur_ms": d, "req_bytes": b}
                    for t, b, d in reqs[i : i + 500]
                ]
            )

    kept = sorted(reqs)[1::2]  # row_number() % 2 = 0
    want = _spearman([float(b) for _, b, _ in kept], [d for _, _, d in kept])
    [f] = findings_of(synth, fill)
    assert f.evidence["requests_with_known_size"] == 2_500
    assert f.evidence["requests_fitted"] == 1_250
    assert f.evidence["correlation"] == pytest.approx(want, abs=1e-9)
