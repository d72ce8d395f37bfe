"""Two versions of a small Flask shop for `perfsleuth load` A/B runs: LOAD_APP_VERSION=nplus1
loads each order's items with one query per order (a planted N+1) on GET /orders; the default
version loads them with one join. GET /health and GET /products/<id> are the same in both."""

from __future__ import annotations

import os
import sqlite3
import tempfile

from flask import Flask

VERSION = os.environ.get("LOAD_APP_VERSION", "batched")
ORDERS = 400
DB = os.path.join(tempfile.mkdtemp(prefix="load_app_"), "shop.db")


def _seed() -> None:
    con = sqlite3.connect(DB)
    con.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT)")
    con.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, order_id INTEGER, price REAL)")
    con.execute("CREATE INDEX items_order ON items (order_id)")
    con.executemany("INSERT INTO orders VALUES (?, ?)", [(i, f"c{i % 7}") for i in range(ORDERS)])
    con.executemany(
        "INSERT INTO items (order_id, price) VALUES (?, ?)",
        [(i, 1.5 * j) for i in range(ORDERS) for j in range(3)],
    )
    con.commit()
    con.close()


_seed()
app = Flask(__name__)


def _con() -> sqlite3.Connection:
    return sqlite3.connect(DB)


@app.get("/health")
def health() -> str:
    return "ok"


@app.get("/products/<int:product_id>")
def product(product_id: int) -> dict[str, object]:
    con = _con()
    try:
        row = con.execute("SELECT id, customer FROM orders WHERE id = ?", (product_id,)).fetchone()
    finally:
        con.close()
    return {"id": product_id, "found": row is not None}


@app.get("/orders")
def orders() -> dict[str, object]:
    con = _con()
    try:
        rows = con.execute("SELECT id, customer FROM orders ORDER BY id").fetchall()
        if VERSION == "nplus1":
            totals = {}
            for oid, _ in rows:
                items = con.execute("SELECT price FROM items WHERE order_id = ?", (oid,)).fetchall()
                totals[oid] = sum(p for (p,) in items)
        else:
            totals = dict(
                con.execute("SELECT order_id, sum(price) FROM items GROUP BY order_id").fetchall()
            )
    finally:
        con.close()
    return {"version": VERSION, "orders": len(rows), "total": sum(totals.values())}
