"""Wagtail 5.0.5: the admin's users index runs a profile query per user listed; 5.1 joins it.

Documented in the Wagtail 5.1 changelog and release notes, "Fix: Avoid N+1 queries in users
index view" (wagtail/wagtail commit a6c9409e03). In 5.0.x each row of the users index
(``GET /admin/users/``, 20 users a page) shows the user's avatar: the ``{% avatar user=user %}``
tag of wagtailusers/users/list.html (line 39, in the ``{% for user in users %}`` of line 34)
calls ``avatar_url`` (wagtail/admin/templatetags/wagtailadmin_tags.py), whose
``hasattr(user, "wagtail_userprofile")`` (line 710) loads the user's profile: one query per
user. 5.1 adds ``select_related("wagtail_userprofile")`` to the view's queryset.

The dashboard (``GET /admin/``) has a second documented problem: in 5.0.x every part of the
admin that needs the user's explorable root page (the sidebar, the menu items, the dashboard
panels) calls ``get_explorable_root_page`` (wagtail/admin/navigation.py:22), whose
``first_common_ancestor`` runs the same three root-page queries (wagtail/query.py lines 321,
348, 373) each time: 5 times a dashboard request (37 queries a request against 22 in 5.1), 3
times a page explorer request.
5.1 caches the result on the user for the request: wagtail/wagtail commit 92510e7f13, "Cache
explorable root page on user object via PagePermissionPolicy" ("This method is used all
around the admin ... so cache the result on the user for the duration of the request"; the
commit lowers Wagtail's own assertNumQueries for the page editor, 39 to 35, and the images
index, 14 to 12), part of the 5.1 changelog's "Refactor UserPagePermissionsProxy and
PagePermissionTester to use PagePermissionPolicy".

Served as a user would: a Wagtail 5 site (Django 4.2, SQLite) under gunicorn (2 sync workers),
120 editors (a third of them with a profile), a superuser browsing the users index pages (the
buggy page), the dashboard and the page explorer (the second problem) and the groups index
(the clean page).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import django_site
import harness
from harness import Client, Expect, RunResult, Server

APP = "wagtail"
BUGGY, FIXED = "5.0.5", "5.1"
PROBLEM = "N+1: a profile query per user listed"
EXPECT = Expect(
    kinds=("n_plus_one",),
    endpoint="GET /admin/users/",
    file_suffix="wagtail/admin/templatetags/wagtailadmin_tags.py",
    line=710,  # avatar_url: hasattr(user, "wagtail_userprofile")
    other_lines=(711, 713),
    other_places=(("wagtailusers/users/list.html", 39), ("wagtailusers/users/list.html", 34)),
    problem=PROBLEM,
)
# The dashboard's repeated root-page look-up (see above): repeated_query (the same statement
# and parameters) or n_plus_one (5 a request), named in first_common_ancestor or its caller;
# raised or not in 5.0.5 (near the floors), never in 5.1.
ROOT_PAGE = Expect(
    kinds=("n_plus_one", "repeated_query"),
    endpoint="GET /admin/",
    also=("GET /admin/pages/",),  # the explorer repeats it too (3 a request), gone in 5.1
    file_suffix="wagtail/admin/navigation.py",
    line=22,  # get_explorable_root_page: pages.first_common_ancestor(...), uncached
    other_places=(("wagtail/query.py", 321), ("wagtail/query.py", 348), ("wagtail/query.py", 373)),
    statements=(
        'SELECT ? AS "a" FROM "wagtailcore_page" WHERE "wagtailcore_page"."depth" = ?',
        'SELECT "wagtailcore_page"."path" FROM "wagtailcore_page" WHERE',
        'SELECT "wagtailcore_page"."id", "wagtailcore_page"."path", "wagtailcore_page"."depth"',
    ),
    problem="repeated root-page look-up (5 a request)",
    # 5 repeats of 3 fast SQLite statements: 5-10 % of the dashboard's time, which crosses
    # n_plus_one's or repeated_query's cost floor in some runs and not in others
    required=False,
)
CLEAN = ["GET /admin/groups/"]
ROUNDS = 25

REQUIREMENTS = ["Django==4.2.16", "gunicorn==23.0.0"]

APPS = [
    "wagtail.users",
    "wagtail.snippets",
    "wagtail.documents",
    "wagtail.images",
    "wagtail.sites",
    "wagtail.admin",
    "wagtail",
    "modelcluster",
    "taggit",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
]

URLS = """\
from django.urls import include, path
from wagtail import urls as wagtail_urls
from wagtail.admin import urls as wagtailadmin_urls

urlpatterns = [path("admin/", include(wagtailadmin_urls)), path("", include(wagtail_urls))]
"""

EXTRA_SETTINGS = """
WAGTAIL_SITE_NAME = "Realworld"
WAGTAILADMIN_BASE_URL = "http://127.0.0.1"
"""

SEED = """\
import django

django.setup()

from django.contrib.auth.models import Group, User
from wagtail.users.models import UserProfile

User.objects.create_superuser("admin", "admin@example.com", "admin-pass")
editors = Group.objects.get(name="Editors")
for i in range(120):
    user = User.objects.create_user(
        f"editor{{i:03d}}", f"editor{{i}}@example.com", "pw", first_name="Ed", last_name=str(i)
    )
    user.groups.add(editors)
    if i % 3 == 0:
        UserProfile.objects.create(user=user, preferred_language="en")
print("seeded", User.objects.count(), "users", UserProfile.objects.count(), "profiles")
"""


def run(role: str, workdir: Path) -> RunResult:
    version = BUGGY if role == "buggy" else FIXED
    result = RunResult(APP, version, role, PROBLEM)
    venv = harness.app_venv(f"wagtail-{version}", [f"wagtail=={version}", *REQUIREMENTS])
    proj = workdir / "site"
    django_site.write_project(
        proj, APPS, django_site.SQLITE, urls=URLS, extra_settings=EXTRA_SETTINGS
    )
    (proj / "seed.py").write_text(SEED.format())
    py = str(venv / "bin" / "python")
    env = {"REALWORLD_DB": str(workdir / "db.sqlite3"), "DJANGO_SETTINGS_MODULE": "proj.settings"}
    server = None
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
            env={**env, "PERFSLEUTH_SERVICE": "wagtail"},
        )
        server.wait_ready("/admin/login/")
        admin = Client(port)
        admin.django_login("admin", "admin-pass")
        pages = iter(range(10**6))

        def users() -> int:
            return admin.get(f"/admin/users/?p={1 + next(pages) % 6}")

        traffic = harness.drive(
            [
                (users, ROUNDS),
                (lambda: admin.get("/admin/"), ROUNDS),
                (lambda: admin.get("/admin/pages/"), ROUNDS),
                (lambda: admin.get("/admin/groups/"), ROUNDS),
            ]
        )
        harness.conclude(
            result,
            server,
            data,
            traffic,
            EXPECT,
            {ep: ROUNDS for ep in [EXPECT.endpoint, ROOT_PAGE.endpoint, *ROOT_PAGE.also, *CLEAN]},
            also=(ROOT_PAGE,),
        )
    except Exception as e:  # a case that cannot run is a failed case, with the reason
        result.error = f"{type(e).__name__}: {e}"
        if server is not None:
            result.error += f" | server log: {server.tail(600)}"
    finally:
        if server is not None:
            server.stop()
    return result
