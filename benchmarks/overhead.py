"""Agent overhead benchmark: three web stacks bare, with perfsleuth, and with three peers.

    .venv/bin/python benchmarks/overhead.py [--stack all] [--requests N] [--repeats 15]
        [--rounds 3] [--variants bare,perfsleuth,otel,sentry,ddtrace] [--cpu N] [--json FILE]
        [--quick]

The stacks (``--stack``, default all; each with an N+1 loop of 10 queries):

* ``fastapi-sqlite``: a FastAPI sync endpoint ``GET /orders/{order_id}`` making 1 + 10 sqlite3
  queries on a small file database. Requests go straight into the ASGI callable, one after
  another on one event loop (no sockets, no HTTP parsing); FastAPI runs the endpoint in anyio's
  thread pool, the same for every variant.
* ``django-pg``: a Django view (``benchmarks/overhead_django``) on PostgreSQL through psycopg 3,
  under WSGI: the order with its customer, its lines, and each line's product through the
  foreign key (1 + 1 + 10 queries). Requests go straight into Django's WSGI callable.
* ``flask-sqlalchemy-pg``: a Flask endpoint on SQLAlchemy 2 ORM models, PostgreSQL through
  psycopg 3, a session per request, the products lazily loaded (1 + 1 + 10 queries), through
  Flask's WSGI callable.

PostgreSQL is the one at ``PERFSLEUTH_BENCH_PG_HOST``/``_PORT``/``_USER``/``_DB`` (default
127.0.0.1:5432, postgres, test); the benchmark's tables are ``bench_overhead_*``, seeded once
(kept: a later run finds them ready). The database server's CPU is not counted (another process).

Each variant runs in a child process of its own (this script with ``--variant``), so
instrumentations never mix. In each of ``--rounds`` rounds, fresh children for all variants
are alive at once; after a warm-up they take turns, ``--repeats`` slices of ``--requests``
requests each, the order rotating from slice to slice, so drift of a shared machine hits
neighbouring slices alike. A slice ends with a flush of the variant's background writer or
exporter, so deferred work is inside it. CPU is ``time.process_time_ns()``: every thread of
the process (event loop, pool thread, perfsleuth's writer, OpenTelemetry's batch processor).
A variant's overhead is the median over all slices of its ratio to bare's slice of the same
round and number; its µs per request, the median over its slices. Each round's line on
stderr adds the medians of user and system CPU, context switches and page faults per request
(getrusage around each slice): the kernel's side, which an instruction count does not see.
Stacks run one after the other, each with its own rounds.

The peers use their instrumentations of each stack (OpenTelemetry: FastAPI + sqlite3, Django
+ psycopg, Flask + SQLAlchemy; sentry-sdk: its default integrations; ddtrace: fastapi + sqlite3,
django + psycopg, flask + sqlalchemy + psycopg) and export into dropping sinks (their
serialisation and I/O are not counted), while perfsleuth's writer really encodes and writes
its spool; afterwards (not timed) the perfsleuth child ingests the spool into a store and
checks every request and every query of the app arrived with a stack.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import io
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("bare", "perfsleuth", "otel", "sentry", "ddtrace")
STACKS = ("fastapi-sqlite", "django-pg", "flask-sqlalchemy-pg")
NEEDS: dict[str, dict[str, tuple[str, ...]]] = {  # stack -> variant -> distributions it needs
    "fastapi-sqlite": {
        "bare": ("fastapi",),
        "otel": (
            "opentelemetry-sdk",
            "opentelemetry-instrumentation-fastapi",
            "opentelemetry-instrumentation-sqlite3",
        ),
        "sentry": ("sentry-sdk",),
        "ddtrace": ("ddtrace",),
    },
    "django-pg": {
        "bare": ("django", "psycopg"),
        "otel": (
            "opentelemetry-sdk",
            "opentelemetry-instrumentation-django",
            "opentelemetry-instrumentation-psycopg",
        ),
        "sentry": ("sentry-sdk",),
        "ddtrace": ("ddtrace",),
    },
    "flask-sqlalchemy-pg": {
        "bare": ("flask", "sqlalchemy", "psycopg"),
        "otel": (
            "opentelemetry-sdk",
            "opentelemetry-instrumentation-flask",
            "opentelemetry-instrumentation-sqlalchemy",
        ),
        "sentry": ("sentry-sdk",),
        "ddtrace": ("ddtrace",),
    },
}
ORDERS, PRODUCTS, LINES = 1000, 200, 10
CALLS = 1 + LINES  # per request of fastapi-sqlite
# per request: the stack's queries of the shop's tables (the PostgreSQL stacks load the
# lines with a query of their own, then each line's product)
STACK_CALLS = {"fastapi-sqlite": CALLS, "django-pg": 2 + LINES, "flask-sqlalchemy-pg": 2 + LINES}
STACK_ENDPOINTS = {
    "fastapi-sqlite": "GET /orders/{order_id}",
    "django-pg": "GET /orders/<int:order_id>",
    "flask-sqlalchemy-pg": "GET /orders/<int:order_id>",
}
# default requests per slice, slices and warm-up: a PostgreSQL request (12 round trips over
# loopback TCP) takes about ten times the CPU of a sqlite one
STACK_REQUESTS = {"fastapi-sqlite": 1000, "django-pg": 80, "flask-sqlalchemy-pg": 80}
STACK_REPEATS = {"fastapi-sqlite": 15, "django-pg": 10, "flask-sqlalchemy-pg": 10}
STACK_WARMUP = {"fastapi-sqlite": 300, "django-pg": 50, "flask-sqlalchemy-pg": 50}
TARGET, STRETCH = 10.0, 5.0  # % of bare's CPU per request
RESULT = "@@result "  # marks the child's result line on its stdout
PG_TABLE = "bench_overhead_"  # prefix of the PostgreSQL stacks' tables
SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "GET",
    "scheme": "http",
    "query_string": b"",
    "root_path": "",
    "client": ("127.0.0.1", 50000),
    "server": ("bench", 80),
}


def pg_conninfo() -> dict[str, str]:
    env = os.environ.get
    return {
        "host": env("PERFSLEUTH_BENCH_PG_HOST", "127.0.0.1"),
        "port": env("PERFSLEUTH_BENCH_PG_PORT", "5432"),
        "user": env("PERFSLEUTH_BENCH_PG_USER", "postgres"),
        "dbname": env("PERFSLEUTH_BENCH_PG_DB", "test"),
    }


def pg_url() -> str:
    """SQLAlchemy's URL of pg_conninfo (a host that is a directory: its Unix socket)."""
    c = pg_conninfo()
    return f"postgresql+psycopg://{c['user']}@/{c['dbname']}?host={c['host']}&port={c['port']}"


