"""Template lines in call stacks (issue 15 item 4, agent side): a query triggered from a Django
or a Jinja2 template carries, in its stored stack, the template file and the lines of the
expression and of its enclosing ``{% for %}``; calls from one Python line under two template
lines are sites (and stacks) of their own.

Real servers (gunicorn under ``perfsleuth run``, the agent as deployed, the C accelerator
included), real Django and Flask/Jinja2 templates, the spool ingested by the real store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.store.duckdb_store import DuckDBStore
from test_django_versions import DJANGOS, _venv
from test_run_servers import APPS, child_env, gunicorn, launched

DJANGO_TEMPLATE = os.path.join(APPS, "tpl_django", "templates", "checks.html")
JINJA_TEMPLATE = os.path.join(APPS, "tpl_flask_templates", "checks.html")
ROWS = 5  # checks on each page


def django_python(series: str) -> str:
    """The python to run Django ``series`` with (the venvs of test_django_versions)."""
    if metadata.version("django") == DJANGOS[series]:
        return sys.executable
    return str(_venv(series))


def stored_calls(data: Path, path: str) -> list[list[dict[str, Any]]]:
    """The db calls of every request to ``path``, with their stored stacks and sites."""
    with DuckDBStore(str(data)) as s:
        s.ingest()
        tids = [
            r["trace_id"]
            for r in s.query("SELECT trace_id FROM requests WHERE path = ? ORDER BY ts", [path])
        ]
        return [[c for c in s.trace(t)["calls"] if c["kind"] == "db"] for t in tids]


def template_frames(call: dict[str, Any], template: str) -> list[tuple[int, str, bool]]:
    """(line, function, app) of the stack's frames in ``template``, innermost first."""
    return [
        (f["line"], f["function"], f["app"])
        for f in reversed(call["stack"])
        if f["file"] == template
    ]


@pytest.mark.parametrize(
    ("series", "speedups"),
    [("5.x", "1"), ("5.x", "0"), pytest.param("3.2", "1", marks=pytest.mark.venvs)],
)
def test_django_template_lines_in_stacks(tmp_path: Path, series: str, speedups: str) -> None:
    python = django_python(series)
    db = str(tmp_path / "django.sqlite3")
    env = child_env(TPL_DJANGO_DB=db, DJANGO_SETTINGS_MODULE="tpl_django.settings")
    seeded = subprocess.run(
        [python, "-m", "tpl_django.seed"], cwd=APPS, env=env, capture_output=True
    )
    assert seeded.returncode == 0, seeded.stderr.decode()
    data = tmp_path / "data"
    server = [python, *gunicorn("tpl_django.wsgi:application", 1)[1:]]
    with launched(tmp_path, data, server, service="dj",
                  ready="/missing/", TPL_DJANGO_DB=db,
                  DJANGO_SETTINGS_MODULE="tpl_django.settings",
                  PERFSLEUTH_SPEEDUPS=speedups) as srv:  # fmt: skip
        for _ in range(2):
            status, body = srv.get("/checks/")
            assert status == 200 and body.count(b" links") == ROWS, body
        srv.stop()
    pages = stored_calls(data, "/checks/")
    assert len(pages) == 2
    for calls in pages:  # the first request (the first stacks of the process) too
        owners = [c for c in calls if "tpl_django_owner" in c["fingerprint"]]
        links = [c for c in calls if "tpl_django_link" in c["fingerprint"]]
        assert len(owners) == ROWS and len(links) == 2 * ROWS, [c["fingerprint"] for c in calls]
        for c in owners:
            # Django's ORM issues it: the call site is the template expression, in the loop
            assert template_frames(c, DJANGO_TEMPLATE) == [
                (4, "{{ check.owner.name }}", True),
                (3, "{% for check in checks %}", True),
            ]
            assert c["site"] == {
                "file": DJANGO_TEMPLATE,
                "line": 4,
                "function": "{{ check.owner.name }}",
            }
        # the model property's line issues both: the template lines tell them apart
        seen = sorted(template_frames(c, DJANGO_TEMPLATE)[0][0] for c in links)
        assert seen == [5] * ROWS + [6] * ROWS
        for c in links:
            assert template_frames(c, DJANGO_TEMPLATE)[1:] == [
                (3, "{% for check in checks %}", True)
            ]
            assert c["site"]["function"] == "Check.link_count"
            assert c["site"]["file"].endswith(os.path.join("tpl_django", "models.py"))


