"""Django ORM: statements are captured by the driver patches, once each.

Django's database backends go through the DB-API drivers perfsleuth instruments:

* sqlite (``django.db.backends.sqlite3``) opens connections with ``Database.connect(...)``
  where ``Database`` is ``sqlite3.dbapi2`` -- the patched ``connect`` -- and creates cursors
  with ``connection.cursor(factory=SQLiteCursorWrapper)``; the instrumented connection turns
  that into an instrumented subclass of ``SQLiteCursorWrapper`` whose driver-level
  ``execute`` runs *after* Django's ``%s`` -> ``?`` conversion. One call per statement, and
  the call site is the application frame above Django's (the view's line).
* PostgreSQL (psycopg 3 or psycopg2) and MySQL (PyMySQL as ``MySQLdb``) use the patched
  cursor classes / ``connect`` functions as they are.

This hook, run when Django's sqlite backend is imported, only makes sure the module object
the backend uses as ``Database`` is patched (it is ``sqlite3.dbapi2`` unless a project swaps
in a compatible module such as ``pysqlite3.dbapi2``). It is idempotent.
"""

from __future__ import annotations

from types import ModuleType

from perfsleuth.agent.instrument import dbapi


def patch_sqlite_backend(module: ModuleType) -> None:
    import sqlite3

    dbapi.patch_sqlite3(sqlite3)
    database = getattr(module, "Database", None)
    if database is not None and hasattr(database, "Cursor") and hasattr(database, "Connection"):
        dbapi.patch_sqlite_dbapi(database)
