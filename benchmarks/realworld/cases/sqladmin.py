"""SQLAdmin 0.8.0: a model's list page joins every relationship of the model, shown or not;
0.9.0 joins only the relationships the list shows.

Documented in aminalaee/sqladmin#409, "Fix control relationships in list page" (first released in
0.9.0), after issue #339 ("each of the relationships were being joinedload()'d ... loading, but
then not being used in the rendering of the list view"). In 0.8.0 ``ModelView.list``
(sqladmin/models.py) adds ``joinedload`` for every relationship (lines 786-787) before running
the page's statement (line 803), so a page of 10 customers also loads every order of each: one
row per order, thousands of rows to show 10. 0.9.0 loops over the list's own relationships.

Served as a user would: a FastAPI app with the admin mounted, a synchronous SQLite engine
(queries run in anyio's thread pool), under uvicorn; 100 customers with 1,500 orders each
(each order with its line items as JSON), the customers' list (not showing orders) as the buggy
page, the admin index, the orders' list and an order's detail page as the clean ones.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import harness
from harness import Client, Expect, RunResult, Server

APP = "sqladmin"
BUGGY, FIXED = "0.8.0", "0.9.0"
PROBLEM = "unbounded: all relations joined"
EXPECT = Expect(
    kinds=("oversized_result",),
    endpoint="GET /admin/{identity}/list",
    file_suffix="sqladmin/models.py",
    line=786,  # for relation in self._relations: (the joinedload of every relationship)
    other_lines=(787, 803),  # the joinedload itself; the list's line that runs the statement
    problem=PROBLEM,
)
CLEAN = ["GET /admin/", "GET /admin/{identity}/details/{pk}"]
CUSTOMERS, ORDERS_PER_CUSTOMER = 100, 1_500
ROUNDS = 20

REQUIREMENTS = [
    "fastapi==0.88.0",
    "SQLAlchemy==1.4.46",
    "WTForms==3.0.1",
    "Jinja2==3.1.2",
    "python-multipart==0.0.5",
    "itsdangerous==2.1.2",
    "uvicorn==0.20.0",
]

SHOP = """\
import os

from fastapi import FastAPI
from sqladmin import Admin, ModelView
from sqlalchemy import Column, ForeignKey, Integer, Numeric, String, Text, create_engine
from sqlalchemy.orm import declarative_base, relationship

Base = declarative_base()
engine = create_engine(
    "sqlite:///" + os.environ["REALWORLD_DB"], connect_args={"check_same_thread": False}
)


class Customer(Base):
    __tablename__ = "customer"

    id = Column(Integer, primary_key=True)
    name = Column(String(100))
    email = Column(String(100))
    orders = relationship("Order", back_populates="customer")


class Order(Base):
    __tablename__ = "order"

    id = Column(Integer, primary_key=True)
    customer_id = Column(Integer, ForeignKey("customer.id"), index=True)
    total = Column(Numeric(10, 2))
    items = Column(Text)
    customer = relationship("Customer", back_populates="orders")


class CustomerAdmin(ModelView, model=Customer):
    column_list = [Customer.id, Customer.name, Customer.email]


class OrderAdmin(ModelView, model=Order):
    column_list = [Order.id, Order.total, Order.customer]


app = FastAPI()
admin = Admin(app, engine)
admin.add_view(CustomerAdmin)
admin.add_view(OrderAdmin)
"""

SEED = """\
import json
import random
import sqlite3

from shop import Base, engine

Base.metadata.create_all(engine)
rng = random.Random(11)
db = sqlite3.connect(engine.url.database)
db.executemany(
    "INSERT INTO customer VALUES (?, ?, ?)",
    [(i, f"Customer {{i}}", f"c{{i}}@example.com") for i in range(1, {customers} + 1)],
)
orders = []
n = 0
for c in range(1, {customers} + 1):
    for _ in range({orders}):
        n += 1
        items = [{{"sku": f"SKU-{{rng.randrange(5000):05d}}", "qty": rng.randrange(1, 5)}}
                 for _ in range(3)]
        orders.append((n, c, rng.randrange(500, 50000) / 100, json.dumps(items)))
db.executemany('INSERT INTO "order" VALUES (?, ?, ?, ?)', orders)
db.commit()
print("seeded", {customers}, "customers", n, "orders")
"""


def run(role: str, workdir: Path) -> RunResult:
    version = BUGGY if role == "buggy" else FIXED
    result = RunResult(APP, version, role, PROBLEM)
    venv = harness.app_venv(f"sqladmin-{version}", [f"sqladmin=={version}", *REQUIREMENTS])
    site = workdir / "site"
    site.mkdir(parents=True)
    (site / "shop.py").write_text(SHOP)
    (site / "seed.py").write_text(SEED.format(customers=CUSTOMERS, orders=ORDERS_PER_CUSTOMER))
    py = str(venv / "bin" / "python")
    env = {"REALWORLD_DB": str(workdir / "shop.db")}
    server = None
    try:
        subprocess.run([py, "seed.py"], cwd=site, env={**os.environ, **env}, check=True)
        port = harness.free_port()
        data = workdir / "data"
        server = Server(
            [str(venv / "bin" / "uvicorn"), "shop:app", "--port", str(port), "--no-access-log"],
            data=data,
            port=port,
            cwd=site,
            # The app under test is the installed sqladmin package, not the user's shop module
            # that mounts it: say so, as a user reading its findings would.
            env={**env, "PERFSLEUTH_SERVICE": "sqladmin", "PERFSLEUTH_APP_PACKAGES": "sqladmin"},
        )
        server.wait_ready("/admin/")
        c = Client(port)
        pages = iter(range(10**6))

        def customers() -> int:
            return c.get(f"/admin/customer/list?page={1 + next(pages) % 10}")

        details = iter(range(10**6))

        def order() -> int:
            return c.get(f"/admin/order/details/{1 + next(details) * 7919 % 150_000}")

        traffic = harness.drive(
            [
                (customers, ROUNDS),
                (lambda: c.get("/admin/"), ROUNDS),
                (lambda: c.get("/admin/order/list"), ROUNDS),
                (order, ROUNDS),
            ],
            threads=2,
        )
        harness.conclude(
            result,
            server,
            data,
            traffic,
            EXPECT,
            {EXPECT.endpoint: 2 * ROUNDS, **{ep: ROUNDS for ep in CLEAN}},
        )
    except Exception as e:  # a case that cannot run is a failed case, with the reason
        result.error = f"{type(e).__name__}: {e}"
        if server is not None:
            result.error += f" | server log: {server.tail(600)}"
    finally:
        if server is not None:
            server.stop()
    return result
