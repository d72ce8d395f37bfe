"""One rule for "unknown endpoint ...; did you mean ...?" (perfsleuth.suggest), used by the
API and the CLI on a real store."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from perfsleuth.server import queries
from perfsleuth.suggest import close_names, did_you_mean

KNOWN = ["GET /customers/{id}/orders", "GET /customers/{id}", "GET /items", "POST /orders"]


def test_the_rule() -> None:
    # names containing the given one first (case-insensitive), in the order known
    assert close_names("get /customers", KNOWN) == KNOWN[:2]
    assert close_names("GET /item", KNOWN) == ["GET /items"]
    # then difflib's closest, at CUTOFF or more alike
    assert close_names("GET /custmers/{id}", KNOWN)[0] == "GET /customers/{id}"
    assert close_names("DELETE /zzz", KNOWN) == []
    assert close_names("GET /customers", KNOWN, n=1) == ["GET /customers/{id}/orders"]
    assert did_you_mean("GET /item", KNOWN) == "; did you mean 'GET /items'?"
    assert did_you_mean("zzz", KNOWN) == did_you_mean("", KNOWN) == ""


@pytest.fixture
def store(synth: Callable[..., Any]) -> Any:
    return synth(lambda w: [w.request(e) for e in KNOWN])


def test_the_api_and_the_cli_say_the_same(store: Any) -> None:
    assert sorted(store.endpoints()) == sorted(KNOWN)
    with pytest.raises(queries.NotFound) as api:
        queries.check_endpoint(store, "GET /customer/{id}/orders")
    hint = did_you_mean("GET /customer/{id}/orders", KNOWN)
    assert hint.startswith("; did you mean 'GET /customers/{id}/orders'")
    assert str(api.value) == f"unknown endpoint 'GET /customer/{{id}}/orders'{hint}"
    store.close()
    bad = "GET /customer/{id}/orders"
    r = subprocess.run(
        [sys.executable, "-m", "perfsleuth", "traces", "-e", bad, "--data", store.data_dir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert hint in r.stderr
