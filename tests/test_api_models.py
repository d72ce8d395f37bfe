"""The API's typed replies: every reply of the demo's data validates against its model in
perfsleuth.server.models (no key the model does not declare, no null where it says a value),
the OpenAPI schema names those models, and web/src/api.gen.ts (the UI's types) is what
scripts/openapi_ts.py makes of that schema."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from perfsleuth.server import create_app, models

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "openapi_ts.py"
N1 = "GET /customers/{customer_id}/orders"


@pytest.fixture(scope="module")
def client(demo_data: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    d = str(tmp_path_factory.mktemp("models") / "data")
    shutil.copytree(demo_data, d)
    with TestClient(create_app(d, ingest_every=0)) as c:
        yield c


def valid(model: Any, body: Any) -> Any:
    """``body`` validated strictly as JSON against ``model`` (ValidationError otherwise): JSON
    mode, where a string is a valid datetime but never a valid number, and no type coerces."""
    return TypeAdapter(model).validate_json(json.dumps(body), strict=True)


def get(client: TestClient, path: str, **params: Any) -> Any:
    r = client.get(path, params=params)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_every_reply_matches_its_model(client: TestClient) -> None:
    spec = get(client, "/api/openapi.json")
    checked: set[str] = set()

    def check(path: str, route: str | None = None, **params: Any) -> Any:
        op = spec["paths"][route or path]["get"]
        ref = op["responses"]["200"]["content"]["application/json"]["schema"]
        model = _model_of(ref)
        body = get(client, path, **params)
        valid(model, body)
        checked.add(route or path)
        return body

    check("/api/status")
    check("/api/fleet", since="all")
    ov = check("/api/overview", since="all")
    assert ov["endpoints"], "the demo's data has requests"
    check("/api/endpoints", since="all")
    check("/api/endpoint", name=N1, since="all")
    check("/api/calltree", endpoint=N1, since="all")
    for row in ov["endpoints"]:
        prof = check("/api/profile", endpoint=row["endpoint"], since="all")
        if prof["samples"]:
            break
    assert prof["samples"], "some endpoint's slow requests were sampled"
    traces = check("/api/traces", since="all", limit=1000)
    kinds: set[str] = set()
    for t in traces:
        full = check(f"/api/traces/{t['trace_id']}", "/api/traces/{trace_id}")
        kinds.update(k for k in ("calls", "stack_samples", "blocker_events", "replay") if full[k])
    # The demo has requests with each part the trace model describes.
    assert kinds == {"calls", "stack_samples", "blocker_events", "replay"}
    found = check("/api/findings", since="all")
    assert found
    check(f"/api/findings/{found[0]['id']}", "/api/findings/{finding_id}", since="all")
    check("/api/compare", a="last-24h", b="last-1h")
    check("/api/compare/values", by="release")
    check("/api/startup")
    check("/api/load")
    r = client.post("/api/sql", json={"query": "SELECT 1 AS a, 'x' AS b"})
    assert r.status_code == 200
    valid(models.SqlResult, r.json())
    untyped = {"/api/startup/{name}", "/api/load/{name}", "/api/traces/{trace_id}/curl"}
    gets = {p for p, ops in spec["paths"].items() if "get" in ops and p.startswith("/api/")}
    assert gets - untyped - checked == set(), "a GET route with a model is not checked here"


def _model_of(ref: dict[str, Any]) -> Any:
    if "$ref" in ref:
        return getattr(models, ref["$ref"].rsplit("/", 1)[-1])
    assert ref.get("type") == "array", ref
    return list[_model_of(ref["items"])]  # type: ignore[misc]


def test_a_key_the_model_does_not_declare_is_refused() -> None:
    """What makes the test above able to fail: the models forbid unknown keys and nulls where
    they say a value."""
    row = {"value": "v1", "requests": 3, "first": None}
    valid(list[models.CompareValue], [row])
    with pytest.raises(ValueError, match="extra"):
        valid(list[models.CompareValue], [{**row, "last": None}])
    with pytest.raises(ValueError, match="requests"):
        valid(list[models.CompareValue], [{**row, "requests": None}])


def test_errors_are_described_as_the_api_answers_them(client: TestClient) -> None:
    spec = get(client, "/api/openapi.json")
    op = spec["paths"]["/api/endpoint"]["get"]
    assert "422" not in op["responses"]
    assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ApiErrorBody"
    }
    r = client.get("/api/endpoint", params={"name": "GET /nope", "since": "all"})
    assert r.status_code == 404
    valid(models.ApiErrorBody, r.json())


def test_the_ui_types_are_generated_from_the_schema(tmp_path: Path) -> None:
    """web/src/api.gen.ts is what the generator makes of the schema; a stale file fails the
    check (and so `make lint`) with a diff."""
    run = [sys.executable, str(SCRIPT), "--check"]
    r = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    stale = tmp_path / "api.gen.ts"
    text = (ROOT / "web" / "src" / "api.gen.ts").read_text(encoding="utf-8")
    assert "export interface Trace {" in text and "export interface GetReplies {" in text
    stale.write_text(text.replace("  time_share: number;\n", ""), encoding="utf-8")
    r = subprocess.run([*run, "--out", str(stale)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "+  time_share: number;" in r.stdout and "does not match" in r.stderr
