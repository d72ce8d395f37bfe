"""_speedups' cheaper DB-call path (the site memo, the direct C-method call) and its CpuMeter's
throw, against what the Python reference does: a memo slot rewritten, site_cache emptied while
Python code runs in the middle of a recorded call, a driver's C method returning a result with
an exception set, an exception thrown as a type and a value."""

from __future__ import annotations

import dis
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest

from perfsleuth.agent import recorder, shipper, stacks

pytestmark = pytest.mark.skipif(recorder.speedups is None, reason="the C accelerator is not built")


def place(conn: sqlite3.Connection, sql: str) -> None:
    conn.execute(sql).fetchall()


def outer(conn: sqlite3.Connection, sql: str) -> None:
    place(conn, sql)


# two "agent" frames (classified None, so a captured stack ends below them): the first
# request's place is called through entry_a, the second's through entry_b
def entry_a(conn: sqlite3.Connection, sql: str) -> None:
    outer(conn, sql)


def entry_b(conn: sqlite3.Connection, sql: str) -> None:
    outer(conn, sql)


def _c_wrappers() -> None:
    from perfsleuth.agent.instrument import dbapi

    sqlite3.connect(":memory:").close()
    if not dbapi.use_speedups(True):
        pytest.skip("the C accelerator is not built here")


def _call_offset(code: Any) -> int:
    return next(i.offset for i in dis.get_instructions(code) if i.opname == "CALL")


def _memo_index(sql: str, code: Any, lasti: int) -> int:
    h = (id(sql) >> 4) ^ (id(code) >> 6) ^ lasti  # site_memo_slot
    return (h ^ (h >> 7)) & 63


def _classifier(armed: list[bool], meanwhile: Callable[[], Any]) -> Callable[[Any], Any]:
    """stacks.classify for the tests below: entry_a and entry_b are library frames, place and
    outer the application's; classifying entry_b while ``armed`` runs ``meanwhile`` once."""
    real = stacks.classify

    def classify(code: Any) -> Any:
        if code is entry_a.__code__ or code is entry_b.__code__:
            if code is entry_b.__code__ and armed[0]:
                armed[0] = False
                meanwhile()
            stacks._kind[id(code)] = (code, None)
            return None
        if code is place.__code__ or code is outer.__code__:  # application code
            stacks._kind[id(code)] = (code, True)
            return True
        return real(code)

    return classify


@pytest.mark.usefixtures("statements_as_made")  # two statement objects of one shape
def test_a_memo_key_hash_rewritten_while_the_stack_is_compared_is_not_used(
    agent_data_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """record_site's memo path reads memo->key_hash after same_stack_at, which may run Python
    code (stacks.classify of a code not seen before; another thread can run meanwhile): a
    statement recorded there writes the same memo slot with its own key's hash, and the
    request's sites dict then gets the first key stored under the second key's hash (the key
    is in the dict but `key in sites` is False; later calls add the site again)."""
    lasti = _call_offset(place.__code__)
    sql1 = "SELECT 11"
    want = _memo_index(sql1, place.__code__, lasti)
    keep = [f"SELECT {n} -- memo" for n in range(2000)]
    sql2 = next(s for s in keep if _memo_index(s, place.__code__, lasti) == want)
    _c_wrappers()
    conn = sqlite3.connect(":memory:")
    armed = [False]
    # what another thread could record meanwhile
    classify = _classifier(armed, lambda: place(conn, sql2))
    got: list[recorder.ActiveRequest] = []
    monkeypatch.setattr(recorder, "_classify", classify)
    recorder.configure(got.append, max_calls=20000, stacks_per_site=1)
    recorder.forget_sites()
    for fn in (entry_a, entry_b, place, outer):  # not classified yet
        stacks._kind.pop(id(fn.__code__), None)
    try:
        req = recorder.speedups.begin("web", "GET", "/a")
        entry_a(conn, sql1)  # the site's entry captured, the memo written
        recorder.speedups.end(req)
        req = recorder.speedups.begin("web", "GET", "/b")
        armed[0] = True
        entry_b(conn, sql1)  # the memo's entry reused: same_stack_at classifies entry_b
        assert not armed[0], "classify(entry_b) was not called"
        sites = dict(req.sites)
        keys = list(req.sites)
        found = [(k[0], k[1], k[2]) in req.sites for k in keys]  # equal keys, made anew
        entry_b(conn, sql1)
        recorder.speedups.end(req)
    finally:
        monkeypatch.undo()
        recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1)
        conn.close()
    assert len(sites) == 2, (sites, [e[2] for e in req.site_list], sql2)
    assert found == [True, True], keys
    statements = [e[2] for e in req.site_list]  # the third call at the same site: no new site
    assert sorted(statements) == sorted([sql1, sql2]), statements


