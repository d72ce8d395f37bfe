"""Minimal Django project: no database, no templates; the agent is inserted automatically."""

SECRET_KEY = "perfsleuth-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "djproject.urls"
INSTALLED_APPS: list[str] = []
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
DATABASES: dict[str, dict[str, str]] = {}
USE_TZ = True
LOGGING_CONFIG = None
