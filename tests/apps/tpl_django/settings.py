import os

SECRET_KEY = "perfsleuth-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tpl_django.urls"
WSGI_APPLICATION = "tpl_django.wsgi.application"
INSTALLED_APPS = ["tpl_django"]
MIDDLEWARE: list[str] = []
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("TPL_DJANGO_DB", os.path.join(os.path.dirname(__file__), "db")),
    }
}
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [os.path.join(os.path.dirname(__file__), "templates")],
    }
]
USE_TZ = True
LOGGING_CONFIG = None
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
