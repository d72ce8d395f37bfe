"""Seed data for the zoo: one PostgreSQL schema per problem module, plus Redis keys.

Seeding is idempotent and safe to run from several processes at once (a test run and
``make bench-accuracy``): each schema carries the seed version it was built with and is only
rebuilt, under an advisory lock, when that version is missing or stale.
"""

from __future__ import annotations

import psycopg
import redis

# Bump when any SQL below changes: schemas of an older version are rebuilt.
SEED_VERSION = 2
_LOCK_KEY = 0x5A00  # pg_advisory_lock key of zoo seeding ("Z0")

TENANTS = ("acme", "globex", "initech", "umbrella", "megacorp")
BIG_TENANT = "megacorp"  # holds 50x the data of every other tenant (outlier_tenant)
NORMAL_EVENTS = 2_000
BIG_EVENTS = 50 * NORMAL_EVENTS
TEAM_SIZE = 20  # fastapi_n1_http: members (so avatar calls) per team

# The dashboard of django_chatty: eight source tables with the same eight metric columns.
CHATTY_TABLES = ("orders", "signups", "tickets", "payments", "refunds", "sessions", "invoices",
                 "shipments")  # fmt: skip
CHATTY_COLUMNS = ("amount", "quantity", "duration_s", "score", "discount", "tax", "weight",
                  "rating")  # fmt: skip

SCHEMAS: dict[str, str] = {
    # Django ORM models (djzoo.models): authors with ten books each.
    "zoo_n1_orm": """
        CREATE TABLE author (id int PRIMARY KEY, name text NOT NULL);
        CREATE TABLE book (id int PRIMARY KEY, author_id int NOT NULL REFERENCES author,
                           title text NOT NULL, pages int NOT NULL);
        CREATE INDEX ON book (author_id);
        INSERT INTO author SELECT g, 'author ' || g FROM generate_series(1, 40) g;
        INSERT INTO book SELECT g, 1 + (g - 1) % 40, 'book ' || g, 100 + g % 300
            FROM generate_series(1, 400) g;
    """,
    # Blog posts and their comments (flask_n1_sql).
    "zoo_n1_sql": """
        CREATE TABLE post (id int PRIMARY KEY, title text NOT NULL, created int NOT NULL);
        CREATE TABLE comment (id int PRIMARY KEY, post_id int NOT NULL, body text NOT NULL);
        CREATE INDEX ON comment (post_id);
        INSERT INTO post SELECT g, 'post ' || g, g FROM generate_series(1, 200) g;
        INSERT INTO comment SELECT g, 1 + g % 200, repeat('c', 40) FROM generate_series(1, 20000) g;
    """,
    # Team members whose avatars live in another service (fastapi_n1_http).
    "zoo_n1_http": f"""
        CREATE TABLE member (team_id int NOT NULL, user_id int NOT NULL,
                             PRIMARY KEY (team_id, user_id));
        INSERT INTO member SELECT t, 100 * t + u FROM generate_series(1, 5) t,
                                                      generate_series(1, {TEAM_SIZE}) u;
    """,
    # Customer accounts (flask_repeated).
    "zoo_repeated": """
        CREATE TABLE account (id int PRIMARY KEY, name text NOT NULL, plan text NOT NULL,
                              seats int NOT NULL, max_seats int NOT NULL, country text NOT NULL);
        INSERT INTO account
            SELECT g, 'account ' || g, (ARRAY['free', 'team', 'enterprise'])[1 + g % 3], g % 50,
                   50, 'NZ'
            FROM generate_series(1, 500) g;
    """,
    # A product catalogue of 25,000 rows (fastapi_oversized).
    "zoo_oversized": """
        CREATE TABLE product (id int PRIMARY KEY, name text NOT NULL, category text NOT NULL,
                              score double precision NOT NULL);
        CREATE INDEX ON product (score DESC);
        INSERT INTO product SELECT g, 'product ' || g, 'category ' || g % 40,
                                   ((g * 7919) % 100003) / 100.0
            FROM generate_series(1, 25000) g;
    """,
    # Sales for a revenue report (django_slow_query).
    "zoo_slow_query": """
        CREATE TABLE sale (id int PRIMARY KEY, region text NOT NULL, amount int NOT NULL,
                           day int NOT NULL);
        INSERT INTO sale SELECT g, 'region ' || g % 12, g % 997, g % 365
            FROM generate_series(1, 20000) g;
    """,
    # Per-tenant activity (fastapi_outlier_tenant): `event` has one tenant 50x bigger than the
    # others, `event_even` gives every tenant the same amount (the clean twin).
    "zoo_tenant": f"""
        CREATE TABLE event (tenant text NOT NULL, kind text NOT NULL, amount int NOT NULL,
                            payload text NOT NULL);
        CREATE TABLE event_even (LIKE event);
        INSERT INTO event SELECT t, 'kind ' || g % 10, g % 1000, md5(g::text)
            FROM unnest(ARRAY{list(TENANTS)}) t,
                 generate_series(1, CASE WHEN t = '{BIG_TENANT}' THEN {BIG_EVENTS}
                                         ELSE {NORMAL_EVENTS} END) g;
        INSERT INTO event_even SELECT t, 'kind ' || g % 10, g % 1000, md5(g::text)
            FROM unnest(ARRAY{list(TENANTS)}) t, generate_series(1, {NORMAL_EVENTS}) g;
        CREATE INDEX ON event (tenant);
        CREATE INDEX ON event_even (tenant);
        ANALYZE event;
        ANALYZE event_even;
    """,
    # Dashboard sources (django_chatty): small tables, one metric column per widget.
    "zoo_chatty": "\n".join(
        f"CREATE TABLE {t} (id int PRIMARY KEY, "
        + ", ".join(f"{c} int NOT NULL" for c in CHATTY_COLUMNS)
        + f"); INSERT INTO {t} SELECT g, "
        + ", ".join(f"(g * {i + 3}) % 101" for i in range(len(CHATTY_COLUMNS)))
        + " FROM generate_series(1, 200) g;"
        for t in CHATTY_TABLES
    ),
}

