"""A shop of five endpoints for tests/test_compare.py (Flask under gunicorn, psycopg on
PostgreSQL).

Each request is tagged ``variant`` from the ``X-Variant`` header (a feature flag's arm). Variant
``b`` of ``GET /checkout`` waits a planted 30 ms more; the other endpoints behave alike in both.

``GET /orders`` lists 25 orders with their customers: one query per order (an N+1) unless
``COMPARE_FIXED=1`` (the release that fixed it: one join).
"""

from __future__ import annotations

import os
import time

import psycopg
from flask import Flask, request

import perfsleuth.agent as ps

DSN = os.environ.get("COMPARE_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
FIXED = os.environ.get("COMPARE_FIXED") == "1"
PLANTED_S = 0.030
ORDERS = 25

app = Flask(__name__)
_conn: psycopg.Connection | None = None


def conn() -> psycopg.Connection:
    global _conn
    if _conn is None:
        _conn = psycopg.connect(DSN, autocommit=True)
    return _conn


@app.before_request
def tag_variant() -> None:
    ps.tag("variant", request.headers.get("X-Variant", "a"))


def work(ms: float) -> None:
    time.sleep(ms / 1000.0)


@app.get("/health")
def health() -> str:
    return "ok"


@app.get("/home")
def home() -> str:
    work(float(request.args.get("ms", 5)))
    return "home"


@app.get("/search")
def search() -> str:
    work(float(request.args.get("ms", 10)))
    conn().execute("SELECT count(*) FROM generate_series(1, 100)").fetchone()
    return "search"


@app.get("/checkout")
def checkout() -> str:
    work(float(request.args.get("ms", 15)))
    if request.headers.get("X-Variant") == "b":
        time.sleep(PLANTED_S)  # the planted regression of the new code path
    return "checkout"


@app.get("/cart")
def cart() -> str:
    work(float(request.args.get("ms", 8)))
    return "cart"


@app.get("/orders")
def orders() -> dict[str, list[str]]:
    c = conn()
    if FIXED:
        rows = c.execute(
            "SELECT o.id, 'customer ' || (o.id %% 7) FROM generate_series(1, %s) AS o(id)",
            (ORDERS,),
        ).fetchall()
        return {"orders": [str(r[1]) for r in rows]}
    ids = [r[0] for r in c.execute("SELECT id FROM generate_series(1, %s) AS o(id)", (ORDERS,))]
    names = []
    for i in ids:  # one query per order: the N+1
        row = c.execute("SELECT 'customer ' || (%s::int %% 7), pg_sleep(0.002)", (i,)).fetchone()
        assert row is not None
        names.append(str(row[0]))
    return {"orders": names}
