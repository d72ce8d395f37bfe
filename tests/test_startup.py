"""`perfsleuth startup`: the demo shop under uvicorn with a planted slow import, and a Django
project under gunicorn with two workers, measured until they first answer: phases that add up
to the total, the import tree, framework and worker phases, the first request against the
steady state, and --compare against a saved run.

Apps: tests/apps/startup_shop.py (the demo shop behind startup_slow_dep, 1 s at import),
tests/apps/djproject.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from perfsleuth.analysis import startup as st
from perfsleuth.server import create_app
from test_run_servers import APPS, free_port, gunicorn, uvicorn
from test_ui import SHOTS, TOKEN, browser, fmt_ms, wait_ready  # noqa: F401  (fixtures)
from test_ui import page as page


def startup_cli(tmp_path: Path, cmd: list[str], path: str, *extra: str) -> tuple[Any, float]:
    """The JSON report of `perfsleuth startup` on ``cmd`` (its {port} filled in), and the
    test's own wall time of the whole run in ms."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "perfsleuth", "startup", "--url", f"http://127.0.0.1:{port}{path}",
         "--json", *extra, "--", *cmd],
        capture_output=True, text=True, timeout=180, cwd=APPS,
    )  # fmt: skip
    wall_ms = (time.monotonic() - t0) * 1000
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), wall_ms


@contextmanager
def ui_server(data: Path) -> Iterator[str]:
    """The web UI on ``data`` (a real uvicorn in a thread); its base URL."""
    import uvicorn as uv

    port = free_port()
    srv = uv.Server(
        uv.Config(
            create_app(str(data), token=TOKEN), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "the UI server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=30)


def phases(report: dict[str, Any]) -> dict[str, float]:
    return {p["phase"]: p["ms"] for p in report["phases"]}


def test_demo_shop_under_uvicorn(tmp_path: Path, page: Any) -> None:
    saved = tmp_path / "before.json"
    data = tmp_path / "data"
    report, wall_ms = startup_cli(
        tmp_path, uvicorn("startup_shop:app"), "/health", "--save", str(saved), "--data", str(data)
    )
    total = report["total_ms"]
    assert 1000 < total < wall_ms
    ph = phases(report)
    assert abs(sum(ph.values()) - total) <= 0.1 * total
    # the phases are measured, not a remainder: imports alone are most of it, and each
    # framework step was seen
    assert ph["imports"] >= 0.5 * total
    assert ph["interpreter start"] > 0 and ph["first request"] > 0
    assert ph["settings / app factory"] > 0 and ph["framework init"] > 0
    assert ph["lifespan startup"] > 0 and ph["server start"] > 0
    assert ph["worker boot"] == 0
    # the planted slow import is the top entry, marked as the app's own
    top = report["imports"]["slowest"][0]
    assert top["name"] == "startup_slow_dep" and top["app"], report["imports"]["slowest"][:3]
    assert 1000 <= top["self_ms"] < 2000
    root = report["imports"]["tree"][0]
    assert root["name"] == "startup_shop" and root["app"]
    assert "startup_slow_dep" in [c["name"] for c in root["children"]]
    fr = report["first_request"]
    assert fr["ms"] > 0 and fr["steady_p50_ms"] > 0
    assert any(n.startswith("imports took") for n in report["notes"])

    again, _ = startup_cli(
        tmp_path,
        uvicorn("startup_shop:app"),
        "/health",
        "--compare",
        str(saved),
        "--data",
        str(data),
    )
    cmp = again["compare"]
    assert cmp["total"]["before_ms"] == total and cmp["total"]["after_ms"] == again["total_ms"]
    rows = {r["phase"]: r for r in cmp["phases"]}
    assert rows["imports"]["before_ms"] == ph["imports"]
    assert rows["imports"]["change_ms"] == round(phases(again)["imports"] - ph["imports"], 3)

    # The UI's Start-up page shows the saved runs: the newest, against the first.
    with ui_server(data) as base:
        page.goto(f"{base}/?token={TOKEN}#/startup?run={again['name']}&against={report['name']}")
        wait_ready(page, "startup")
        shown = page.locator(".verdict-line").get_attribute("data-total")
        assert float(shown or 0) == again["total_ms"]
        for p in again["phases"]:
            row = page.locator(f".startup-phases tr[data-phase='{p['phase']}']")
            assert row.locator("td[data-col='ms']").inner_text().strip() == fmt_ms(p["ms"])
        top = page.locator(".slowest-imports li").first
        assert top.get_attribute("data-module") == "startup_slow_dep"
        assert "app" in top.inner_text()
        assert page.locator(".import-tree li[data-module='startup_shop'][data-app='1']").count()
        total_row = page.locator(".startup-compare tr[data-phase='total']")
        assert total_row.locator("td[data-col='before_ms']").inner_text().strip() == fmt_ms(total)
        page.screenshot(path=str(SHOTS / "startup.png"), full_page=True)


def test_django_under_gunicorn_two_workers(tmp_path: Path) -> None:
    cmd = gunicorn("djproject.wsgi:application", 2)
    port = free_port()
    raw = st.measure(
        [c.replace("{port}", str(port)) for c in cmd],
        f"http://127.0.0.1:{port}/health/",
        cwd=APPS,
        env={**_env(), "DJANGO_SETTINGS_MODULE": "djproject.settings"},
    )
    report = st.analyze(raw)
    total = report["total_ms"]
    ph = phases(report)
    assert abs(sum(ph.values()) - total) <= 0.1 * total
    assert report["serving_pid"] != report["root_pid"]  # a worker answered
    workers = [p for p in report["processes"] if p["kind"] == "fork"]
    assert len(workers) == 2
    for w in workers:
        names = [s["name"] for s in w["spans"]]
        assert "gunicorn Worker.load_wsgi (import the app)" in names and "django.setup()" in names
    assert ph["worker boot"] > 0 and ph["framework init"] > 0
    assert ph["settings / app factory"] > 0 and ph["imports"] > 0
    framework = {t["name"] for p in report["phases"] for t in p["top"]}
    assert "django.setup()" in framework or "Django apps registry (apps ready)" in framework
    assert any(n.startswith("2 workers each loaded the app") for n in report["notes"])
    app_modules = {n["name"] for n in _walk(report["imports"]["tree"]) if n["app"]}
    assert "djproject.wsgi" in app_modules and "djproject.urls" in app_modules


def _walk(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for n in nodes:
        out.append(n)
        out.extend(_walk(n["children"]))
    return out


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PERFSLEUTH_")}


def test_uvicorn_spawned_workers(tmp_path: Path) -> None:
    report, _ = startup_cli(
        tmp_path, uvicorn("startup_shop:app", "--workers", "2"), "/health", "--data", str(tmp_path)
    )
    total = report["total_ms"]
    assert abs(sum(phases(report).values()) - total) <= 0.1 * total
    workers = [p for p in report["processes"] if p["pid"] != report["root_pid"] and p["spans"]]
    assert len(workers) == 2 and all(p["kind"] == "exec" for p in workers), report["processes"]
    assert report["serving_pid"] in {p["pid"] for p in workers}
    # the path runs through the worker that answered: its own import of the app
    assert report["imports"]["slowest"][0]["name"] == "startup_slow_dep", report["imports"]
    assert any(n.startswith("2 workers each loaded the app") for n in report["notes"]), report
