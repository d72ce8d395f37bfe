"""upstream_latency (FastAPI + httpx): a checkout quote whose time is almost all spent waiting
for a slow pricing API (~200 ms). Clean twin: the same call to a fast upstream."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import APIRouter

from zoo import env

router = APIRouter()
_pricing = httpx.Client(base_url=env.UPSTREAM, timeout=30.0)


def _quote(path: str, items: int) -> dict[str, Any]:
    quote = _pricing.get(path, params={"items": items}).json()
    return {"items": items, "total_cents": quote["price_cents"] * items}


@router.get("/upstream/bad")
def quote_bad(items: int = 1) -> dict[str, Any]:
    return _quote("/quotes/slow", items)  # PLANTED: upstream_latency


@router.get("/upstream/clean")
def quote_clean(items: int = 1) -> dict[str, Any]:
    return _quote("/quotes/fast", items)
