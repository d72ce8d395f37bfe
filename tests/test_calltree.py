"""The call-site tree: stacks of an endpoint's calls merged into a weighted trie, from spool
records written with the real wire encoder and ingested by the real store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from perfsleuth.analysis import calltree
from perfsleuth.cli.main import app
from perfsleuth.store.duckdb_store import DuckDBStore
from spoolwrite import SegmentWriter, call

SERVER = ("/usr/lib/python3/site-packages/server.py", 10, "serve", False)
V = "/srv/app/views.py"
EP = "GET /page"
T1, T2 = "aaaa000000000001", "bbbb000000000002"


def stack(*frames: tuple[int, str]) -> list[tuple[str, int, str, bool]]:
    return [SERVER, *((V, line, fn, True) for line, fn in frames)]


USERS = stack((5, "page"), (20, "load_users"))
ORDERS = stack((6, "page"), (30, "load_orders"))
DIRECT = stack((7, "page"))
TINY1 = stack((8, "page"), (40, "tiny"))
TINY2 = stack((9, "page"), (41, "tiny2"))


def calls_of(path: list[tuple[str, int, str, bool]], n: int, ms: float, **kw: Any) -> list:
    """``n`` calls from the innermost frame of ``path``; only the first carries the stack
    (the agent may store a site's stack once per request)."""
    site = path[-1][:3]
    return [
        call("db", f"SELECT {site[2]}", dur_ms=ms, site=site, stack=path if i == 0 else None, **kw)
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    data = str(tmp_path_factory.mktemp("calltree") / "data")
    w = SegmentWriter(data)
    for tid in (T1, T2):
        calls = (
            calls_of(USERS, 10, 2.0)
            + calls_of(ORDERS, 5, 4.0)
            + calls_of(DIRECT, 1, 1.0)
            + calls_of(TINY1, 1, 0.01)
            + calls_of(TINY2, 1, 0.01)
            + [
                call(
                    "http",
                    "GET api/x",
                    dur_ms=50.0,
                    site=(V, 50, "fetch"),
                    stack=stack((50, "fetch")),
                    host="api",
                )
            ]
        )
        w.request(EP, trace_id=tid, dur_ms=200.0, calls=calls)
    # a site without any stack in its request: the tree still shows the call site
    w.request("GET /bare", dur_ms=5.0, calls=[call("db", "SELECT 1", site=(V, 60, "bare"))] * 3)
    w.request("GET /none", dur_ms=5.0)
    w.close()
    with DuckDBStore(data) as s:
        s.ingest()
    return data


@pytest.fixture(scope="module")
def store(data: str) -> Iterator[DuckDBStore]:
    with DuckDBStore(data, read_only=True) as s:
        yield s


def leaves(node: calltree.Node) -> list[calltree.Node]:
    if not node.children:
        return [node]
    return [leaf for c in node.children.values() for leaf in leaves(c)]


def check_sums(node: calltree.Node) -> None:
    """A node's numbers cover its subtree: never less than its children's sums."""
    if node.children:
        assert node.calls >= sum(c.calls for c in node.children.values())
        assert node.ms >= sum(c.ms for c in node.children.values()) - 1e-9
    for c in node.children.values():
        check_sums(c)


def by_path(node: calltree.Node, *names: str) -> calltree.Node:
    for name in names:
        node = next(c for c in node.children.values() if c.name == name)
    return node


def test_tree_weights_add_up(store: DuckDBStore) -> None:
    root = calltree.build(store, EP)
    assert root.name == EP
    assert root.calls == 2 * (10 + 5 + 1 + 1 + 1)
    assert root.ms == pytest.approx(2 * (20.0 + 20.0 + 1.0 + 0.02))
    check_sums(root)
    assert sum(leaf.calls for leaf in leaves(root)) == root.calls
    assert sum(leaf.ms for leaf in leaves(root)) == pytest.approx(root.ms)
    # application frames only, outermost first; calls without a stack are counted on the
    # path of their site's stack in the same trace
    users = by_path(root, "page (views.py:5)", "load_users (views.py:20)")
    assert (users.calls, users.ms) == (20, pytest.approx(40.0))
    assert (users.file, users.line, users.function) == (V, 20, "load_users")
    orders = by_path(root, "page (views.py:6)", "load_orders (views.py:30)")
    assert (orders.calls, orders.ms) == (10, pytest.approx(40.0))
    direct = by_path(root, "page (views.py:7)")
    assert (direct.calls, direct.children) == (2, {})
    # most time first
    assert [c.name for c in root.ordered()][:2] == ["page (views.py:5)", "page (views.py:6)"]


def test_json_shape(store: DuckDBStore) -> None:
    def walk(d: dict[str, Any]) -> None:
        assert set(d) == {"name", "file", "line", "function", "template", "calls", "ms", "children"}
        assert isinstance(d["calls"], int) and isinstance(d["ms"], float)
        assert d["template"] is False  # no template frames in these Python stacks
        assert isinstance(d["children"], list)
        for c in d["children"]:
            walk(c)

    d = calltree.build(store, EP).to_dict()
    walk(d)
    assert (d["file"], d["line"], d["function"]) == (None, None, None)
    assert json.loads(json.dumps(d)) == d


def test_pruning_folds_small_paths_and_keeps_the_sums(store: DuckDBStore) -> None:
    full = calltree.build(store, EP)
    pruned = calltree.build(store, EP, min_share=0.1)
    assert (pruned.calls, pruned.ms) == (full.calls, full.ms)
    names = [c.name for c in pruned.ordered()]
    # page:7 (2 calls, 2 ms), page:8 and page:9 (2 calls, 0.02 ms each) are each under 10 %
    # of the calls (36) and of the time (82 ms)
    assert names == ["page (views.py:5)", "page (views.py:6)", "(3 smaller paths)"]
    other = by_path(pruned, "(3 smaller paths)")
    assert other.calls == 6 and other.ms == pytest.approx(2.04)
    assert other.file is None and not other.children
    check_sums(pruned)


def test_library_frames_on_request(store: DuckDBStore) -> None:
    root = calltree.build(store, EP, app_only=False)
    [server] = root.children.values()
    assert (server.function, server.calls) == ("serve", root.calls)
    assert by_path(server, "page (views.py:5)", "load_users (views.py:20)").calls == 20


def test_one_trace_one_kind_and_bare_sites(store: DuckDBStore) -> None:
    one = calltree.build(store, EP, trace_id=T1[:6])
    assert one.calls == 18 and T1 in one.name
    assert by_path(one, "page (views.py:5)", "load_users (views.py:20)").calls == 10
    http = calltree.build(store, EP, kind="http")
    assert http.calls == 2 and http.ms == pytest.approx(100.0)
    assert [c.name for c in http.ordered()] == ["fetch (views.py:50)"]
    bare = calltree.build(store, "GET /bare")
    assert [(c.name, c.calls) for c in bare.ordered()] == [("bare (views.py:60)", 3)]
    assert calltree.build(store, "GET /none").calls == 0
    with pytest.raises(calltree.NotFound, match="no trace with id 'ffff'"):
        calltree.build(store, EP, trace_id="ffff")
    with pytest.raises(ValueError, match="unknown call kind"):
        calltree.build(store, EP, kind="grpc")


def cli(*args: str) -> Any:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def rounded(d: dict[str, Any]) -> dict[str, Any]:
    """Times to the µs: float sums may differ in their last bits between two runs."""
    return {**d, "ms": round(d["ms"], 3), "children": [rounded(c) for c in d["children"]]}


def test_cli(data: str, store: DuckDBStore) -> None:
    r = cli("calltree", EP, "--data", data, "--no-ingest", "--json", "--min-share", "0")
    assert r.exit_code == 0, r.stderr
    assert rounded(json.loads(r.stdout)) == rounded(calltree.build(store, EP).to_dict())
    r = cli("calltree", EP, "--data", data, "--no-ingest")
    assert r.exit_code == 0, r.stderr
    assert "load_users" in r.stdout and "20 calls" in r.stdout
    assert "36 calls" in r.stdout  # the root's total
    r = cli("calltree", "--trace", T2, "--data", data, "--no-ingest", "--json")
    assert json.loads(r.stdout)["calls"] == 18
    for args, msg in [
        (("GET /nope",), "unknown endpoint 'GET /nope'"),
        ((EP, "--kind", "grpc"), "invalid --kind 'grpc'"),
        ((EP, "--trace", "ffff"), "no trace with id 'ffff'"),
        ((), "give an endpoint"),
        ((EP, "--min-share", "2"), "invalid --min-share"),
    ]:
        r = cli("calltree", *args, "--data", data, "--no-ingest")
        assert r.exit_code == 2, (args, r.stdout)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("perfsleuth: "), r.stderr
        assert msg in lines[0]