# Redis (flask_n1_cache): a cart of 25 SKUs per user, and a price per SKU.
CART_SIZE = 25
USERS = tuple(f"user{i}" for i in range(7))
REDIS_PREFIX = "zoo:"


def _current(cur: psycopg.Cursor, schema: str) -> bool:
    cur.execute(
        "SELECT 1 FROM information_schema.tables WHERE table_schema = %s AND table_name = %s",
        (schema, "_zoo_seed"),
    )
    if cur.fetchone() is None:
        return False
    cur.execute(f"SELECT version FROM {schema}._zoo_seed")
    row = cur.fetchone()
    return row is not None and row[0] == SEED_VERSION


def seed_postgres(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
        try:
            for schema, ddl in SCHEMAS.items():
                if _current(cur, schema):
                    continue
                with conn.transaction():
                    cur.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
                    cur.execute(f"CREATE SCHEMA {schema}")
                    cur.execute(f"SET LOCAL search_path = {schema}")
                    cur.execute(ddl)
                    cur.execute(f"CREATE TABLE _zoo_seed (version int); "
                                f"INSERT INTO _zoo_seed VALUES ({SEED_VERSION})")  # fmt: skip
        finally:
            cur.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))


def cart_key(user: str) -> str:
    return f"{REDIS_PREFIX}cart:{user}"


def price_key(sku: int) -> str:
    return f"{REDIS_PREFIX}price:{sku}"


def seed_redis(url: str) -> None:
    r = redis.Redis.from_url(url)
    pipe = r.pipeline()
    for n, user in enumerate(USERS):
        skus = [1000 + 37 * n + i for i in range(CART_SIZE)]
        pipe.delete(cart_key(user))
        pipe.rpush(cart_key(user), *skus)
        for sku in skus:
            pipe.set(price_key(sku), 100 + sku % 900)
    pipe.execute()
    r.close()


def seed(pg_dsn: str, redis_url: str) -> None:
    seed_postgres(pg_dsn)
    seed_redis(redis_url)