def seed_pg() -> None:
    """The PostgreSQL stacks' tables, the same shop as seed_db's (an id per order line, for
    the ORMs); left as they are when a previous run seeded them."""
    import psycopg

    t = PG_TABLE
    with psycopg.connect(**pg_conninfo(), autocommit=True) as con:
        try:
            n = con.execute(f"SELECT count(*) FROM {t}order_items").fetchone()
            if n is not None and n[0] == ORDERS * LINES:
                return
        except psycopg.errors.UndefinedTable:
            pass
        with con.transaction():
            for name in ("order_items", "orders", "products", "customers"):
                con.execute(f"DROP TABLE IF EXISTS {t}{name}")
            con.execute(f"CREATE TABLE {t}customers (id integer PRIMARY KEY, name text)")
            con.execute(
                f"CREATE TABLE {t}products (id integer PRIMARY KEY, name text,"
                " price double precision)"
            )
            con.execute(
                f"CREATE TABLE {t}orders (id integer PRIMARY KEY, customer_id integer, placed text)"
            )
            con.execute(
                f"CREATE TABLE {t}order_items (id integer PRIMARY KEY, order_id integer,"
                " line integer, product_id integer, qty integer)"
            )
            con.execute(f"CREATE INDEX ON {t}order_items (order_id, line)")
            ids = range(1, ORDERS + 1)
            with con.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO {t}customers VALUES (%s, %s)", [(i, f"c{i}") for i in ids]
                )
                cur.executemany(
                    f"INSERT INTO {t}products VALUES (%s, %s, %s)",
                    [(i, f"p{i}", i / 4) for i in ids],
                )
                cur.executemany(
                    f"INSERT INTO {t}orders VALUES (%s, %s, '2024-05-01')",
                    [(i, i) for i in ids],
                )
                cur.executemany(
                    f"INSERT INTO {t}order_items VALUES (%s, %s, %s, %s, %s)",
                    [
                        ((o - 1) * LINES + j + 1, o, j, (o * 31 + j) % PRODUCTS + 1, j + 1)
                        for o in ids
                        for j in range(LINES)
                    ],
                )
            con.execute(f"ANALYZE {t}order_items")


def seed_db(path: str) -> None:
    import sqlite3  # not at the top: a child imports it only after instrumenting

    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT);"
        "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price REAL);"
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, placed TEXT);"
        "CREATE TABLE order_items (order_id INTEGER, line INTEGER, product_id INTEGER,"
        " qty INTEGER, PRIMARY KEY (order_id, line));"
    )
    ids = range(1, ORDERS + 1)
    con.executemany("INSERT INTO customers VALUES (?, ?)", [(i, f"c{i}") for i in ids])
    con.executemany("INSERT INTO products VALUES (?, ?, ?)", [(i, f"p{i}", i / 4) for i in ids])
    con.executemany("INSERT INTO orders VALUES (?, ?, '2024-05-01')", [(i, i) for i in ids])
    con.executemany(
        "INSERT INTO order_items VALUES (?, ?, ?, ?)",
        [(o, j, (o * 31 + j) % PRODUCTS + 1, j + 1) for o in ids for j in range(LINES)],
    )
    con.commit()
    con.close()


