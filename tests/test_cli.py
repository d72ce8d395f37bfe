"""The `perfsleuth` command line, end to end: real spool data written by the real agent in a
subprocess, ingested into the real store, read back through the CLI (in process with Typer's
CliRunner, and as `python -m perfsleuth`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import DemoRun
from perfsleuth.agent.shipper import BATCH_MAX
from perfsleuth.cli.main import app

# A tiny "application": requests recorded with the agent's recorder API around real sqlite3
# queries. Library auto-instrumentation is off so that the calls recorded are exactly the ones
# below, whatever other instrumentation the agent grows.
APP = textwrap.dedent(
    """
    import os, sqlite3, sys, time
    import perfsleuth.agent as ps
    from perfsleuth.agent import recorder

    assert ps.start(sys.argv[1], service="cli-test", instrument=False)
    ITEMS = "select * from items where order_id = ?"
    UPDATE = "update orders set total = total where id = ?"
    ORDERS_PER_CUSTOMER = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    db = sqlite3.connect(":memory:")
    db.execute("create table orders (id integer primary key, customer integer, total real)")
    db.execute("create table items (id integer primary key, order_id integer, sku text)")
    for c in range(10):
        for o in range(ORDERS_PER_CUSTOMER):
            oid = c * 100 + o
            db.execute("insert into orders values (?, ?, ?)", (oid, c, 9.5))
            db.execute("insert into items (order_id, sku) values (?, ?)", (oid, "sku-%d" % o))


    def query(sql, args=()):
        call = recorder.start_call("db", "sqlite", sql, args)
        rows = db.execute(sql, args).fetchall()
        if call is not None:
            call.rows = len(rows)
            call.finish()
        return rows


    def web(endpoint, path, handler, *args, user=None, tenant=None):
        req = recorder.begin("web", endpoint.split()[0], path)
        req.endpoint = endpoint
        ps.set_user(user, tenant)
        try:
            req.status = handler(*args)
        finally:
            recorder.end(req)


    def fast():
        call = recorder.start_call("db", "sqlite", "select count(*) from orders", ())
        db.execute("select count(*) from orders").fetchall()
        call.rows = 1
        call.finish()
        return 200


    def customer_orders(customer):
        call = recorder.start_call(
            "db", "sqlite", "select id from orders where customer = ?", (customer,))
        orders = db.execute("select id from orders where customer = ?", (customer,)).fetchall()
        call.rows = len(orders)
        call.finish()
        for (oid,) in orders:
            call = recorder.start_call("db", "sqlite", ITEMS, (oid,))  # N+1 HERE
            rows = db.execute(ITEMS, (oid,)).fetchall()
            call.rows = len(rows)
            call.finish()
        ps.attr("orders", len(orders))
        ps.tag("variant", "b" if customer % 2 else "a")
        time.sleep(0.004 * customer)  # customer 9 is the slowest request
        return 200


    def checkout(i):
        call = recorder.start_call("db", "sqlite", UPDATE, (i,))
        db.execute(UPDATE, (i,))
        call.finish()
        return 500 if i % 5 in (1, 3) else 200


    for i in range(30):
        web("GET /health", "/health", fast, user="u%d" % (i % 3), tenant="acme")
    for c in range(10):
        web("GET /customers/{id}/orders", "/customers/%d/orders" % c, customer_orders, c,
            user="u%d" % (c % 3), tenant="globex")
    for i in range(5):
        web("POST /checkout", "/checkout", checkout, i, user="u1", tenant="acme")
    for i in range(2):
        with ps.task("nightly-report"):
            time.sleep(0.001)
    ps.flush()
    print("ok")
    """
)

EXPECTED = {
    "GET /health": 30,
    "GET /customers/{id}/orders": 10,
    "POST /checkout": 5,
    "nightly-report": 2,
}
N1 = "GET /customers/{id}/orders"


@dataclass
class Recorded:
    data: str
    app: Path
    n1_line: int  # line of the N+1 query in the app


def write_app(directory: Path) -> tuple[Path, int]:
    path = directory / "app.py"
    path.write_text(APP)
    line = next(i for i, s in enumerate(APP.splitlines(), 1) if "N+1 HERE" in s)
    return path, line


def run_app(app_path: Path, data: str, *args: str, env: dict[str, str] | None = None) -> None:
    out = subprocess.run(
        [sys.executable, str(app_path), data, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def cli(*args: str) -> Any:
    """Run the CLI in process; returns the click Result (stdout and stderr kept apart)."""
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def cli_json(*args: str) -> Any:
    r = cli(*args, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def py_m(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "perfsleuth", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(stderr: str, contains: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("perfsleuth: "), stderr
    assert contains in lines[0], stderr
    assert "Traceback" not in stderr


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    base = tmp_path_factory.mktemp("cli")
    data = str(base / "data")
    app_path, line = write_app(base)
    run_app(app_path, data)
    return Recorded(data, app_path, line)


# ---------------------------------------------------------------------------------- top


def test_top_json_has_every_endpoint_with_its_count(recorded: Recorded) -> None:
    out = cli_json("top", "--data", recorded.data)
    assert set(out) == {"rows", "drops"}
    counts = {r["endpoint"]: r["count"] for r in out["rows"]}
    assert counts == EXPECTED
    rows = {r["endpoint"]: r for r in out["rows"]}
    assert rows["POST /checkout"]["error_rate"] == pytest.approx(0.4)
    assert rows["GET /health"]["error_rate"] == 0
    # 1 query for the orders + one per order (8): the N+1 shows in DB calls per request
    assert rows[N1]["db_calls_per_request"] == pytest.approx(9)
    assert rows["GET /health"]["db_calls_per_request"] == pytest.approx(1)
    for r in out["rows"]:
        assert {"p50_ms", "p95_ms", "p99_ms"} <= set(r)
        assert r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"] <= r["max_ms"]
    assert out["drops"]["dropped_total"] == 0


def test_top_table(recorded: Recorded) -> None:
    r = cli("top", "--data", recorded.data, "--no-ingest")
    assert r.exit_code == 0, r.stderr
    for endpoint in EXPECTED:
        assert endpoint in r.stdout
    for header in ("count", "p50 ms", "p95 ms", "p99 ms", "err %", "DB/req"):
        assert header in r.stdout
    assert "The agent dropped" not in r.stdout


def test_top_filters_and_groupings(recorded: Recorded) -> None:
    bg = cli_json("top", "--data", recorded.data, "--kind", "background")["rows"]
    assert [(r["endpoint"], r["count"]) for r in bg] == [("nightly-report", 2)]
    web = cli_json("top", "--data", recorded.data, "--kind", "web")["rows"]
    assert {r["endpoint"] for r in web} == set(EXPECTED) - {"nightly-report"}

    by_tenant = cli_json("top", "--data", recorded.data, "--by", "tenant", "--kind", "web")
    assert {r["tenant"]: r["count"] for r in by_tenant["rows"]} == {"acme": 35, "globex": 10}

    pairs = cli_json("top", "--data", recorded.data, "--by", "endpoint,user")["rows"]
    assert all({"endpoint", "user"} <= set(r) for r in pairs)
    health = {r["user"]: r["count"] for r in pairs if r["endpoint"] == "GET /health"}
    assert health == {"u0": 10, "u1": 10, "u2": 10}

    limited = cli_json("top", "--data", recorded.data, "--limit", "2")["rows"]
    assert len(limited) == 2

    recent = cli_json("top", "--data", recorded.data, "--since", "1h")["rows"]
    assert {r["endpoint"]: r["count"] for r in recent} == EXPECTED


@pytest.mark.parametrize(
    "args",
    [["--by", "colour"], ["--kind", "batch"], ["--limit", "0"]],
)
def test_top_rejects_bad_options(recorded: Recorded, args: list[str]) -> None:
    r = cli("top", "--data", recorded.data, *args)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "invalid")
    assert r.stdout == ""


# ---------------------------------------------------------------------------------- traces


def test_traces_slowest_are_ordered_slowest_first(recorded: Recorded) -> None:
    everything = cli_json("traces", "--data", recorded.data, "--endpoint", N1, "--limit", "100")
    assert len(everything) == 10
    durations = sorted((t["duration_ms"] for t in everything), reverse=True)

    slowest = cli_json("traces", "--data", recorded.data, "--endpoint", N1, "--slowest", "3")
    assert [t["duration_ms"] for t in slowest] == durations[:3]
    assert all(t["endpoint"] == N1 for t in slowest)

    newest = cli_json("traces", "--data", recorded.data, "--limit", "5")
    assert len(newest) == 5
    assert [t["ts"] for t in newest] == sorted((t["ts"] for t in newest), reverse=True)


def test_traces_table(recorded: Recorded) -> None:
    r = cli("traces", "--data", recorded.data, "--endpoint", N1, "--slowest", "2")
    assert r.exit_code == 0, r.stderr
    assert "slowest" in r.stdout and N1 in r.stdout
    assert "perfsleuth trace " in r.stdout


def test_unknown_endpoint_is_one_clear_error(recorded: Recorded) -> None:
    r = cli("traces", "--data", recorded.data, "--endpoint", "GET /customers/{id}/order")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "unknown endpoint 'GET /customers/{id}/order'")
    assert "did you mean 'GET /customers/{id}/orders'" in r.stderr
    assert r.stdout == ""


# ---------------------------------------------------------------------------------- trace


def customer_nine(recorded: Recorded) -> dict[str, Any]:
    """Customer 9's request (8 orders: the N+1's longest loop). Not "the slowest": 4 ms of
    sleep per customer orders them on a quiet machine only."""
    everything = cli_json("traces", "--data", recorded.data, "--endpoint", N1, "--limit", "100")
    (nine,) = [t for t in everything if t["path"] == "/customers/9/orders"]
    return nine


def test_trace_waterfall_shows_call_sites_and_folds_repeats(recorded: Recorded) -> None:
    nine = customer_nine(recorded)
    tid = nine["trace_id"]
    site = f"app.py:{recorded.n1_line}"

    t = cli_json("trace", tid, "--data", recorded.data)
    assert t["trace_id"] == tid and t["endpoint"] == N1
    assert len(t["calls"]) == 9
    assert sum(1 for c in t["calls"] if c["site"] and c["site"]["line"] == recorded.n1_line) == 8

    r = cli("trace", tid, "--data", recorded.data)
    assert r.exit_code == 0, r.stderr
    assert N1 in r.stdout and "/customers/9/orders" in r.stdout
    assert f"{site} customer_orders" in r.stdout
    assert "select * from items where order_id = ?" in r.stdout.lower()
    assert "x5 more of the same" in r.stdout  # 8 repeats: 3 shown, 5 folded
    assert "orders=8" in r.stdout  # the custom attribute
    assert "variant=b" in r.stdout  # the tag
    assert "u0" in r.stdout and "globex" in r.stdout

    everything = cli("trace", tid[:10], "--data", recorded.data, "--all")
    assert everything.exit_code == 0, everything.stderr
    assert "more of the same" not in everything.stdout
    waterfall = [ln for ln in everything.stdout.splitlines() if "repeated:" not in ln]
    assert sum(1 for ln in waterfall if site in ln and "order_id = ?" in ln) == 8


def test_trace_stacks_show_the_code_path(recorded: Recorded) -> None:
    nine = customer_nine(recorded)
    r = cli("trace", nine["trace_id"], "--data", recorded.data, "--stacks")
    assert r.exit_code == 0, r.stderr
    lines = APP.splitlines()
    caller = next(i for i, s in enumerate(lines, 1) if "req.status = handler(*args)" in s)
    stack_part = r.stdout.split("Call stacks")[1]
    assert f"app.py:{caller} web" in stack_part
    assert f"app.py:{recorded.n1_line} customer_orders" in stack_part
    assert "8 × select * from items where order_id = ?" in stack_part


def test_unknown_trace_is_one_clear_error(recorded: Recorded) -> None:
    r = cli("trace", "ffffffffffffffff", "--data", recorded.data)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "ffffffffffffffff")


# ---------------------------------------------------------------------------------- sql


def test_sql_returns_rows(recorded: Recorded) -> None:
    rows = cli_json(
        "sql",
        "SELECT endpoint, count(*) AS n FROM requests GROUP BY endpoint ORDER BY endpoint",
        "--data",
        recorded.data,
    )
    assert rows == [{"endpoint": e, "n": n} for e, n in sorted(EXPECTED.items())]

    limited = cli_json("sql", "SELECT * FROM calls", "--data", recorded.data, "--limit", "4")
    assert len(limited) == 4 and "fingerprint_id" in limited[0]

    r = cli("sql", "SELECT kind, count(*) AS n FROM requests GROUP BY 1", "--data", recorded.data)
    assert r.exit_code == 0, r.stderr
    assert "background" in r.stdout and "web" in r.stdout and "2 rows" in r.stdout


@pytest.mark.parametrize(
    "query",
    [
        "DROP TABLE ingest_offsets",
        "DELETE FROM requests",
        "CREATE TABLE x AS SELECT 1",
        "SELECT 1; DROP TABLE ingest_offsets",
    ],
)
def test_sql_refuses_writes(recorded: Recorded, query: str) -> None:
    r = cli("sql", query, "--data", recorded.data)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "")
    assert r.stdout == ""
    rows = cli_json("sql", "SELECT count(*) AS n FROM requests", "--data", recorded.data)
    assert rows == [{"n": sum(EXPECTED.values())}]


def test_sql_error_is_one_line(recorded: Recorded) -> None:
    r = cli("sql", "SELEC endpoint FROM requests", "--data", recorded.data)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "")
    r = cli("sql", "SELECT nope FROM requests", "--data", recorded.data)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "nope")


# ---------------------------------------------------------------------------------- errors


def test_empty_store_says_what_to_do(tmp_path: Path) -> None:
    data = str(tmp_path / "nothing-here")
    for args in (["top"], ["traces"], ["top", "--json"], ["trace", "abc"]):
        r = cli(*args, "--data", data)
        assert r.exit_code == 1, (args, r.stderr)
        assert_one_line_error(r.stderr, f"no requests recorded yet in {data}")
        assert "perfsleuth run -- ..." in r.stderr and "perfsleuth demo" in r.stderr
        assert r.stdout == ""


@pytest.mark.parametrize("since", ["1x", "abc", "0m", "-5m", "1.5.h", "h", "0.0000001s", "0.5s"])
def test_bad_since_is_a_usage_error(recorded: Recorded, since: str) -> None:
    for command in ("top", "traces"):
        r = cli(command, "--data", recorded.data, "--since", since)
        assert r.exit_code == 2
        assert_one_line_error(r.stderr, f"invalid --since {since!r}")


@pytest.mark.parametrize("since", ["15m", "1h", "24h", "7d", "90s", "2w", "1.5h"])
def test_good_since_values(recorded: Recorded, since: str) -> None:
    r = cli("top", "--data", recorded.data, "--since", since, "--no-ingest", "--json")
    assert r.exit_code == 0, r.stderr


def test_empty_window_is_not_an_error(recorded: Recorded) -> None:
    r = cli("traces", "--data", recorded.data, "--since", "1s", "--json")
    assert r.exit_code == 0, r.stderr
    time.sleep(1.1)
    r = cli("top", "--data", recorded.data, "--since", "1s")
    assert r.exit_code == 0, r.stderr
    assert "No requests in the last 1s" in r.stdout


def test_locked_store_is_one_clear_error(recorded: Recorded) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from perfsleuth.store import open_store; "
            "s = open_store(sys.argv[1]); print('held', flush=True); time.sleep(60)",
            recorded.data,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        for args in (["ingest"], ["top"], ["sql", "SELECT 1"]):
            r = py_m(*args, "--data", recorded.data)
            assert r.returncode == 1, (args, r.stderr)
            assert_one_line_error(r.stderr, "in use by another perfsleuth process")
    finally:
        holder.kill()
        holder.wait()


def test_python_m_perfsleuth(recorded: Recorded) -> None:
    r = py_m("--help")
    assert r.returncode == 0 and "perfsleuth" in r.stdout
    r = py_m("top", "--data", recorded.data, "--json")
    assert r.returncode == 0, r.stderr
    assert {row["endpoint"] for row in json.loads(r.stdout)["rows"]} == set(EXPECTED)


# ---------------------------------------------------------------------------------- ingest


def test_ingest_reports_counts(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    app_path, _ = write_app(tmp_path)
    run_app(app_path, data)
    report = cli_json("ingest", "--data", data)
    assert report["requests"] == sum(EXPECTED.values())
    assert report["calls"] == 30 + 10 * 9 + 5
    assert report["damaged"] == []
    again = cli("ingest", "--data", data)
    assert again.exit_code == 0 and "Nothing new to ingest" in again.stdout

    run_app(app_path, data)
    r = cli("ingest", "--data", data)
    assert r.exit_code == 0, r.stderr
    assert f"Ingested {sum(EXPECTED.values())} requests" in r.stdout


def test_ingest_damaged_segment_exit_3(tmp_path: Path) -> None:
    data = tmp_path / "data"
    app_path, _ = write_app(tmp_path)
    run_app(app_path, str(data), "40")  # bigger requests: the damage hits one in the middle
    (seg,) = (data / "spool").glob("*.seg")
    raw = bytearray(seg.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = b"\x00" * 64
    seg.write_bytes(bytes(raw))

    r = cli("ingest", "--data", str(data))
    assert r.exit_code == 3, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1, r.stderr
    assert seg.name in warnings[0] and "offset" in warnings[0] and "bytes" in warnings[0]
    assert str(data / "spool" / "corrupt") in warnings[0]
    assert (data / "spool" / "corrupt" / seg.name).exists()
    assert not seg.exists()
    # everything readable was ingested: all but the requests of the damaged record(s) (the
    # agent writes up to BATCH_MAX requests per record)
    rows = cli_json("sql", "SELECT count(*) AS n FROM requests", "--data", str(data))
    lost = sum(EXPECTED.values()) - rows[0]["n"]
    assert 1 <= lost <= 2 * BATCH_MAX
    assert cli("ingest", "--data", str(data)).exit_code == 0


def test_drops_are_reported_under_the_table(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    app_path, _ = write_app(tmp_path)
    # a queue of 5 and a writer that sleeps: most requests are dropped (and counted)
    run_app(app_path, data, env={"PERFSLEUTH_QUEUE_SIZE": "5", "PERFSLEUTH_FLUSH_SECONDS": "60"})
    out = cli_json("top", "--data", data)
    assert out["drops"]["dropped_queue_full"] == sum(EXPECTED.values()) - 5
    assert sum(r["count"] for r in out["rows"]) == 5
    r = cli("top", "--data", data)
    assert r.exit_code == 0
    dropped = sum(EXPECTED.values()) - 5
    assert (
        f"The agent dropped {dropped} requests (queue full: {dropped}, write errors: 0, "
        "writer dead: 0)"
    ) in " ".join(r.stdout.split())


def test_top_shows_the_drops_when_every_request_was_dropped(tmp_path: Path) -> None:
    """The spool cannot be created (a file stands where its directory goes): nothing is
    stored, every request is a counted drop, and top says so instead of "nothing recorded"."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "spool").write_text("not a directory")
    app_path, _ = write_app(tmp_path)
    run_app(app_path, str(data))
    out = cli_json("top", "--data", str(data))
    assert out["rows"] == []
    assert out["drops"]["dropped_total"] == sum(EXPECTED.values())
    r = cli("top", "--data", str(data))
    assert r.exit_code == 0, r.stderr
    assert f"The agent dropped {sum(EXPECTED.values())} requests" in " ".join(r.stdout.split())


