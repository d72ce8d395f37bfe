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
from pathlib import Path

import django_site
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

APPS = [
    "django_admin_index",
    "ordered_model",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.admin",
]

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


def run(role: str, workdir: Path) -> RunResult:
    version = BUGGY if role == "buggy" else FIXED
    result = RunResult(APP, version, role, PROBLEM)
    venv = harness.app_venv(
        f"admin-index-{version}", [f"django-admin-index=={version}", *REQUIREMENTS]
    )
    proj = workdir / "site"
    django_site.write_project(proj, APPS, django_site.POSTGRES)
    (proj / "seed.py").write_text(SEED.format(groups=GROUPS, links=LINKS_PER_GROUP))
    py = str(venv / "bin" / "python")
    server = None
    with django_site.PostgresDatabase("admin_index") as db:
        env = {"REALWORLD_DB": db, "DJANGO_SETTINGS_MODULE": "proj.settings"}
        try:
            django_site.manage(py, proj, env, "migrate", "-v", "0")
            subprocess.run([py, "seed.py"], cwd=proj, env={**os.environ, **env}, check=True)
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
            harness.conclude(
                result,
                server,
                data,
                traffic,
                EXPECT,
                {ep: ROUNDS for ep in [EXPECT.endpoint, *EXPECT.also, *CLEAN]},
            )
        except Exception as e:  # a case that cannot run is a failed case, with the reason
            result.error = f"{type(e).__name__}: {e}"
            if server is not None:
                result.error += f" | server log: {server.tail(600)}"
        finally:
            if server is not None:
                server.stop()
    return result