def make_app(db_path: str) -> Any:
    """The reference app; imports fastapi and sqlite3 late, after the variant's set-up."""
    import sqlite3

    from fastapi import FastAPI

    app = FastAPI()
    local = threading.local()  # a connection per pool thread, opened (instrumented) lazily

    @app.get("/orders/{order_id}")
    def get_order(order_id: int) -> dict[str, Any]:
        con = getattr(local, "con", None)
        if con is None:
            con = local.con = sqlite3.connect(db_path)
        cur = con.cursor()  # not con.execute: every peer traces cursor.execute
        cur.execute(
            "SELECT o.id, o.placed, c.name FROM orders o"
            " JOIN customers c ON c.id = o.customer_id WHERE o.id = ?",
            (order_id,),
        )
        oid, placed, customer = cur.fetchone()
        items = []
        for line in range(LINES):  # the N+1 loop
            cur.execute(
                "SELECT p.name, p.price, i.qty FROM order_items i"
                " JOIN products p ON p.id = i.product_id WHERE i.order_id = ? AND i.line = ?",
                (order_id, line),
            )
            name, price, qty = cur.fetchone()
            items.append({"product": name, "qty": qty, "price": price})
        total = sum(i["price"] * i["qty"] for i in items)
        return {"id": oid, "placed": placed, "customer": customer, "items": items, "total": total}

    return app


async def request(app: Any, order_id: int) -> int:
    """One GET through the ASGI callable; returns the response status."""
    path = f"/orders/{order_id}"
    headers = [(b"host", b"bench"), (b"x-user", b"u%d" % (order_id % 50))]
    scope = {**SCOPE, "path": path, "raw_path": path.encode(), "headers": headers}
    messages = [{"type": "http.request", "body": b"", "more_body": False}]
    status = 0

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


def make_django_app() -> Any:
    """The Django stack's WSGI callable (benchmarks/overhead_django); imports Django late."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "overhead_django.settings"
    from django.core.wsgi import get_wsgi_application

    return get_wsgi_application()


def make_flask_app() -> Any:
    """The Flask + SQLAlchemy stack's app; imports Flask and SQLAlchemy late."""
    from flask import Flask
    from sqlalchemy import Column, Float, ForeignKey, Integer, Text, create_engine, select
    from sqlalchemy.orm import declarative_base, relationship, scoped_session, sessionmaker

    # Columns without annotations: this module's `from __future__ import annotations` makes
    # Mapped[...] strings SQLAlchemy cannot resolve in a function's scope.
    t = PG_TABLE
    Base: Any = declarative_base()

    class Customer(Base):
        __tablename__ = f"{t}customers"
        id = Column(Integer, primary_key=True)
        name = Column(Text)

    class Product(Base):
        __tablename__ = f"{t}products"
        id = Column(Integer, primary_key=True)
        name = Column(Text)
        price = Column(Float)

    class Order(Base):
        __tablename__ = f"{t}orders"
        id = Column(Integer, primary_key=True)
        customer_id = Column(Integer, ForeignKey(Customer.id))
        placed = Column(Text)
        customer = relationship(Customer, lazy="joined")

    class OrderItem(Base):
        __tablename__ = f"{t}order_items"
        id = Column(Integer, primary_key=True)
        order_id = Column(Integer, ForeignKey(Order.id))
        line = Column(Integer)
        product_id = Column(Integer, ForeignKey(Product.id))
        qty = Column(Integer)
        product = relationship(Product)  # lazy: a query per line, the N+1

    engine = create_engine(pg_url(), pool_size=2)
    sessions = scoped_session(sessionmaker(engine))
    app = Flask("bench_flask")

    @app.teardown_appcontext
    def end_session(exc: BaseException | None) -> None:
        sessions.remove()

    @app.get("/orders/<int:order_id>")
    def get_order(order_id: int) -> dict[str, Any]:
        session = sessions()
        order = session.get(Order, order_id)
        assert order is not None
        lines = select(OrderItem).where(OrderItem.order_id == order_id).order_by(OrderItem.line)
        items = [
            {"product": i.product.name, "qty": i.qty, "price": i.product.price}
            for i in session.scalars(lines)
        ]
        total = sum(i["price"] * i["qty"] for i in items)
        return {
            "id": order.id,
            "placed": order.placed,
            "customer": order.customer.name,
            "items": items,
            "total": total,
        }

    return app