# ---------------------------------------------------------------------------------- run


RUN_APP = textwrap.dedent(
    """
    import sqlite3
    from perfsleuth.agent import recorder

    db = sqlite3.connect(":memory:")
    for i in range(3):
        req = recorder.begin("web", "GET", "/run/%d" % i)
        assert req is not None, "the agent is not running"
        req.endpoint = "GET /run/{i}"
        db.execute("select ?", (i,)).fetchall()
        req.status = 200
        recorder.end(req)
    print("ran", flush=True)
    """
)


def test_run_installs_the_agent_in_the_command(tmp_path: Path) -> None:
    script = tmp_path / "runapp.py"
    script.write_text(RUN_APP)
    data = str(tmp_path / "data")
    r = py_m("run", "--data", data, "--service", "runner", "--", sys.executable, str(script))
    assert r.returncode == 0, r.stderr
    assert "ran" in r.stdout
    rows = cli_json("top", "--data", data)["rows"]
    assert [(row["endpoint"], row["count"]) for row in rows] == [("GET /run/{i}", 3)]
    assert rows[0]["db_calls_per_request"] == 1  # sqlite3 was instrumented in the child
    services = cli_json("sql", "SELECT DISTINCT service FROM requests", "--data", data)
    assert services == [{"service": "runner"}]


