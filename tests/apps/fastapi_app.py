"""A FastAPI shop: route templates, an included router, a mounted Starlette app, errors."""

from __future__ import annotations

import os

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.applications import Starlette
from starlette.routing import Route

import perfsleuth.agent as ps

app = FastAPI()


@app.get("/health")
def health() -> dict[str, str]:
    return {"ok": "yes"}


@app.get("/orders/{order_id}")
def get_order(order_id: int) -> dict[str, int]:
    ps.attr("order_id", order_id)
    ps.attr("pid", os.getpid())
    return {"order_id": order_id, "pid": os.getpid()}


@app.post("/orders")
async def create_order(request: Request) -> dict[str, int]:
    body = await request.body()
    return {"received": len(body)}


@app.get("/async/{name}")
async def async_hello(name: str) -> PlainTextResponse:
    return PlainTextResponse(f"hello {name}")


@app.get("/boom")
def boom() -> None:
    raise RuntimeError("boom")


@app.get("/stream")
def stream() -> StreamingResponse:
    return StreamingResponse(iter([b"a" * 10, b"b" * 20, b"c" * 30]), media_type="text/plain")


items = APIRouter(prefix="/items")


@items.get("/{item_id}")
def get_item(item_id: str) -> dict[str, str]:
    return {"item": item_id}


v1 = APIRouter()
v1.include_router(items)
app.include_router(v1, prefix="/api/v1")


def report(request: Request) -> PlainTextResponse:
    return PlainTextResponse(
        f"report {request.path_params['report_id']} of {request.path_params['tenant']}"
    )


legacy = Starlette(routes=[Route("/reports/{report_id:int}", report)])
app.mount("/legacy/{tenant}", legacy)


async def plain(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"plain {request.path_params['slug']}")


app.add_route("/plain/{slug}", plain)  # a Starlette route in a FastAPI router

regional = FastAPI()


@regional.get("/stock/{sku}")
def stock(sku: str) -> dict[str, str]:
    return {"sku": sku}


async def raw(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"raw {request.path_params['n']}")


regional.add_route("/raw/{n:int}", raw)
regional.add_route("/plain/{slug}", plain)  # the same endpoint as /plain/{slug} above
app.mount("/v2/{region}", regional)
