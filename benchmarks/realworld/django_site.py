"""The Django project a case serves its app from: what a user writes around a reusable app
(settings, URLs, wsgi, manage.py), nothing of the app itself."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

SETTINGS = """\
import os

SECRET_KEY = "realworld-suite"
DEBUG = {debug}
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = {apps!r}
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
] + {extra_middleware!r}
ROOT_URLCONF = "proj.urls"
TEMPLATES = [
    {{
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {{
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        }},
    }}
]
DATABASES = {{"default": {database}}}
STATIC_URL = "/static/"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
"""

URLS = """\
from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
"""

WSGI = """\
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
application = get_wsgi_application()
"""

MANAGE = """\
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""

SQLITE = '{"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["REALWORLD_DB"]}'
POSTGRES = (
    '{"ENGINE": "django.db.backends.postgresql", "NAME": os.environ["REALWORLD_DB"],'
    ' "USER": "postgres", "HOST": "127.0.0.1", "PORT": "5432"}'
)


def write_project(
    root: Path,
    apps: list[str],
    database: str,
    debug: bool = False,
    extra_middleware: list[str] | None = None,
    urls: str = URLS,
    extra_settings: str = "",
) -> None:
    """``root/proj`` (settings, urls, wsgi) and ``root/manage.py``."""
    (root / "proj").mkdir(parents=True)
    (root / "proj" / "__init__.py").write_text("")
    (root / "proj" / "settings.py").write_text(
        SETTINGS.format(
            debug=debug, apps=apps, database=database, extra_middleware=extra_middleware or []
        )
        + extra_settings
    )
    (root / "proj" / "urls.py").write_text(urls)
    (root / "proj" / "wsgi.py").write_text(WSGI)
    (root / "manage.py").write_text(MANAGE)


def psql(sql: str) -> None:
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-q", "-c", sql],
        check=True,
        capture_output=True,
    )


class PostgresDatabase:
    """A fresh database on the local PostgreSQL for one run, dropped afterwards."""

    def __init__(self, prefix: str) -> None:
        self.name = f"realworld_{prefix}_{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> str:
        psql(f"CREATE DATABASE {self.name}")
        return self.name

    def __exit__(self, *exc: object) -> None:
        psql(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")


def manage(python: str, root: Path, env: dict[str, str], *args: str) -> None:
    subprocess.run([python, "manage.py", *args], cwd=root, env={**os.environ, **env}, check=True)
