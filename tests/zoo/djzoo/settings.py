"""Django settings: PostgreSQL through psycopg 3, persistent connections (connecting is not
part of a request's time), no migrations (the tables come from ``zoo.seed``)."""

from __future__ import annotations

from urllib.parse import urlsplit

from zoo import env

_pg = urlsplit(env.PG_DSN)

SECRET_KEY = "perfsleuth-zoo-only"
DEBUG = False  # DEBUG would keep every query in memory
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "zoo.djzoo.urls"
INSTALLED_APPS = ["zoo.djzoo"]
MIDDLEWARE: list[str] = []
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _pg.path.lstrip("/"),
        "USER": _pg.username or "postgres",
        "PASSWORD": _pg.password or "",
        "HOST": _pg.hostname or "127.0.0.1",
        "PORT": str(_pg.port or 5432),
        "CONN_MAX_AGE": 300,
        # The ORM models' tables live in the n1_orm schema; raw SQL names its schema.
        "OPTIONS": {"options": "-c search_path=zoo_n1_orm"},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
LOGGING_CONFIG = None
