"""n_plus_one on a cache (Flask + redis-py): the cart page reads the user's cart (one LRANGE)
and then each item's price with its own GET. Clean twin: one MGET for all prices."""

from __future__ import annotations

from typing import Any

import redis
from flask import Blueprint, request

from zoo import env, seed

bp = Blueprint("n1_cache", __name__)
_cache = redis.Redis.from_url(env.REDIS_URL)


def _cart(user: str) -> list[int]:
    return [int(s) for s in _cache.lrange(seed.cart_key(user), 0, -1)]


@bp.get("/n1-cache/bad")
def cart_bad() -> dict[str, Any]:
    user = request.headers.get("X-User", seed.USERS[0])
    total = 0
    for sku in _cart(user):
        total += int(_cache.get(seed.price_key(sku)) or 0)  # PLANTED: n_plus_one
    return {"user": user, "total_cents": total}


@bp.get("/n1-cache/clean")
def cart_clean() -> dict[str, Any]:
    user = request.headers.get("X-User", seed.USERS[0])
    prices = _cache.mget([seed.price_key(sku) for sku in _cart(user)])
    return {"user": user, "total_cents": sum(int(p or 0) for p in prices)}
