"""The demo shop's SQLite database: tenants, customers, products, orders and their items.

One tenant, ``megacorp``, is much larger than the others: its 50 customers hold a third of all
orders, so the pages that load "all orders of a customer" are much slower for it.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3

TENANTS = ("acme", "globex", "initech", "umbrella")
BIG_TENANT = "megacorp"
BIG_CUSTOMERS = 50  # customer ids 1..50 belong to megacorp
CUSTOMERS = 2000
PRODUCTS = 500
BIG_ORDERS_PER_CUSTOMER = 400
ORDERS_PER_CUSTOMER = 20  # the others: 50*400 + 1950*20 = 59,000 orders
ITEMS_PER_ORDER = 3

SCHEMA = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL,
                        email TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, price_cents INTEGER NOT NULL,
                       stock INTEGER NOT NULL, description TEXT NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL, created TEXT NOT NULL,
                     total_cents INTEGER NOT NULL, status TEXT NOT NULL);
CREATE TABLE order_items (id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL,
                          product_id INTEGER NOT NULL, quantity INTEGER NOT NULL,
                          price_cents INTEGER NOT NULL);
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE INDEX orders_customer ON orders (customer_id);
CREATE INDEX items_order ON order_items (order_id);
"""

_WORDS = (
    "alpine amber anchor arctic aurora basil birch bolt breeze cedar cobalt comet "
    "coral crimson delta drift ember falcon fern flint frost garnet glacier harbor "
    "hazel indigo iris jade juniper kestrel lagoon lark linen lotus lunar maple "
    "meadow mesa nimbus oak onyx orchid pebble pine prairie quartz raven reef ridge "
    "river saffron sage sierra slate sparrow spruce summit tide topaz tundra umber "
    "velvet willow zephyr"
).split()
_THINGS = "lamp kettle chair desk mug backpack jacket boots tent scarf clock shelf rug".split()
_CITIES = "Lisbon Oslo Quito Lyon Perth Osaka Denver Tallinn Dakar Bergen Cusco Austin".split()


def tenant_of(customer_id: int) -> str:
    if customer_id <= BIG_CUSTOMERS:
        return BIG_TENANT
    return TENANTS[customer_id % len(TENANTS)]


def customers_of(tenant: str) -> list[int]:
    return [c for c in range(1, CUSTOMERS + 1) if tenant_of(c) == tenant]


def feed_path(db_path: str) -> str:
    """The catalog feed ``POST /catalog/import`` parses: a multi-MB JSON file next to the DB."""
    return os.path.splitext(db_path)[0] + "-catalog-feed.json"


def seed(db_path: str) -> dict[str, int]:
    """(Re)create the demo database and catalog feed; deterministic. Returns row counts."""
    rng = random.Random(42)
    tmp = db_path + ".tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    con = sqlite3.connect(tmp)
    try:
        con.executescript(SCHEMA)
        con.executemany(
            "INSERT INTO customers VALUES (?, ?, ?, ?, ?)",
            (
                (c, tenant_of(c), f"{rng.choice(_WORDS).title()} {rng.choice(_WORDS).title()}",
                 f"customer{c}@example.com", rng.choice(_CITIES))
                for c in range(1, CUSTOMERS + 1)
            ),
        )  # fmt: skip
        products = [
            (
                p,
                f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} {rng.choice(_THINGS)}",
                rng.randrange(500, 50_000),
                rng.randrange(0, 300),
                " ".join(rng.choices(_WORDS, k=30)),
            )
            for p in range(1, PRODUCTS + 1)
        ]
        con.executemany("INSERT INTO products VALUES (?, ?, ?, ?, ?)", products)
        orders, items = [], []
        order_id = item_id = 0
        for c in range(1, CUSTOMERS + 1):
            n = BIG_ORDERS_PER_CUSTOMER if c <= BIG_CUSTOMERS else ORDERS_PER_CUSTOMER
            for _ in range(n):
                order_id += 1
                total = 0
                for _ in range(ITEMS_PER_ORDER):
                    item_id += 1
                    prod = products[rng.randrange(PRODUCTS)]
                    qty = rng.randrange(1, 4)
                    items.append((item_id, order_id, prod[0], qty, prod[2]))
                    total += qty * prod[2]
                day = rng.randrange(1, 29)
                orders.append(
                    (order_id, c, f"2026-{rng.randrange(1, 11):02d}-{day:02d}", total, "shipped")
                )
        con.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", orders)
        con.executemany("INSERT INTO order_items VALUES (?, ?, ?, ?, ?)", items)
        con.executemany(
            "INSERT INTO settings VALUES (?, ?)",
            [("currency", "EUR"), ("discount_percent", "10"), ("carrier", "slowship")],
        )
        con.commit()
    finally:
        con.close()
    os.replace(tmp, db_path)
    _write_feed(feed_path(db_path), products, rng)
    return {
        "customers": CUSTOMERS,
        "products": PRODUCTS,
        "orders": len(orders),
        "order_items": len(items),
    }


def _write_feed(path: str, products: list[tuple], rng: random.Random) -> None:
    # ~10 MB: every product with a long variant list, as a supplier's catalog export looks.
    feed = {
        "supplier": "northwind-wholesale",
        "products": [
            {
                "sku": f"NW-{p[0]:05d}",
                "name": p[1],
                "price_cents": p[2],
                "variants": [
                    {"color": rng.choice(_WORDS), "size": rng.choice("SMLX"),
                     "stock": rng.randrange(99)}
                    for _ in range(400)
                ],
                "description": p[4],
            }
            for p in products
        ],
    }  # fmt: skip
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(feed, fh)
    os.replace(tmp, path)


def connect(db_path: str) -> sqlite3.Connection:
    # check_same_thread=False: FastAPI runs sync endpoints on a thread pool; each request opens
    # its own connection anyway (SQLite opens are cheap), this only allows closing elsewhere.
    return sqlite3.connect(db_path, check_same_thread=False)
