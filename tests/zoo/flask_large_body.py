"""large_request_body (Flask): a catalogue import posted as one JSON document of 200 KB-2 MB;
parsing and normalising it is the request's time, so bigger bodies are slower. Clean twin: the
same import sent in small pages (a few KB per request)."""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, request

bp = Blueprint("large_body", __name__)


def _normalise(raw: bytes) -> dict[str, Any]:
    records = json.loads(raw)
    skus = set()
    total = 0.0
    for rec in records:
        skus.add(rec["sku"].strip().upper())
        total += float(rec["price"]) * int(rec.get("stock", 0))
        rec["name"] = " ".join(rec["name"].split()).title()
    return {"records": len(records), "skus": len(skus), "stock_value": round(total, 2)}


@bp.post("/large-body/bad")
def import_bad() -> dict[str, Any]:
    return _normalise(request.get_data())  # PLANTED: large_request_body


@bp.post("/large-body/clean")
def import_clean() -> dict[str, Any]:
    return _normalise(request.get_data())


def catalogue_body(records: int) -> bytes:
    """A request body for these endpoints (used by the traffic driver)."""
    recs = [{"sku": f" sku-{i:06d} ", "name": f"  product   number {i} ", "price": f"{i % 97}.50",
             "stock": i % 13, "tags": ["zoo", f"cat{i % 7}"]} for i in range(records)]  # fmt: skip
    return json.dumps(recs).encode()
