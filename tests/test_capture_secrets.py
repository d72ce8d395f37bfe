"""Captures keep no secrets by default: headers whose names say token, secret, key, auth,
session, password, csrf or credential; query-string parameters and urlencoded form fields of
such names (issue 17 item 10). PERFSLEUTH_CAPTURE_SECRETS=1 keeps them. A real Flask app
under gunicorn and `perfsleuth run`; the capture read back from the store."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from test_replay import NO_SAMPLE, wait_for_captures
from test_run_servers import gunicorn, launched

SECRETS = ("CSRFSECRET", "AMZSECRET", "APIKEYSECRET", "SESSIONSECRET", "QSECRET", "PWSECRET")
HEADERS = {
    "X-CSRF-Token": "CSRFSECRET",
    "X-Amz-Security-Token": "AMZSECRET",
    "Api-Key": "APIKEYSECRET",
    "X-Session-Id": "SESSIONSECRET",
    "X-Request-Color": "blue",
    "Content-Type": "application/x-www-form-urlencoded",
}
FORM = "name=O%27Brien&password=PWSECRET&note=caf%C3%A9"


@pytest.mark.parametrize("keep", ["0", "1"])
def test_secret_headers_query_parameters_and_form_fields_are_redacted(
    tmp_path: Path, keep: str
) -> None:
    data = tmp_path / "data"
    with launched(tmp_path, data, gunicorn("replay_app:flask_app", 1), service="sec",
                  ready="/fast", PERFSLEUTH_CAPTURE_SECRETS=keep, **NO_SAMPLE) as srv:  # fmt: skip
        status, _ = srv.request(
            "POST", "/form?access_token=QSECRET&page=2", body=FORM.encode(), headers=HEADERS
        )
        assert status == 200
        cap = wait_for_captures(data, 1)["POST /form"]
    body = base64.b64decode(cap["body_b64"]).decode()
    text = json.dumps(cap) + body
    headers = dict(json.loads(cap["headers"]))
    assert headers["x-request-color"] == "blue"
    if keep == "1":
        assert all(s in text for s in SECRETS)
        return
    assert not [s for s in SECRETS if s in text], text
    assert {headers[h] for h in ("x-csrf-token", "x-amz-security-token", "api-key",
                                 "x-session-id")} == {"[redacted]"}  # fmt: skip
    assert "page=2" in cap["url"] and "access_token=%5Bredacted%5D" in cap["url"]
    assert "name=O%27Brien" in body and "note=caf%C3%A9" in body
    assert "password=%5Bredacted%5D" in body
    redacted = cap["redacted"].split(",")
    assert {"query:access_token", "form:password", "x-csrf-token", "api-key"} <= set(redacted)
    assert cap["body_size"] == len(FORM)  # the size sent, not the redacted body's
