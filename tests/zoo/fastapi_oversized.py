"""oversized_result (FastAPI + psycopg 3): the "top products" widget loads the whole
25,000-row catalogue and sorts it in Python to show 20. Clean twin: ORDER BY ... LIMIT in SQL."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from zoo import db

router = APIRouter()

ALL_PRODUCTS = "SELECT id, name, category, score FROM zoo_oversized.product"
TOP_PRODUCTS = (
    "SELECT id, name, category, score FROM zoo_oversized.product ORDER BY score DESC LIMIT %s"
)


def _shape(rows: list[Any]) -> list[dict[str, Any]]:
    return [{"id": r[0], "name": r[1], "category": r[2], "score": r[3]} for r in rows]


@router.get("/oversized/bad")
def top_products_bad(limit: int = 20) -> list[dict[str, Any]]:
    rows = db.pg().execute(ALL_PRODUCTS).fetchall()  # PLANTED: oversized_result
    return _shape(sorted(rows, key=lambda r: r[3], reverse=True)[:limit])


@router.get("/oversized/clean")
def top_products_clean(limit: int = 20) -> list[dict[str, Any]]:
    return _shape(db.pg().execute(TOP_PRODUCTS, (limit,)).fetchall())
