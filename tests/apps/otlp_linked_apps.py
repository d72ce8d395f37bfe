"""Two Flask services traced by the official OpenTelemetry SDK, each with its own tracer
provider (service name) exporting OTLP/HTTP protobuf: ``shop``'s ``GET /checkout`` calls
``billing``'s ``GET /invoices/<id>`` over HTTP, in a CLIENT span whose context goes in the
request's ``traceparent`` header (the SDK's propagator, as the HTTP client instrumentations
do); ``billing`` spends the request in twelve queries, one per invoice line, each walking a
few thousand rows (a few ms: the call is most of checkout's time)."""

from __future__ import annotations

import json
import sqlite3
import threading
import urllib.request
from typing import Any

from flask import Flask, jsonify
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.flask import FlaskInstrumentor
from opentelemetry.instrumentation.sqlite3 import SQLite3Instrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from werkzeug.serving import make_server

LINES = 12


def _provider(endpoint: str, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def _serve(app: Flask) -> Any:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def build(endpoint: str) -> tuple[list[Any], list[TracerProvider], str]:
    """(the started servers, their tracer providers, shop's base URL)."""
    billing_tp = _provider(endpoint, "billing")
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript("CREATE TABLE lines (invoice INTEGER, n INTEGER, amount INTEGER);")
    db.executemany(
        "INSERT INTO lines VALUES (?, ?, ?)", [(i, n, 10) for i in range(50) for n in range(LINES)]
    )
    db.commit()
    conn = SQLite3Instrumentor().instrument_connection(db, tracer_provider=billing_tp)
    lock = threading.Lock()
    billing = Flask("billing")
    FlaskInstrumentor().instrument_app(billing, tracer_provider=billing_tp)

    @billing.get("/invoices/<int:invoice_id>")
    def invoice(invoice_id: int) -> Any:
        with lock:
            total = 0
            for n in range(LINES):
                sql = (
                    "WITH RECURSIVE walk(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM walk"
                    " WHERE x < 20000) SELECT amount + (SELECT count(*) FROM walk) - 20000"
                    " FROM lines WHERE invoice = ? AND n = ?"
                )
                total += conn.cursor().execute(sql, (invoice_id, n)).fetchone()[0]
        return jsonify({"invoice": invoice_id, "total": total})

    billing_server = _serve(billing)
    billing_url = f"http://127.0.0.1:{billing_server.server_port}"

    shop_tp = _provider(endpoint, "shop")
    tracer = shop_tp.get_tracer("shop")
    shop = Flask("shop")
    FlaskInstrumentor().instrument_app(shop, tracer_provider=shop_tp)

    @shop.get("/checkout")
    def checkout() -> Any:
        url = f"{billing_url}/invoices/7"
        attrs = {
            "http.request.method": "GET",
            "url.full": url,
            "server.address": "127.0.0.1",
            "server.port": billing_server.server_port,
        }
        with tracer.start_as_current_span("GET", kind=trace.SpanKind.CLIENT, attributes=attrs):
            headers: dict[str, str] = {}
            propagate.inject(headers)
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as r:
                invoice = json.loads(r.read())
        return jsonify({"paid": invoice["total"]})

    @shop.get("/health")
    def health() -> Any:
        return jsonify({"ok": True})

    shop_server = _serve(shop)
    return (
        [shop_server, billing_server],
        [shop_tp, billing_tp],
        f"http://127.0.0.1:{shop_server.server_port}",
    )