def wsgi_request(app: Any, order_id: int) -> int:
    """One GET through a WSGI callable, the body read and closed; returns the status."""
    path = f"/orders/{order_id}"
    environ = {
        "REQUEST_METHOD": "GET",
        "SCRIPT_NAME": "",
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "HTTP_HOST": "bench",
        "HTTP_X_USER": f"u{order_id % 50}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(b""),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    status = ""

    def start_response(s: str, headers: Any, exc_info: Any = None) -> Callable[[bytes], None]:
        nonlocal status
        status = s
        return lambda data: None

    body = app(environ, start_response)
    try:
        for _ in body:
            pass
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()
    return int(status.split()[0]) if status else 0


# ----------------------------------------------------------------------------- the variants
# Each returns (app, flush, check): flush() pushes deferred work into the sink (timed);
# check(n) says what the instrumentation produced for n requests (not timed). ``db`` is the
# sqlite file of fastapi-sqlite (unused by the PostgreSQL stacks).

Setup = tuple[Any, Callable[[], Any], Callable[[int], tuple[bool, str]]]


def build_app(stack: str, db: str) -> Any:
    if stack == "django-pg":
        return make_django_app()
    if stack == "flask-sqlalchemy-pg":
        return make_flask_app()
    return make_app(db)


def setup_bare(db: str, tmp: str, stack: str = "fastapi-sqlite") -> Setup:
    return build_app(stack, db), lambda: None, lambda n: (True, "")


def setup_perfsleuth(
    db: str,
    tmp: str,
    stack: str = "fastapi-sqlite",
    all_stacks: bool = False,
    evidence: bool = True,
    capture: bool = True,
) -> Setup:
    data = os.environ["PERFSLEUTH_DATA"] = os.path.join(tmp, "agent")
    os.environ["PERFSLEUTH_EVIDENCE"] = "1" if evidence else "0"
    os.environ["PERFSLEUTH_CAPTURE"] = "1" if capture else "0"
    if all_stacks:  # default: one stack per (statement, call site) and request
        os.environ["PERFSLEUTH_STACKS_PER_SITE"] = "1000000"
    import perfsleuth.agent as ps

    # default config: patches the framework (every request) and the driver (every call)
    if not ps.start():
        raise RuntimeError("perfsleuth.agent.start() did not start")
    per_request = STACK_CALLS[stack]

    def check(n: int) -> tuple[bool, str]:
        from perfsleuth.agent import shipper
        from perfsleuth.store.duckdb_store import DuckDBStore

        # events the evidence thread emits once the agent is off are dropped by design (and
        # counted): the events dropped while it ran are those counted before the shutdown
        events = ps.stats().get("dropped_events", 0)
        shipper.shutdown()  # what atexit would do: write and close the last segment
        drops = {k: v for k, v in ps.stats().items() if k.startswith("dropped") and v}
        drops.pop("dropped_events", None)
        if events:
            drops["dropped_events"] = events
        with DuckDBStore(data) as store:
            rep = store.ingest()
            # the app's queries (a PostgreSQL stack's first request also sets its connection up)
            calls = store.query(
                "SELECT count(*) AS n, count(c.stack_id) AS stacked FROM calls c"
                " JOIN fingerprints f ON f.id = c.fingerprint_id"
                " WHERE f.text ILIKE '%orders%' OR f.text ILIKE '%order_items%'"
                " OR f.text ILIKE '%products%'"
            )[0]
            eps = [r["endpoint"] for r in store.query("SELECT DISTINCT endpoint FROM requests")]
        ok = rep.requests == n and calls["n"] == calls["stacked"] == per_request * n
        ok = ok and eps == [STACK_ENDPOINTS[stack]] and not drops
        text = f"{rep.requests}/{n} requests, {calls['n']}/{per_request * n} calls"
        if calls["n"] != per_request * n:  # recorded but not ingested, or not recorded
            text += f" ({rep.calls} calls ingested in all)"
        text += f", {calls['stacked']} with stack" + (f", {drops}" if drops else "")
        return ok, text + ("" if eps == [STACK_ENDPOINTS[stack]] else f", endpoints {eps}")

    return build_app(stack, db), ps.flush, check


def without_step_meter(setup: Setup) -> Setup:
    from perfsleuth.agent.frameworks import asgi

    asgi._CpuMeter = lambda req, aw: aw
    return setup


def setup_otel(db: str, tmp: str, stack: str = "fastapi-sqlite") -> Setup:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class DropExporter(SpanExporter):
        spans = 0

        def export(self, spans: Any) -> SpanExportResult:
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

    exporter = DropExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    if stack == "django-pg":
        from opentelemetry.instrumentation.django import DjangoInstrumentor
        from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

        os.environ["DJANGO_SETTINGS_MODULE"] = "overhead_django.settings"  # read by instrument
        PsycopgInstrumentor().instrument(tracer_provider=provider)  # before any connection
        DjangoInstrumentor().instrument(tracer_provider=provider)  # adds its middleware
        app = make_django_app()
    elif stack == "flask-sqlalchemy-pg":
        from opentelemetry.instrumentation.flask import FlaskInstrumentor
        from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

        FlaskInstrumentor().instrument(tracer_provider=provider)  # before the app is made
        # wraps create_engine; its declared range ends below SQLAlchemy 2.1, which it traces
        SQLAlchemyInstrumentor().instrument(tracer_provider=provider, skip_dep_check=True)
        app = make_flask_app()
    else:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.instrumentation.sqlite3 import SQLite3Instrumentor

        SQLite3Instrumentor().instrument(tracer_provider=provider)  # before any connection
        app = make_app(db)
        FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    return app, provider.force_flush, lambda n: (True, f"{exporter.spans / n:.1f} spans/request")


def setup_sentry(db: str, tmp: str, stack: str = "fastapi-sqlite") -> Setup:
    import sentry_sdk
    from sentry_sdk.transport import Transport

    class DropTransport(Transport):
        transactions = 0
        spans = 0

        def capture_envelope(self, envelope: Any) -> None:
            for item in envelope.items:
                if item.type == "transaction":
                    self.transactions += 1
                    self.spans += len((item.payload.json or {}).get("spans", ()))

    transport = DropTransport()
    # Default integrations: those of Starlette and FastAPI, Django, Flask and SQLAlchemy are
    # enabled when their library is installed (sentry has none for sqlite3 or bare psycopg).
    sentry_sdk.init(dsn="http://public@127.0.0.1:1/1", traces_sample_rate=1.0, transport=transport)

    def check(n: int) -> tuple[bool, str]:
        text = f"{transport.transactions / n:.1f} tx/request"
        return transport.transactions == n, text + f", {transport.spans / n:.1f} spans/request"

    return build_app(stack, db), sentry_sdk.flush, check


def setup_ddtrace(db: str, tmp: str, stack: str = "fastapi-sqlite") -> Setup:
    os.environ.update(
        DD_TRACE_ENABLED="true",
        DD_INSTRUMENTATION_TELEMETRY_ENABLED="false",
        DD_REMOTE_CONFIGURATION_ENABLED="false",
        DD_TRACE_STARTUP_LOGS="false",
        DD_CRASHTRACKING_ENABLED="false",
        # Used only if the writer cannot be replaced below: a closed local port, so the
        # background writer thread fails fast and nothing leaves the machine.
        DD_TRACE_AGENT_URL="http://127.0.0.1:9",
    )
    from ddtrace import patch

    # before the app imports its framework and driver
    if stack == "django-pg":
        patch(django=True, psycopg=True)
    elif stack == "flask-sqlalchemy-pg":
        patch(flask=True, sqlalchemy=True, psycopg=True)
    else:
        patch(fastapi=True, sqlite3=True)
    from ddtrace.internal.writer import TraceWriter
    from ddtrace.trace import tracer

    class DropWriter(TraceWriter):
        spans = 0

        def recreate(self, appsec_enabled: Any = None, llmobs_enabled: Any = None) -> Any:
            return self

        def stop(self, timeout: Any = None) -> None:
            pass

        def write(self, spans: Any = None) -> None:
            self.spans += len(spans or ())

        def flush_queue(self) -> None:
            pass

    writer = DropWriter()
    note = ""
    try:
        tracer._span_aggregator.writer = writer  # private, but there is no public way to drop
    except AttributeError:
        note = " (agent writer, closed port)"

    def check(n: int) -> tuple[bool, str]:
        return True, f"{writer.spans / n:.1f} spans/request{note}"

    return build_app(stack, db), tracer.flush, check


SETUPS: dict[str, Callable[..., Setup]] = {
    "bare": setup_bare,
    "perfsleuth": setup_perfsleuth,
    # Opt-in (--variants): a freshly captured stack for every call, not one per site and request.
    "perfsleuth-all-stacks": lambda db, tmp, stack="fastapi-sqlite": setup_perfsleuth(
        db, tmp, stack, all_stacks=True
    ),
    # Opt-in: without the runtime-evidence thread and GC hook (what they cost under load).
    "perfsleuth-no-evidence": lambda db, tmp, stack="fastapi-sqlite": setup_perfsleuth(
        db, tmp, stack, evidence=False
    ),
    # Opt-in: without replayable captures (the per-request decision and the 1 % sample).
    "perfsleuth-no-capture": lambda db, tmp, stack="fastapi-sqlite": setup_perfsleuth(
        db, tmp, stack, capture=False
    ),
    # Opt-in: without the CPU meter of the request's task steps on the loop (the worker
    # thread's run is still timed): what the loop's CPU-clock reads cost.
    "perfsleuth-no-step-cpu": lambda db, tmp, stack="fastapi-sqlite": without_step_meter(
        setup_perfsleuth(db, tmp, stack)
    ),
    # Opt-in: with Jinja2's runtime imported first, as in an app serving Jinja2 templates too
    # (stacks then look for template frames; the endpoint's own calls are under none).
    "perfsleuth-jinja-loaded": lambda db, tmp, stack="fastapi-sqlite": (
        importlib.import_module("jinja2.runtime") and setup_perfsleuth(db, tmp, stack)
    ),
    "otel": setup_otel,
    "sentry": setup_sentry,
    "ddtrace": setup_ddtrace,
}


KERNEL_SIDE = ("user_us", "sys_us", "faults", "switches")  # per request, from getrusage


def kernel_side(r0: Any, n: int) -> dict[str, float]:
    """Per request since ``r0`` (getrusage): user and system CPU (µs; the kernel's split,
    sampled at its tick), minor page faults and context switches: what an instruction count
    (callgrind: user space only) does not see."""
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "user_us": (r1.ru_utime - r0.ru_utime) * 1e6 / n,
        "sys_us": (r1.ru_stime - r0.ru_stime) * 1e6 / n,
        "faults": (r1.ru_minflt - r0.ru_minflt) / n,
        "switches": (r1.ru_nvcsw + r1.ru_nivcsw - r0.ru_nvcsw - r0.ru_nivcsw) / n,
    }