def test_a_site_forgotten_while_its_stack_is_compared_is_captured_again(
    agent_data_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """record_site writes the memo's cache_version after same_stack, which may run Python code
    (stacks.classify) that empties site_cache (forget_sites: the shipper's memory budget,
    another thread): a memo taking site_cache's new tag for a key it no longer maps would
    answer "cached" while site_cache stays unchanged, and its entry would be reused without
    site_cache holding it. The Python reference captures the site again at the next request,
    into site_cache. (On versions without the memo: the same outcome.)"""
    sql = "SELECT 12"
    _c_wrappers()
    conn = sqlite3.connect(":memory:")
    armed = [False]
    # what another thread could do meanwhile
    classify = _classifier(armed, recorder.forget_sites)
    got: list[recorder.ActiveRequest] = []
    monkeypatch.setattr(recorder, "_classify", classify)
    recorder.configure(got.append, max_calls=20000, stacks_per_site=1)
    recorder.forget_sites()
    for fn in (entry_a, entry_b, place, outer):  # not classified yet
        stacks._kind.pop(id(fn.__code__), None)
    # no template engine known (an earlier test may have loaded one): find_site's walk then
    # stops at the site (place) and entry_b is first classified while the stack is compared
    templates_on = stacks.templates_on
    recorder.speedups.configure(template_key=None, template_engines=None, engine_of=None)
    try:
        steps = (("/1", entry_a, False), ("/2", entry_b, True), ("/3", entry_b, False))
        for path, entry, arm in steps:
            if arm:
                stacks._kind[0] = (None, None)  # code_kinds' tag moves: the memo not used
                armed[0] = True
            req = recorder.speedups.begin("web", "GET", path)
            entry(conn, sql)
            key = next(iter(req.sites))
            recorder.speedups.end(req)
            if arm:
                assert not armed[0], "classify(entry_b) was not called"
                # classify ran after site_cache was read (emptied, the site not in it)
                assert key not in recorder._site_cache
    finally:
        if templates_on:
            recorder._templates_in_c()
        stacks._kind.pop(0, None)
        monkeypatch.undo()
        recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1)
        conn.close()
    assert key in recorder._site_cache


def _method_returning_a_result_with_an_error() -> Any:
    """A method descriptor of list whose C function (_testcapi.return_result_with_error,
    METH_NOARGS) returns None with an exception set: a buggy driver's method."""
    import ctypes

    _testcapi = pytest.importorskip("_testcapi")
    fn = _testcapi.return_result_with_error
    # PyCFunctionObject: the object's head (reference count, type), then its PyMethodDef
    method_def = ctypes.c_void_p.from_address(id(fn) + 2 * ctypes.sizeof(ctypes.c_void_p))
    new = ctypes.pythonapi.PyDescr_NewMethod
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.py_object, ctypes.c_void_p]
    return new(list, method_def.value)


def _outcome(call: Any) -> tuple[Any, ...]:
    try:
        result = call()
    except Exception as e:
        return ("raised", type(e), str(e), type(e.__cause__))
    return ("returned", result)


def test_a_c_method_s_result_with_an_exception_set_raises_as_the_method_s_own_call(
    agent_data_dir: str,
) -> None:
    """The wrapper's direct call of a C method checks its result as the generic call does: a
    result with an exception set is a SystemError (caused by that exception) out of the call,
    not an error the wrapper clears and counts as its own."""
    method = _method_returning_a_result_with_an_error()
    wrapper = recorder.speedups.CursorMethod(method, recorder.speedups.FETCHALL)
    errors = recorder.stats.get("internal_errors", 0)
    want = _outcome(lambda: method([]))
    assert want[:2] == ("raised", SystemError), want
    assert _outcome(lambda: wrapper([])) == want
    assert recorder.stats.get("internal_errors", 0) == errors


class _Suspend:
    def __await__(self) -> Any:
        yield "suspended"


@pytest.mark.parametrize("meter", ["c", "python"])
@pytest.mark.parametrize(
    "args, want",
    [
        ((KeyError, "k"), ("k",)),
        ((KeyError, ("a", "b")), ("a", "b")),
        ((KeyError, None), ()),
        ((KeyError, KeyError("same")), ("same",)),
        ((KeyError,), ()),
        ((KeyError("one"),), ("one",)),
        ((KeyError, "k", None), ("k",)),
    ],
)
def test_a_cpu_meter_s_throw_reaches_the_app_as_a_generator_s_throw_makes_it(
    agent_data_dir: str, meter: str, args: tuple[Any, ...], want: tuple[Any, ...]
) -> None:
    """throw(type[, value[, tb]]) into a metered request's coroutine: the app gets the
    exception a generator's throw makes of them (a value that is not an instance of the type
    is the type's argument), and handles it."""
    from perfsleuth.agent.frameworks import asgi as ps_asgi

    cls = recorder.speedups.CpuMeter if meter == "c" else ps_asgi.CpuMeter
    seen: list[BaseException] = []

    async def app() -> str:
        try:
            await _Suspend()
        except KeyError as e:
            seen.append(e)
            return "handled"
        return "not thrown"

    req = recorder.begin("web", "GET", "/throw", cls=ps_asgi._AsgiRequest)
    assert req is not None
    req.cpu_ns = 0
    try:
        aw = cls(req, app())
        assert aw.send(None) == "suspended"
        with pytest.raises(StopIteration) as stop:
            aw.throw(*args)
    finally:
        recorder.end(req)
    assert stop.value.value == "handled"
    assert len(seen) == 1 and type(seen[0]) is KeyError and seen[0].args == want
    if isinstance(args[-1], KeyError):
        assert seen[0] is args[-1]


@pytest.mark.parametrize("meter", ["c", "python"])
def test_a_cpu_meter_s_throw_of_an_instance_with_a_value_is_a_type_error(
    agent_data_dir: str, meter: str
) -> None:
    """throw(instance, value) raises the TypeError a generator's throw raises; the app stays
    suspended and runs on."""
    from perfsleuth.agent.frameworks import asgi as ps_asgi

    cls = recorder.speedups.CpuMeter if meter == "c" else ps_asgi.CpuMeter

    async def app() -> str:
        await _Suspend()
        return "done"

    req = recorder.begin("web", "GET", "/throw", cls=ps_asgi._AsgiRequest)
    assert req is not None
    req.cpu_ns = 0
    try:
        aw = cls(req, app())
        assert aw.send(None) == "suspended"
        with pytest.raises(TypeError, match="instance exception may not have a separate value"):
            aw.throw(KeyError("i"), "v")
        with pytest.raises(StopIteration) as stop:
            aw.send(None)
    finally:
        recorder.end(req)
    assert stop.value.value == "done"
