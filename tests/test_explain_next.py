"""``perfsleuth explain`` ends with where to dig next: the call-site tree of the finding's own
calls (issue 15 item 11: an HTTP finding suggested ``calltree --kind db``). Requests written
with the real wire encoder (tests/spoolwrite.py) and ingested by the real store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from spoolwrite import SegmentWriter, call


def perfsleuth(data: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "perfsleuth", *args, "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_explain_of_an_http_finding_suggests_the_http_call_tree(tmp_path: Path) -> None:
    data = tmp_path / "data"
    w = SegmentWriter(str(data))
    for i in range(20):
        wait = 400.0 if i % 2 else 100.0
        quote = call(
            "http",
            "GET carrier.example:443/v1/quotes/{id}",
            dur_ms=wait,
            host="carrier.example:443",
            status=200,
            site=("app/shipping.py", 30, "shipping_quote"),
        )
        w.request("GET /quote", dur_ms=wait + 10, calls=[quote])
    w.close()
    found = json.loads(perfsleuth(data, "findings", "--json"))
    assert [(f["kind"], f["endpoint"]) for f in found] == [("upstream_latency", "GET /quote")]
    assert found[0]["callsite"]["function"] == "shipping_quote"
    out = perfsleuth(data, "explain", found[0]["id"], "--no-ingest")
    assert "perfsleuth calltree 'GET /quote' --kind http" in out, out
    # and the tree it points at has the calls
    tree = json.loads(perfsleuth(data, "calltree", "GET /quote", "--kind", "http", "--json"))
    assert tree["calls"] == 20
