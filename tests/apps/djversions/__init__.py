"""A Django project that runs unchanged on Django 3.2, 4.2 and 5.x (tests/test_django_versions.py):
authors and books on SQLite or PostgreSQL, an N+1 page and its clean twin."""
