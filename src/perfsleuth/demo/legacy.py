"""The demo's legacy admin app (Flask, served by gunicorn): a clean page, a CSV export that
makes one query per customer, and a form handler that re-parses a large body per field."""

from __future__ import annotations

import csv
import io
import os
import urllib.parse
from typing import Any

from flask import Flask, Response, abort, request

from perfsleuth import agent
from perfsleuth.demo import db

DB_PATH = os.environ.get("PERFSLEUTH_DEMO_DB", "demo.sqlite3")
EXPORT_PAGE = 300
NOTE_FIELDS = ("customer_id", "subject", "body", "priority", "channel", "agent", "tags", "lang")

app = Flask(__name__)


@app.get("/admin/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/admin/customers/<int:customer_id>")
def customer(customer_id: int) -> dict[str, Any]:
    """Clean: two indexed queries."""
    con = db.connect(DB_PATH)
    try:
        row = con.execute(
            "SELECT id, tenant, name, email, city FROM customers WHERE id = ?", (customer_id,)
        ).fetchone()
        if row is None:
            abort(404)
        n, total = con.execute(
            "SELECT count(*), coalesce(sum(total_cents), 0) FROM orders WHERE customer_id = ?",
            (customer_id,),
        ).fetchone()
    finally:
        con.close()
    return {"id": row[0], "tenant": row[1], "name": row[2], "email": row[3], "city": row[4],
            "orders": n, "total_cents": total}  # fmt: skip


@app.get("/admin/export.csv")
def export_csv() -> Response:
    """N+1 in an export: one order-summary query per customer of the page."""
    page = max(request.args.get("page", 1, type=int), 1)
    con = db.connect(DB_PATH)
    try:
        customers = con.execute(
            "SELECT id, name, email FROM customers ORDER BY id LIMIT ? OFFSET ?",
            (EXPORT_PAGE, (page - 1) * EXPORT_PAGE),
        ).fetchall()
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["id", "name", "email", "orders", "total_cents"])
        for cid, name, email in customers:
            n, total = con.execute(
                "SELECT count(*), coalesce(sum(total_cents), 0) FROM orders WHERE customer_id = ?",
                (cid,),
            ).fetchone()  # the loop: one query per customer
            writer.writerow([cid, name, email, n, total])
    finally:
        con.close()
    agent.attr("customers_exported", len(customers))
    return Response(out.getvalue(), mimetype="text/csv")


@app.post("/admin/notes")
def add_note() -> dict[str, Any]:
    """A support note with a pasted log (0.3-3 MB): the whole body is parsed again per field."""
    raw = request.get_data(as_text=True)
    note = {}
    for field in NOTE_FIELDS:
        values = urllib.parse.parse_qs(raw).get(field)  # re-parses the whole body every time
        note[field] = values[0] if values else ""
    agent.attr("note_bytes", len(note["body"]))
    return {"stored": True, "fields": sum(1 for v in note.values() if v)}
