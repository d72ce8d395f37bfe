"""slow_query (Django, raw SQL): a revenue report whose query takes ~350 ms. ``pg_sleep``
stands in for the unindexed scan of a big table such a report usually is: it is deterministic
and needs no gigabytes of seed data. Clean twin: the same report without it (fast)."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse

REVENUE_SLOW = (
    "SELECT region, sum(amount) FROM zoo_slow_query.sale, pg_sleep(0.35) "
    "WHERE day >= %s GROUP BY region ORDER BY region"
)
REVENUE = (
    "SELECT region, sum(amount) FROM zoo_slow_query.sale WHERE day >= %s "
    "GROUP BY region ORDER BY region"
)


def _since(request: HttpRequest) -> int:
    return int(request.GET.get("since", "0"))


def revenue_bad(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cur:
        cur.execute(REVENUE_SLOW, [_since(request)])  # PLANTED: slow_query
        return JsonResponse({"revenue": dict(cur.fetchall())})


def revenue_clean(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cur:
        cur.execute(REVENUE, [_since(request)])
        return JsonResponse({"revenue": dict(cur.fetchall())})
