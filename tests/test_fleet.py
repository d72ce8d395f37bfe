"""Fleet (issue 19 items 1-2): remote agents store and forward their spools to one
``perfsleuth server``. Real processes throughout: the server, and small WSGI apps under the
agent on their own ports (standing in for hosts, each with its own spool and PERFSLEUTH_HOST).

Every request sent to an app has a unique path, so "exactly once" is checked as: the server's
store holds each path once and as many as were sent (less what the agents say they dropped).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

PY = sys.executable
INGEST_TOKEN = "ingest-token-aaaaaaaaaaaaaaaa"
READ_TOKEN = "read-token-rrrrrrrrrrrrrrrrrrrr"
WRONG_TOKEN = "wrong-token-wwwwwwwwwwwwwwwwww"
OTLP_TOKEN = "otlp-token-oooooooooooooooooooo"
DEADLINE = 120.0

APP = """
import sqlite3, sys
import perfsleuth.agent as ps
ps.start()
from wsgiref.simple_server import make_server, WSGIRequestHandler

class Quiet(WSGIRequestHandler):
    def log_message(self, *a):
        pass

def app(environ, start_response):
    con = sqlite3.connect(":memory:")
    for i in range(3):
        con.execute("select ?", (i,)).fetchall()
    con.close()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]