def serve_asgi(app: Any, flush: Callable[[], Any], check: Any, warmup: int) -> None:
    """The child's slices through an ASGI app, on one event loop."""

    async def timed(first: int, n: int) -> dict[str, Any]:
        gc.collect()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        bad = 0
        for i in range(first, first + n):
            bad += await request(app, i % ORDERS + 1) != 200
        flush()  # the slice's deferred work (writer, batch processor) counts in it
        cpu, wall = time.process_time_ns() - c0, time.perf_counter_ns() - w0
        out = {"cpu_us": cpu / n / 1000, "wall_us": wall / n / 1000, "bad": bad}
        return out | kernel_side(r0, n)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        print(RESULT + json.dumps(await timed(0, warmup)), flush=True)
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] != "run":
                finish(check, line)
                return
            print(RESULT + json.dumps(await timed(int(line[1]), int(line[2]))), flush=True)

    asyncio.run(serve())


def serve_wsgi(app: Any, flush: Callable[[], Any], check: Any, warmup: int) -> None:
    """The child's slices through a WSGI app, on the main thread."""

    def timed(first: int, n: int) -> dict[str, Any]:
        gc.collect()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        bad = 0
        for i in range(first, first + n):
            bad += wsgi_request(app, i % ORDERS + 1) != 200
        flush()
        cpu, wall = time.process_time_ns() - c0, time.perf_counter_ns() - w0
        out = {"cpu_us": cpu / n / 1000, "wall_us": wall / n / 1000, "bad": bad}
        return out | kernel_side(r0, n)

    print(RESULT + json.dumps(timed(0, warmup)), flush=True)
    while True:
        line = sys.stdin.readline().split()
        if not line or line[0] != "run":
            finish(check, line)
            return
        print(RESULT + json.dumps(timed(int(line[1]), int(line[2]))), flush=True)


