"""Call sites on the request path (issue 22): a statement never seen before at a known place
takes the stack last captured there, and a statement made through a library (an ORM, Django's
execute hook) finds its application site without Python's site path.

Real sqlite3 (its C cursor wrappers) and a "library" module compiled under site-packages (so
the agent classifies its frames as library code, as it does an ORM's)."""

from __future__ import annotations

import os
import sqlite3
import sysconfig
from collections.abc import Callable
from typing import Any

import pytest

from perfsleuth.agent import recorder, stacks

LIBRARY_FILE = os.path.join(sysconfig.get_paths()["purelib"], "fake_orm_for_tests", "query.py")
_LIBRARY_SRC = """
def execute(start_call, sql, params):
    return run(start_call, sql, params)

def run(start_call, sql, params):
    call = start_call("db", "postgresql", sql, params)
    if call is not None:
        call.finish()
    return call
"""
_library: dict[str, Any] = {}
exec(compile(_LIBRARY_SRC, LIBRARY_FILE, "exec"), _library)


def distinct(k: int) -> str:
    # literals written into the text: every statement is new
    return f"SELECT {k} AS k, '{'x' * k}' AS pad FROM t WHERE id IN ({', '.join(['1'] * (k + 1))})"


@pytest.fixture(autouse=True)
def fresh_caches() -> None:
    """Each case captures its own stacks: the recorder's site and stack caches are global, and
    a stack the C run cached would otherwise be taken by the Python run as it was."""
    recorder.forget_sites()


@pytest.fixture(params=["c", "python"])
def site_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C site path (when the accelerator is built) or Python's alone."""
    if request.param == "c":
        if recorder.speedups is None:
            pytest.skip("the C accelerator is not built")
    else:
        monkeypatch.setattr(recorder, "_c_record_call", None, raising=False)
    return str(request.param)


def app_frames(flat: tuple[Any, ...]) -> list[str]:
    """The names of a captured stack's application frames, innermost first."""
    return [c.co_name for c in flat[::2] if stacks.is_app_file(c.co_filename)]


def test_the_library_file_is_library_code() -> None:
    assert stacks.is_app_file(__file__)
    assert not stacks.is_app_file(LIBRARY_FILE)


def test_distinct_statements_at_one_place_share_its_stack(
    in_request: Callable[..., Any], site_path: str
) -> None:
    with in_request("GET /distinct") as req:
        for k in range(6):
            _library["execute"](recorder.start_call, distinct(k), ())
    entries = req.site_list
    assert [e[2] for e in entries] == [distinct(k) for k in range(6)]
    # one stack object for all: captured at the first, taken as it was by the others
    assert all(e[3] is entries[0][3] for e in entries)
    # and it is this function's line, above the library's frames
    names = [c.co_name for c in entries[0][3][::2]]
    assert names[:3] == ["run", "execute", "test_distinct_statements_at_one_place_share_its_stack"]


def test_a_new_statement_from_another_stack_gets_its_own(
    in_request: Callable[..., Any], site_path: str
) -> None:
    def helper(k: int) -> None:
        _library["execute"](recorder.start_call, distinct(k), ())

    def caller_a(k: int) -> None:
        helper(k)

    def caller_b(k: int) -> None:
        helper(k)

    with in_request("GET /two-callers") as req:
        for k in (1, 2):
            caller_a(k)  # one line: one stack
        caller_b(3)
    a1, a2, b3 = req.site_list
    assert a1[3] is a2[3]
    assert b3[3] is not a1[3]
    assert app_frames(b3[3])[:2] == ["helper", "caller_b"]
    assert app_frames(a1[3])[:2] == ["helper", "caller_a"]


def test_sqlite_distinct_statements_share_the_stack(in_request: Callable[..., Any]) -> None:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
    db.execute("INSERT INTO t VALUES (1)")
    with in_request("GET /sqlite-distinct") as req:
        for k in range(5):
            db.execute(distinct(k)).fetchall()
    entries = req.site_list
    assert [e[2] for e in entries] == [distinct(k) for k in range(5)]
    assert all(e[3] is entries[0][3] for e in entries)


