"""The Flask zoo app (run under gunicorn): one blueprint per planted problem."""

from __future__ import annotations

from flask import Flask

from zoo import flask_large_body, flask_n1_cache, flask_n1_sql, flask_repeated

app = Flask(__name__)
for module in (flask_n1_cache, flask_n1_sql, flask_repeated, flask_large_body):
    app.register_blueprint(module.bp)


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}
