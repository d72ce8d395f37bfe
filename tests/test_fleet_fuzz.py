"""Fuzzed chunks against the collector's segment ingest (``POST /api/ingest/segment``): no
5xx, the server keeps answering, and garbage stores no request. Seeded; the real app (its
store, its ingest) in-process through Starlette's test client."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

from fastapi.testclient import TestClient

from perfsleuth.server import create_app
from perfsleuth.wire import REQUESTS
from perfsleuth.wire.segment import FILE_MAGIC, encode_payload

CASES = 2000


def chunk(rng: random.Random) -> bytes:
    pick = rng.random()
    if pick < 0.3:
        return rng.randbytes(rng.randint(0, 300))
    if pick < 0.6:  # a valid start, then damage
        return FILE_MAGIC + rng.randbytes(rng.randint(0, 200))
    if pick < 0.8:  # well-framed records with hostile payloads
        return FILE_MAGIC + encode_payload(REQUESTS, rng.randbytes(rng.randint(0, 100)))
    return FILE_MAGIC[: rng.randint(0, len(FILE_MAGIC))]


def test_fuzzed_chunks_never_5xx(tmp_path: Path) -> None:
    rng = random.Random(19)
    app = create_app(str(tmp_path / "data"), ingest_every=0.2)
    agents = ["a", "host_x", "../x", "", "a" * 80, "h.1"]
    statuses: dict[int, int] = {}
    with TestClient(app) as client:
        for i in range(CASES):
            body = chunk(rng)
            headers = {}
            enc = rng.random()
            if enc < 0.3:
                body = gzip.compress(body)
                if rng.random() < 0.3:
                    body = body[: rng.randint(0, len(body))]  # truncated
                headers["Content-Encoding"] = "gzip"
            elif enc < 0.35:
                headers["Content-Encoding"] = rng.choice(["br", "deflate", "x"])
            seg = rng.choice([f"h-{i % 7}-{i % 3}-1", "bad", "h-1-2", f"h-1-2-{10**12}"])
            params: dict[str, str] = {
                "agent": rng.choice(agents),
                "segment": seg,
                "offset": str(rng.choice([0, 0, 8, rng.randint(-5, 400), 10**19])),
                "final": str(rng.choice([0, 1, 2])),
            }
            if rng.random() < 0.05:
                params.pop(rng.choice(list(params)))
            r = client.post("/api/ingest/segment", params=params, content=body, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (params, r.text)
        assert client.get("/api/status").status_code == 200
        app.state.backend.ingest_once()
        r = client.post("/api/sql", json={"query": "SELECT count(*) FROM requests"})
        assert r.status_code == 200, r.text
        assert r.json()["rows"] == [[0]]
    # Both accepted and refused chunks were exercised.
    assert statuses.get(200, 0) > 0
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 0
