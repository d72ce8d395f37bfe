"""A Flask service traced by the official OpenTelemetry SDK (Flask and sqlite3 instrumentation)
exporting OTLP/HTTP protobuf: ``GET /orders`` runs one items query per order (an N+1) from a
function that records its call site in ``code.*`` attributes; ``GET /orders/summary`` runs one
query (clean)."""

from __future__ import annotations

import sqlite3
import sys
import threading
from typing import Any

from flask import Flask, jsonify
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.flask import FlaskInstrumentor
from opentelemetry.instrumentation.sqlite3 import SQLite3Instrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from werkzeug.serving import make_server

ORDERS = 30


def build(endpoint: str) -> tuple[Any, TracerProvider]:
    """(a started WSGI server, its tracer provider) exporting to ``endpoint``."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": "otlp-shop", "host.name": "box-1"})
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    tracer = provider.get_tracer("otlp-shop")
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT);"
        "CREATE TABLE items (order_id INTEGER, sku TEXT, qty INTEGER);"
    )
    db.executemany("INSERT INTO orders VALUES (?, ?)", [(i, f"c{i % 3}") for i in range(ORDERS)])
    db.executemany("INSERT INTO items VALUES (?, ?, ?)", [(i, "sku", 1) for i in range(ORDERS)])
    db.commit()
    conn = SQLite3Instrumentor().instrument_connection(db, tracer_provider=provider)
    lock = threading.Lock()
    app = Flask("otlp_shop")
    FlaskInstrumentor().instrument_app(app, tracer_provider=provider)

    def items_of(order_id: int) -> list[Any]:
        # The query's own span carries where it was made (the DB-API instrumentation does not).
        with tracer.start_as_current_span(
            "SELECT items",
            kind=trace.SpanKind.CLIENT,
            attributes={
                "db.system": "sqlite",
                "db.statement": f"SELECT sku, qty FROM items WHERE order_id = {order_id}",
                "code.filepath": __file__,
                "code.lineno": sys._getframe().f_lineno,
                "code.function": "items_of",
            },
        ):
            sql = "SELECT sku, qty FROM items WHERE order_id = ?"
            return conn.cursor().execute(sql, (order_id,)).fetchall()

    @app.get("/orders")
    def orders() -> Any:
        with lock:
            rows = conn.cursor().execute("SELECT id FROM orders ORDER BY id").fetchall()
            return jsonify([{"id": r[0], "items": items_of(r[0])} for r in rows])

    @app.get("/orders/summary")
    def summary() -> Any:
        with lock:
            rows = (
                conn.cursor().execute("SELECT customer, count(*) FROM orders GROUP BY 1").fetchall()
            )
        return jsonify(rows)

    @app.get("/boom")
    def boom() -> Any:
        raise ValueError("planted failure")

    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, provider
