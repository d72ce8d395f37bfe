"""outlier_tenant (FastAPI + psycopg 3): an activity report aggregated per tenant (header
X-Tenant). Tenant ``megacorp`` has 50x the events of everyone else, so its reports are far
slower while all other tenants' are fast. Clean twin: the same report over a table where every
tenant has the same amount of data."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header

from zoo import db

router = APIRouter()
# For requests without the header (the harness's warm-up, which must not look like a tenant).
DEFAULT_TENANT = "acme"
Tenant = Annotated[str, Header(alias="X-Tenant")]

REPORT = (
    "SELECT kind, count(*), sum(amount) FROM zoo_tenant.{table} WHERE tenant = %s "
    "GROUP BY kind ORDER BY kind"
)


def _report(table: str, tenant: str) -> list[dict[str, Any]]:
    rows = db.pg().execute(REPORT.format(table=table), (tenant,)).fetchall()
    return [{"kind": k, "events": n, "amount": a} for k, n, a in rows]


@router.get("/tenant-report/bad")
def report_bad(tenant: Tenant = DEFAULT_TENANT) -> dict[str, Any]:
    # The query is indexed and fine for normal tenants: the slowness is the tenant's data.
    return {"tenant": tenant, "report": _report("event", tenant)}  # PLANTED: outlier_tenant


@router.get("/tenant-report/clean")
def report_clean(tenant: Tenant = DEFAULT_TENANT) -> dict[str, Any]:
    return {"tenant": tenant, "report": _report("event_even", tenant)}
