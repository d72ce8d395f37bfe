"""A Flask + SQLAlchemy ORM shop on PostgreSQL with an N+1 and its fixed twin, and a repeated
query issued by a helper from three lines of one view (tests/test_loops_impact.py).

- ``GET /orders/broken``: the order list reads each order's lines through the lazy ``items``
  relationship, one query per order. ``GET /orders/fixed``: the same page with the lines loaded
  in one query (``selectinload``); everything else is the same code.
- ``GET /members/<id>/card``: ``get_member(cur, id)`` called three times from the view, the
  same statement with the same parameters. ``GET /members/<id>/card-once``: called once.

The ORM's tables live in ``LOOP_TWINS_ORM_DB`` (an SQLAlchemy URL: an SQLite file, where the
ORM's work around each query is most of an N+1's cost, or PostgreSQL, where the round trips
are), the members in PostgreSQL (``LOOP_TWINS_PG``); in PostgreSQL everything goes in the
schema named by ``LOOP_TWINS_SCHEMA`` (the test makes a fresh one). Run:
``gunicorn apps.loop_twins:app`` from tests/.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from flask import Flask
from sqlalchemy import ForeignKey, create_engine, event, select
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    relationship,
    selectinload,
)

PG = os.environ.get("LOOP_TWINS_PG", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = os.environ.get("LOOP_TWINS_SCHEMA", "loop_twins")
ORM_DB = os.environ.get("LOOP_TWINS_ORM_DB", PG.replace("postgresql://", "postgresql+psycopg://"))
ORDERS_PER_PAGE = 30
LINES_PER_ORDER = 4


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]
    status: Mapped[str]
    items: Mapped[list[Item]] = relationship(back_populates="order", order_by="Item.id")


class Item(Base):
    __tablename__ = "items"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"), index=True)
    sku: Mapped[str]
    qty: Mapped[int]
    price_cents: Mapped[int]
    order: Mapped[Order] = relationship(back_populates="items")


engine = create_engine(ORM_DB)

if engine.dialect.name == "postgresql":

    @event.listens_for(engine, "connect")
    def _search_path(dbapi_conn: Any, _record: Any) -> None:
        with dbapi_conn.cursor() as cur:
            cur.execute(f'SET search_path TO "{SCHEMA}"')
        dbapi_conn.commit()


def seed(orders: int = 200) -> None:
    """Create the schema's tables and rows (the test runs this before starting the server)."""
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{SCHEMA}".members '
            "(id int PRIMARY KEY, name text, plan text, seats int)"
        )
        conn.execute(
            f"INSERT INTO \"{SCHEMA}\".members SELECT i, 'member ' || i, 'pro', i % 7 "
            "FROM generate_series(1, 50) i ON CONFLICT DO NOTHING"
        )
    Base.metadata.create_all(engine)
    with Session(engine) as s:
        if s.scalar(select(Order.id).limit(1)) is not None:
            return
        for i in range(1, orders + 1):
            o = Order(id=i, customer=f"customer {i % 37}", status="paid")
            o.items = [
                Item(sku=f"SKU-{i}-{j}", qty=1 + j, price_cents=100 * (i + j))
                for j in range(LINES_PER_ORDER)
            ]
            s.add(o)
        s.commit()


app = Flask(__name__)


def _order_json(order: Order) -> dict[str, Any]:
    lines = [{"sku": it.sku, "qty": it.qty, "cents": it.price_cents} for it in order.items]
    return {"id": order.id, "customer": order.customer, "lines": lines,
            "total": sum(it.qty * it.price_cents for it in order.items)}  # fmt: skip


@app.get("/health")
def health() -> str:
    return "ok"


@app.get("/orders/broken")
def orders_broken() -> dict[str, Any]:
    with Session(engine) as s:
        page = s.scalars(select(Order).order_by(Order.id).limit(ORDERS_PER_PAGE)).all()
        out = []
        for order in page:
            out.append(_order_json(order))  # PLANTED: n_plus_one (order.items, lazy)
        return {"orders": out}


@app.get("/orders/fixed")
def orders_fixed() -> dict[str, Any]:
    with Session(engine) as s:
        query = select(Order).options(selectinload(Order.items))
        page = s.scalars(query.order_by(Order.id).limit(ORDERS_PER_PAGE)).all()
        out = []
        for order in page:
            out.append(_order_json(order))
        return {"orders": out}


def get_member(cur: psycopg.Cursor[Any], member_id: int) -> tuple[Any, ...]:
    cur.execute("SELECT id, name, plan, seats FROM members WHERE id = %s", (member_id,))
    row = cur.fetchone()
    assert row is not None
    return tuple(row)


def _connect() -> psycopg.Connection[Any]:
    return psycopg.connect(PG, autocommit=True, options=f"-c search_path={SCHEMA}")


@app.get("/members/<int:member_id>/card")
def member_card(member_id: int) -> dict[str, Any]:
    with _connect() as conn, conn.cursor() as cur:
        name = get_member(cur, member_id)[1]  # CALL 1
        plan = get_member(cur, member_id)[2]  # CALL 2
        seats = get_member(cur, member_id)[3]  # CALL 3
    return {"name": name, "plan": plan, "seats": seats}


@app.get("/members/<int:member_id>/card-once")
def member_card_once(member_id: int) -> dict[str, Any]:
    with _connect() as conn, conn.cursor() as cur:
        _, name, plan, seats = get_member(cur, member_id)
    return {"name": name, "plan": plan, "seats": seats}
