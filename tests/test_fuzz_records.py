"""Structure-aware fuzzing of spool segments: records of every type with valid checksums and
random (often hostile) field values, then random damage (flipped bits, cuts, garbage, runs of
crafted record headers, zeroed ranges, repeated records). Segments are ingested into a real
DuckDB store, many per store, and checked:

- no crash: ingest and wire.segment.read_segment raise nothing;
- no hang: each ingest ends within HANG_SECONDS;
- no loss: every well-formed request whose record ends before the segment's first damaged
  byte is in the store, with all its calls;
- no double: a trace id is stored once, its calls once.

Short in the suite (PERFSLEUTH_FUZZ_CASES, 300 by default); ``benchmarks/fuzz.py`` runs the
long mode (100,000 cases) and prints the figures. A case is made from (seed, index) alone:
``make_case(seed, index)`` reproduces it.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.wire import (
    BLOCKER,
    CAPTURE,
    FINGERPRINT,
    GC,
    HEADER,
    LOCATION,
    REQUESTS,
    SAMPLES,
    STACK,
    STATS,
)
from perfsleuth.wire import batch as wbatch
from perfsleuth.wire import calls as wcalls
from perfsleuth.wire.segment import FILE_MAGIC, REC_MAGIC, read_segment

CASES = int(os.environ.get("PERFSLEUTH_FUZZ_CASES", "300"))
SEED = int(os.environ.get("PERFSLEUTH_FUZZ_SEED", "1"))
PER_STORE = 25  # segments ingested together
HANG_SECONDS = 120.0
NOW = 1_764_000_000 * 10**9  # fixed, so that a case is the same whenever it runs
DAY = 86_400 * 10**9
NULL = wcalls.NULL

# Values a field may get instead of a good one
HOSTILE: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    -(2**63),
    2**64,
    -(2**70),
    10**30,
    1.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x",
    "123",
    "-9",
    "0x10",
    "\ud800",
    "\udc00\ud800",
    "\x00",
    "é" * 3,
    "\u2028",
    [],
    [1, "a", None],
    {},
    {"a": {"b": [1]}},
    [[[[[[[[[[1]]]]]]]]]],
]
DEEP = "__DEEP__"  # replaced by JSON nested past any recursion limit


def raw_record(rtype: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(rtype))
    return struct.pack("<2scII", REC_MAGIC, rtype, len(payload), crc) + payload


def to_json(obj: Any) -> bytes:
    """JSON as a hostile writer may send it: NaN and Infinity, escaped lone surrogates, and
    the DEEP marker as nesting 100,000 levels deep."""
    text = json.dumps(obj, ensure_ascii=True, allow_nan=True).encode()
    return text.replace(json.dumps(DEEP).encode(), b"[" * 100_000 + b"]" * 100_000)


@dataclass
class Case:
    seed: int
    index: int
    data: bytes
    # trace id -> number of calls, of the well-formed requests before the first damage
    good: dict[str, int] = field(default_factory=dict)
    damage: str = ""  # what was done to the segment (for the figures)


def _hex_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(64) | 1:016x}"


class _Maker:
    def __init__(self, rng: random.Random, seed: int, index: int) -> None:
        self.rng = rng
        self.records: list[tuple[bytes, dict[str, int]]] = []  # (bytes, good requests in it)
        self.fps = [rng.getrandbits(63) for _ in range(3)]
        self.seed, self.index = seed, index

    def hostile(self) -> Any:
        r = self.rng.random()
        if r < 0.03:
            return DEEP
        if r < 0.1:
            return self.rng.getrandbits(self.rng.choice([8, 53, 63, 64, 65, 100])) * (
                self.rng.choice([1, -1])
            )
        return copy.deepcopy(self.rng.choice(HOSTILE))

    def spoil(self, obj: Any, p: float = 0.3) -> Any:
        """``obj`` with some fields replaced by hostile values, maybe not an object at all."""
        rng = self.rng
        if not isinstance(obj, dict) or rng.random() < 0.05:
            return self.hostile()
        out = dict(obj)
        for k in list(out):
            if rng.random() < p:
                out[k] = self.hostile()
        if rng.random() < 0.2:
            out[rng.choice(["x", "calls", "samples", "pauses", "stacks", "cx"])] = self.hostile()
        return out

    def add(self, rtype: bytes, payload: bytes, good: dict[str, int] | None = None) -> None:
        self.records.append((raw_record(rtype, payload), good or {}))

    def add_json(self, rtype: bytes, obj: Any, hostile: bool) -> None:
        self.add(rtype, to_json(self.spoil(obj) if hostile else obj))

    # ------------------------------------------------------------------------- records

    def header(self, hostile: bool) -> None:
        obj = {"v": 1, "host": "fuzz", "pid": 100 + self.index, "service": "fuzz", "agent": "t"}
        self.add_json(HEADER, obj, hostile)

    def dictionaries(self, hostile: bool) -> None:
        rng = self.rng
        lid = rng.getrandbits(63)
        self.add_json(LOCATION, {"id": lid, "file": "a.py", "line": 3, "func": "f"}, hostile)
        self.add_json(STACK, {"id": rng.getrandbits(63), "frames": [lid, lid]}, hostile)
        text = rng.choice(["SELECT * FROM t WHERE id = ?", "SELECT 1", "GET k"])
        fp = {"id": rng.choice(self.fps), "kind": "db", "text": text, "op": "SELECT"}
        self.add_json(FINGERPRINT, fp, hostile)

    def batch(self, hostile: bool) -> None:
        rng = self.rng
        n = rng.randrange(1, 6)
        ids = [rng.getrandbits(64) | 1 for _ in range(n)]
        ncalls = [rng.randrange(3) for _ in range(n)]
        t0 = 10**9
        values = {
            "id": [i - (1 << 64) if i >= 1 << 63 else i for i in ids],
            "ts": [NOW + rng.randrange(-DAY, DAY) for _ in range(n)],
            "dur": [10**6] * n,
            "status": [200] * n,
            "t0": [t0] * n,
            "ncalls": ncalls,
        }
        obj: dict[str, Any] = {
            "v": 2,
            "n": n,
            "endpoint": {"all": "GET /batch"},
            "method": ["GET"] * n,
            "sites": [[0] if c else None for c in ncalls],
            "site_table": [[rng.choice(self.fps), NULL, NULL, 0, 1]],
            "attrs": {"0": {"b": 1}},
        }
        rows = b"".join(
            wbatch.AGENT_ROW.pack(0, t0 + 10 * j, t0 + 10 * j + 5, 1, NULL)
            for c in ncalls
            for j in range(c)
        )
        if hostile:
            what = rng.random()
            if what < 0.5:  # odd integers: the columns are read as they are
                col = rng.choice(["dur", "cpu_ns", "gc_ns", "status", "ts", "req_bytes"])
                values[col] = [
                    rng.choice([2**53 + 1, 2**63 - 1, -(2**63) + 1, -1, 0]) for _ in range(n)
                ]
            else:
                spoilt = self.spoil(obj, 0.2)
                obj = spoilt if isinstance(spoilt, dict) else obj
                obj["v"], obj["n"] = 2, n
        ints = b"".join(
            wbatch.INT_ROW.pack(*[values.get(c, [NULL] * n)[i] for c in wbatch.INT_COLUMNS])
            for i in range(n)
        )
        good = {} if hostile else {f"{i:016x}": c for i, c in zip(ids, ncalls, strict=True)}
        self.add(REQUESTS, to_json(obj) + b"\x00" + ints + rows, good)

    def evidence(self, hostile: bool) -> None:
        rng = self.rng
        tid = _hex_id(rng)
        rtype, obj = rng.choice(
            [
                (SAMPLES, {"id": tid, "ts": NOW, "samples": [[1000, "cpu", 1], [2000, "wait", 2]]}),
                (BLOCKER, {"ts": NOW, "dur": 10**8, "stacks": [[1, 3]], "last_call": {"ms": 1}}),
                (GC, {"pauses": [{"ts": NOW, "gen": 2, "dur": 10**6, "ids": [tid]}]}),
                (CAPTURE, {"id": tid, "ts": NOW, "url": "/x", "headers": [["a", "b"]]}),
                (STATS, {"ts": NOW, "dropped": 1, "counters": {"written": 5}}),
            ]
        )
        if hostile and isinstance(obj, dict):
            for k in ("samples", "pauses", "stacks", "headers"):
                if k in obj and rng.random() < 0.5:
                    obj[k] = [self.spoil(x) for x in obj[k]]
        self.add_json(rtype, obj, hostile)


def make_case(seed: int, index: int) -> Case:
    """One segment: records of every type, some hostile, then maybe damage."""
    rng = random.Random(f"{seed}-{index}")
    m = _Maker(rng, seed, index)
    hostile_share = rng.choice([0.0, 0.1, 0.3, 0.7])
    m.header(rng.random() < hostile_share / 3)
    makers = [m.dictionaries, m.batch, m.evidence]
    for _ in range(rng.randrange(1, 25)):
        rng.choice(makers)(rng.random() < hostile_share)
    data = bytearray(FILE_MAGIC)
    good_at: list[tuple[int, dict[str, int]]] = []  # (record end, its good requests)
    for rec, good in m.records:
        data += rec
        good_at.append((len(data), good))
    first_damage, what = _damage(rng, data, [end for end, _ in good_at])
    case = Case(seed, index, bytes(data), damage=what)
    for end, good in good_at:
        if end <= first_damage:
            case.good.update(good)
    return case


def _damage(rng: random.Random, data: bytearray, ends: list[int]) -> tuple[int, str]:
    """Damage ``data`` in place; returns (offset of the first damaged byte, what was done)."""
    n = len(data)
    what = rng.choice(
        ["none", "none", "flip", "cut", "garbage", "headers", "zeros", "repeat", "several"]
    )
    first = n + 1  # nothing damaged
    for step in range(rng.randrange(2, 5) if what == "several" else 1):
        kind = (
            rng.choice(["flip", "cut", "garbage", "headers", "zeros"])
            if step or (what == "several")
            else what
        )
        at = rng.randrange(len(FILE_MAGIC) // 2, len(data) + 1)
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << rng.randrange(8)
        elif kind == "cut":
            del data[at:]
        elif kind == "garbage":
            data[at:at] = rng.randbytes(rng.randrange(1, 200))
        elif kind == "headers":  # a run of headers, each claiming the rest as payload
            k = rng.randrange(1, 300)
            head = struct.Struct("<2scII")
            data[at:at] = b"".join(
                head.pack(REC_MAGIC, REQUESTS, (k - i - 1) * 11, rng.getrandbits(32))
                for i in range(k)
            )
        elif kind == "zeros":
            size = rng.randrange(1, 64)
            data[at : at + size] = bytes(min(size, max(0, len(data) - at)))
        elif kind == "repeat" and ends:  # a whole record again, at a record boundary
            i = rng.randrange(len(ends))
            start = ends[i - 1] if i else len(FILE_MAGIC)
            rec = bytes(data[start : ends[i]])
            data[ends[-1] : ends[-1]] = rec
            continue  # no damage: a duplicate
        else:
            continue
        first = min(first, at)
    return first, what


# ------------------------------------------------------------------------------ running


@dataclass
class Figures:
    cases: int = 0
    damaged_cases: int = 0
    records: int = 0
    crashes: int = 0
    hangs: int = 0
    good_expected: int = 0
    lost: int = 0
    doubled: int = 0
    ingest_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def add(self, other: Figures) -> None:
        for k, v in vars(other).items():
            if k == "failures":
                self.failures.extend(v)
            else:
                setattr(self, k, getattr(self, k) + v)


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def run_cases(cases: list[Case], data_dir: str) -> Figures:
    """Ingest ``cases`` (one segment each) into a fresh store in ``data_dir`` and check."""
    fig = Figures(cases=len(cases))
    spool = os.path.join(data_dir, "spool")
    os.makedirs(spool)
    names = []
    for c in cases:
        name = f"fuzz-{c.index + 1}-{c.seed + 1}-{c.index:06d}.seg"  # host fuzz, pid index
        names.append(f"seed {c.seed} case {c.index} ({c.damage})")
        with open(os.path.join(spool, name), "wb") as fh:
            fh.write(c.data)
        if c.index % 7 == 0:  # the segment copied under another name: nothing may double
            with open(os.path.join(spool, "copy" + name[4:]), "wb") as fh:
                fh.write(c.data)
        fig.damaged_cases += c.damage != "none"
        try:
            fig.records += len(read_segment(c.data).records)
        except Exception as e:
            fig.crashes += 1
            fig.failures.append(f"read_segment crashed on {names[-1]}: {e!r}")
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
    t0 = time.perf_counter()
    try:
        with DuckDBStore(data_dir) as store:
            store.ingest()
            rows = store.query(
                "SELECT r.trace_id, count(*) AS n, "
                "(SELECT count(*) FROM calls c WHERE c.trace_id = r.trace_id) AS calls "
                "FROM requests r GROUP BY r.trace_id"
            )
    except Hang:
        fig.hangs += 1
        fig.failures.append(f"ingest hung (> {HANG_SECONDS} s) on one of: {names}")
        return fig
    except Exception as e:
        fig.crashes += 1
        fig.failures.append(f"ingest crashed on one of {names}: {e!r}")
        return fig
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    fig.ingest_seconds = time.perf_counter() - t0
    stored = {r["trace_id"]: r for r in rows}
    for r in rows:
        if r["trace_id"] and r["n"] > 1:
            fig.doubled += r["n"] - 1
            fig.failures.append(f"trace {r['trace_id']} stored {r['n']} times")
    for c, name in zip(cases, names, strict=True):
        for tid, ncalls in c.good.items():
            fig.good_expected += 1
            got = stored.get(tid)
            if got is None:
                fig.lost += 1
                fig.failures.append(f"lost request {tid} of {name}")
            elif got["calls"] != ncalls:
                bad = got["calls"] > ncalls
                fig.doubled += bad
                fig.lost += not bad
                fig.failures.append(f"request {tid} of {name}: {got['calls']} calls of {ncalls}")
    return fig


def run(n_cases: int, seed: int, work_dir: str, per_store: int = PER_STORE) -> Iterator[Figures]:
    """Figures of each store's worth of cases."""
    for lo in range(0, n_cases, per_store):
        cases = [make_case(seed, i) for i in range(lo, min(n_cases, lo + per_store))]
        yield run_cases(cases, os.path.join(work_dir, f"store-{lo}"))


def test_fuzz_records(tmp_path: Any) -> None:
    total = Figures()
    for fig in run(CASES, SEED, str(tmp_path)):
        total.add(fig)
    assert total.cases == CASES
    assert total.good_expected > CASES  # the checks had something to check
    assert (total.crashes, total.hangs, total.lost, total.doubled) == (0, 0, 0, 0), total.failures[
        :10
    ]


@pytest.mark.parametrize("index", range(20))
def test_a_case_is_made_from_its_seed_and_index_alone(index: int) -> None:
    assert make_case(SEED, index).data == make_case(SEED, index).data
