"""The demo: a small shop API with planted, realistic performance problems.

``shop`` (FastAPI under uvicorn) and ``legacy`` (Flask under gunicorn, so WSGI and pre-fork
workers are exercised) share one SQLite file seeded by ``db``; ``upstream`` is the slow shipping
service the shop calls over HTTP; ``traffic`` drives a mixed load from several tenants, one of
them (``megacorp``) much larger than the rest; ``servers`` starts and stops all of it.

The planted problems, each at a known place (the finding tests rely on these names):

=================================  ========================================================
``GET /customers/{customer_id}/orders``  N+1: one items query per order (``shop.customer_orders``)
``GET /products/{product_id}``      the same product row fetched three times per request
``GET /reports/top-customers``      loads every order (60k rows) to show 20
``GET /shipping/quote``             waits for the slow upstream carrier API
``POST /catalog/import``            parses a ~10 MB JSON feed on the event loop (async endpoint)
``GET /search``                     pure-Python fuzzy matching: a CPU hotspot
``GET /admin/export.csv``           one query per customer for a CSV export (Flask)
``POST /admin/notes``               a 0.3-3 MB form body re-parsed once per field (Flask)
=================================  ========================================================

Clean endpoints: ``GET /health``, ``GET /products``, ``GET /orders/{order_id}``,
``GET /admin/customers/<int:customer_id>``, ``GET /admin/health``.
"""

from __future__ import annotations

# Endpoint names exactly as the agent records them (method + route template).
SHOP_ENDPOINTS = (
    "GET /health",
    "GET /products",
    "GET /products/{product_id}",
    "GET /orders/{order_id}",
    "GET /customers/{customer_id}/orders",
    "GET /reports/top-customers",
    "GET /shipping/quote",
    "POST /catalog/import",
    "GET /search",
)
LEGACY_ENDPOINTS = (
    "GET /admin/health",
    "GET /admin/customers/<int:customer_id>",
    "GET /admin/export.csv",
    "POST /admin/notes",
)
ENDPOINTS = SHOP_ENDPOINTS + LEGACY_ENDPOINTS

# The shop's background job (workload kind "background").
BACKGROUND_TASKS = ("refresh-recommendations",)

PLANTED = {
    "GET /customers/{customer_id}/orders": "n_plus_one",
    "GET /products/{product_id}": "repeated_query",
    "GET /reports/top-customers": "oversized_result",
    "GET /shipping/quote": "upstream_latency",
    "POST /catalog/import": "event_loop_blocker",
    "GET /search": "slow_request_hotspot",
    "GET /admin/export.csv": "n_plus_one",
    "POST /admin/notes": "large_request_body",
}
CLEAN = (
    "GET /health",
    "GET /products",
    "GET /orders/{order_id}",
    "GET /admin/customers/<int:customer_id>",
    "GET /admin/health",
)
