"""django-auditlog 2.0.0: the log's admin changelist runs two queries per row; 2.1.0 joins them.

Documented in the 2.1.0 changelog ("Fix n+1 query problem", jazzband/django-auditlog#381): the
``LogEntryAdmin`` changelist (``GET /admin/auditlog/logentry/``) shows each entry's resource and
user through ``LogEntryAdminMixin.resource_url`` and ``user_url`` (auditlog/mixins.py), which read
``obj.content_type`` (line 35) and ``obj.actor`` (line 21): one content type query and one user
query per row, 100 rows a page. 2.1.0 adds ``select_related("content_type", "actor")`` to the
admin's queryset.

Served as a developer would see it: Django 3.2 (still widely deployed) on SQLite under
``manage.py runserver`` with ``DEBUG = True``. The project has a small catalogue app whose models
auditlog tracks; the seed makes 20 staff users and 600 changes to 5 kinds of object, so the log
has many actors and content types. A superuser browses the log's changelist (the buggy page),
an entry's change page, the admin index and the catalogue's changelist (the clean pages).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import django_site
import harness
from harness import Client, Expect, RunResult, Server

APP = "django-auditlog"
BUGGY, FIXED = "2.0.0", "2.1.0"
PROBLEM = "N+1: actor and content type per log row"
EXPECT = Expect(
    kinds=("n_plus_one", "repeated_query"),
    endpoint="GET /admin/auditlog/logentry/",
    file_suffix="auditlog/mixins.py",
    line=35,  # resource_url: obj.content_type
    other_lines=(21,),  # user_url: obj.actor
    problem=PROBLEM,
)
CLEAN = [
    "GET /admin/",
    "GET /admin/catalog/book/",
    "GET /admin/auditlog/logentry/<path:object_id>/change/",
]
ROUNDS = 25

REQUIREMENTS = ["Django==3.2.25", "python-dateutil==2.9.0.post0"]

APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.admin",
    "auditlog",
    "catalog",
]

CATALOG_MODELS = """\
from auditlog.registry import auditlog
from django.db import models


class Author(models.Model):
    name = models.CharField(max_length=100)


class Publisher(models.Model):
    name = models.CharField(max_length=100)


class Book(models.Model):
    title = models.CharField(max_length=200)
    price = models.DecimalField(max_digits=8, decimal_places=2)
    stock = models.IntegerField(default=0)


for model in (Author, Publisher, Book):
    auditlog.register(model)
"""

CATALOG_ADMIN = """\
from django.contrib import admin

from .models import Book


@admin.register(Book)
class BookAdmin(admin.ModelAdmin):
    list_display = ["title", "price", "stock"]
"""

SEED = """\
import django

django.setup()

from auditlog.models import LogEntry
from auditlog.registry import auditlog
from django.contrib.auth.models import Group, User

from catalog.models import Author, Book, Publisher

auditlog.register(User)
auditlog.register(Group)
User.objects.create_superuser("admin", "admin@example.com", "admin-pass")
staff = [User.objects.create_user(f"editor{i}", is_staff=True) for i in range(20)]
for i in range(120):
    Author.objects.create(name=f"Author {i}")
    Publisher.objects.create(name=f"Publisher {i}")
    Group.objects.create(name=f"Team {i}")
    book = Book.objects.create(title=f"Book {i}", price=10 + i % 30, stock=i)
    book.stock += 5
    book.save()
# The middleware records who made a change; the seed runs outside a request, so name them here.
for n, entry_id in enumerate(LogEntry.objects.order_by("id").values_list("id", flat=True)):
    LogEntry.objects.filter(id=entry_id).update(actor=staff[n % len(staff)])
print("seeded", LogEntry.objects.count(), "log entries")
"""


def run(role: str, workdir: Path) -> RunResult:
    version = BUGGY if role == "buggy" else FIXED
    result = RunResult(APP, version, role, PROBLEM)
    venv = harness.app_venv(f"auditlog-{version}", [f"django-auditlog=={version}", *REQUIREMENTS])
    proj = workdir / "site"
    django_site.write_project(
        proj,
        APPS,
        django_site.SQLITE,
        debug=True,
        extra_middleware=["auditlog.middleware.AuditlogMiddleware"],
    )
    (proj / "catalog").mkdir()
    (proj / "catalog" / "__init__.py").write_text("")
    (proj / "catalog" / "models.py").write_text(CATALOG_MODELS)
    (proj / "catalog" / "admin.py").write_text(CATALOG_ADMIN)
    (proj / "seed.py").write_text(SEED)
    py = str(venv / "bin" / "python")
    env = {"REALWORLD_DB": str(workdir / "db.sqlite3"), "DJANGO_SETTINGS_MODULE": "proj.settings"}
    server = None
    try:
        django_site.manage(py, proj, env, "makemigrations", "catalog", "-v", "0")
        django_site.manage(py, proj, env, "migrate", "-v", "0")
        subprocess.run([py, "seed.py"], cwd=proj, env={**os.environ, **env}, check=True)
        port = harness.free_port()
        data = workdir / "data"
        server = Server(
            [py, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
            data=data,
            port=port,
            cwd=proj,
            env={**env, "PERFSLEUTH_SERVICE": "auditlog"},
        )
        server.wait_ready("/admin/login/")
        admin = Client(port)
        admin.django_login("admin", "admin-pass")
        entries = iter(range(10**6))

        def entry() -> int:
            return admin.get(f"/admin/auditlog/logentry/{1 + next(entries) * 37 % 600}/change/")

        traffic = harness.drive(
            [
                (lambda: admin.get("/admin/auditlog/logentry/"), ROUNDS),
                (entry, ROUNDS),
                (lambda: admin.get("/admin/"), ROUNDS),
                (lambda: admin.get("/admin/catalog/book/"), ROUNDS),
            ]
        )
        harness.conclude(
            result, server, data, traffic, EXPECT, {ep: ROUNDS for ep in [EXPECT.endpoint, *CLEAN]}
        )
    except Exception as e:  # a case that cannot run is a failed case, with the reason
        result.error = f"{type(e).__name__}: {e}"
        if server is not None:
            result.error += f" | server log: {server.tail(600)}"
    finally:
        if server is not None:
            server.stop()
    return result
