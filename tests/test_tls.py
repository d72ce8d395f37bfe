"""HTTPS to the collector (issue 19): ``perfsleuth server --tls-cert/--tls-key`` serves the
fleet over TLS, and the agent's forwarder (``PERFSLEUTH_COLLECTOR=https://...``) verifies the
certificate, against ``PERFSLEUTH_CA_FILE`` when set. Real processes, a real CA and server
certificate made by the ``openssl`` command in the test.
"""

from __future__ import annotations

import http.client
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_fleet import INGEST_TOKEN, PY, Fleet, spool_files

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def make_ca(tmp: Path, name: str) -> tuple[Path, Path]:
    """A CA certificate and key: (ca.pem, ca.key)."""
    pem, key = tmp / f"{name}.pem", tmp / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(pem), "-days", "2",
         "-subj", f"/CN=perfsleuth test {name}",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        check=True, capture_output=True,
    )  # fmt: skip
    return pem, key


def make_server_cert(
    tmp: Path, ca: tuple[Path, Path], names: str = "IP:127.0.0.1,DNS:localhost"
) -> tuple[Path, Path]:
    """A certificate for ``names`` (127.0.0.1 and localhost) signed by ``ca``: (cert.pem,
    cert.key)."""
    cert, key, csr, ext = (tmp / n for n in ("server.pem", "server.key", "server.csr", "ext"))
    ext.write_text(
        f"subjectAltName={names}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    subprocess.run(
        ["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


class TlsFleet(Fleet):
    """The fleet of test_fleet with the server behind TLS."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.ca = make_ca(tmp, "ca")
        self.cert = make_server_cert(tmp, self.ca)

    def start_server(self) -> None:
        import subprocess as sp

        log = open(self.tmp / "server.log", "ab")  # noqa: SIM115 - the child writes it
        self.server = sp.Popen(
            [PY, "-m", "perfsleuth", "server", "--data", str(self.data),
             "--port", str(self.port), "--tokens", str(self.tokens),
             "--tls-cert", str(self.cert[0]), "--tls-key", str(self.cert[1])],
            stdout=log, stderr=sp.STDOUT,
        )  # fmt: skip
        from test_fleet import wait_port

        wait_port(self.port, self.server, "perfsleuth server")

    def call(
        self, method: str, path: str, token: str | None, body: bytes | str | None = None
    ) -> tuple[int, bytes]:
        ctx = ssl.create_default_context(cafile=str(self.ca[0]))
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=30, context=ctx)
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def start_tls_agent(self, host: str, **env: str) -> None:
        self.start_agent(
            host, INGEST_TOKEN, PERFSLEUTH_COLLECTOR=f"https://127.0.0.1:{self.port}", **env
        )


@pytest.fixture
def tls_fleet(tmp_path: Path) -> Iterator[TlsFleet]:
    f = TlsFleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


def test_the_server_speaks_https_only_and_says_so(tls_fleet: TlsFleet) -> None:
    tls_fleet.start_server()
    assert tls_fleet.call("GET", "/api/status", INGEST_TOKEN)[0] == 403  # TLS, then the token
    plain = http.client.HTTPConnection("127.0.0.1", tls_fleet.port, timeout=10)
    with pytest.raises((http.client.HTTPException, OSError)):
        plain.request("GET", "/api/status")
        plain.getresponse().read()
    plain.close()
    log = (tls_fleet.tmp / "server.log").read_text()
    assert f"PERFSLEUTH_COLLECTOR=https://127.0.0.1:{tls_fleet.port}" in log


def test_an_agent_ships_over_https_trusting_its_ca_file(tls_fleet: TlsFleet) -> None:
    tls_fleet.start_server()
    tls_fleet.start_tls_agent("h_tls", PERFSLEUTH_CA_FILE=str(tls_fleet.ca[0]))
    tls_fleet.send("h_tls", 30)
    assert tls_fleet.wait_stored({"h_tls": 30}) == {"h_tls": (30, 30)}
    assert tls_fleet.status("h_tls").get("last_error", "") == ""


def test_an_untrusted_certificate_is_said_while_retrying_and_the_spool_buffers(
    tls_fleet: TlsFleet,
) -> None:
    """Without the CA (the system's CAs do not know it), then with a CA that did not sign the
    certificate: each time the status says why while the agent retries and keeps its spool;
    with the right CA the backlog drains, every request stored once."""
    tls_fleet.start_server()
    env = {"SSL_CERT_FILE": "", "SSL_CERT_DIR": ""}
    tls_fleet.start_tls_agent("h_tls", **env)
    tls_fleet.send("h_tls", 20)

    def untrusted(st: dict[str, Any]) -> bool:
        return "certificate is not trusted" in st.get("last_error", "") and (
            st.get("forward_errors", 0) >= 2  # retried, still said
        )

    st = tls_fleet.wait_status("h_tls", untrusted, "no untrusted certificate said")
    assert "set PERFSLEUTH_CA_FILE" in st["last_error"], st["last_error"]
    assert "certificate" in st["last_error"] and f"{tls_fleet.port}" in st["last_error"]
    assert tls_fleet.stored() == {}
    assert spool_files(tls_fleet.agents["h_tls"][2]), "it keeps buffering"
    tls_fleet.stop_agent("h_tls")

    other = make_ca(tls_fleet.tmp, "other_ca")
    tls_fleet.start_tls_agent("h_tls", PERFSLEUTH_CA_FILE=str(other[0]), **env)
    tls_fleet.send("h_tls", 5)
    st = tls_fleet.wait_status("h_tls", untrusted, "no untrusted certificate said")
    assert f"PERFSLEUTH_CA_FILE {other[0]} did not sign it" in st["last_error"]
    assert tls_fleet.stored() == {}
    tls_fleet.stop_agent("h_tls")

    tls_fleet.start_tls_agent("h_tls", PERFSLEUTH_CA_FILE=str(tls_fleet.ca[0]), **env)
    tls_fleet.send("h_tls", 5)
    assert tls_fleet.wait_stored({"h_tls": 30}) == {"h_tls": (30, 30)}
    assert tls_fleet.status("h_tls").get("last_error", "") == ""


def test_an_unreadable_ca_file_is_said_and_nothing_is_sent(tls_fleet: TlsFleet) -> None:
    tls_fleet.start_server()
    missing = tls_fleet.tmp / "no-such-ca.pem"
    tls_fleet.start_tls_agent("h_tls", PERFSLEUTH_CA_FILE=str(missing))
    tls_fleet.send("h_tls", 3)
    st = tls_fleet.wait_status(
        "h_tls", lambda s: "cannot load it" in s.get("last_error", ""), "no CA file error said"
    )
    assert f"PERFSLEUTH_CA_FILE {missing}" in st["last_error"]
    assert tls_fleet.stored() == {}


def test_a_certificate_for_another_name_is_not_called_a_ca_problem(tls_fleet: TlsFleet) -> None:
    """A certificate the trusted CA signed, but for another host name: the status names the
    mismatch, not PERFSLEUTH_CA_FILE (which would not fix it)."""
    tls_fleet.cert = make_server_cert(tls_fleet.tmp, tls_fleet.ca, "DNS:collector.example")
    tls_fleet.start_server()
    tls_fleet.start_tls_agent("h_tls", PERFSLEUTH_CA_FILE=str(tls_fleet.ca[0]))
    tls_fleet.send("h_tls", 3)
    st = tls_fleet.wait_status(
        "h_tls", lambda s: s.get("last_error", ""), "no certificate problem said"
    )
    said = st["last_error"]
    assert "does not name 127.0.0.1" in said and "mismatch" in said, said
    assert "PERFSLEUTH_CA_FILE" not in said and "not trusted" not in said, said
    assert spool_files(tls_fleet.agents["h_tls"][2]), "it keeps buffering"