@pytest.mark.parametrize("speedups", ["1", "0"])
def test_jinja2_template_lines_in_stacks(tmp_path: Path, speedups: str) -> None:
    data = tmp_path / "data"
    with launched(tmp_path, data, gunicorn("tpl_flask:app", 1), service="flask",
                  ready="/missing", PERFSLEUTH_SPEEDUPS=speedups) as srv:  # fmt: skip
        for _ in range(2):
            status, body = srv.get("/checks")
            assert status == 200 and body.count(b"https://example.test/") == 2 * ROWS, body
        srv.stop()
    pages = stored_calls(data, "/checks")
    assert len(pages) == 2
    for calls in pages:
        urls = [c for c in calls if "FROM links WHERE" in c["fingerprint"]]
        assert len(urls) == 2 * ROWS, [c["fingerprint"] for c in calls]
        lines = []
        for c in urls:
            frames = template_frames(c, JINJA_TEMPLATE)
            # the template's compiled code is shown at its template lines, not its own
            assert frames[1:] == [(3, "{% for check in checks %}", True)], frames
            assert frames[0][2] is True
            lines.append(frames[0][:2])
            assert c["site"]["function"] == "Check.url"
        # a line is named by its tags (the markup around them left out)
        line4 = "{{ check.url }} {{ check.id }}"
        assert sorted(lines) == [(4, line4)] * ROWS + [(5, "{{ check.url }}")] * ROWS


def test_no_template_no_template_frames(tmp_path: Path) -> None:
    """A page without a template (same app, same engine loaded) has the plain stack."""
    data = tmp_path / "data"
    with launched(tmp_path, data, gunicorn("tpl_flask:app", 1), service="flask",
                  ready="/plain") as srv:  # fmt: skip
        assert srv.get("/plain")[0] == 200
        srv.stop()
    pages = stored_calls(data, "/plain")
    assert len(pages) == 2  # the readiness probe and the request
    for calls in pages:
        assert len(calls) == 1
        files = {f["file"] for f in calls[0]["stack"]}
        assert not any(f.endswith(".html") for f in files)
        assert calls[0]["site"]["function"] == "plain"


def test_jinja2_nested_loops_and_macros_in_process(tmp_path: Path) -> None:
    """The template frames of a call under a macro called from nested loops, innermost
    first: the macro's line, the caller's line, then each enclosing loop's line."""
    import jinja2

    from perfsleuth.agent import stacks

    (tmp_path / "page.html").write_text(
        "{% macro row(c) %}\n"
        "  <td>{{ c.probe }}</td>\n"
        "{% endmacro %}\n"
        "{% for group in groups %}\n"
        "  {% for c in group %}\n"
        "    {{ row(c) }}\n"
        "  {% endfor %}\n"
        "{% endfor %}\n"
    )
    seen: list[list[tuple[str, int, str]]] = []

    class Probe:
        @property
        def probe(self) -> str:
            flat = stacks.capture(sys._getframe())
            seen.append(
                [
                    (code.co_filename, stacks.line(code, where), code.co_qualname)
                    for code, where in zip(flat[::2], flat[1::2], strict=True)
                ]
            )
            return "x"

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tmp_path)))
    env.get_template("page.html").render(groups=[[Probe()], [Probe(), Probe()]])
    page = str(tmp_path / "page.html")
    assert len(seen) == 3
    for frames in seen:
        assert [(line, name) for fn, line, name in frames if fn == page] == [
            (2, "{{ c.probe }}"),
            (6, "{{ row(c) }}"),
            (5, "{% for c in group %}"),
            (4, "{% for group in groups %}"),
        ]
        assert frames[0][2].endswith("probe")  # the property itself, innermost


def test_same_stack_tells_template_lines_apart(tmp_path: Path) -> None:
    """stacks.same (the site cache's reuse check) agrees with capture under a template: the
    same template line again is the same stack, another template line of the same Python
    line is not."""
    import jinja2

    from perfsleuth.agent import stacks

    (tmp_path / "t.html").write_text(
        "{% for c in items %}\n  {{ c.probe }}\n  {{ c.probe }}\n{% endfor %}\n"
    )
    stacks_seen: list[tuple[Any, ...]] = []
    same_as_first: list[bool] = []

    class Probe:
        @property
        def probe(self) -> str:
            frame = sys._getframe(1)  # the caller: it stays where it is during the checks
            flat = stacks.capture(frame)
            if not stacks_seen:
                stacks_seen.append(flat)
            same_as_first.append(stacks.same(frame, stacks_seen[0]))
            assert stacks.same(frame, flat)
            return ""

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tmp_path)))
    env.get_template("t.html").render(items=[Probe(), Probe()])
    # line 2, line 3, line 2, line 3
    assert same_as_first == [True, False, True, False]
