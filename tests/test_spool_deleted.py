"""A spool directory deleted under a running agent (a clean-up job, an operator's rm -rf): what
was written to the deleted segment is counted as lost, not as written, and the agent goes on in
a new segment (issue 17 item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from perfsleuth.store.duckdb_store import DuckDBStore

APP = textwrap.dedent(
    """
    import glob, json, os, shutil, sys
    import perfsleuth.agent as ps
    from perfsleuth.agent import recorder

    data = sys.argv[1]
    ps.start(data, service="gone", segment_seconds=600)

    def serve(n, prefix):
        for i in range(n):
            req = recorder.begin("web", "GET", "/%s/%d" % (prefix, i))
            req.endpoint = "GET /%s/{i}" % prefix
            req.status = 200
            recorder.end(req)
        ps.flush()

    serve(7, "before")
    assert len(glob.glob(os.path.join(data, "spool", "*.open"))) == 1
    shutil.rmtree(os.path.join(data, "spool"))  # the 7 requests go with it
    serve(5, "after")
    print(json.dumps(ps.stats()))
    """
)


def test_a_deleted_spool_counts_its_requests_lost_and_the_agent_goes_on(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSLEUTH_")}
    out = subprocess.run([sys.executable, "-c", APP, str(data)], capture_output=True, text=True,
                         env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["dropped_spool_deleted"] == 7
    assert stats["requests_written"] == 5
    with DuckDBStore(str(data)) as store:
        store.ingest()
        rows = store.query("SELECT endpoint, count(*) AS n FROM requests GROUP BY 1")
        drops = store.agent_drops()
    assert {r["endpoint"]: r["n"] for r in rows} == {"GET /after/{i}": 5}
    assert drops["dropped_spool_deleted"] == 7 and drops["requests_written"] == 5
