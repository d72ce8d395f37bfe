"""Where the zoo's services are. The harness passes them to the apps it launches as ``ZOO_*``
variables; the defaults are the test suite's (tests/conftest.py), repeated here because the
apps and ``benchmarks/accuracy.py`` run without pytest's conftest."""

from __future__ import annotations

import os

PG_DSN = os.environ.get(
    "ZOO_PG_DSN",
    os.environ.get("PERFSLEUTH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test"),
)
REDIS_URL = os.environ.get(
    "ZOO_REDIS_URL", os.environ.get("PERFSLEUTH_TEST_REDIS", "redis://127.0.0.1:6379/0")
)
# The fake upstream service (zoo.upstream), started by the harness.
UPSTREAM = os.environ.get("ZOO_UPSTREAM", "http://127.0.0.1:8898")
