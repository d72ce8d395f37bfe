"""An application installed as a package (issue 15 item 8): its frames are application code
although they live in site-packages, and a launcher script (``bin/uvicorn``) never is.

The app package is written here and really installed (``pip install``) into a temporary
virtualenv's site-packages; that virtualenv reaches the project's libraries (uvicorn,
Starlette, Django, perfsleuth) through a ``.pth`` file. pip writes the ``bin/uvicorn``
console-script shim from the package's entry point, as installing uvicorn would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import pytest

from perfsleuth.agent.launch import command_env, served_packages
from perfsleuth.store.duckdb_store import DuckDBStore
from test_run_servers import child_env, launched

PYPROJECT = """\
[build-system]
requires = []
build-backend = "wheel_backend"
backend-path = ["."]

[project]
name = "psapp"
version = "0.1"
"""

# A PEP 517 backend of the package's own (the project's venv has no wheel builder): the
# package's files as a wheel, with a console script ``uvicorn`` as uvicorn's own wheel has.
BACKEND = """\
import base64, hashlib, os, zipfile

DIST = "psapp-0.1.dist-info"
META = {
    "METADATA": "Metadata-Version: 2.1\\nName: psapp\\nVersion: 0.1\\n",
    "WHEEL": "Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    "entry_points.txt": "[console_scripts]\\nuvicorn = uvicorn.main:main\\n",
}


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = "psapp-0.1-py3-none-any.whl"
    files = {}
    for top in ("psapp", "psdj", "psext"):
        for fn in sorted(os.listdir(top)):
            if fn.endswith(".py"):
                with open(os.path.join(top, fn), "rb") as fh:
                    files[top + "/" + fn] = fh.read()
    for fn, text in META.items():
        files[DIST + "/" + fn] = text.encode()
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{path},sha256={digest.decode()},{len(data)}")
        record.append(DIST + "/RECORD,,")
        zf.writestr(DIST + "/RECORD", "\\n".join(record) + "\\n")
    return name
"""

WEB = """\
import sqlite3
import time

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

DB = sqlite3.connect(":memory:", check_same_thread=False)
DB.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total INTEGER)")
DB.executemany("INSERT INTO orders VALUES (?, ?)", [(i, 10 * i) for i in range(1, 4)])


def load_total(order_id):
    return DB.execute("SELECT total FROM orders WHERE id = ?", (order_id,)).fetchone()[0]


async def orders(request):
    total = 0
    for i in range(1, 4):
        total += load_total(i)
    return PlainTextResponse(str(total))


async def block(request):
    time.sleep(0.4)  # blocks the event loop
    return PlainTextResponse("done")


