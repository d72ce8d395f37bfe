"""Settings of the benchmark's Django project: no sessions, auth or admin, one database."""

import os

SECRET_KEY = "perfsleuth-benchmark"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "overhead_django.urls"
INSTALLED_APPS = ["overhead_django"]
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
# The connection stays open across requests (CONN_MAX_AGE None), as a production pool would.
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("PERFSLEUTH_BENCH_PG_DB", "test"),
        "USER": os.environ.get("PERFSLEUTH_BENCH_PG_USER", "postgres"),
        "HOST": os.environ.get("PERFSLEUTH_BENCH_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("PERFSLEUTH_BENCH_PG_PORT", "5432"),
        "CONN_MAX_AGE": None,
    }
}
