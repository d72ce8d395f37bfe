"""The demo shop API (FastAPI). Several endpoints carry planted problems, written the way they
are written in real code bases; see ``perfsleuth.demo`` for the list.

Configuration comes from the environment (``servers.start_servers`` sets it):
``PERFSLEUTH_DEMO_DB`` (the SQLite file) and ``PERFSLEUTH_DEMO_UPSTREAM`` (the carrier API).
The app never imports perfsleuth's agent beyond ``attr``/``tag``/``task``: under
``perfsleuth run`` everything else is instrumented from outside.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request

from perfsleuth import agent
from perfsleuth.demo import db

DB_PATH = os.environ.get("PERFSLEUTH_DEMO_DB", "demo.sqlite3")
UPSTREAM = os.environ.get("PERFSLEUTH_DEMO_UPSTREAM", "http://127.0.0.1:8899")
RECOMMENDATIONS_EVERY_S = 2.0

_carrier = httpx.Client(base_url=UPSTREAM, timeout=10.0)
_stop = threading.Event()


@contextlib.contextmanager
def connection() -> Iterator[Any]:
    con = db.connect(DB_PATH)
    try:
        yield con
    finally:
        con.close()


def _refresh_recommendations() -> None:
    """A background job: recorded with workload kind ``background``, not as a web request."""
    while not _stop.wait(RECOMMENDATIONS_EVERY_S):
        with agent.task("refresh-recommendations"), connection() as con:
            top = con.execute(
                "SELECT product_id, SUM(quantity) FROM order_items WHERE order_id > ? "
                "GROUP BY product_id ORDER BY 2 DESC LIMIT 10",
                (50_000,),
            ).fetchall()
            agent.attr("products", len(top))


@contextlib.asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    worker = threading.Thread(target=_refresh_recommendations, name="recommendations", daemon=True)
    worker.start()
    yield
    _stop.set()
    worker.join(timeout=5)


app = FastAPI(title="perfsleuth demo shop", lifespan=lifespan)


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/products")
def products(page: int = 1) -> list[dict[str, Any]]:
    """Clean: one indexed, paged query."""
    with connection() as con:
        rows = con.execute(
            "SELECT id, name, price_cents FROM products ORDER BY id LIMIT 20 OFFSET ?",
            ((max(page, 1) - 1) * 20,),
        ).fetchall()
    return [{"id": r[0], "name": r[1], "price_cents": r[2]} for r in rows]


@app.get("/orders/{order_id}")
def order(order_id: int) -> dict[str, Any]:
    """Clean: the order and its items in two indexed queries."""
    with connection() as con:
        row = con.execute(
            "SELECT id, customer_id, created, total_cents FROM orders WHERE id = ?", (order_id,)
        ).fetchone()
        if row is None:
            raise HTTPException(404, "no such order")
        items = con.execute(
            "SELECT i.product_id, p.name, i.quantity FROM order_items i "
            "JOIN products p ON p.id = i.product_id WHERE i.order_id = ?",
            (order_id,),
        ).fetchall()
    lines = [{"product_id": i[0], "name": i[1], "quantity": i[2]} for i in items]
    return {"id": row[0], "customer_id": row[1], "created": row[2], "total_cents": row[3],
            "items": lines}  # fmt: skip


# --- planted: N+1 -------------------------------------------------------------------------


def _items_of(con: Any, order_id: int) -> list[Any]:
    return con.execute(
        "SELECT product_id, quantity, price_cents FROM order_items WHERE order_id = ?", (order_id,)
    ).fetchall()


@app.get("/customers/{customer_id}/orders")
def customer_orders(customer_id: int) -> dict[str, Any]:
    """N+1: the orders in one query, then one more query per order for its items."""
    agent.tag("tenant_size", "large" if db.tenant_of(customer_id) == db.BIG_TENANT else "normal")
    with connection() as con:
        orders = con.execute(
            "SELECT id, created, total_cents FROM orders WHERE customer_id = ? ORDER BY id",
            (customer_id,),
        ).fetchall()
        out = []
        for o in orders:
            items = _items_of(con, o[0])  # the loop: one query per order
            out.append({"id": o[0], "created": o[1], "total_cents": o[2], "items": len(items)})
    agent.attr("orders", len(out))
    return {"customer_id": customer_id, "orders": out}


# --- planted: the same query three times in one request ------------------------------------


def _product(con: Any, product_id: int) -> Any:
    # with the units sold in the last 20,000 order lines: about a millisecond a lookup, what a
    # real query on a networked database costs, so that each repeat costs something too
    return con.execute(
        "SELECT p.id, p.name, p.price_cents, p.stock, p.description,"
        " (SELECT coalesce(sum(i.quantity), 0) FROM order_items i"
        "  WHERE i.id > (SELECT max(id) FROM order_items) - 20000 AND i.product_id = p.id)"
        " AS sold_recently FROM products p WHERE p.id = ?",
        (product_id,),
    ).fetchone()


def _discounted_price(con: Any, product_id: int) -> int:
    discount = int(con.execute("SELECT value FROM settings WHERE key = 'discount_percent'")
                   .fetchone()[0])  # fmt: skip
    return _product(con, product_id)[2] * (100 - discount) // 100  # fetched again


def _in_stock(con: Any, product_id: int) -> bool:
    return _product(con, product_id)[3] > 0  # and again


@app.get("/products/{product_id}")
def product(product_id: int) -> dict[str, Any]:
    with connection() as con:
        row = _product(con, product_id)
        if row is None:
            raise HTTPException(404, "no such product")
        return {"id": row[0], "name": row[1], "price_cents": _discounted_price(con, product_id),
                "in_stock": _in_stock(con, product_id), "description": row[4],
                "sold_recently": row[5]}  # fmt: skip


# --- planted: 59,000 rows loaded to show 20 ------------------------------------------------


@app.get("/reports/top-customers")
def top_customers(limit: int = 20) -> list[dict[str, Any]]:
    """Aggregates in Python what one GROUP BY ... LIMIT would have done in the database."""
    with connection() as con:
        rows = con.execute("SELECT customer_id, total_cents FROM orders").fetchall()
    agent.attr("rows_loaded", len(rows))
    totals: dict[int, int] = {}
    for customer_id, total in rows:
        totals[customer_id] = totals.get(customer_id, 0) + total
    best = sorted(totals.items(), key=lambda kv: kv[1], reverse=True)[:limit]
    return [{"customer_id": c, "total_cents": t} for c, t in best]


# --- planted: a slow upstream --------------------------------------------------------------


@app.get("/shipping/quote")
def shipping_quote(customer_id: int, weight_g: int = 1000) -> dict[str, Any]:
    with connection() as con:
        row = con.execute("SELECT city FROM customers WHERE id = ?", (customer_id,)).fetchone()
    if row is None:
        raise HTTPException(404, "no such customer")
    r = _carrier.get(f"/v1/quotes/{row[0]}", params={"weight_g": weight_g})
    r.raise_for_status()
    return {"customer_id": customer_id, **r.json()}


# --- planted: a multi-MB JSON parsed on the event loop -------------------------------------


@app.post("/catalog/import")
async def catalog_import(request: Request) -> dict[str, Any]:
    """An async endpoint doing blocking work: every other request on this worker waits."""
    await request.body()
    with open(db.feed_path(DB_PATH), encoding="utf-8") as fh:
        feed = json.load(fh)  # ~10 MB, parsed synchronously on the event loop
    # ... and every variant normalised in Python, still on the loop
    stock = {
        f"{p['sku']}-{v['color']}-{v['size']}".lower(): v["stock"]
        for p in feed["products"]
        for v in p["variants"]
    }
    variants = len(stock)
    agent.attr("feed_products", len(feed["products"]))
    return {"products": len(feed["products"]), "variants": variants}


# --- planted: a CPU hotspot ----------------------------------------------------------------


def _edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _distance(q: str, text: str) -> int:
    """The best match of ``q`` against each word and each pair of adjacent words ("back pak")."""
    words = text.lower().split()
    terms = words + [a + b for a, b in itertools.pairwise(words)]
    return min(_edit_distance(q, t) for t in terms)


@app.get("/search")
def search(q: str, limit: int = 10) -> list[dict[str, Any]]:
    """Fuzzy search in pure Python over every product's name and description, per request."""
    with connection() as con:
        rows = con.execute("SELECT id, name, description FROM products").fetchall()
    scored = sorted((_distance(q.lower(), f"{name} {text}"), pid, name) for pid, name, text in rows)
    return [{"id": pid, "name": name, "distance": d} for d, pid, name in scored[:limit]]
