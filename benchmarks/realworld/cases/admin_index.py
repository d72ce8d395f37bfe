"""django-admin-index 3.1.0: an N+1 on every admin page, fixed in 3.1.1.

Documented in the 3.1.1 release tag ("Fixed N + 1 query regression introduced in 3.1.0") and in
pull request maykinmedia/django-admin-index#90 ("Extra .annotate() to AppLink model inside nested
for loop caused classic N+1 query problem ... when you enter any admin page"). In 3.1.0
``AppGroupQuerySet.as_list`` (django_admin_index/models.py) loops over the application groups and,
at line 74, runs ``app.applink_set.annotate(...)`` for each: the ``annotate`` defeats the
``prefetch_related("applink_set")`` above it, so each group costs one query. 3.1.1 prefetches the
annotated links once. The menu is rendered by the ``{% dashboard_app_list %}`` tag of
``django_admin_index/includes/app_list.html``, included by the admin index and changelists.

Served as a user would: a Django 4.2 project on PostgreSQL under gunicorn (sync workers), an
admin with 24 application groups of 4 links each (a back office with many sections), a
superuser browsing the index and a changelist; the login page and the admin's JavaScript
catalog are the clean pages.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import harness
from harness import Client, Expect, RunResult, Server

APP = "django-admin-index"
BUGGY, FIXED = "3.1.0", "3.1.1"
PROBLEM = "N+1: a links query per app group"
EXPECT = Expect(
    kinds=("n_plus_one",),
    endpoint="GET /admin/",
    file_suffix="django_admin_index/models.py",
    line=74,
    problem=PROBLEM,
    # The same loop runs on every admin page that shows the menu.
    also=("GET /admin/auth/user/",),
)
CLEAN = ["GET /admin/login/", "GET /admin/jsi18n/"]
GROUPS, LINKS_PER_GROUP = 24, 4
ROUNDS = 40

REQUIREMENTS = [
    "Django==4.2.16",
    "django-ordered-model==3.7.4",
    "psycopg2-binary==2.9.10",
    "gunicorn==23.0.0",
]

SETTINGS = """\
import os

SECRET_KEY = "realworld-suite"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django_admin_index",
    "ordered_model",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.admin",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "proj.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["REALWORLD_DB"],
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "5432",
    }
}
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

SEED = """\
import django

django.setup()

from django.contrib.auth.models import User
from django_admin_index.models import AppGroup, AppLink, ContentTypeProxy

User.objects.create_superuser("admin", "admin@example.com", "admin-pass")
models = list(ContentTypeProxy.objects.filter(app_label="auth"))
for g in range({groups}):
    group = AppGroup.objects.create(
        name=f"Section {{g}}", slug=f"section-{{g}}", translations={{"en": f"Section {{g}}"}}
    )
    group.models.add(*models)
    for i in range({links}):
        AppLink.objects.create(
            app_group=group,
            name=f"Report {{g}}.{{i}}",
            link=f"/reports/{{g}}/{{i}}/",
            translations={{"en": f"Report {{g}}.{{i}}"}},
        )
print("seeded", AppGroup.objects.count(), "groups", AppLink.objects.count(), "links")
"""


def psql(sql: str) -> None:
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-q", "-c", sql],
        check=True,
        capture_output=True,
    )


def run(role: str, workdir: Path) -> RunResult:
    version = BUGGY if role == "buggy" else FIXED
    result = RunResult(APP, version, role, PROBLEM)
    venv = harness.app_venv(
        f"admin-index-{version}", [f"django-admin-index=={version}", *REQUIREMENTS]
    )
    proj = workdir / "site"
    (proj / "proj").mkdir(parents=True)
    (proj / "proj" / "__init__.py").write_text("")
    (proj / "proj" / "settings.py").write_text(SETTINGS)
    (proj / "proj" / "urls.py").write_text(URLS)
    (proj / "proj" / "wsgi.py").write_text(WSGI)
    (proj / "seed.py").write_text(SEED.format(groups=GROUPS, links=LINKS_PER_GROUP))
    db = f"realworld_admin_index_{uuid.uuid4().hex[:8]}"
    env = {"REALWORLD_DB": db, "DJANGO_SETTINGS_MODULE": "proj.settings"}
    py = str(venv / "bin" / "python")
    psql(f"CREATE DATABASE {db}")
    server = None
    try:
        run_env = {**os.environ, **env}
        subprocess.run(
            [py, "-m", "django", "migrate", "-v", "0"], cwd=proj, env=run_env, check=True
        )
        subprocess.run([py, "seed.py"], cwd=proj, env=run_env, check=True)
        port = harness.free_port()
        data = workdir / "data"
        server = Server(
            [str(venv / "bin" / "gunicorn"), "-w", "2", "-b", f"127.0.0.1:{port}", "proj.wsgi"],
            data=data,
            port=port,
            cwd=proj,
            env={**env, "PERFSLEUTH_SERVICE": "admin-index"},
        )
        server.wait_ready("/admin/login/")
        admin = Client(port)
        admin.django_login("admin", "admin-pass")
        anon = Client(port)
        traffic = harness.drive(
            [
                (lambda: admin.get("/admin/"), ROUNDS),
                (lambda: admin.get("/admin/auth/user/"), ROUNDS),
                (lambda: admin.get("/admin/jsi18n/"), ROUNDS),
                (lambda: anon.get("/admin/login/"), ROUNDS),
            ]
        )
        if set(traffic["statuses"]) != {200}:
            result.error = f"unexpected statuses {traffic['statuses']}"
        server.stop()
        result.requests = harness.requests_by_endpoint(data)
        result.findings = harness.perfsleuth_json("findings", "--limit", "100", data=data)
        harness.judge(
            result,
            EXPECT,
            CLEAN,
            {ep: ROUNDS for ep in [EXPECT.endpoint, *EXPECT.also, *CLEAN]},
        )
    except Exception as e:  # a case that cannot run is a failed case, with the reason
        result.error = f"{type(e).__name__}: {e}"
        if server is not None:
            result.error += f" | server log: {server.tail(600)}"
    finally:
        if server is not None:
            server.stop()
        psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    return result