def test_run_passes_arguments_through_untouched(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    code = "import sys, json; print(json.dumps(sys.argv[1:]))"
    args = ["--data", "x", "--json", "-h", "--", "plain"]
    r = py_m("run", "--data", data, "--", sys.executable, "-c", code, *args)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == args


def test_run_without_a_command(tmp_path: Path) -> None:
    r = cli("run", "--data", str(tmp_path))
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "nothing to run")
    r = py_m("run", "--data", str(tmp_path), "--", "no-such-program-here")
    assert r.returncode == 127
    assert_one_line_error(r.stderr, "command not found")


# ---------------------------------------------------------------------------------- demo


def test_demo_smoke(demo_run: DemoRun, tmp_path: Path) -> None:
    """The whole demo, shortened (the session's run, conftest.demo_run): its report's commands
    work, and every demo endpoint shows up in `top` afterwards."""
    from perfsleuth.demo import ENDPOINTS  # the endpoints the demo services serve

    data = str(tmp_path / "demo")
    shutil.copytree(demo_run.data, data)  # `top` ingests: the session's copy stays as it was
    r = demo_run
    assert "Traceback" not in r.stderr
    assert "What to look at next" in r.stdout
    assert "perfsleuth traces --endpoint" in r.stdout and "perfsleuth trace " in r.stdout
    # the detectors' verdict comes first, with a finding id that `explain` knows
    assert "perfsleuth findings --data" in r.stdout
    explain = re.search(r"perfsleuth explain (\S+)", r.stdout)
    assert explain, r.stdout
    shown = py_m("explain", explain.group(1), "--data", data)
    assert shown.returncode == 0, shown.stderr
    replay = re.search(r"perfsleuth replay (\S+) --curl", r.stdout)  # slow requests were kept
    assert replay, r.stdout
    curl = py_m("replay", replay.group(1), "--curl", "--data", data)
    assert curl.returncode == 0 and "curl -sS -X" in curl.stdout, curl.stderr
    top = json.loads(py_m("top", "--data", data, "--json").stdout)
    seen = {row["endpoint"] for row in top["rows"]}
    missing = set(ENDPOINTS) - seen
    assert not missing, f"demo endpoints missing from top: {missing}"