def finish(check: Any, line: list[str]) -> None:
    ok, text = check(int(line[1]) if line else 0)
    print(RESULT + json.dumps({"ok": ok, "check": text}), flush=True)


def run_child(args: argparse.Namespace) -> None:
    """A variant's process: set up, warm up, then run the slices the parent asks for, one at a
    time (``run FIRST N`` on stdin: a result line on stdout), then ``check TOTAL``."""
    if args.cpu >= 0:  # before any thread starts, so that every thread inherits it
        os.sched_setaffinity(0, {args.cpu})
    variant, _, src = args.variant.partition("@")
    if src:  # another checkout's agent (an A/B of two versions): imported from there
        sys.path.insert(0, src)
    tmp = tempfile.mkdtemp(prefix="perfsleuth-overhead-")
    try:
        app, flush, check = SETUPS[variant](args.db, tmp, args.stack)
        if args.stack == "fastapi-sqlite":
            serve_asgi(app, flush, check, args.warmup)
        else:  # no event loop in the process: Django refuses DB access under a running one
            serve_wsgi(app, flush, check, args.warmup)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------- the parent


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_cpu() -> int:
    """The last CPU we may use (-1 where affinity cannot be set): children are pinned to it.

    Unpinned, on a 2-core machine a child's event loop and pool thread either share a core or
    ping-pong between the two, and which one a process gets is luck: bare measured 250 or
    330 µs of CPU per request from one process to the next, more than the 10 % being tested.
    Pinned, every thread still counts, but background work no longer overlaps the requests,
    so wall time includes it too.
    """
    return max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else -1


