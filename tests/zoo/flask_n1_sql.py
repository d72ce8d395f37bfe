"""n_plus_one on SQL through a helper (Flask + psycopg2 pool): the blog index counts each
post's comments with a helper that runs one query. The statement lives in the helper, but the
problem is the loop in the view, so that is the line to report. Clean twin: one GROUP BY."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flask import Blueprint, request
from psycopg2.pool import ThreadedConnectionPool

from zoo import env

bp = Blueprint("n1_sql", __name__)
PAGE = 25
_pool: ThreadedConnectionPool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> ThreadedConnectionPool:
    # Created on first use, in the worker (after gunicorn's fork), not in the master.
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadedConnectionPool(1, 8, env.PG_DSN)
        return _pool


@contextmanager
def _cursor() -> Iterator[Any]:
    pool = _get_pool()
    conn = pool.getconn()
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            yield cur
    finally:
        pool.putconn(conn)


def _comment_count(cur: Any, post_id: int) -> int:
    cur.execute("SELECT count(*) FROM zoo_n1_sql.comment WHERE post_id = %s", (post_id,))
    return int(cur.fetchone()[0])


@bp.get("/n1-sql/bad")
def posts_bad() -> dict[str, Any]:
    offset = PAGE * (request.args.get("page", 0, type=int) % 8)
    with _cursor() as cur:
        cur.execute(
            "SELECT id, title FROM zoo_n1_sql.post ORDER BY created DESC LIMIT %s OFFSET %s",
            (PAGE, offset),
        )
        posts = []
        for post_id, title in cur.fetchall():
            comments = _comment_count(cur, post_id)  # PLANTED: n_plus_one
            posts.append({"id": post_id, "title": title, "comments": comments})
    return {"posts": posts}


@bp.get("/n1-sql/clean")
def posts_clean() -> dict[str, Any]:
    offset = PAGE * (request.args.get("page", 0, type=int) % 8)
    with _cursor() as cur:
        # The page's posts with their comment counts, in one statement.
        cur.execute(
            "SELECT p.id, p.title, (SELECT count(*) FROM zoo_n1_sql.comment c "
            "WHERE c.post_id = p.id) FROM zoo_n1_sql.post p "
            "ORDER BY p.created DESC LIMIT %s OFFSET %s",
            (PAGE, offset),
        )
        posts = [{"id": i, "title": t, "comments": n} for i, t, n in cur.fetchall()]
    return {"posts": posts}
