"""The C accelerator's sqlite site path once a template engine is loaded (agent/_speedups.c,
record_site): a call under no template is recorded in C, a call under a template line goes to
Python's path for its site's first call only, and both give the sites, stacks and rows of the
Python reference. Real Jinja2 templates rendered from files, real sqlite3, the agent running.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.agent import recorder, stacks
from perfsleuth.agent.instrument import dbapi

pytestmark = pytest.mark.skipif(recorder.speedups is None, reason="the C accelerator is not built")

jinja2 = pytest.importorskip("jinja2")

PAGE = """<ul>
{% for i in ids %}
  <li>{{ name(i) }}</li>
  <li>{{ price(i) }}</li>
{% endfor %}
</ul>
"""
IDS = [1, 2, 3]


class CountingRequest(recorder.ActiveRequest):
    """A request that counts the calls recorded through Python's record_call."""

    __slots__ = ()
    python_calls = 0

    def record_call(self, kind: str, system: str, target: Any, params: Any, up: int) -> int:
        CountingRequest.python_calls += 1
        return super().record_call(kind, system, target, params, up + 1)


def product_name(cur: sqlite3.Cursor, i: int) -> str:
    cur.execute("SELECT name FROM products WHERE id = ?", (i,))
    return str(cur.fetchone()[0])


def order_total(cur: sqlite3.Cursor) -> float:
    cur.execute("SELECT sum(price) FROM products WHERE id < ?", (100,))
    return float(cur.fetchone()[0])


def serve(con: sqlite3.Connection, template: Any) -> tuple[CountingRequest, int]:
    """One request: two calls from one plain line, then a page whose two template lines call
    one Python line (product_name) for every id. Returns it and its Python record_calls."""
    CountingRequest.python_calls = 0
    req = recorder.begin("web", "GET", "/page", cls=CountingRequest)
    assert isinstance(req, CountingRequest)
    try:
        cur = con.cursor()
        for _ in range(2):
            order_total(cur)
        template.render(
            ids=IDS,
            name=lambda i: product_name(cur, i),
            price=lambda i: product_name(cur, i + 10),
        )
    finally:
        req.status = 200
        recorder.end(req)
    return req, CountingRequest.python_calls


def sites(req: recorder.ActiveRequest) -> list[tuple[Any, ...]]:
    """Each call's site entry (kind, system, statement, stack, key) and parameters' hash."""
    calls = req.calls
    assert calls is not None and req.site_list is not None
    rows = [recorder._ROW.unpack_from(calls, i) for i in range(0, len(calls), recorder.ROW)]
    return [(req.site_list[slot], ph) for slot, _, _, _, ph in rows]


def lines(entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The entries with lines for instructions: a frame calling a C method (the accelerator's
    wrapper) and one calling a Python method stop at different instructions of one line."""
    out = []
    for entry, ph in entries:
        kind, system, statement, stack, key = entry
        frames = tuple(
            (stack[i], stacks.line(stack[i], stack[i + 1])) for i in range(0, len(stack), 2)
        )
        out.append((kind, system, statement, frames, key[0], key[1], key[3:], ph))
    return out


def template_lines(stack: tuple[Any, ...], file: str) -> list[tuple[int, str]]:
    return [
        (stack[i + 1], stack[i].co_name)
        for i in range(0, len(stack), 2)
        if stack[i].co_filename == file
    ]


@pytest.fixture
def shop(tmp_path: Path, agent_data_dir: str) -> tuple[sqlite3.Connection, Any, str]:
    (tmp_path / "page.html").write_text(PAGE)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tmp_path)))
    template = env.get_template("page.html")
    assert stacks.check_engines(), "jinja2 is imported: stacks carry template lines"
    con = sqlite3.connect(str(tmp_path / "shop.db"))
    con.execute("CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price REAL)")
    con.executemany("INSERT INTO products VALUES (?, ?, ?)", [(i, f"p{i}", i) for i in range(20)])
    return con, template, str(tmp_path / "page.html")


def run_both(
    con: sqlite3.Connection, template: Any
) -> dict[str, tuple[recorder.ActiveRequest, int]]:
    out = {}
    try:
        for mode in ("c", "python"):  # one line for both: their stacks are the same frames
            assert dbapi.use_speedups(mode == "c") == (mode == "c")
            out[mode] = serve(con, template)
    finally:
        dbapi.use_speedups(True)
    return out


def test_c_and_python_give_the_same_sites_and_stacks_under_templates(
    shop: tuple[sqlite3.Connection, Any, str],
) -> None:
    con, template, page = shop
    for _ in range(2):  # the second time, the site cache holds the first one's entries
        got = run_both(con, template)
        c_sites, py_sites = sites(got["c"][0]), sites(got["python"][0])
        assert len(c_sites) == 2 + 2 * len(IDS)
        assert lines(c_sites) == lines(py_sites)
        plain, under = c_sites[:2], c_sites[2:]
        assert plain[0][0] is plain[1][0]  # one site: the plain line's two calls
        assert len(plain[0][0][4]) == 3 and not template_lines(plain[0][0][3], page)
        # one Python line under two template lines: two sites, each with its template lines
        assert len({id(entry) for entry, _ in under}) == 2
        for n, (entry, _) in enumerate(under):
            line = 3 if n % 2 == 0 else 4
            assert entry[4][3] == (page, line)
            assert template_lines(entry[3], page)[:2] == [
                (line, "{{ name(i) }}" if line == 3 else "{{ price(i) }}"),
                (2, "{% for i in ids %}"),
            ]


def test_c_hands_python_only_a_template_sites_first_call(
    shop: tuple[sqlite3.Connection, Any, str],
) -> None:
    con, template, _ = shop
    got = run_both(con, template)
    # Python's wrappers record every call through record_call
    assert got["python"][1] == 2 + 2 * len(IDS)
    # C: the plain line's calls stay in C (a template engine is loaded, but no template frame
    # is above them); of the template lines' calls, the first of each site goes to Python
    assert got["c"][1] == 2


def test_c_site_path_without_templates_configured_records_in_c(
    shop: tuple[sqlite3.Connection, Any, str],
) -> None:
    """Templates off in the accelerator (template_key None): every site is C's, and the calls
    under a template get the plain line's stack (what the accelerator knows without them)."""
    con, template, _ = shop
    recorder.speedups.configure(template_key=None, template_engines=None, engine_of=None)
    try:
        req, python_calls = serve(con, template)
    finally:
        recorder._templates_in_c()
    assert python_calls == 0
    assert all(len(entry[4]) == 3 for entry, _ in sites(req))


def test_configure_refuses_template_settings_given_apart() -> None:
    with pytest.raises(TypeError):
        recorder.speedups.configure(template_key=stacks.template_key)
    with pytest.raises(TypeError):
        recorder.speedups.configure(
            template_key=stacks.template_key, template_engines=[], engine_of=len
        )