app = Starlette(routes=[Route("/orders", orders), Route("/block", block)])
"""

DJANGO_SETTINGS = """\
SECRET_KEY = "x"
INSTALLED_APPS = ["django.contrib.contenttypes", "psdj", "psext"]
ROOT_URLCONF = "psdj.urls"
DATABASES = {}
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with the app package pip-installed into its site-packages."""
    root = tmp_path_factory.mktemp("installed-app")
    src = root / "src"
    for name, text in {
        "pyproject.toml": PYPROJECT,
        "wheel_backend.py": BACKEND,
        "psapp/__init__.py": "",
        "psapp/web.py": WEB,
        "psdj/__init__.py": "",
        "psdj/settings.py": DJANGO_SETTINGS,
        "psdj/urls.py": "urlpatterns = []\n",
        "psdj/views.py": "def index(request):\n    return None\n",
        "psext/__init__.py": "",  # a reusable app of its own distribution, in INSTALLED_APPS
        "psext/models.py": "",
    }.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # the project's libraries (and its editable perfsleuth), .pth files included
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib, "project_libs.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    subprocess.run(
        [
            str(python), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
            "--no-build-isolation", str(src),
        ],
        check=True,
        env=child_env(),
    )  # fmt: skip
    installed = Path(purelib, "psapp", "web.py")
    assert installed.is_file() and (env_dir / "bin" / "uvicorn").is_file()
    return env_dir


def site_packages(venv: Path) -> str:
    return str(next(venv.glob("lib/python*/site-packages")))


def test_served_packages_from_server_commands() -> None:
    assert served_packages(["uvicorn", "shop.asgi:app", "--port", "8000"]) == ["shop"]
    assert served_packages(["/v/bin/gunicorn", "-b", "127.0.0.1:80", "site.wsgi:application"]) == [
        "site"
    ]
    assert served_packages(["python3", "-m", "uvicorn", "--factory", "pkg.main:create"]) == ["pkg"]
    assert served_packages(
        ["gunicorn", "--bind=localhost:80", "-k", "uvicorn.workers.X", "a:b"]
    ) == ["a"]
    assert served_packages(["python", "manage.py", "runserver", "0.0.0.0:8000"]) == []
    env = command_env(
        ["uvicorn", "shop.asgi:app"], "/tmp/d", None, {"PERFSLEUTH_APP_PACKAGES": "x"}
    )
    assert env["PERFSLEUTH_APP_PACKAGES"] == "x,shop"


def test_installed_app_under_uvicorn_is_application_code(venv: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    uvicorn = str(venv / "bin" / "uvicorn")
    cmd = [uvicorn, "psapp.web:app", "--host", "127.0.0.1", "--port", "{port}"]
    with launched(tmp_path, data, cmd, service="installed", ready="/missing") as srv:
        assert srv.get("/orders") == (200, b"60")
        assert srv.get("/block") == (200, b"done")
        srv.stop()
    web = os.path.join(site_packages(venv), "psapp", "web.py")
    with DuckDBStore(str(data)) as s:
        s.ingest()
        (tid,) = [
            r["trace_id"] for r in s.query("SELECT trace_id FROM requests WHERE path = '/orders'")
        ]
        calls = s.trace(tid)["calls"]
        assert len(calls) == 3
        for c in calls:
            assert c["site"] == {"file": web, "line": 14, "function": "load_total"}
            app = [(f["file"], f["function"]) for f in c["stack"] if f["app"]]
            assert app[-2:] == [(web, "orders"), (web, "load_total")]  # outermost first
            assert all(f["app"] == (f["file"] == web) for f in c["stack"])
        blockers = s.blockers(endpoint="GET /block")
        assert blockers, "the blocked loop was not recorded"
        stack: list[dict[str, Any]] = blockers[0]["stack"]
    launchers = [f for f in stack if f["file"] == uvicorn]
    assert launchers and not any(f["app"] for f in launchers)  # recorded, not application
    app_frames = [f for f in stack if f["app"]]
    assert app_frames and app_frames[-1]["file"] == web and app_frames[-1]["function"] == "block"
    assert all(f["file"] == web for f in app_frames)


def check_in_venv(venv: Path, code: str, **env: str) -> str:
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", textwrap.dedent(code)],
        env=child_env(**env),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_app_packages_setting_and_django_project(venv: Path) -> None:
    """PERFSLEUTH_APP_PACKAGES names app packages; Django's project is read from its settings
    once they are configured (never imported by the agent)."""
    named = """
        import perfsleuth.agent.stacks as stacks
        import psapp.web, psdj.views
        print(stacks.is_app_file(psapp.web.__file__), stacks.is_app_file(psdj.views.__file__))
    """
    assert check_in_venv(venv, named) == "False False"
    assert check_in_venv(venv, named, PERFSLEUTH_APP_PACKAGES="psapp") == "True False"
    django = """
        import sys
        import perfsleuth.agent.stacks as stacks
        import psdj.views, psext.models
        before = stacks.is_app_file(psdj.views.__file__)
        assert "django" not in sys.modules
        import django
        django.setup()
        import django.contrib.contenttypes.models as ct
        print(before, stacks.is_app_file(psdj.views.__file__), stacks.is_app_file(django.__file__),
              stacks.is_app_file(psext.models.__file__), stacks.is_app_file(ct.__file__))
    """
    # the project and an installed app are the application; Django and its contrib apps not
    assert (
        check_in_venv(venv, django, DJANGO_SETTINGS_MODULE="psdj.settings")
        == "False True False True False"
    )
    launcher = str(venv / "bin" / "uvicorn")
    shim = "import perfsleuth.agent.stacks as s, sys; print(s.is_app_file(sys.argv[1]))"
    r = subprocess.run([str(venv / "bin" / "python"), "-c", shim, launcher],
                       capture_output=True, text=True, env=child_env())  # fmt: skip
    assert r.stdout.strip() == "False", r.stderr


def test_console_script_shims_are_never_application_code(venv: Path, tmp_path: Path) -> None:
    """pip's shim copied out of any bin/ directory is still a launcher; a script of the
    application's without an extension is application code."""
    from perfsleuth.agent import stacks

    tools = tmp_path / "tools"
    tools.mkdir()
    shim = tools / "serve"
    shim.write_bytes((venv / "bin" / "uvicorn").read_bytes())
    legacy = tools / "serve-legacy"  # what pip wrote before removesuffix
    legacy.write_text(
        "import re\nimport sys\nfrom uvicorn.main import main\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        "    sys.exit(main())\n"
    )
    own = tools / "manage"
    own.write_text("import sys\nfrom shop.cli import run\nsys.exit(run())\n")
    assert stacks.is_app_file(str(shim)) is False
    assert stacks.is_app_file(str(legacy)) is False
    assert stacks.is_app_file(str(own)) is True
    assert stacks.is_app_file(str(venv / "bin" / "python")) is False
