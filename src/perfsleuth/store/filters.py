"""The fleet filters: only the requests of one host or service (``only={"host": "h1"}``), as a
portable SQL condition on the requests and on the rollups (both carry the columns)."""

from __future__ import annotations

from typing import Any

from perfsleuth.store.base import StoreError
from perfsleuth.store.schema import quote

# Columns an ``only`` filter may name (equality): the fleet's, which rollups are keyed by too.
ONLY_COLUMNS = ("service", "host")


def only_where(only: dict[str, str] | None, alias: str = "") -> tuple[str, list[Any]]:
    """SQL (and its parameters) keeping the rows whose ONLY_COLUMNS have the given values; a
    value of "" matches NULL too (requests that carry no host or service)."""
    conds, params = ["true"], []
    p = f"{alias}." if alias else ""
    for col, value in (only or {}).items():
        if col not in ONLY_COLUMNS:
            raise StoreError(f"cannot filter by {col!r}; use any of: {', '.join(ONLY_COLUMNS)}")
        conds.append(f"coalesce({p}{quote(col)}, '') = ?")
        params.append(value)
    return " AND ".join(conds), params
