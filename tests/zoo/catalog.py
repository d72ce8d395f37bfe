"""Every planted problem of the zoo: where it is, its endpoints, and the traffic it gets.

A plant's bad endpoint has the problem; its clean twin (same route with ``clean`` in place of
``bad``) has it fixed. The line causing the problem carries ``# PLANTED: <kind>``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zoo import seed

ZOO_DIR = Path(__file__).resolve().parent
VARIANTS = ("bad", "clean")

# Kinds whose findings point at a line of code (the others are about a whole endpoint).
CALLSITE_KINDS = frozenset(("n_plus_one", "repeated_query", "oversized_result", "slow_query"))


@dataclass(frozen=True)
class Plant:
    kind: str  # the detector kind that must find it
    framework: str  # "fastapi" | "flask" | "django": which zoo app serves it
    module: str  # its source file, relative to tests/zoo
    route: str  # endpoint as the agent names it, "{variant}" standing for bad/clean
    path: str  # request path; "{variant}" as above, "{n}" a small varying number (1-5)
    # Calls (DB, HTTP or cache) with the planted line on their stack, per bad request.
    per_request: int = 1
    body: Callable[[int, str], bytes] | None = None  # request body for request i, variant
    # Other finding kinds the bad twin causes as a direct consequence of the plant (true
    # findings, not noise): the accuracy benchmark counts them apart, neither TP nor FP.
    also: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.module.removesuffix(".py")

    def endpoint(self, variant: str) -> str:
        return self.route.replace("{variant}", variant)

    @property
    def bad(self) -> str:
        return self.endpoint("bad")

    @property
    def clean(self) -> str:
        return self.endpoint("clean")

    def request(self, i: int, variant: str) -> tuple[str, str, bytes | None]:
        """(method, path, body) of the i-th request to one of the two endpoints."""
        # n changes every fifth request: every tenant (i % 5) sees every n.
        n = 1 + (i // len(seed.TENANTS)) % 5
        path = self.path.replace("{variant}", variant).replace("{n}", str(n))
        body = self.body(i, variant) if self.body else None
        return self.route.split(" ", 1)[0], path, body

    @property
    def source(self) -> Path:
        return ZOO_DIR / self.module

    def planted_line(self) -> int:
        """Line number of the ``# PLANTED: <kind>`` marker (exactly one per module)."""
        marker = f"# PLANTED: {self.kind}"
        lines = self.source.read_text().splitlines()
        hits = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(marker)]
        if len(hits) != 1:
            raise ValueError(f"{self.module}: {len(hits)} lines marked {marker!r}, not 1")
        return hits[0]


@functools.lru_cache(maxsize=32)
def _catalogue_body(records: int) -> bytes:
    from zoo.flask_large_body import catalogue_body  # imports Flask: only when bodies are needed

    return catalogue_body(records)


def import_body(i: int, variant: str) -> bytes:
    """Bad: 200 KB to 2 MB in eight sizes; clean: 2-8 KB pages. The size changes every fifth
    request, so each of the five tenants sends every size (size is not a tenant trait)."""
    step = (i // len(seed.TENANTS)) % 8
    # ~115 bytes a record: 1,750 records ~ 200 KB, 17,500 ~ 2 MB
    return _catalogue_body(1_750 + 2_250 * step if variant == "bad" else 20 + 7 * step)


PLANTS: tuple[Plant, ...] = (
    # FastAPI (uvicorn)
    Plant("n_plus_one", "fastapi", "fastapi_n1_http.py", "GET /n1-http/{variant}",
          "/n1-http/{variant}?team={n}", per_request=seed.TEAM_SIZE),
    Plant("oversized_result", "fastapi", "fastapi_oversized.py", "GET /oversized/{variant}",
          "/oversized/{variant}"),
    Plant("outlier_tenant", "fastapi", "fastapi_outlier_tenant.py",
          "GET /tenant-report/{variant}", "/tenant-report/{variant}"),
    Plant("upstream_latency", "fastapi", "fastapi_upstream.py", "GET /upstream/{variant}",
          "/upstream/{variant}?items={n}"),
    # Flask (gunicorn)
    Plant("n_plus_one", "flask", "flask_n1_cache.py", "GET /n1-cache/{variant}",
          "/n1-cache/{variant}", per_request=seed.CART_SIZE),
    Plant("n_plus_one", "flask", "flask_n1_sql.py", "GET /n1-sql/{variant}",
          "/n1-sql/{variant}?page={n}", per_request=25),  # flask_n1_sql.PAGE
    Plant("repeated_query", "flask", "flask_repeated.py",
          "GET /repeated/{variant}/<int:account_id>", "/repeated/{variant}/{n}", per_request=3),
    Plant("large_request_body", "flask", "flask_large_body.py", "POST /large-body/{variant}",
          "/large-body/{variant}", per_request=0, body=import_body,
          # Parsing 0.2-2 MB bodies builds ~17k objects a request: measured 2026-11-25, 25
          # collections, 12 ms and 32 % of the request in GC (the clean twin: under 2 %).
          also=("gc_pressure",)),
    # Django (gunicorn)
    Plant("n_plus_one", "django", "django_n1_orm.py", "GET /n1-orm/{variant}/",
          "/n1-orm/{variant}/", per_request=30),  # django_n1_orm.AUTHORS_PER_PAGE
    Plant("slow_query", "django", "django_slow_query.py", "GET /slow-query/{variant}/",
          "/slow-query/{variant}/?since={n}"),
    Plant("chatty_endpoint", "django", "django_chatty.py", "GET /chatty/{variant}/",
          "/chatty/{variant}/", per_request=len(seed.CHATTY_TABLES) * len(seed.CHATTY_COLUMNS)),
)  # fmt: skip

FRAMEWORKS = ("fastapi", "flask", "django")
KINDS = tuple(sorted({p.kind for p in PLANTS}))