class Child:
    """One variant's process, driven slice by slice over pipes."""

    def __init__(self, name: str, db: str, args: argparse.Namespace) -> None:
        self.name = name
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", name, "--db", db]
        for opt in ("warmup", "cpu", "stack"):
            cmd += [f"--{opt}", str(getattr(args, opt))]
        # stderr into a file, not a pipe: nobody reads it while the child runs, and a child
        # whose library logs a lot would block on a full pipe
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed by finish())
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )
        self.requests = args.warmup
        self.error = ""

    def result(self) -> dict[str, Any] | None:
        """The child's next result line; None (and ``error`` set) if it died."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                out: dict[str, Any] = json.loads(line[len(RESULT) :])
                return out
        self.proc.wait()
        self.stderr.seek(0)
        tail = " | ".join(self.stderr.read().splitlines()[-3:])
        self.error = self.error or f"child failed: {tail}"
        return None

    def ask(self, command: str) -> dict[str, Any] | None:
        if self.error or self.proc.stdin is None:
            return None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: result() says how
        return self.result()

    def run(self, n: int) -> dict[str, Any] | None:
        out = self.ask(f"run {self.requests} {n}")
        self.requests += n
        return out

    def finish(self) -> tuple[bool, str]:
        out = self.ask(f"check {self.requests}")
        self.proc.wait(timeout=300)
        self.stderr.close()
        if out is None:
            return False, self.error
        return bool(out["ok"]), str(out["check"])


def run_round(names: list[str], db: str, args: argparse.Namespace, rnd: int) -> dict[str, Any]:
    """One round: a fresh process per variant, all alive at once; slice after slice, each
    variant in turn runs ``--requests`` requests (the order rotating from slice to slice), so
    neighbouring slices of different variants see the same state of a shared machine."""
    children = [Child(name, db, args) for name in names]
    runs: dict[str, dict[str, Any]] = {
        n: {"cpu_us": [], "wall_us": [], "bad": 0, **{k: [] for k in KERNEL_SIDE}} for n in names
    }
    for child in children:  # warm-ups ran side by side; wait for all of them
        warm = child.result()
        if warm is not None:
            runs[child.name]["bad"] += warm["bad"]
    for s in range(args.repeats):
        for child in children[s % len(children) :] + children[: s % len(children)]:
            res = child.run(args.requests)
            if res is None:
                continue
            for key in ("cpu_us", "wall_us", *KERNEL_SIDE):
                runs[child.name][key].append(res[key])
            runs[child.name]["bad"] += res["bad"]
    for child in children:
        ok, text = child.finish()
        r = runs[child.name]
        if r["bad"]:
            ok, text = False, f"{r['bad']} responses not 200; {text}"
        r.update(ok=ok and not child.error, check=text)
        if child.error:  # a slice list with holes cannot be paired
            r["cpu_us"], r["wall_us"] = [], []
        cpu = statistics.median(r["cpu_us"]) if r["cpu_us"] else float("nan")
        msg = f"  {args.stack} round {rnd}: {child.name:<22}{cpu:8.1f} µs CPU/request"
        if r["sys_us"]:  # the kernel's side, which an instruction count does not see
            med = {k: statistics.median(r[k]) for k in KERNEL_SIDE}
            msg += (
                f" (user {med['user_us']:.0f}, system {med['sys_us']:.0f} µs;"
                f" {med['switches']:.2f} context switches, {med['faults']:.2f} page faults)"
            )
        msg += f"  {text}"
        print(msg, file=sys.stderr, flush=True)
    return runs


def summarise(runs: list[dict[str, Any]], bare: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-request figures (median over every slice) and the overhead: the median over
    slices of the ratio to bare's slice next to it (same round, same slice number)."""
    med = statistics.median
    cpu = [x for r in runs for x in r["cpu_us"]]
    wall = [x for r in runs for x in r["wall_us"]]
    ratios = [
        (a / b, c / d)
        for r, base in zip(runs, bare, strict=True)
        if len(r["cpu_us"]) == len(base["cpu_us"])
        for a, b, c, d in zip(
            r["cpu_us"], base["cpu_us"], r["wall_us"], base["wall_us"], strict=True
        )
    ]
    cpu_r = sorted(x[0] for x in ratios)
    q = statistics.quantiles(cpu_r, n=4) if len(cpu_r) >= 2 else [cpu_r[0]] * 3 if cpu_r else []
    return {
        "cpu_us": med(cpu) if cpu else None,
        "wall_us": med(wall) if wall else None,
        "ratio_cpu": med(cpu_r) if cpu_r else None,
        "ratio_wall": med(x[1] for x in ratios) if ratios else None,
        # the middle half of the paired ratios, in points of overhead: a feel for the noise
        "iqr_pct": [(q[0] - 1) * 100, (q[2] - 1) * 100] if q else None,
        "cpu_us_slices": [r["cpu_us"] for r in runs],  # every slice, by round
        "ok": bool(runs) and all(r["ok"] for r in runs),
        "check": runs[-1]["check"] if runs else "",
    }


def print_table(names: list[str], summary: dict[str, dict[str, Any]]) -> None:
    base = summary["bare"]
    head = f"{'variant':<22}{'CPU µs/req':>11}{'× bare':>8}{'overhead':>10}{'IQR':>16}"
    head += f"{'wall µs/req':>13}{'× bare':>8}   check"
    print(head + "\n" + "-" * len(head))
    for name in names:
        s = summary.get(name)
        if s is None:
            print(f"{name:<22}skipped (not installed)")
        elif s["ratio_cpu"] is None or base["cpu_us"] is None:
            print(f"{name:<22}failed: {s['check']}")
        else:
            s["overhead_pct"] = (s["ratio_cpu"] - 1) * 100
            over = "-" if name == "bare" else f"{s['overhead_pct']:+.1f} %"
            lo, hi = s["iqr_pct"]
            iqr = "-" if name == "bare" else f"{lo:+.1f}..{hi:+.1f} %"
            print(
                f"{name:<22}{s['cpu_us']:>11.1f}{s['ratio_cpu']:>7.2f}x{over:>10}{iqr:>16}"
                f"{s['wall_us']:>13.1f}{s['ratio_wall']:>7.2f}x   "
                + ("" if s["ok"] else "FAILED: ")
                + s["check"]
            )