srv = make_server("127.0.0.1", int(sys.argv[1]), ps.wsgi(app), handler_class=Quiet)
srv.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{what} did not listen on {port}")


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.data = tmp / "server"
        self.tokens = tmp / "tokens"
        self.tokens.write_text(
            f"# name kind token\nteam_a ingest {INGEST_TOKEN}\nui read {READ_TOKEN}\n"
            f"team_otlp ingest {OTLP_TOKEN}\n"
        )
        (tmp / "app.py").write_text(APP)
        self.server: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, tuple[subprocess.Popen[bytes], int, Path]] = {}
        self.sent: dict[str, int] = {}

    # -------------------------------------------------------------------- server

    def start_server(self) -> None:
        log = open(self.tmp / "server.log", "ab")  # noqa: SIM115 - the child writes it
        self.server = subprocess.Popen(
            [
                PY,
                "-m",
                "perfsleuth",
                "server",
                "--data",
                str(self.data),
                "--port",
                str(self.port),
                "--tokens",
                str(self.tokens),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_port(self.port, self.server, "perfsleuth server")

    def kill_server(self, sig: int = signal.SIGKILL) -> None:
        assert self.server is not None
        self.server.send_signal(sig)
        self.server.wait(timeout=60)
        self.server = None

    def sql(self, query: str) -> list[list[Any]]:
        status, body = self.call("POST", "/api/sql", READ_TOKEN, json.dumps({"query": query}))
        assert status == 200, body
        rows: list[list[Any]] = json.loads(body)["rows"]
        return rows

    def call(
        self, method: str, path: str, token: str | None, body: bytes | str | None = None
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def stored(self) -> dict[str, tuple[int, int]]:
        """host -> (request rows, distinct paths) in the server's store."""
        rows = self.sql(
            "SELECT host, count(*), count(DISTINCT path) FROM requests "
            "WHERE path LIKE '/r/%' GROUP BY host"
        )
        return {h: (int(n), int(d)) for h, n, d in rows}

    # -------------------------------------------------------------------- agents

    def start_agent(self, host: str, token: str = INGEST_TOKEN, **env: str) -> None:
        port = self.agents[host][1] if host in self.agents else free_port()
        data = self.tmp / f"agent-{host}"
        e = dict(os.environ)
        e.update(
            PERFSLEUTH_DATA=str(data),
            PERFSLEUTH_COLLECTOR=f"http://127.0.0.1:{self.port}",
            PERFSLEUTH_TOKEN=token,
            PERFSLEUTH_HOST=host,
            PERFSLEUTH_SERVICE=f"svc_{host}",
            PERFSLEUTH_SEGMENT_SECONDS="1",
            PERFSLEUTH_CAPTURE="0",
            PERFSLEUTH_EVIDENCE="0",
        )
        e.update(env)
        log = open(self.tmp / f"agent-{host}.log", "ab")  # noqa: SIM115 - the child writes it
        proc = subprocess.Popen(
            [PY, str(self.tmp / "app.py"), str(port)], env=e, stdout=log, stderr=subprocess.STDOUT
        )
        wait_port(port, proc, f"agent {host}")
        self.agents[host] = (proc, port, data)

    def stop_agent(self, host: str) -> None:
        proc = self.agents[host][0]
        proc.terminate()
        proc.wait(timeout=30)

    def send(self, host: str, n: int) -> None:
        _, port, _ = self.agents[host]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        start = self.sent.get(host, 0)
        for i in range(start, start + n):
            conn.request("GET", f"/r/{host}/{i}")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            conn.close()
        self.sent[host] = start + n

    def status(self, host: str) -> dict[str, Any]:
        """The agent process's status file (its counters, last_error)."""
        proc, _, data = self.agents[host]
        path = data / "agents"
        files = [p for p in path.glob("*.json") if p.name.endswith(f"-{proc.pid}.json")]
        if not files:
            return {}
        try:
            got: dict[str, Any] = json.loads(files[0].read_text())
            return got
        except ValueError:
            return {}

    def wait_status(self, host: str, pred: Any, what: str) -> dict[str, Any]:
        end = time.monotonic() + DEADLINE
        st: dict[str, Any] = {}
        while time.monotonic() < end:
            st = self.status(host)
            if st and pred(st):
                return st
            time.sleep(0.3)
        raise AssertionError(f"{host}: {what}; status: {st}")

    def wait_stored(self, expect: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Poll until the store holds ``expect`` requests per host (or the deadline), then
        a few ingest rounds more, so that a late double would show."""
        end = time.monotonic() + DEADLINE
        got: dict[str, tuple[int, int]] = {}
        while time.monotonic() < end:
            got = self.stored()
            if all(got.get(h, (0, 0))[0] >= n for h, n in expect.items()):
                break
            time.sleep(0.5)
        time.sleep(3)
        return self.stored()

    def close(self) -> None:
        for proc, _, _ in self.agents.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
            self.server.wait()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


def spool_files(data: Path) -> list[Path]:
    return [p for p in (data / "spool").iterdir() if p.suffix in (".seg", ".open")]


def test_three_agents_exactly_once_across_outage_and_kill(fleet: Fleet) -> None:
    hosts = ["host_a", "host_b", "host_c"]
    # The collector is down when the agents start: they buffer.
    for h in hosts:
        fleet.start_agent(h)
    for h in hosts:
        fleet.send(h, 40)
    st = fleet.wait_status("host_a", lambda s: s.get("forward_errors", 0) > 0, "no send error")
    assert st["forward_segments_sent"] == 0
    assert spool_files(fleet.agents["host_a"][2]), "the spool buffers while the server is down"

    fleet.start_server()
    got = fleet.wait_stored({h: 40 for h in hosts})
    assert got == {h: (40, 40) for h in hosts}, "the backlog drained once"

    # Killed with -9 while agents send and the server ingests, then restarted.
    for h in hosts:
        fleet.send(h, 30)
    fleet.kill_server()
    for h in hosts:
        fleet.send(h, 30)
    fleet.start_server()
    for h in hosts:
        fleet.send(h, 20)
    got = fleet.wait_stored({h: 120 for h in hosts})
    assert got == {h: (120, 120) for h in hosts}

    # An agent killed with -9 that forgot what was acknowledged sends its open segment again
    # from the start: the server acknowledges what it holds and stores only the rest.
    fleet.send("host_a", 10)
    fleet.wait_status("host_a", lambda s: s.get("requests_written", 0) >= 130, "not written")
    fleet.agents["host_a"][0].kill()
    fleet.agents["host_a"][0].wait()
    (fleet.agents["host_a"][2] / "spool" / "forward.json").unlink()
    fleet.start_agent("host_a")
    expect = {"host_a": 130, "host_b": 120, "host_c": 120}
    got = fleet.wait_stored(expect)
    assert got == {h: (n, n) for h, n in expect.items()}

    # The origin of the rows: the token's name per segment received.
    tokens = fleet.sql("SELECT DISTINCT token, host FROM segments_received ORDER BY host")
    assert tokens == [["team_a", h] for h in hosts]
    # README's origin query: every request once, with the token that sent it.
    origin = fleet.sql(
        f"SELECT count(*), count(DISTINCT trace_id), min(token), max(token) "
        f"FROM ({readme_origin_query()})"
    )
    assert origin == [[370, 370, "team_a", "team_a"]]
    # Agents delete what the collector holds completely.
    for h in hosts:
        fleet.wait_status(h, lambda s: s.get("forward_segments_sent", 0) > 0, "nothing sent")

    # top --by host on the server's data counts every request once.
    fleet.kill_server(signal.SIGTERM)
    out = subprocess.run(
        [PY, "-m", "perfsleuth", "top", "--data", str(fleet.data), "--by", "host", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["host"]: r["count"] for r in json.loads(out.stdout)["rows"]}
    assert rows == expect


def test_wrong_token_buffers_then_right_token_drains(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_agent("host_w", token=WRONG_TOKEN)
    fleet.send("host_w", 50)
    st = fleet.wait_status(
        "host_w", lambda s: "refused the token" in s.get("last_error", ""), "no refusal said"
    )
    assert "403" in st["last_error"]
    assert st["forward_auth_errors"] >= 1
    assert fleet.stored() == {}
    assert spool_files(fleet.agents["host_w"][2]), "it keeps buffering"

    fleet.stop_agent("host_w")
    fleet.start_agent("host_w", token=INGEST_TOKEN)
    fleet.send("host_w", 10)
    assert fleet.wait_stored({"host_w": 60}) == {"host_w": (60, 60)}
    st = fleet.status("host_w")
    assert "refused" not in st.get("last_error", "")


def test_spool_cap_drops_oldest_and_counts(fleet: Fleet) -> None:
    cap = 40_000
    fleet.start_agent(
        "host_cap", PERFSLEUTH_SPOOL_MAX_BYTES=str(cap), PERFSLEUTH_SEGMENT_SECONDS="0.3"
    )
    for _ in range(12):
        fleet.send("host_cap", 50)
        time.sleep(0.4)  # segments rotate: the oldest can go
    st = fleet.wait_status(
        "host_cap", lambda s: s.get("forward_dropped_segments", 0) > 0, "nothing dropped"
    )
    data = fleet.agents["host_cap"][2]
    st = fleet.wait_status(
        "host_cap",
        lambda s: sum(p.stat().st_size for p in spool_files(data)) <= cap,
        "spool over its cap",
    )
    fleet.start_server()
    sent = fleet.sent["host_cap"]

    def settled(s: dict[str, Any]) -> bool:
        n = fleet.stored().get("host_cap", (0, 0))[0]
        return n + s["dropped_spool_cap"] + s["dropped_spool_full"] >= sent

    st = fleet.wait_status("host_cap", settled, "not drained")
    got = fleet.wait_stored({"host_cap": sent - st["dropped_spool_cap"] - st["dropped_spool_full"]})
    st = fleet.status("host_cap")
    n, distinct = got["host_cap"]
    assert n == distinct
    assert st["dropped_spool_cap"] > 0
    assert n + st["dropped_spool_cap"] + st["dropped_spool_full"] == sent
    assert n < sent
    # The drop counters reach the collector's store too (a STATS record).
    query = (
        "SELECT max(value) FROM agent_stats WHERE name = 'dropped_spool_cap' AND host = 'host_cap'"
    )
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end and fleet.sql(query)[0][0] is None:
        time.sleep(0.5)
    assert int(fleet.sql(query)[0][0] or 0) > 0


def test_ingest_endpoint_idempotent_gap_and_token_kinds(fleet: Fleet) -> None:
    # A real segment: an agent that writes locally only.
    fleet.start_agent("host_local", PERFSLEUTH_COLLECTOR="")
    fleet.send("host_local", 25)
    fleet.stop_agent("host_local")
    segs = sorted((fleet.agents["host_local"][2] / "spool").glob("*.seg"))
    assert len(segs) == 1
    seg = segs[0]
    data = seg.read_bytes()
    base = seg.name[: -len(".seg")]
    fleet.start_server()
    url = f"/api/ingest/segment?agent=host_local&segment={base}"
    half = len(data) // 2

    def post(offset: int, chunk: bytes, final: int = 0, token: str = INGEST_TOKEN) -> Any:
        status, body = fleet.call("POST", f"{url}&offset={offset}&final={final}", token, chunk)
        return status, json.loads(body)

    assert post(0, data[:half], token=READ_TOKEN)[0] == 403  # a read token cannot send
    assert fleet.call("GET", "/api/status", INGEST_TOKEN)[0] == 403  # nor an ingest token read
    assert fleet.call("GET", "/api/status", None)[0] == 401
    status, reply = post(half + 10, data[half + 10 :])
    assert (status, reply["held"]) == (409, 0)  # a gap: told where to send from
    for _ in range(2):  # the second time: already held, acknowledged again
        status, reply = post(0, data[:half])
        assert (status, reply["held"], reply["complete"]) == (200, half, False)
    status, reply = post(0, data, final=1)  # overlaps what is held: only the rest is written
    assert (status, reply["held"], reply["complete"]) == (200, len(data), True)
    status, reply = post(0, data, final=1)  # sent twice: stored once
    assert (status, reply["held"], reply["complete"]) == (200, len(data), True)
    got = fleet.wait_stored({"host_local": 25})
    assert got == {"host_local": (25, 25)}
    status, reply = post(0, data, final=1)  # after the ingest removed the file: still once
    assert (status, reply["complete"]) == (200, True)
    time.sleep(3)
    assert fleet.stored() == {"host_local": (25, 25)}
    other = f"/api/ingest/segment?agent=host_local&segment={base}9&offset=0"
    assert fleet.call("POST", other, INGEST_TOKEN, b"garbage")[0] == 400  # not a segment
    bad = fleet.call("POST", "/api/ingest/segment?agent=x&segment=../y&offset=0", INGEST_TOKEN)
    assert bad[0] == 400
    # a chunk over the cap (16 MiB), streamed without a length: refused once past it
    conn = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=30)
    conn.putrequest("POST", f"{url}9&offset=0")
    conn.putheader("Authorization", f"Bearer {INGEST_TOKEN}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    mib = b"\0" * (1 << 20)
    try:
        for _ in range(17):
            conn.send(b"%x\r\n%s\r\n" % (len(mib), mib))
        conn.send(b"0\r\n\r\n")
    except OSError:
        pass  # refused mid-body: the answer is waiting
    resp = conn.getresponse()
    assert resp.status == 413, resp.read()
    assert b"over" in resp.read()
    conn.close()


def test_a_segment_the_collector_refuses_does_not_hold_back_the_rest(fleet: Fleet) -> None:
    spool = fleet.tmp / "agent-host_r" / "spool"
    spool.mkdir(parents=True)
    bogus = spool / "aaa_bogus-1-1-1.seg"  # sorts first: shipped first
    bogus.write_bytes(b"not a spool segment at all")
    fleet.start_server()
    fleet.start_agent("host_r")
    fleet.send("host_r", 10)
    assert fleet.wait_stored({"host_r": 10}) == {"host_r": (10, 10)}
    st = fleet.wait_status(
        "host_r", lambda s: s.get("forward_rejected_segments", 0) == 1, "not rejected"
    )
    assert "refused segment aaa_bogus-1-1-1" in st["last_error"]
    assert not bogus.exists()


WSGI_MODULE = """
import atexit
import io
import os
import sqlite3

import perfsleuth.agent as ps

def plain(environ, start_response):
    con = sqlite3.connect(":memory:")
    con.execute("select 1").fetchall()
    con.close()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]

app = ps.wsgi(plain)

def at_exit():  # a request at each process's exit (before the agent's own shutdown)
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": f"/r/exit-{os.getpid()}",
               "SERVER_NAME": "x", "SERVER_PORT": "1", "wsgi.input": io.BytesIO()}
    list(app(environ, lambda *a: None))

atexit.register(at_exit)
"""


def test_prefork_workers_ship_once(fleet: Fleet) -> None:
    """gunicorn with 3 workers under `perfsleuth run`: the processes share one spool, exactly
    one of them forwards it (a lock file elects it; the status files' counters say which),
    every request is stored once, and what the processes wrote at exit reaches the server."""
    (fleet.tmp / "fleet_wsgi.py").write_text(WSGI_MODULE)
    fleet.start_server()
    port = free_port()
    data = fleet.tmp / "agent-host_g"
    env = dict(os.environ)
    env.update(
        PERFSLEUTH_COLLECTOR=f"http://127.0.0.1:{fleet.port}",
        PERFSLEUTH_TOKEN=INGEST_TOKEN,
        PERFSLEUTH_HOST="host_g",
        PERFSLEUTH_SEGMENT_SECONDS="1",
        PERFSLEUTH_CAPTURE="0",
        PERFSLEUTH_EVIDENCE="0",
        PYTHONPATH=str(fleet.tmp),
    )
    log = open(fleet.tmp / "gunicorn.log", "ab")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "perfsleuth",
            "run",
            "--data",
            str(data),
            "--",
            str(Path(PY).parent / "gunicorn"),
            "-w",
            "3",
            "-b",
            f"127.0.0.1:{port}",
            "fleet_wsgi:app",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=fleet.tmp,
    )
    fleet.agents["host_g"] = (proc, port, data)
    try:
        wait_port(port, proc, "gunicorn")
        fleet.send("host_g", 90)
        assert fleet.wait_stored({"host_g": 90}) == {"host_g": (90, 90)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    statuses = [json.loads(p.read_text()) for p in (data / "agents").glob("*.json")]
    workers = [s for s in statuses if s.get("requests_written", 0) > 0]
    assert len(workers) >= 3, statuses  # each worker wrote (a request at exit at least)
    forwarders = [s["pid"] for s in statuses if s.get("forward_bytes_sent", 0) > 0]
    assert len(forwarders) == 1, statuses
    # One request per process at its exit: the elected process ships them at its own exit.
    assert fleet.wait_stored({"host_g": 90 + len(workers)}) == {
        "host_g": (90 + len(workers), 90 + len(workers))
    }


def test_a_short_server_token_names_the_servers_variable(tmp_path: Path) -> None:
    """``perfsleuth server --token`` reads PERFSLEUTH_SERVER_TOKEN (PERFSLEUTH_TOKEN is the
    agent's): the refusal of a short one names that variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSLEUTH_")}
    env["PERFSLEUTH_SERVER_TOKEN"] = "short"
    out = subprocess.run(
        [PY, "-m", "perfsleuth", "server", "--data", str(tmp_path / "d"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode != 0
    assert "PERFSLEUTH_SERVER_TOKEN" in out.stderr, out.stderr
    assert "PERFSLEUTH_TOKEN:" not in out.stderr


def test_server_prints_where_agents_send(fleet: Fleet) -> None:
    """The server announces the port it listens on and the collector URL agents use."""
    fleet.start_server()
    log = fleet.tmp / "server.log"
    end = time.monotonic() + 30
    while "PERFSLEUTH_COLLECTOR" not in log.read_text() and time.monotonic() < end:
        time.sleep(0.1)
    text = log.read_text()
    assert f"perfsleuth server: http://127.0.0.1:{fleet.port}/" in text, text
    assert f"agents: PERFSLEUTH_COLLECTOR=http://127.0.0.1:{fleet.port}" in text, text


def test_a_segments_lock_stays_the_same_while_many_others_come_and_go() -> None:
    """Two chunks of one segment (a retry beside the first writer) must share one lock however
    many other segments were received meanwhile: otherwise both append and bytes repeat."""
    from perfsleuth.server.routes.ingest import _lock

    held = _lock("agent~live-1-2-3")
    with held:
        for i in range(10_000):
            _lock(f"agent~other-{i}-2-3")
        assert _lock("agent~live-1-2-3") is held
        assert _lock("agent~live-1-2-3").locked()


def readme_origin_query() -> str:
    """The origin query README "Fleet" documents (its `SELECT ... ASOF JOIN ...` span)."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    start = text.index("`SELECT r.trace_id, r.endpoint, s.token")
    end = text.index("`", start + 1)
    return " ".join(text[start + 1 : end].split())


def test_the_documented_origin_query_gives_each_request_once_and_its_own_process(
    tmp_path: Path,
) -> None:
    """Two processes of one host with the same pid (a reused pid), sent with different tokens,
    each with several segments: the README's query gives every request one row, the token of
    the process that ran it; its first request comes before its first segment opened."""
    from perfsleuth.store.duckdb_store import DuckDBStore

    t0 = 1_790_000_000 * 10**9
    s = 10**9
    rows = []
    for token, base in (("team_old", t0), ("team_new", t0 + 600 * s)):
        for k in range(3):  # segments opened 0 s, 100 s, 200 s after the process's first write
            rows.append(
                {
                    "segment": f"a~h1-77-{base + k * 100 * s}-{k + 1:06d}",
                    "token": token,
                    "agent": "a",
                    "host": "h1",
                    "service": "svc",
                    "pid": 77,
                    "received_ns": base + k * 100 * s + s,
                    "started_ns": base + k * 100 * s,
                }
            )
    with DuckDBStore(str(tmp_path / "d")) as store:
        store.record_received(rows)
        store.record_received(rows[:1])  # a segment recorded twice keeps one row
        con = store._con
        con.execute(
            "CREATE TEMP TABLE requests (trace_id VARCHAR, endpoint VARCHAR, host VARCHAR,"
            " pid INTEGER, ts TIMESTAMP)"
        )
        want = {}
        for token, base in (("team_old", t0), ("team_new", t0 + 600 * s)):
            for k, off in enumerate((-2, 5, 150, 290)):  # -2: before the first segment opened
                tid = f"{token}-{k}"
                want[tid] = token
                con.execute(
                    "INSERT INTO temp.requests VALUES (?, '/x', 'h1', 77, make_timestamp(?))",
                    [tid, (base + off * s) // 1000],
                )
        query = readme_origin_query().replace("FROM requests", "FROM temp.requests")
        got = con.execute(query).fetchall()
        assert sorted(r[0] for r in got) == sorted(want), "each request exactly once"
        assert {r[0]: r[2] for r in got} == want
        # The join the README gave before, USING (host, pid), repeats and mixes them.
        old = con.execute(
            "SELECT r.trace_id, s.token FROM temp.requests r JOIN segments_received s "
            "USING (host, pid)"
        ).fetchall()
        assert len(old) == 6 * len(want)


def test_a_store_with_the_collectors_old_table_gains_the_started_column(tmp_path: Path) -> None:
    """segments_received as the collector used to create it (no ``started``) is migrated: the
    column added, the start of the segments held read from their names."""
    from perfsleuth.store.duckdb_store import DuckDBStore

    data = tmp_path / "d"
    with DuckDBStore(str(data)) as store:
        store._con.execute("DROP TABLE segments_received")
        store._con.execute(
            "CREATE TABLE segments_received (segment VARCHAR PRIMARY KEY, token VARCHAR, "
            "agent VARCHAR, host VARCHAR, service VARCHAR, pid INTEGER, received TIMESTAMP)"
        )
        store._con.execute(
            "INSERT INTO segments_received VALUES ('a~h-1-1790000000123456789-000001', 't',"
            " 'a', 'h', 'svc', 1, now()), ('a~odd', 't', 'a', 'h', 'svc', 1, now())"
        )
    with DuckDBStore(str(data)) as store:
        store.record_received(
            [{"segment": "a~s2", "token": "t", "pid": 2, "received_ns": 1, "started_ns": 5000}]
        )
        rows = store._con.execute(
            "SELECT segment, started FROM segments_received ORDER BY segment"
        ).fetchall()
    assert [r[0] for r in rows] == ["a~h-1-1790000000123456789-000001", "a~odd", "a~s2"]
    # The old rows' start is the one in the segment's name (a name without one: NULL).
    assert rows[0][1] == datetime.fromtimestamp(1790000000.123456, UTC).replace(tzinfo=None)
    assert rows[1][1] is None and rows[2][1] is not None


def test_received_segments_are_recorded_together_and_an_odd_header_value_fails_none(
    tmp_path: Path,
) -> None:
    """A remote agent's segment header may say anything: a pid or time past the columns'
    range is recorded as unknown (NULL), and the other rows of the call are recorded; a row
    held already is left as it is."""
    from perfsleuth.store.duckdb_store import DuckDBStore

    with DuckDBStore(str(tmp_path / "d")) as store:
        store.record_received([{"segment": "a~kept", "token": "first", "pid": 1}])
        store.record_received(
            [
                {"segment": "a~kept", "token": "second", "pid": 1},
                {"segment": "a~odd", "pid": 2**40, "received_ns": 2**70, "started_ns": "x"},
                {"segment": "a~ok", "pid": 7, "received_ns": 10**18, "started_ns": 10**18},
            ]
        )
        rows = store._con.execute(
            "SELECT segment, token, pid, received, started FROM segments_received ORDER BY 1"
        ).fetchall()
    assert [r[:3] for r in rows] == [
        ("a~kept", "first", 1),
        ("a~odd", None, None),
        ("a~ok", None, 7),
    ]
    assert rows[1][3:] == (None, None)
    assert rows[2][3] == datetime.fromtimestamp(10**9, UTC).replace(tzinfo=None)


def test_the_forwarders_counters_are_in_the_one_list_agent_and_store_read() -> None:
    """wire.counters lists every counter the agent keeps about its data, forward's included,
    so that top reports them (0 when no process counted one)."""
    from perfsleuth.agent.recorder import stats
    from perfsleuth.agent.spool import forward  # noqa: F401 - sets its counters
    from perfsleuth.wire.counters import AGENT

    kept = {k for k in stats if k.startswith(("forward_", "dropped_"))}
    assert {"forward_errors", "dropped_spool_cap"} <= kept
    assert kept <= set(AGENT)


def _otlp_payload(n: int, first: int = 0) -> bytes:
    """OTLP JSON: ``n`` SERVER spans of service node-api on host n1, process 321, now (trace
    ids from ``first`` + 1 on)."""
    t0 = time.time_ns() - 60 * 10**9

    def kv(key: str, value: Any) -> dict[str, Any]:
        if isinstance(value, int):
            return {"key": key, "value": {"intValue": str(value)}}
        return {"key": key, "value": {"stringValue": value}}

    spans = [
        {
            "traceId": f"{i + 1:032x}",
            "spanId": f"{i + 1:016x}",
            "name": "GET /users/:id",
            "kind": 2,
            "startTimeUnixNano": str(t0 + i * 10**6),
            "endTimeUnixNano": str(t0 + i * 10**6 + 5 * 10**6),
            "attributes": [
                kv("http.request.method", "GET"),
                kv("http.route", "/users/:id"),
                kv("url.path", f"/users/{i}"),
                kv("http.response.status_code", 200),
            ],
        }
        for i in range(first, first + n)
    ]
    resource = [kv("service.name", "node-api"), kv("host.name", "n1"), kv("process.pid", 321)]
    body = {
        "resourceSpans": [{"resource": {"attributes": resource}, "scopeSpans": [{"spans": spans}]}]
    }
    return json.dumps(body).encode()


def test_the_store_records_which_token_sent_agent_segments_and_otlp_spans(fleet: Fleet) -> None:
    """An agent ships with one ingest token, an OTLP exporter posts with another: the store
    records both (segments_received), /api/fleet and `perfsleuth fleet` name each host's token
    and route, and the README's origin query gives the OTLP request its token too."""
    fleet.start_server()
    fleet.start_agent("h1")
    fleet.send("h1", 5)
    status, body = fleet.call("POST", "/v1/traces", OTLP_TOKEN, _otlp_payload(3))
    assert status == 200, body
    # The same payload again stores nothing twice and records no second origin.
    status, body = fleet.call("POST", "/v1/traces", OTLP_TOKEN, _otlp_payload(3))
    assert status == 200, body
    fleet.wait_stored({"h1": 5})

    def sources(got: dict[str, Any]) -> dict[tuple[str, str], tuple[int, list[str], list[str]]]:
        return {
            (r["host"], r["service"]): (r["requests"], r["tokens"], r["via"])
            for r in got["sources"]
        }

    want = {
        ("h1", "svc_h1"): (5, ["team_a"], ["agent"]),
        ("n1", "node-api"): (3, ["team_otlp"], ["otlp"]),
    }
    status, body = fleet.call("GET", "/api/fleet?since=all", READ_TOKEN)
    assert status == 200, body
    got = json.loads(body)
    assert sources(got) == want
    assert got["hosts"] == ["h1", "n1"] and got["services"] == ["node-api", "svc_h1"]
    by_token = {(r["token"], r["via"]): r for r in got["tokens"]}
    assert set(by_token) == {("team_a", "agent"), ("team_otlp", "otlp")}
    assert by_token["team_otlp", "otlp"]["segments"] == 1  # one source, one day
    assert by_token["team_otlp", "otlp"]["hosts"] == ["n1"]
    # An ingest token may not read it.
    assert fleet.call("GET", "/api/fleet", INGEST_TOKEN)[0] == 403
    origin = fleet.sql(readme_origin_query().replace("s.token", "s.token, r.host"))
    assert {(r[3], r[2]) for r in origin} == {("h1", "team_a"), ("n1", "team_otlp")}
    assert len(origin) == 8

    fleet.kill_server(signal.SIGTERM)
    out = subprocess.run(
        [PY, "-m", "perfsleuth", "fleet", "--data", str(fleet.data), "--json", "--no-ingest"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert sources(json.loads(out.stdout)) == want
    text = subprocess.run(
        [PY, "-m", "perfsleuth", "fleet", "--data", str(fleet.data), "--no-ingest"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert text.returncode == 0, text.stderr
    assert "team_otlp" in text.stdout and "node-api" in text.stdout, text.stdout


def test_retention_keeps_only_the_received_segments_a_kept_request_may_come_from(
    tmp_path: Path,
) -> None:
    """segments_received is in the store's retention: a row goes when it was received before
    the cutoff and no request kept can be of it (a later segment of its process started
    before the first day kept, or no request kept is of its host and pid); the last segment
    of a process whose requests are kept stays, as do recent rows and old segments received
    recently (a backlog)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from perfsleuth.store.duckdb_store import DuckDBStore
    from spoolwrite import SegmentWriter, call

    now = time.time_ns()
    day = 86_400 * 10**9

    def row(name: str, host: str, pid: int, started_days: float, received_days: float) -> Any:
        return {
            "segment": f"a~{name}",
            "token": "t",
            "agent": "a",
            "host": host,
            "service": "shop",
            "pid": pid,
            "received_ns": now - int(received_days * day),
            "started_ns": now - int(started_days * day),
        }

    data = str(tmp_path / "d")
    w = SegmentWriter(data, pid=2)  # requests of host testbox, pid 2, today
    w.request("GET /a", calls=[call()])
    w.close()
    with DuckDBStore(data) as store:
        store.ingest()
        store.record_received(
            [
                row("superseded", "h1", 1, 20, 20),  # a later segment of h1/1 started at 15
                row("orphan", "h1", 1, 15, 15),  # no request of h1/1 is kept
                row("origin", "testbox", 2, 10, 10),  # today's requests of testbox/2 are its
                row("recent", "h3", 3, 1, 1),
                row("backlog", "h4", 4, 20, 0.01),  # an old segment the collector got just now
                row("otlp-old", "", None, 12, 12),  # type: ignore[arg-type]
            ]
        )
        store.apply_retention(7)
        kept = sorted(
            r[0] for r in store._con.execute("SELECT segment FROM segments_received").fetchall()
        )
    assert kept == ["a~backlog", "a~origin", "a~recent"]


def test_a_segment_received_while_the_store_is_busy_is_recorded_by_the_next_ingest(
    tmp_path: Path,
) -> None:
    """The origin of a segment whose chunk came while the store's lock was held (an ingest
    round, an API call) is written by the next ingest round, not only by a later chunk: an
    agent's last chunk has none after it."""
    from fastapi.testclient import TestClient

    from perfsleuth.server import create_app
    from spoolwrite import SegmentWriter, call

    w = SegmentWriter(str(tmp_path / "agent"), host="h9", pid=9)
    w.request("GET /x", calls=[call()])
    seg = Path(w.close())
    base = seg.name[: -len(".seg")]
    tokens = {INGEST_TOKEN: ("team_a", "ingest"), READ_TOKEN: ("ui", "read")}
    app = create_app(str(tmp_path / "server"), tokens=tokens, ingest_every=3600)
    with TestClient(app) as client:
        be = app.state.backend
        with be.lock:  # busy: the chunk is stored and acknowledged, its origin waits
            r = client.post(
                f"/api/ingest/segment?agent=h9&segment={base}&offset=0&final=1",
                content=seg.read_bytes(),
                headers={"Authorization": f"Bearer {INGEST_TOKEN}"},
            )
        assert r.status_code == 200, r.text
        be.ingest_once()
        with be.use() as store:
            rows = store.query("SELECT segment, token, host FROM segments_received")
    assert rows == [{"segment": f"h9~{base}", "token": "team_a", "host": "testbox"}]


def test_otlp_payloads_acknowledged_before_a_kill_are_stored_once(fleet: Fleet) -> None:
    """An exporter posts payloads as fast as it is answered; the server is killed with -9
    right after the last answer, while acknowledged payloads still wait in its queue
    (DATA/otlp/). Restarted, it stores them, and an answered payload sent again (as after a
    lost reply) adds nothing: every request is stored exactly once, with the token that sent
    it."""
    per, payloads = 300, 12
    fleet.start_server()
    for k in range(payloads):
        status, body = fleet.call("POST", "/v1/traces", OTLP_TOKEN, _otlp_payload(per, k * per))
        assert status == 200, body
    fleet.kill_server()
    queued = [p for p in (fleet.data / "otlp").iterdir() if p.suffix == ".otlp"]
    assert queued, "the kill came after the queue was stored: nothing left to recover"
    fleet.start_server()
    status, body = fleet.call("POST", "/v1/traces", OTLP_TOKEN, _otlp_payload(per, 0))
    assert status == 200, body
    rows = fleet.sql(
        "SELECT count(*), count(DISTINCT trace_id), min(service), max(service) FROM requests"
    )
    assert rows == [[per * payloads, per * payloads, "node-api", "node-api"]]
    assert not [p for p in (fleet.data / "otlp").iterdir() if p.suffix == ".otlp"]
    tokens = fleet.sql("SELECT DISTINCT token FROM segments_received")
    assert tokens == [["team_otlp"]]
