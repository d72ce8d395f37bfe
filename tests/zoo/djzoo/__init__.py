"""The Django zoo project (run under gunicorn): settings, URLs and the ORM models; the views
are the ``zoo/django_*.py`` problem modules."""
