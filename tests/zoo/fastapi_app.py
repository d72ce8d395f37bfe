"""The FastAPI zoo app (run under uvicorn): one router per planted problem."""

from __future__ import annotations

from fastapi import FastAPI

from zoo import fastapi_n1_http, fastapi_outlier_tenant, fastapi_oversized, fastapi_upstream

app = FastAPI(title="perfsleuth zoo (FastAPI)")
for module in (fastapi_n1_http, fastapi_oversized, fastapi_outlier_tenant, fastapi_upstream):
    app.include_router(module.router)


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}
