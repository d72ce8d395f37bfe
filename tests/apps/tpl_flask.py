"""Flask app whose per-row queries run from a Jinja2 template (issue 15 item 4): a property
issuing a sqlite3 query, used on two template lines inside ``{% for %}``."""

from __future__ import annotations

import sqlite3

from flask import Flask, render_template

app = Flask(__name__, template_folder="tpl_flask_templates")
_db = sqlite3.connect(":memory:", check_same_thread=False)
_db.execute("CREATE TABLE links (check_id INTEGER, url TEXT)")
_db.executemany(
    "INSERT INTO links VALUES (?, ?)", [(i, f"https://example.test/{i}") for i in range(1, 6)]
)


class Check:
    def __init__(self, check_id: int) -> None:
        self.id = check_id

    @property
    def url(self) -> str:
        row = _db.execute("SELECT url FROM links WHERE check_id = ?", (self.id,)).fetchone()
        return str(row[0])


@app.route("/checks")
def checks() -> str:
    return render_template("checks.html", checks=[Check(i) for i in range(1, 6)])


@app.route("/plain")
def plain() -> str:
    return str(_db.execute("SELECT count(*) FROM links").fetchone()[0])
