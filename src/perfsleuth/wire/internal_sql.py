"""Framework-internal statements: what a driver, an ORM or a framework runs for itself, not for
the application's page.

* **session set-up**: ``PRAGMA``, ``SET``, ``SHOW``, ``RESET`` (Django's sqlite ``PRAGMA
  foreign_keys = ON``, its PostgreSQL ``SET TIME ZONE``, SQLAlchemy's ``show
  standard_conforming_strings``);
* **introspection**: the catalogs (sqlite's reserved ``sqlite_*`` tables and functions, such
  as Django 4.2's ``select sqlite_compileoption_used(?)``; ``information_schema``;
  ``pg_catalog`` and its ``pg_*`` tables), server variables (``SELECT @@sql_mode``,
  ``SELECT set_config(?, ?, false)``, Django's time zone with psycopg 3), the server's version
  and current schema or database;
* **helpers**: Django's ``SELECT QUOTE(?), ...`` (sqlite ``last_executed_query`` with
  ``DEBUG=True``, run on a raw cursor after each statement).

Not among them: ``SELECT 1`` (a liveness ping, but after normalisation it is any one-value
``SELECT``, the shape of many a toy statement and of some real ones) and transaction control
(``BEGIN``, ``SAVEPOINT``: real round trips the application's code asks for).

How they are kept (the smallest change to the wire -> store path): the agent records them as
it records every statement, and the store files a call whose fingerprint is internal under the
call kind :data:`INTERNAL_KIND` (``"db.internal"``) instead of ``"db"``, in ``calls`` and in
``fingerprints``. Every detector selects its calls by kind (``kind = 'db'`` or a ``kinds`` list
naming ``db``), and the requests' ``db_calls``/``db_ms`` count ``db`` calls only, so these
statements feed no finding and never stand in for the application's own, while ``calltree``
and the trace views still show them (connection set-up is time a request spends).

:func:`is_internal` takes a statement as the application sent it or as normalised by
:func:`perfsleuth.wire.fingerprint.normalize_sql` (literals as ``?``). Never raises.
"""

from __future__ import annotations

import re

INTERNAL_KIND = "db.internal"

_SETUP = re.compile(r"(?:PRAGMA|SET|SHOW|RESET)\b", re.IGNORECASE)
_CATALOG = re.compile(
    r"\b(?:sqlite_\w+|information_schema|pg_catalog)\b"  # sqlite reserves sqlite_* names
    r"|\b(?:FROM|JOIN)\s+pg_\w+\b(?!\s*\()"  # a pg_* table, not a function (pg_sleep)
    r"|@@\w+",
    re.IGNORECASE,
)
_HELPER = re.compile(
    r"SELECT\s+(?:"
    r"QUOTE\(\s*(?:\?|%s)\s*\)(?:\s*,\s*QUOTE\(\s*(?:\?|%s)\s*\))*"  # Django sqlite DEBUG
    r"|(?:pg_catalog\.)?(?:version|current_schema|current_database|database|set_config"
    r"|current_setting)\s*\([^()]*\)"
    r")(?:\s+AS\s+\w+)?\s*;?\s*",
    re.IGNORECASE,
)
_LEAD = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*", re.DOTALL)


def is_internal(sql: str) -> bool:
    """Whether a statement is one a framework, ORM or driver runs for itself."""
    try:
        text = sql[_LEAD.match(sql).end() :]  # type: ignore[union-attr]
        return bool(_SETUP.match(text) or _HELPER.fullmatch(text) or _CATALOG.search(text, 0, 4096))
    except Exception:
        return False
