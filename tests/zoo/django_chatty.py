"""chatty_endpoint (Django, raw SQL): an ops dashboard with 64 tiles, each tile its own small
query (eight tables x eight metric columns): 64 different statements per request, none of them
repeated. Clean twin: one query per table computing all of its tiles (eight statements)."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse

from zoo.seed import CHATTY_COLUMNS, CHATTY_TABLES

AGGREGATES = ("sum", "avg", "max", "min")
# (table, column, aggregate) of every tile
TILES = [
    (t, c, AGGREGATES[(i + j) % len(AGGREGATES)])
    for i, t in enumerate(CHATTY_TABLES)
    for j, c in enumerate(CHATTY_COLUMNS)
]


def _tile_sql(table: str, column: str, agg: str) -> str:
    return f"SELECT {agg}({column}) FROM zoo_chatty.{table}"


def dashboard_bad(request: HttpRequest) -> JsonResponse:
    tiles = {}
    with connection.cursor() as cur:
        for table, column, agg in TILES:
            cur.execute(_tile_sql(table, column, agg))  # PLANTED: chatty_endpoint
            tiles[f"{table}.{column}"] = float(cur.fetchone()[0])
    return JsonResponse({"tiles": tiles})


def dashboard_clean(request: HttpRequest) -> JsonResponse:
    tiles = {}
    with connection.cursor() as cur:
        for table in CHATTY_TABLES:
            mine = [(c, agg) for t, c, agg in TILES if t == table]
            cur.execute(
                f"SELECT {', '.join(f'{agg}({c})' for c, agg in mine)} FROM zoo_chatty.{table}"
            )
            for (column, _), value in zip(mine, cur.fetchone(), strict=True):
                tiles[f"{table}.{column}"] = float(value)
    return JsonResponse({"tiles": tiles})
