"""Store ingest benchmark: a synthetic spool written with the real wire encoder, then timed
ingest into DuckDB and timed queries.

    .venv/bin/python benchmarks/ingest.py [--requests 100000] [--calls 10] [--dir DIR]

The spool has the agent's shapes (perfsleuth.agent.shipper): 8 MB segments, each starting
with a header and the L/S/F dictionary records its requests use; 300 Zipf-distributed
endpoints, lognormal durations, 5,000 users, ``--calls`` DB/HTTP/cache calls per request with
a call site and a 12-frame stack. Prints spool size, requests/s and calls/s, on-disk bytes
per request, and the time of ``top`` and ``traces``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import tempfile
import time
from datetime import timedelta
from typing import Any

from perfsleuth.store.duckdb_store import DuckDBStore
from perfsleuth.store.spool import local_host
from perfsleuth.wire import FINGERPRINT, HEADER, LOCATION, REQUEST, STACK
from perfsleuth.wire.segment import FILE_MAGIC, encode_record

SEGMENT_BYTES = 8_000_000


def _id(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()) >> 1


def write_spool(data_dir: str, n_requests: int, calls_per_request: int, seed: int = 1) -> int:
    """Write the synthetic spool; returns its size in bytes."""
    rng = random.Random(seed)
    spool = os.path.join(data_dir, "spool")
    os.makedirs(spool, exist_ok=True)
    n_endpoints = 300
    endpoints = [f"GET /api/v1/resource{i}/{{id}}" for i in range(n_endpoints)]
    weights = [1 / (i + 1) for i in range(n_endpoints)]
    frames = [(f"app/module{i}.py", 10 + i, f"func{i}", i % 3 != 0) for i in range(40)]
    systems = {"db": "postgresql", "http": "http", "cache": "redis"}
    # Per endpoint: the dictionary records its calls use, and (kind, system, fp, stack, site).
    needs: list[list[tuple[tuple[bytes, int], bytes]]] = []
    templates: list[list[tuple[str, str, int, int, int]]] = []
    for e in range(n_endpoints):
        recs: dict[tuple[bytes, int], bytes] = {}
        stack = frames[e % 20 : e % 20 + 12]
        ids = []
        for file, line, func, app in stack:
            lid = _id(file, line, func)
            ids.append(lid)
            body = {"id": lid, "file": file, "line": line, "func": func, "app": app}
            recs[(LOCATION, lid)] = encode_record(LOCATION, body)
        sid = _id(*ids)
        recs[(STACK, sid)] = encode_record(STACK, {"id": sid, "frames": ids})
        tpl = []
        for j in range(6):
            kind = ("db", "http", "cache")[j % 3]
            text = f"{kind.upper()} statement {e} {j}"
            fid = _id(kind, text)
            body = {"id": fid, "kind": kind, "text": text, "op": kind.upper()}
            recs[(FINGERPRINT, fid)] = encode_record(FINGERPRINT, body)
            tpl.append((kind, systems[kind], fid, sid, ids[-1]))
        needs.append(list(recs.items()))
        templates.append(tpl)
    start_ns = time.time_ns() - 3_600 * 10**9
    total = 0
    seg_no = 0
    chunks: list[bytes] = []
    size = 0
    emitted: set[tuple[bytes, int]] = set()

    def new_segment() -> None:
        nonlocal chunks, size, emitted, seg_no
        seg_no += 1
        header = {"v": 1, "host": "bench", "pid": 1, "service": "bench", "agent": "bench"}
        chunks = [FILE_MAGIC + encode_record(HEADER, header)]
        size = len(chunks[0])
        emitted = set()

    def close_segment() -> None:
        nonlocal total
        path = os.path.join(spool, f"{local_host()}-1-{start_ns}-{seg_no:06d}.seg")
        with open(path, "wb") as fh:
            fh.write(b"".join(chunks))
        total += size

    new_segment()
    picks = rng.choices(range(n_endpoints), weights, k=n_requests)
    for i, e in enumerate(picks):
        for key, rec in needs[e]:
            if key not in emitted:
                emitted.add(key)
                chunks.append(rec)
                size += len(rec)
        dur = rng.lognormvariate(3.0, 0.8) * 1e6
        calls = []
        off = 0
        tpl = templates[e]
        for j in range(calls_per_request):
            kind, system, fid, sid, site = tpl[j % len(tpl)]
            cdur = int(dur / (calls_per_request * 2) * rng.random())
            call: dict[str, Any] = {
                "kind": kind,
                "system": system,
                "fp": fid,
                "off": off,
                "dur": cdur,
                "stack": sid,
                "site": site,
            }
            if kind == "db":
                call["rows"] = rng.randint(0, 50)
                call["ph"] = rng.getrandbits(62)
            elif kind == "http":
                call["status"] = 200
                call["host"] = "api.example.com"
            else:
                call["hit"] = rng.random() < 0.8
            off += cdur
            calls.append(call)
        body = {
            "id": f"{rng.getrandbits(64):016x}",
            "ts": start_ns + i * 3_600 * 10**9 // max(1, n_requests),
            "dur": int(dur),
            "kind": "web",
            "method": "GET",
            "endpoint": endpoints[e],
            "path": f"/api/v1/resource{e}/{i}",
            "status": 500 if rng.random() < 0.01 else 200,
            "calls": calls,
            "user": f"user{rng.randint(0, 4999)}",
            "tenant": f"tenant{rng.randint(0, 49)}",
            "cpu_ns": int(dur * 0.3),
        }
        rec = encode_record(REQUEST, body)
        chunks.append(rec)
        size += len(rec)
        if size >= SEGMENT_BYTES:
            close_segment()
            new_segment()
    close_segment()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--dir", default=None, help="data dir to use (default: a temporary one)")
    args = ap.parse_args()
    data_dir = args.dir or tempfile.mkdtemp(prefix="perfsleuth-bench-")
    try:
        t0 = time.perf_counter()
        spool_bytes = write_spool(data_dir, args.requests, args.calls)
        print(
            f"spool: {args.requests:,} requests x {args.calls} calls, "
            f"{spool_bytes / 1e6:.1f} MB, written in {time.perf_counter() - t0:.1f} s"
        )
        store = DuckDBStore(data_dir)
        t0 = time.perf_counter()
        rep = store.ingest()
        dt = time.perf_counter() - t0
        print(
            f"ingest: {rep.requests:,} requests, {rep.calls:,} calls in {dt:.2f} s = "
            f"{rep.requests / dt:,.0f} requests/s, {rep.calls / dt:,.0f} calls/s, "
            f"{spool_bytes / dt / 1e6:.1f} MB/s of spool"
        )
        store.close()
        db_bytes = os.path.getsize(os.path.join(data_dir, "perfsleuth.duckdb"))
        print(
            f"database: {db_bytes / 1e6:.1f} MB, {db_bytes / max(1, rep.requests):.0f} bytes "
            "per request with its calls"
        )
        store = DuckDBStore(data_dir, read_only=True)
        for label, fn in (
            ("top by endpoint", lambda: store.top()),
            ("top by endpoint x user", lambda: store.top(by=("endpoint", "user"))),
            ("top since 30 min", lambda: store.top(since=timedelta(minutes=30))),
            ("traces slowest 20", lambda: store.traces(slowest=20)),
        ):
            fn()  # warm
            t0 = time.perf_counter()
            rows = fn()
            print(f"{label}: {(time.perf_counter() - t0) * 1000:.0f} ms ({len(rows)} rows)")
        tid = store.traces(limit=1)[0]["trace_id"]
        t0 = time.perf_counter()
        store.trace(tid)
        print(f"trace by id: {(time.perf_counter() - t0) * 1000:.0f} ms")
        store.close()
    finally:
        if args.dir is None:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