def verdict(stack: str, summary: dict[str, dict[str, Any]]) -> tuple[bool | None, str]:
    """Whether perfsleuth met the target on this stack, and the sentence that says so."""
    ps = summary.get("perfsleuth", {})
    if ps.get("overhead_pct") is None:
        return None, f"{stack:<20} perfsleuth not measured"
    pct = ps["overhead_pct"]
    met = bool(pct <= TARGET and ps["ok"])
    capture = "capture verified" if ps["ok"] else "capture verification FAILED"
    return met, (
        f"{stack:<20} {pct:+5.1f} % CPU per request ({capture}): target ≤ {TARGET:.0f} % "
        f"{'met' if met else 'NOT met'}, stretch ≤ {STRETCH:.0f} % "
        + ("met" if met and pct <= STRETCH else "not met")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--stack", default="all", help=f"one of {', '.join(STACKS)}, or all (one after another)"
    )
    ap.add_argument(
        "--requests",
        type=int,
        help="requests per timed slice (default by stack: "
        + ", ".join(f"{k} {v}" for k, v in STACK_REQUESTS.items())
        + ")",
    )
    ap.add_argument(
        "--repeats", type=int, help="slices per variant and round (default by stack: 15, 10, 10)"
    )
    ap.add_argument("--warmup", type=int, help="untimed requests first (default by stack)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the variants")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"among {', '.join(SETUPS)}; VARIANT@DIR imports perfsleuth from DIR (a src/ of "
        "another checkout: two versions of the agent in one paired run)",
    )
    ap.add_argument("--cpu", type=int, default=default_cpu(), help="pin children; -1: don't")
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="a short run, for development")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--db", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return run_child(args)
    stacks = list(STACKS) if args.stack == "all" else [args.stack]
    if set(stacks) - set(STACKS):
        ap.error(f"--stack must be one of {', '.join(STACKS)} or all")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if "bare" not in names or {n.partition("@")[0] for n in names} - set(SETUPS):
        ap.error(f"--variants must include bare, among: {', '.join(SETUPS)}")
    given = {"requests": args.requests, "warmup": args.warmup, "repeats": args.repeats}

    started = time.perf_counter()
    dists = ["perfsleuth"]
    for stack in stacks:
        dists += [d for v in NEEDS[stack].values() for d in v if d not in dists]
    pin = f"children pinned to CPU {args.cpu}" if args.cpu >= 0 else "not pinned"
    print(f"perfsleuth agent overhead: Python {platform.python_version()}, {os.cpu_count()} CPUs")
    print("versions: " + ", ".join(f"{d} {version(d) or '-'}" for d in dists))
    print(f"stacks: {', '.join(stacks)}; {pin}")
    results: dict[str, Any] = {}
    verdicts: list[tuple[bool | None, str]] = []
    for stack in stacks:
        args.stack = stack
        args.requests = given["requests"] or STACK_REQUESTS[stack]
        args.repeats = given["repeats"] or STACK_REPEATS[stack]
        args.warmup = given["warmup"] if given["warmup"] is not None else STACK_WARMUP[stack]
        if args.quick:
            args.requests, args.repeats, args.rounds = max(50, args.requests // 2), 4, 1
            args.warmup = min(args.warmup, 100)
        print(
            f"\n== {stack}: {args.rounds} rounds x {args.repeats} slices x {args.requests} "
            f"requests (+{args.warmup} warm-up) per variant, interleaved, "
            f"{STACK_CALLS[stack]} queries per request (an N+1 of {LINES})\n"
        )
        needs = NEEDS[stack]
        skipped = [
            v for v in names if any(version(d) is None for d in needs.get(v.partition("@")[0], ()))
        ]
        if "bare" in skipped:
            print(f"{stack}: skipped ({', '.join(needs['bare'])} not all installed)")
            continue
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in names if v not in skipped}
        tmp = tempfile.mkdtemp(prefix="perfsleuth-overhead-db-")
        try:
            db = os.path.join(tmp, "shop.db")
            if stack == "fastapi-sqlite":
                seed_db(db)
            else:
                try:
                    seed_pg()
                except Exception as exc:
                    print(f"{stack}: skipped (PostgreSQL: {type(exc).__name__}: {exc})")
                    continue
            for rnd in range(1, args.rounds + 1):
                for name, res in run_round(list(runs), db, args, rnd).items():
                    runs[name].append(res)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        summary = {name: summarise(rs, runs["bare"]) for name, rs in runs.items()}
        print_table(names, summary)
        verdicts.append(verdict(stack, summary))
        results[stack] = {
            "config": {k: getattr(args, k) for k in ("requests", "repeats", "warmup", "rounds")},
            "calls_per_request": STACK_CALLS[stack],
            "skipped": skipped,
            "results": summary,
            "target_met": verdicts[-1][0],
        }
    print("\nperfsleuth against the target, by stack:")
    for _, text in verdicts:
        print("  " + text)
    elapsed = time.perf_counter() - started
    print(f"(took {elapsed:.0f} s)")
    if args.json:
        doc = {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "pinned_cpu": args.cpu,
            "versions": {d: version(d) for d in dists},
            "stacks": results,
            "target_pct": TARGET,
            "seconds": round(elapsed, 1),
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)


if __name__ == "__main__":
    main()
