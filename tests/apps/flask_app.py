"""A Flask admin app: converter rules, a blueprint, errors, streaming, a cross-worker barrier."""

from __future__ import annotations

import os
import time

from flask import Blueprint, Flask, Response, request

import perfsleuth.agent as ps


def create_app(**config: object) -> Flask:
    app = Flask(__name__)
    app.config.update(config)
    app.register_blueprint(admin)
    app.register_blueprint(shop)
    return app


admin = Blueprint("admin", __name__)
shop = Blueprint("shop", __name__, url_prefix="/shop")


@admin.get("/health")
def health() -> str:
    return "ok"


@admin.get("/admin/customers/<int:customer_id>")
def customer(customer_id: int) -> dict[str, int]:
    ps.attr("customer_id", customer_id)
    ps.attr("pid", os.getpid())
    return {"customer_id": customer_id, "pid": os.getpid()}


@admin.post("/upload")
def upload() -> dict[str, int]:
    return {"received": len(request.get_data())}


@admin.get("/boom")
def boom() -> str:
    raise ValueError("boom")


@admin.get("/stream")
def stream() -> Response:
    def gen():  # type: ignore[no-untyped-def]
        for i in range(5):
            yield f"chunk {i}\n"

    return Response(gen(), mimetype="text/plain")


@admin.get("/barrier/<int:n>")
def barrier(n: int) -> dict[str, int]:
    """Blocks until `n` different worker processes are inside this view (or 60 s pass).

    With sync workers a blocked worker accepts no other connection, so `n` concurrent calls
    land on `n` different workers: the test gets every worker to serve a request, no timing.
    """
    d = request.args["dir"]
    open(os.path.join(d, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(d)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    ps.attr("pid", os.getpid())
    return {"pid": os.getpid(), "seen": len(os.listdir(d))}


@shop.get("/carts/<uuid:cart_id>/items")
def cart_items(cart_id: object) -> dict[str, str]:
    return {"cart": str(cart_id)}


app = create_app()
