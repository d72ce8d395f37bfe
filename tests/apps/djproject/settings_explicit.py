"""The same project with the middleware listed explicitly (it must not be inserted twice)."""

from djproject.settings import *  # noqa: F403

MIDDLEWARE = [
    "django.middleware.common.CommonMiddleware",
    "perfsleuth.agent.DjangoMiddleware",
]
