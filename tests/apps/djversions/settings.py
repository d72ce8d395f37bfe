"""Settings from the environment: DJV_DB ("sqlite" or "postgresql"), DJV_SQLITE (the database
file), DJV_PG_DSN and DJV_PG_SCHEMA (the schema holding the tables), DJV_DEBUG ("1": DEBUG)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

SECRET_KEY = "perfsleuth-tests-only"
DEBUG = os.environ.get("DJV_DEBUG") == "1"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "djversions.urls"
INSTALLED_APPS = ["djversions"]
MIDDLEWARE: list[str] = []
USE_TZ = True
LOGGING_CONFIG = None
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

if os.environ.get("DJV_DB") == "postgresql":
    _pg = urlsplit(os.environ["DJV_PG_DSN"])
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _pg.path.lstrip("/"),
            "USER": _pg.username or "postgres",
            "PASSWORD": _pg.password or "",
            "HOST": _pg.hostname or "127.0.0.1",
            "PORT": str(_pg.port or 5432),
            "OPTIONS": {"options": f"-c search_path={os.environ['DJV_PG_SCHEMA']}"},
        }
    }
else:
    DATABASES = {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["DJV_SQLITE"]}
    }
