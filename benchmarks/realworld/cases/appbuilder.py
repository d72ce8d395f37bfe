"""Flask-AppBuilder 4.4.0: the roles list loads each permission's parts one query at a time;
4.4.1 loads them with the permission.

Documented in the 4.4.1 changelog, "fix: performance issues on user and roles list" (#2209,
dpgaspar/Flask-AppBuilder commit 5aae9b68). The roles list (``GET /roles/list/``) shows each
role's permissions; a permission prints as ``PermissionView.__repr__``
(flask_appbuilder/security/sqla/models.py line 81), which reads ``self.permission`` and
``self.view_menu``, lazy relationships: a query for each permission and each view menu not yet
in the session (and one for each role's permissions). 4.4.1 makes both relationships
``lazy="joined"``. The view menus are loaded this way for every permission the page prints: the
roles' permission lists and the search form's choices of permissions. (Each role's list of
permissions still loads with a query of its own in 4.4.1: the fix did not touch that one, so the
suite judges the statements it did.)

Served as a user would: a Flask app built with AppBuilder (a small back office with five model
views, so there are many view menus) on SQLite under gunicorn (2 sync workers), the Admin role
plus 8 team roles holding slices of its permissions, and an admin browsing the roles list (the
buggy page), the index, the permissions list and a product list (the clean pages).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import harness
from harness import Client, Expect, RunResult, Server

APP = "Flask-AppBuilder"
BUGGY, FIXED = "4.4.0", "4.4.1"
PROBLEM = "N+1: view menu per permission shown"
EXPECT = Expect(
    kinds=("n_plus_one",),
    endpoint="GET /roles/list/",
    file_suffix="flask_appbuilder/security/sqla/models.py",
    line=81,
    problem=PROBLEM,
    statements=("SELECT ab_view_menu.", "SELECT ab_permission."),
    known=(
        (
            "SELECT EXISTS (SELECT ? FROM ab_permission_view JOIN ab_permission_view_role",
            "the menu checks each entry's permission with its own query, on every page",
        ),
        (
            "SELECT ab_role.id AS ab_role_id, ab_role.name AS ab_role_name FROM ab_role",
            "the menu's checks for an anonymous user read the public role once per entry "
            "(SecurityManager.get_public_role, the same in both releases): the login page",
        ),
        (
            "SELECT ab_permission_view.id AS ab_permission_view_id, ab_permission_",
            "... and load the public role's permissions again for each entry "
            "(SecurityManager.get_public_permissions -> role.permissions, the same code in both "
            "releases; raised once the login page has enough requests): the login page",
        ),
    ),
)
CLEAN = ["GET /", "GET /permissions/list/", "GET /productview/list/"]
ROUNDS = 30

REQUIREMENTS = [
    "Flask==2.3.3",
    "Werkzeug==2.3.8",
    "SQLAlchemy==1.4.52",
    "Flask-SQLAlchemy==2.5.1",
    "WTForms==3.1.2",
    "marshmallow==3.20.2",
    "marshmallow-sqlalchemy==0.28.2",
    "gunicorn==23.0.0",
]

APP_PY = """\
import os

from flask import Flask
from flask_appbuilder import AppBuilder, Model, ModelView, SQLA
from flask_appbuilder.models.sqla.interface import SQLAInterface
from sqlalchemy import Column, ForeignKey, Integer, Numeric, String

app = Flask(__name__)
app.config.update(
    SQLALCHEMY_DATABASE_URI="sqlite:///" + os.environ["REALWORLD_DB"],
    SQLALCHEMY_TRACK_MODIFICATIONS=False,
    SECRET_KEY="realworld-suite",
)
db = SQLA(app)


class Supplier(Model):
    id = Column(Integer, primary_key=True)
    name = Column(String(100), nullable=False)


class Product(Model):
    id = Column(Integer, primary_key=True)
    name = Column(String(100), nullable=False)
    price = Column(Numeric(8, 2))
    supplier_id = Column(Integer, ForeignKey("supplier.id"))


class Warehouse(Model):
    id = Column(Integer, primary_key=True)
    city = Column(String(100))


class Customer(Model):
    id = Column(Integer, primary_key=True)
    name = Column(String(100))


class Invoice(Model):
    id = Column(Integer, primary_key=True)
    number = Column(String(20))


def view(model, columns):
    return type(
        model.__name__ + "View",
        (ModelView,),
        {"datamodel": SQLAInterface(model), "list_columns": columns},
    )


appbuilder = AppBuilder(app, db.session)
appbuilder.add_view(view(Product, ["name", "price"]), "Products", category="Catalog")
appbuilder.add_view(view(Supplier, ["name"]), "Suppliers", category="Catalog")
appbuilder.add_view(view(Warehouse, ["city"]), "Warehouses", category="Stock")
appbuilder.add_view(view(Customer, ["name"]), "Customers", category="Sales")
appbuilder.add_view(view(Invoice, ["number"]), "Invoices", category="Sales")
"""

SEED = """\
from app import Product, Supplier, app, appbuilder, db

with app.app_context():
    sm = appbuilder.sm
    admin = sm.find_role("Admin")
    sm.add_user("admin", "Ada", "Admin", "admin@example.com", admin, password="admin-pass")
    perms = list(admin.permissions)
    for i in range(8):
        sm.add_role(f"Team {i}", perms[i::3])
    supplier = Supplier(name="Acme")
    db.session.add(supplier)
    for i in range(40):
        db.session.add(Product(name=f"Product {i}", price=i + 0.5, supplier_id=1))
    db.session.commit()
    print("seeded", len(perms), "admin permissions,", len(sm.get_all_roles()), "roles")
"""


def run(role: str, workdir: Path) -> RunResult:
    version = BUGGY if role == "buggy" else FIXED
    result = RunResult(APP, version, role, PROBLEM)
    venv = harness.app_venv(
        f"appbuilder-{version}", [f"Flask-AppBuilder=={version}", *REQUIREMENTS]
    )
    site = workdir / "site"
    site.mkdir(parents=True)
    (site / "app.py").write_text(APP_PY)
    (site / "seed.py").write_text(SEED)
    py = str(venv / "bin" / "python")
    env = {"REALWORLD_DB": str(workdir / "app.db")}
    server = None
    try:
        subprocess.run([py, "seed.py"], cwd=site, env={**os.environ, **env}, check=True)
        port = harness.free_port()
        data = workdir / "data"
        server = Server(
            [str(venv / "bin" / "gunicorn"), "-w", "2", "-b", f"127.0.0.1:{port}", "app:app"],
            data=data,
            port=port,
            cwd=site,
            # The app under test is the installed flask_appbuilder package, not the user's
            # app module that builds on it: say so, as a user reading its findings would.
            env={
                **env,
                "PERFSLEUTH_SERVICE": "appbuilder",
                "PERFSLEUTH_APP_PACKAGES": "flask_appbuilder",
            },
        )
        server.wait_ready("/login/")
        c = Client(port)
        c.form_login("/login/", {"username": "admin", "password": "admin-pass"}, "/roles/list/")
        traffic = harness.drive(
            [
                (lambda: c.get("/roles/list/"), ROUNDS),
                (lambda: c.get("/"), ROUNDS),
                (lambda: c.get("/permissions/list/"), ROUNDS),
                (lambda: c.get("/productview/list/"), ROUNDS),
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