def test_a_code_classified_anew_is_seen_anew_by_the_site_path(
    in_request: Callable[..., Any], site_path: str
) -> None:
    """The kind of a code object can change while the agent runs (an application package
    resolved after its code was first seen): the site path (C's remembers the kinds it read)
    takes the new kind at the next call."""
    run = _library["run"].__code__
    sql = "SELECT * FROM p WHERE id = %s"

    def site_code(req: recorder.ActiveRequest) -> int:
        assert req.site_list is not None
        return int(req.site_list[-1][4][1])  # the site key: (statement, id(code), lasti)

    with in_request("GET /before") as req:
        _library["execute"](recorder.start_call, sql, (1,))
    assert site_code(req) != id(run)  # the library's frames are passed: this test's line
    stacks._kind[id(run)] = (run, True)  # the library's module is now application code
    try:
        recorder.forget_sites()
        with in_request("GET /after") as req:
            _library["execute"](recorder.start_call, sql, (1,))
        assert site_code(req) == id(run)
    finally:
        stacks._kind.pop(id(run), None)
        recorder.forget_sites()


def test_a_frame_made_a_template_engine_s_anew_is_seen_anew_by_the_c_site_path(
    in_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What templates._engine says of a code can change while the agent runs (the dict is
    cleared when full, and a code freed since may have had the same address): the C site path,
    which remembers the answers it read, takes the new one at the next call and hands a call
    under a template engine's frame to Python's path."""
    if recorder.speedups is None:
        pytest.skip("the C accelerator is not built")
    from perfsleuth.agent import templates

    slow: list[str] = []
    python_path = recorder.ActiveRequest._record_call

    def counted(self: recorder.ActiveRequest, *args: Any) -> int:
        slow.append(args[2])
        return python_path(self, *args)

    monkeypatch.setattr(recorder.ActiveRequest, "_record_call", counted)

    def render(k: int) -> None:  # the frame whose engine answer changes
        _library["execute"](recorder.start_call, "SELECT * FROM p WHERE id = %s", (k,))

    code = render.__code__
    engines_were_on = stacks.templates_on
    recorder._templates_in_c()  # the C site path looks for template engines' frames
    try:
        for k in (1, 2):  # the first call classifies render's code, the second reads it back
            with in_request("GET /plain"):
                render(k)
        assert slow == []  # under no template: recorded in C
        templates._engine[id(code)] = (code, templates.JINJA)
        recorder.forget_sites()
        with in_request("GET /templated"):
            render(3)
        assert slow == ["SELECT * FROM p WHERE id = %s"]  # under an engine's frame: Python's
    finally:
        templates._engine.pop(id(code), None)
        stacks._template_steps.pop(id(code), None)
        recorder.forget_sites()
        if not engines_were_on:
            recorder.speedups.configure(template_key=None, template_engines=None, engine_of=None)


def test_a_library_call_s_known_site_takes_no_python_site_path(
    in_request: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Django's execute hook and SQLAlchemy call the driver from their own frames: the
    site is the application's line above them, found in C (Python's path walked the frames in
    Python for every statement: the fast path's key is the library's frame)."""
    if recorder.speedups is None:
        pytest.skip("the C accelerator is not built")
    slow: list[str] = []
    python_path = recorder.ActiveRequest._record_call

    def counted(self: recorder.ActiveRequest, *args: Any) -> int:
        slow.append(args[2])
        return python_path(self, *args)

    monkeypatch.setattr(recorder.ActiveRequest, "_record_call", counted)
    with in_request("GET /orm") as req:
        for k in range(10):
            _library["execute"](recorder.start_call, "SELECT * FROM p WHERE id = %s", (k,))
        _library["execute"](recorder.start_call, "SELECT * FROM p WHERE id = %(id)s", {"id": 1})
    assert slow == []
    assert req.calls is not None and len(req.calls) == 11 * recorder.ROW
    assert len(req.site_list) == 2
    slots = [recorder.get_field(req.calls, i + recorder.SLOT) for i in range(0, 11 * 40, 40)]
    assert slots == [0] * 10 + [1]
    hashes = {recorder.get_field(req.calls, i + recorder.PH) for i in range(0, 10 * 40, 40)}
    assert len(hashes) == 10  # each call's parameters hashed
    # the dict's parameters are left for the writer to hash, as Python's path leaves them
    assert req.call_value(10 * recorder.ROW, "params") == {"id": 1}
    assert app_frames(req.site_list[0][3])[0] == (
        "test_a_library_call_s_known_site_takes_no_python_site_path"
    )


def test_a_request_s_first_call_at_a_known_place_compares_the_frames_above_it(
    in_request: Callable[..., Any], site_path: str
) -> None:
    """The C site path remembers what a place's first call found (the site and its entry), so
    the next request's first call there skips the walk for the site: it still compares the
    frames above, and a call from the same line under other callers gets its own stack."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")

    def helper() -> None:
        db.execute("SELECT id FROM t WHERE id = ?", (1,)).fetchall()
        _library["execute"](recorder.start_call, "SELECT * FROM p WHERE id = %s", (1,))

    def caller_a() -> None:
        helper()

    def caller_b() -> None:
        helper()

    seen = []
    for caller in (caller_a, caller_a, caller_b, caller_a):
        with in_request("GET /memo") as req:
            caller()
        assert req.site_list is not None and len(req.site_list) == 2
        seen.append(req.site_list)
    a1, a2, b, a3 = seen
    for k in (0, 1):
        assert a2[k] is a1[k]  # the same frames: the entry reused
        assert b[k] is not a1[k]  # the same line under another caller: a new stack
        assert app_frames(b[k][3])[:2] == ["helper", "caller_b"]
        assert b[k][4] == a1[k][4]  # the same site (helper's line)
        assert app_frames(a3[k][3])[:2] == ["helper", "caller_a"]
    recorder.forget_sites()
    with in_request("GET /memo") as req:
        caller_a()
    assert req.site_list is not None
    assert [e[4] for e in req.site_list] == [e[4] for e in a1]
    assert all(e is not old for e, old in zip(req.site_list, a1, strict=True))  # made anew


def test_a_code_classified_anew_moves_a_known_place_s_site_at_the_next_request(
    in_request: Callable[..., Any], site_path: str
) -> None:
    """What the C site path remembers of a place holds only while the code kinds are as they
    were: a library frame turned application code is the site from the next request on,
    without the caches being forgotten."""
    run = _library["run"].__code__
    sql = "SELECT * FROM p WHERE id = %s"
    keys = []
    try:
        for turn in range(4):
            if turn == 2:
                stacks._kind[id(run)] = (run, True)
            with in_request("GET /kinds") as req:
                _library["execute"](recorder.start_call, sql, (1,))
            assert req.site_list is not None
            keys.append(req.site_list[-1][4][1])
    finally:
        stacks._kind.pop(id(run), None)
        recorder.forget_sites()
    assert keys[0] == keys[1] != id(run)
    assert keys[2] == keys[3] == id(run)


def test_calls_alternating_between_statements_at_one_line_keep_their_sites(
    in_request: Callable[..., Any],
) -> None:
    """The C wrappers remember the last site a request's statement took (record_site sets it
    when the site is the calling frame): statements alternating at one line keep their own."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
    a, b = "SELECT id FROM t WHERE id = ?", "SELECT id FROM t WHERE id > ?"
    for _ in range(2):  # the second request: its first calls find the places known
        with in_request("GET /alternate") as req:
            for sql in (a, b, a, a, b, b, a):
                db.execute(sql, (1,)).fetchall()
            db.execute(b, (2,)).fetchall()  # another line
        assert req.site_list is not None and req.calls is not None
        slots = [
            recorder.get_field(req.calls, i + recorder.SLOT)
            for i in range(0, len(req.calls), recorder.ROW)
        ]
        assert slots == [0, 1, 0, 0, 1, 1, 0, 2]
        assert [e[2] for e in req.site_list] == [a, b, b]
        assert req.site_list[1][4] != req.site_list[2][4]
