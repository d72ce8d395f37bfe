"""What a detector sees: :class:`Context`.

Detectors work in SQL over the logical views (``requests``, ``calls``, ...) through
:class:`Context`, which scopes every query to the window and endpoint asked for; only per-group
aggregates ever come back to Python.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

from perfsleuth.analysis import frames
from perfsleuth.analysis.config import Config
from perfsleuth.store.base import Store

__all__ = ["Context"]


def _utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Context:
    """What a detector sees: the store, its settings, and the scope of the question.

    :meth:`query` runs SQL in which ``r`` (requests) and ``c`` (calls) are already restricted
    to the window and the endpoint asked for.
    """

    def __init__(
        self,
        store: Store,
        config: Config,
        since: timedelta | None = None,
        endpoint: str | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.endpoint = endpoint
        self.cutoff = None if since is None else _utcnow() - since
        conds: list[str] = []
        params: list[Any] = []
        if self.cutoff is not None:
            conds.append("ts >= ?")
            params.append(self.cutoff)
        if endpoint is not None:
            conds.append("endpoint = ?")
            params.append(endpoint)
        where = " AND ".join(conds) or "true"
        self._with = (
            f"r AS (SELECT * FROM requests WHERE {where}), c AS (SELECT * FROM calls WHERE {where})"
        )
        self._params = params * 2
        span = self.query("SELECT count(*) AS n, min(ts) AS first, max(ts) AS last FROM r")[0]
        self.requests = int(span["n"])
        self.first_seen: datetime | None = span["first"]
        self.last_seen: datetime | None = span["last"]
        # Minutes of traffic, at least one (a 10-second demo is not "6 x" a minute).
        seconds = 0.0
        if self.first_seen is not None and self.last_seen is not None:
            seconds = (self.last_seen - self.first_seen).total_seconds()
        self.minutes = max(seconds / 60.0, 1.0)
        self.cwd = os.getcwd()

    def t(self, kind: str, name: str) -> Any:
        """A detector setting."""
        return self.config.get(kind, name)

    def query(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        sql = sql.strip()
        if sql[:4].upper() == "WITH":
            sql = f"WITH {self._with}, {sql[4:].lstrip()}"
        else:
            sql = f"WITH {self._with} {sql}"
        return self.store.query(sql, [*self._params, *params])

    def per_min(self, ms: float | None) -> float:
        return float(ms or 0.0) / self.minutes

    def fingerprints(self, ids: set[int]) -> dict[int, str]:
        ids = {i for i in ids if i is not None}
        if not ids:
            return {}
        rows = self.store.query(
            "SELECT id, text FROM fingerprints WHERE list_contains(?, id)", [sorted(ids)]
        )
        return {r["id"]: r["text"] for r in rows}

    def with_statements(
        self, rows: list[dict[str, Any]]
    ) -> list[tuple[dict[str, Any], str | None, dict[str, Any] | None]]:
        """(row, statement text, call site) of detector rows keyed by fingerprint_id and
        site_id: the two dictionary lookups every per-statement detector makes."""
        sites = frames.locations(self.store, (r["site_id"] for r in rows))
        fps = self.fingerprints({r["fingerprint_id"] for r in rows})
        out = []
        for r in rows:
            site = sites.get(r["site_id"])
            out.append((r, fps.get(r["fingerprint_id"]), site.site() if site is not None else None))
        return out
