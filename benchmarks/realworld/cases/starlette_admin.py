"""starlette-admin 0.2.2: the list API of an `async def` view runs synchronous SQLAlchemy queries
on the event loop; 0.3.0 runs them in a worker thread.

Documented in commit 31f843a of jowilf/starlette-admin, "Run SQLA sync function in a worker
thread", first released in 0.3.0. The suite's fixed release is 0.3.2, the first with the fix that
imports on Python 3.11 (0.3.0 and 0.3.1 give a dataclass field a mutable default). With a
synchronous engine, 0.2.2's ``ModelView.count`` and ``ModelView.find_all`` (async defs in
starlette_admin/contrib/sqla/view.py) call ``session.execute(stmt)`` directly (lines 167 and
193), so the API endpoint ``BaseAdmin._render_api`` (``GET /admin/api/{identity}``, what the list
page's table fetches) blocks the loop for as long as the query runs, and every other request
waits. 0.3.0 wraps each call in ``anyio.to_thread.run_sync``. The session comes from
``DBSessionMiddleware``, a ``BaseHTTPMiddleware``: the route runs in a child task of the
request's own.

Served as a user would: a FastAPI app with the admin mounted, under uvicorn, with a synchronous
SQLite engine, a ``product`` table of 400,000 rows, the admin's search box (``where=<term>``: a
LIKE on the text columns, a full scan) driven alongside the clean pages (the admin index, the
list page, a product's detail page) and the plain listing without search, on 4 client threads.
"""

from __future__ import annotations

import os
import subprocess
import urllib.parse
from pathlib import Path

import harness
from harness import Client, Expect, RunResult, Server

APP = "starlette-admin"
BUGGY, FIXED = "0.2.2", "0.3.2"
PROBLEM = "sync SQL in async def (search)"
EXPECT = Expect(
    kinds=("event_loop_blocker",),
    endpoint="GET /admin/api/{identity}",
    file_suffix="starlette_admin/contrib/sqla/view.py",
    line=193,  # find_all's session.execute; count's, line 167, blocks the same way
    other_lines=(167,),
    problem=PROBLEM,
)
CLEAN = [
    "GET /admin/",
    "GET /admin/{identity}/list",
    "GET /admin/{identity}/detail/{pk}",
]
ROWS = 400_000
SEARCHES, CLEAN_ROUNDS = 30, 30

REQUIREMENTS = [
    "fastapi==0.87.0",  # the host app; it pins starlette 0.21.0
    "starlette==0.21.0",
    "SQLAlchemy==1.4.41",
    "Jinja2==3.1.2",
    "python-multipart==0.0.5",
    "uvicorn==0.20.0",
    "pydantic==1.10.2",  # 0.2.2 imports pydantic and sqlmodel without declaring them
    "sqlmodel==0.0.8",
]

MODELS = """\
import os

from sqlalchemy import Column, Integer, String, Text, create_engine
from sqlalchemy.orm import declarative_base

Base = declarative_base()
engine = create_engine(
    "sqlite:///" + os.environ["REALWORLD_DB"], connect_args={"check_same_thread": False}
)


class Product(Base):
    __tablename__ = "product"

    id = Column(Integer, primary_key=True)
    name = Column(String(100))
    sku = Column(String(40))
    description = Column(Text)
"""

# How each release registers a model view: 0.2.2 through a metaclass keyword, 0.3.x with an
# instance (the upgrade changes this line of the user's app, nothing else).
APP_022 = """\
from fastapi import FastAPI
from starlette_admin.contrib.sqla import Admin, ModelView

from models import Product, engine


class ProductView(ModelView, model=Product):
    pass


app = FastAPI()
admin = Admin(engine, title="Shop admin")
admin.add_view(ProductView)
admin.mount_to(app)
"""

APP_030 = """\
from fastapi import FastAPI
from starlette_admin.contrib.sqla import Admin, ModelView

from models import Product, engine

app = FastAPI()
admin = Admin(engine, title="Shop admin")
admin.add_view(ModelView(Product))
admin.mount_to(app)
"""

SEED = """\
import random
import sqlite3

from models import Base, engine

Base.metadata.create_all(engine)
words = "red green blue steel oak linen cotton wool glass paper copper brass".split()
rng = random.Random(7)
rows = []
for i in range(1, {rows} + 1):
    name = " ".join(rng.choice(words) for _ in range(3)) + f" item {{i}}"
    desc = " ".join(rng.choice(words) for _ in range(14))
    rows.append((i, name, f"SKU-{{i:07d}}", desc))
db = sqlite3.connect(engine.url.database)
db.executemany("INSERT INTO product VALUES (?, ?, ?, ?)", rows)
db.commit()
print("seeded", db.execute("select count(*) from product").fetchone()[0], "products")
"""


def run(role: str, workdir: Path) -> RunResult:
    version = BUGGY if role == "buggy" else FIXED
    result = RunResult(APP, version, role, PROBLEM)
    venv = harness.app_venv(
        f"starlette-admin-{version}", [f"starlette-admin=={version}", *REQUIREMENTS]
    )
    site = workdir / "site"
    site.mkdir(parents=True)
    (site / "models.py").write_text(MODELS)
    (site / "shop.py").write_text(APP_022 if version == BUGGY else APP_030)
    (site / "seed.py").write_text(SEED.format(rows=ROWS))
    env = {"REALWORLD_DB": str(workdir / "shop.db")}
    py = str(venv / "bin" / "python")
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
            # The app under test is the installed starlette_admin package, not the user's shop
            # module that mounts it: say so, as a user reading its findings would.
            env={
                **env,
                "PERFSLEUTH_SERVICE": "starlette-admin",
                "PERFSLEUTH_APP_PACKAGES": "starlette_admin",
            },
        )
        server.wait_ready("/admin/")
        c = Client(port)
        terms = ["zinc", "oak linen", "item 77", "SKU-00123", "velvet", "brass wool"]
        searches = iter(range(10**6))

        def search() -> int:
            term = terms[next(searches) % len(terms)]
            query = urllib.parse.urlencode(
                {"skip": 0, "limit": 20, "where": term, "order_by": "id asc"}
            )
            return c.get(f"/admin/api/product?{query}")

        details = iter(range(10**6))

        def detail() -> int:
            return c.get(f"/admin/product/detail/{1 + next(details) * 7919 % ROWS}")

        traffic = harness.drive(
            [
                (search, SEARCHES),
                (lambda: c.get("/admin/"), CLEAN_ROUNDS),
                (lambda: c.get("/admin/product/list"), CLEAN_ROUNDS),
                (detail, CLEAN_ROUNDS),
                (lambda: c.get("/admin/api/product?skip=0&limit=20"), CLEAN_ROUNDS),
            ],
            threads=4,
        )
        harness.conclude(
            result,
            server,
            data,
            traffic,
            EXPECT,
            {EXPECT.endpoint: SEARCHES + CLEAN_ROUNDS, **{ep: CLEAN_ROUNDS for ep in CLEAN}},
        )
    except Exception as e:  # a case that cannot run is a failed case, with the reason
        result.error = f"{type(e).__name__}: {e}"
        if server is not None:
            result.error += f" | server log: {server.tail(600)}"
    finally:
        if server is not None:
            server.stop()
    return result
