"""psycopg 3 connections for the FastAPI zoo apps: one per worker thread, kept open (what a
small app without a pool does), so connecting is not part of a request's time."""

from __future__ import annotations

import threading

import psycopg

from zoo import env

_local = threading.local()


def pg() -> psycopg.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = _local.conn = psycopg.connect(env.PG_DSN, autocommit=True)
    return conn
