"""The fleet a store holds: which hosts and services sent requests, and which token sent what
(``GET /api/fleet``, ``perfsleuth fleet``, the UI's host and service filters).

Who sent what is the ``segments_received`` table: a row per agent segment (``perfsleuth
server``'s segment ingest) and a row per OTLP source (service, host, process id) a token sent
spans from on a day, named ``otlp~TOKEN~SERVICE/HOST/PID~YYYYMMDD``. :func:`otlp_rows` makes the
latter from a payload's stored tables; :class:`OtlpOrigins` records each once.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from perfsleuth.server.window import Window
from perfsleuth.store.base import Store

log = logging.getLogger("perfsleuth.server")
OTLP_AGENT = "otlp"  # segments_received.agent of OTLP sources
_SEEN_MAX = 100_000  # origin keys remembered as recorded before the memory starts afresh


def otlp_rows(tables: Any, token: str, now_ns: int | None = None) -> list[dict[str, Any]]:
    """``segments_received`` rows for the requests of one mapped OTLP payload (its
    :class:`perfsleuth.store.tables.Tables`; None for a payload without spans): one per
    (service, host, pid, day), started at the first request of that source in the payload."""
    if tables is None:
        return []
    now_ns = time.time_ns() if now_ns is None else now_ns
    found: dict[tuple[str, str, int | None, str], datetime] = {}
    for day_tables in tables.days.values():
        req = day_tables.get("requests")
        if req is None or not req.num_rows:
            continue
        for service, host, pid, day, first in _sources(req):
            key = (service or "", host or "", pid, day)
            if key not in found or first < found[key]:
                found[key] = first
    return [
        {
            "segment": f"{OTLP_AGENT}~{token}~{service}/{host}/{'' if pid is None else pid}~{day}",
            "token": token,
            "agent": OTLP_AGENT,
            "host": host,
            "service": service,
            "pid": pid,
            "received_ns": now_ns,
            "started_ns": _ns(first),
        }
        for (service, host, pid, day), first in found.items()
    ]


def _sources(req: pa.Table) -> list[tuple[Any, Any, Any, str, datetime]]:
    """(service, host, pid, day, first request) of each source in one day's requests: a
    payload is most often one process's (min = max of each column, ~10x cheaper than a
    group-by)."""
    one: list[Any] = []
    for col in ("service", "host", "pid"):
        values = req[col]
        if values.null_count == len(values):
            one.append(None)
            continue
        mm = pc.min_max(values)
        if values.null_count or mm["min"] != mm["max"]:
            break
        one.append(mm["min"].as_py())
    else:
        first: datetime = pc.min(req["ts"]).as_py()
        return [(*one, first.strftime("%Y%m%d"), first)]
    req = req.select(["service", "host", "pid", "ts"])
    req = req.append_column("day", pc.strftime(req["ts"], format="%Y%m%d"))
    got = req.group_by(["service", "host", "pid", "day"]).aggregate([("ts", "min")])
    return [(r["service"], r["host"], r["pid"], r["day"], r["ts_min"]) for r in got.to_pylist()]


def _ns(ts: datetime) -> int:
    return int((ts - datetime(1970, 1, 1)).total_seconds()) * 10**9 + ts.microsecond * 1000


class OtlpOrigins:
    """Records the origin rows of OTLP payloads, each key once per process (a payload's rows
    are written only when one of its keys is new: most payloads write nothing)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def record(self, store: Any, tables: Any, token: str) -> None:
        """Under the store's lock, after the payload's tables were stored. Never raises: the
        payload is stored, and a failure here is logged (the next payload of the source that
        is new again tries again)."""
        try:
            rows = otlp_rows(tables, token)
            with self._lock:
                new = [r for r in rows if r["segment"] not in self._seen]
            if not new:
                return
            store.record_received(new)
        except Exception as e:
            log.warning("could not record which token sent an OTLP payload: %s", e)
            return
        with self._lock:
            if len(self._seen) > _SEEN_MAX:
                self._seen.clear()
            self._seen.update(r["segment"] for r in new)


def fleet(store: Store, w: Window) -> dict[str, Any]:
    """Hosts and services with requests in the window (with the tokens and routes that sent
    from each), and every token's share of what was received. The counts are ``store.top``'s
    by host and service (rollups answer long windows); processes and first/last request come
    from raw rows only when those answered (None otherwise: a scan of them all would be slow)."""
    top, answered = store.top_answered(since=w.since, by=("host", "service"))
    detail: dict[tuple[str, str], dict[str, Any]] = {}
    if answered["source"] == "raw":
        cond, params = ("ts >= ?", [w.start]) if w.start is not None else ("true", [])
        for r in store.query(
            f"""SELECT coalesce(host, '') AS host, coalesce(service, '') AS service,
                count(DISTINCT pid) AS processes, min(ts) AS first, max(ts) AS last
            FROM requests WHERE {cond} GROUP BY ALL""",
            params,
        ):
            detail[r["host"], r["service"]] = r
    # Lists are sorted here, not in SQL: an ordered or filtered aggregate does not carry over
    # to ClickHouse (arraySortIf), and NULL tokens are dropped here for the same reason.
    sent: dict[tuple[str, str], dict[str, Any]] = {
        (r["host"], r["service"]): {
            "tokens": _sorted(r["tokens"]),
            "via": _sorted(r["via"]),
        }
        for r in store.query(
            f"""SELECT coalesce(host, '') AS host, coalesce(service, '') AS service,
                list(DISTINCT token) AS tokens,
                list(DISTINCT CASE WHEN agent = '{OTLP_AGENT}' THEN 'otlp' ELSE 'agent' END)
                    AS via
            FROM segments_received GROUP BY ALL"""
        )
    }
    sources: list[dict[str, Any]] = []
    for r in top:
        key = (r["host"] or "", r["service"] or "")
        d, s = detail.get(key, {}), sent.get(key, {})
        sources.append(
            {
                "host": key[0],
                "service": key[1],
                "requests": int(r["count"]),
                "processes": d.get("processes"),
                "first": d.get("first"),
                "last": d.get("last"),
                "tokens": s.get("tokens") or [],
                "via": s.get("via") or [],
            }
        )
    sources.sort(key=lambda r: (-r["requests"], r["host"], r["service"]))
    tokens = store.query(
        f"""SELECT coalesce(token, '') AS token,
                CASE WHEN agent = '{OTLP_AGENT}' THEN 'otlp' ELSE 'agent' END AS via,
                count(*) AS segments,
                list(DISTINCT coalesce(host, '')) AS hosts,
                list(DISTINCT coalesce(service, '')) AS services,
                min(received) AS first_received, max(received) AS last_received
            FROM segments_received GROUP BY ALL ORDER BY 1, 2"""
    )
    for t in tokens:
        t["hosts"], t["services"] = _sorted(t["hosts"]), _sorted(t["services"])
    return {
        "window": {"since": w.label},
        "source": answered["source"],
        "sources": sources,
        "tokens": tokens,
        "hosts": sorted({r["host"] for r in sources}),
        "services": sorted({r["service"] for r in sources}),
    }


def _sorted(values: Any) -> list[Any]:
    """An aggregated list, sorted, without NULLs."""
    return sorted(v for v in values or () if v is not None)
