"""The DuckDB store's reading half: every query of the store interface
(:class:`perfsleuth.store.base.StoreReader`) in DuckDB's SQL.

One module of ~500 lines because the ClickHouse store reads through this same class (its
queries transpiled in :mod:`perfsleuth.store.clickhouse_dialect`): every query the interface
promises stays in one place, in one dialect."""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Sequence
from datetime import date, datetime, timedelta
from typing import Any

import duckdb

from perfsleuth.store import schema
from perfsleuth.store.base import StoreError
from perfsleuth.store.duckdb_file import iso, utcnow
from perfsleuth.store.duckdb_rollups import DuckDBRollups
from perfsleuth.store.filters import only_where
from perfsleuth.store.schema import quote
from perfsleuth.store.values import as_int
from perfsleuth.suggest import close_names
from perfsleuth.wire.counters import AGENT as AGENT_COUNTERS

GROUP_COLUMNS = ("endpoint", "user", "tenant", "service", "host", "kind", "method", "status")


KINDS = ("web", "background")


_EXPLAIN = re.compile(r"^\s*explain\s+(?:analyze\s+|analyse\s+)?(?:\([^)]*\)\s*)?", re.I)


_READ_ONLY_TYPES = {duckdb.StatementType.SELECT}


class DuckDBReader(DuckDBRollups):
    # traces(slowest=n) finds the n-th longest duration first (DuckDB's top-N reads every
    # selected column of every row; ClickHouse's reads the sort column first by itself)
    _slowest_in_two_steps = True

    def _source(self, since: timedelta | None) -> tuple[str, datetime | None]:
        """FROM-able SQL over the requests of the window (only the days it touches)."""
        if since is None:
            return "requests", None
        cutoff = utcnow() - since
        names = self._table_names()
        days = sorted(d for d in self._day_tables(names)["requests"] if d >= cutoff.date())
        return f"({schema.duckdb_union(schema.REQUESTS, days, self._layouts(names))})", cutoff

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return self._query(sql, params)

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        cur = self._con.execute(sql, list(params))
        cols = [d[0] for d in cur.description or ()]
        return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]

    def top(
        self,
        since: timedelta | None = None,
        by: tuple[str, ...] = ("endpoint",),
        kind: str | None = None,
        only: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """See :meth:`Store.top`. Groups are ordered by total time (busiest first), then count.
        ``rate_per_min`` divides by the ``since`` window, or by the time the selected
        requests span (at least one minute)."""
        return self.top_answered(since, by, kind, only)[0]

    def top_answered(
        self,
        since: timedelta | None = None,
        by: tuple[str, ...] = ("endpoint",),
        kind: str | None = None,
        only: dict[str, str] | None = None,
        *,
        percentiles_for: str | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """:meth:`top`, and what answered: {source: "raw" | "rollups", resolution_s (None for
        raw rows), start (ISO 8601, None for all)}. Rollups answer long windows (see
        :meth:`rollup_top`). ``percentiles_for`` (grouping by endpoint only): the percentiles
        of that endpoint's row alone are computed, the other rows' p50/p95/p99 are None (a
        page showing one endpoint pays for its percentiles only, and the other rows' totals
        still give its share of the time); what answers is decided as without it."""
        by = tuple(dict.fromkeys(by))
        if not by or any(b not in GROUP_COLUMNS for b in by):
            raise StoreError(
                f"cannot group by {', '.join(by) or 'nothing'}; use any of: "
                + ", ".join(GROUP_COLUMNS)
            )
        if percentiles_for is not None and by != ("endpoint",):
            raise StoreError("percentiles of one endpoint need a top grouped by endpoint")
        self._where(None, kind, None, only)  # a bad kind or filter is refused either way
        cutoff = None if since is None else utcnow() - since
        minutes = None if since is None else since.total_seconds() / 60
        got = self.rollup_top(cutoff, by, kind, minutes, only=only, percentiles_for=percentiles_for)
        if got is not None:
            return got
        return self._raw_top(since, by, kind, only, percentiles_for), {
            "source": "raw",
            "resolution_s": None,
            "start": iso(cutoff),
        }

    def _raw_top(
        self,
        since: timedelta | None,
        by: tuple[str, ...],
        kind: str | None,
        only: dict[str, str] | None = None,
        percentiles_for: str | None = None,
    ) -> list[dict[str, Any]]:
        src, cutoff = self._source(since)
        where, params = self._where(cutoff, kind, None, only)
        rows = self._raw_top_rows(src, where, params, by, percentiles_for, since is None)
        if not rows:
            return []
        if since is not None:
            minutes = since.total_seconds() / 60
        else:
            span = max(r["last_ts"] for r in rows) - min(r["first_ts"] for r in rows)
            minutes = span.total_seconds() / 60
        minutes = max(minutes, 1.0)
        out = []
        for r in rows:
            n = r["count"]
            total = float(r["total_ms"])
            q = r["q"] or [None, None, None]
            row = {b: r[b] for b in by}
            row.update(
                count=n,
                rate_per_min=n / minutes,
                p50_ms=q[0],
                p95_ms=q[1],
                p99_ms=q[2],
                max_ms=r["max_ms"],
                error_rate=float(r["error_rate"]),
                db_calls_per_request=r["db_calls"] / n,
                http_calls_per_request=r["http_calls"] / n,
                cache_calls_per_request=r["cache_calls"] / n,
                db_share=min(1.0, r["db_ms"] / total) if total > 0 else 0.0,
                http_share=min(1.0, r["http_ms"] / total) if total > 0 else 0.0,
                cache_share=min(1.0, r["cache_ms"] / total) if total > 0 else 0.0,
                gc_share=min(1.0, r["gc_ms"] / total) if total > 0 else 0.0,
                total_ms=total,
            )
            out.append(row)
        return out

    def _raw_top_rows(
        self,
        src: str,
        where: str,
        params: list[Any],
        by: tuple[str, ...],
        percentiles_for: str | None,
        span: bool,
    ) -> list[dict[str, Any]]:
        """The raw top's groups, busiest first: ``by``'s columns, count, q (p50, p95, p99, or
        None; with ``percentiles_for`` only that endpoint's), max_ms, error_rate, the sums
        of the call columns, gc_ms, total_ms, and first_ts/last_ts (with ``span`` only:
        what a window without ``since`` spans)."""
        g = ", ".join(quote(b) for b in by)
        q_params: list[Any] = []
        q_filter = ""
        if percentiles_for is not None:  # the one endpoint's rows only feed the quantiles
            q_filter, q_params = " FILTER (WHERE endpoint = ?)", [percentiles_for]
        ts_span = ", min(ts) AS first_ts, max(ts) AS last_ts" if span else ""
        return self._query(
            f"""
            SELECT {g}, count(*) AS count,
                quantile_cont(duration_ms, [0.5, 0.95, 0.99]){q_filter} AS q,
                max(duration_ms) AS max_ms,
                avg(CASE WHEN status >= 500 OR error IS NOT NULL THEN 1.0 ELSE 0.0 END)
                    AS error_rate,
                sum(db_calls) AS db_calls, sum(http_calls) AS http_calls,
                sum(cache_calls) AS cache_calls,
                sum(db_ms) AS db_ms, sum(http_ms) AS http_ms, sum(cache_ms) AS cache_ms,
                coalesce(sum(gc_ms), 0) AS gc_ms,
                coalesce(sum(duration_ms), 0) AS total_ms{ts_span}
            FROM {src} WHERE {where}
            GROUP BY {g}
            ORDER BY total_ms DESC, count DESC, {g}
            """,
            [*q_params, *params],
        )

    @staticmethod
    def _where(
        cutoff: datetime | None,
        kind: str | None,
        endpoint: str | None = None,
        only: dict[str, str] | None = None,
    ) -> tuple[str, list[Any]]:
        conds: list[str] = ["true"]
        params: list[Any] = []
        if cutoff is not None:
            conds.append("ts >= ?")
            params.append(cutoff)
        if kind is not None:
            if kind not in KINDS:
                raise StoreError(f"unknown kind '{kind}'; use one of: {', '.join(KINDS)}")
            conds.append("kind = ?")
            params.append(kind)
        if endpoint is not None:
            conds.append("endpoint = ?")
            params.append(endpoint)
        only_sql, only_params = only_where(only)
        conds.append(only_sql)
        params.extend(only_params)
        return " AND ".join(conds), params

    def endpoints(self) -> list[str]:
        rows = self._con.execute("SELECT DISTINCT endpoint FROM requests ORDER BY 1").fetchall()
        return [r[0] for r in rows]

    def _check_endpoint(self, endpoint: str) -> None:
        # a known endpoint stops at its first row; the list is read for an unknown one only
        if self._con.execute(
            "SELECT 1 FROM requests WHERE endpoint = ? LIMIT 1", [endpoint]
        ).fetchone():
            return
        known = self.endpoints()
        if endpoint in known:
            return
        if not known:
            raise StoreError(f"unknown endpoint '{endpoint}'; no requests have been ingested yet")
        close = close_names(endpoint, known, n=len(known))
        shown = (close or known)[:5]
        more = "" if len(close or known) <= 5 else ", ..."
        raise StoreError(f"unknown endpoint '{endpoint}'; known: {', '.join(shown)}{more}")

    def traces(
        self,
        endpoint: str | None = None,
        since: timedelta | None = None,
        slowest: int | None = None,
        limit: int = 20,
        only: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        if endpoint is not None:
            self._check_endpoint(endpoint)
        src, cutoff = self._source(since)
        where, params = self._where(cutoff, None, endpoint, only)
        order = "duration_ms DESC NULLS LAST, ts DESC" if slowest else "ts DESC"
        n = slowest if slowest else limit
        if slowest and n > 0 and self._slowest_in_two_steps:
            # The n-th longest duration first, reading that one column: the rows at or above
            # it hold the n slowest (ties included), so the wide SELECT sorts only those (over
            # 30 days of raw rows its top-N read every column of millions of rows: ~1.3 s).
            nth = self._con.execute(
                f"SELECT count(*), min(d) FROM (SELECT duration_ms AS d FROM {src} "
                f"WHERE {where} AND duration_ms IS NOT NULL ORDER BY d DESC LIMIT ?)",
                [*params, int(n)],
            ).fetchone()
            if nth is not None and int(nth[0]) >= n:  # else NULL durations make up the n
                where, params = f"{where} AND duration_ms >= ?", [*params, nth[1]]
        rows = self._query(
            f"""
            SELECT trace_id, ts, endpoint, method, path, status, duration_ms,
                db_calls, db_ms, http_calls, http_ms, cache_calls, cache_ms, "user", tenant
            FROM {src} WHERE {where} ORDER BY {order} LIMIT ?
            """,
            [*params, max(0, int(n))],
        )
        for r in rows:
            r["ts"] = iso(r["ts"])
        return rows

    def trace(self, trace_id: str) -> dict[str, Any]:
        prefix = trace_id.strip().lower()
        if not prefix:
            raise StoreError("give a trace id (or a unique prefix of one)")
        ids = [
            r[0]
            for r in self._con.execute(
                "SELECT DISTINCT trace_id FROM requests WHERE starts_with(trace_id, ?) LIMIT 6",
                [prefix],
            ).fetchall()
        ]
        if not ids:
            raise StoreError(f"no trace with id '{trace_id}'")
        if len(ids) > 1:
            shown = ", ".join(sorted(ids)[:5]) + (", ..." if len(ids) > 5 else "")
            raise StoreError(f"trace id prefix '{trace_id}' is ambiguous: it matches {shown}")
        tid = ids[0]
        req = self._query("SELECT * FROM requests WHERE trace_id = ? LIMIT 1", [tid])[0]
        day = req["ts"].date()
        names = self._table_names()
        exists = day in self._day_tables(names)["requests"]  # none on ClickHouse
        calls_src = (
            f"({schema.duckdb_day_select(schema.CALLS, day, self._layouts(names))})"
            if exists
            else "calls"
        )
        attrs_src = quote(schema.day_table(schema.ATTRIBUTES, day)) if exists else "attributes"
        attrs = self._con.execute(
            f"SELECT kind, key, value, num FROM {attrs_src} WHERE trace_id = ?", [tid]
        ).fetchall()
        calls = self._query(
            f"""
            SELECT c.seq, c.kind, c.system, c.offset_ms, c.duration_ms,
                f.text AS fingerprint, f.op, c.rows, c.bytes, c.host, c.status, c.hit,
                c.wait_ms, c.error, c.params_hash, c.unfinished, c.fingerprint_id,
                c.stack_id, c.site_id, l.file AS site_file, l.line AS site_line,
                l.function AS site_function
            FROM {calls_src} c
            LEFT JOIN fingerprints f ON f.id = c.fingerprint_id
            LEFT JOIN locations l ON l.id = c.site_id
            WHERE c.trace_id = ? ORDER BY c.seq
            """,
            [tid],
        )
        stacks = self._stacks({c["stack_id"] for c in calls if c["stack_id"] is not None})
        for c in calls:
            site_id = c.pop("site_id")
            file, line, func = c.pop("site_file"), c.pop("site_line"), c.pop("site_function")
            c["site"] = (
                {"file": file, "line": line, "function": func}
                if site_id is not None and (file is not None or func is not None)
                else None
            )
            c["stack"] = stacks.get(c.pop("stack_id"), [])
        req["ts"] = iso(req["ts"])
        req["attributes"] = {k: _attr_value(v, n) for kind, k, v, n in attrs if kind == "attr"}
        req["tags"] = {k: v for kind, k, v, _ in attrs if kind == "tag"}
        req["calls"] = calls
        req["samples"] = self._count("samples", day, tid)
        req["blockers"] = self._count("blockers", day, tid)
        req["capture"] = self._capture_reason(tid)
        req["links"] = None
        if any(a[0] == "link" for a in attrs):  # OTLP span ids: other services' requests
            from perfsleuth.store.otlp.links import links

            req["links"] = links(self, tid)
        return req

    def _capture_reason(self, trace_id: str) -> str | None:
        """Why the trace was captured for replay (None: it was not)."""
        if "captures" not in self._table_names():
            return None
        row = self._con.execute(
            "SELECT coalesce(reason, '?') FROM captures WHERE trace_id = ?", [trace_id]
        ).fetchone()
        return str(row[0]) if row else None

    def _count(self, table: str, day: date, trace_id: str) -> int:
        name = schema.day_table(schema.TABLES[table], day)
        if name not in self._table_names():
            return 0
        row = self._con.execute(
            f"SELECT count(*) FROM {quote(name)} WHERE trace_id = ?", [trace_id]
        ).fetchone()
        return int(row[0]) if row else 0

    def samples(self, trace_id: str) -> list[dict[str, Any]]:
        """See :meth:`Store.samples`."""
        rows = self._query(
            "SELECT offset_ms, state, stack_id FROM samples WHERE trace_id = ? ORDER BY offset_ms",
            [self._trace_id(trace_id)],
        )
        stacks = self._stacks({r["stack_id"] for r in rows if r["stack_id"] is not None})
        for r in rows:
            r["stack"] = stacks.get(r.pop("stack_id"), [])
        return rows

    def blockers(
        self,
        since: timedelta | None = None,
        endpoint: str | None = None,
        trace_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """See :meth:`Store.blockers`."""
        conds: list[str] = ["true"]
        params: list[Any] = []
        if since is not None:
            conds.append("b.ts >= ?")
            params.append(utcnow() - since)
        if trace_id is not None:
            conds.append("b.trace_id = ?")
            params.append(self._trace_id(trace_id))
        ep = "coalesce(nullif(b.endpoint, ''), r.endpoint, '<no request>')"
        if endpoint is not None:
            conds.append(f"{ep} = ?")
            params.append(endpoint)
        rows = self._query(
            f"""
            SELECT b.ts, b.trace_id, {ep} AS endpoint, b.duration_ms, b.delayed, b.stack_id,
                b.stack_samples, b.samples, b.last_kind, b.last_call, b.last_rows,
                b.last_bytes, b.last_ms, b.pid
            FROM blockers b LEFT JOIN requests r ON r.trace_id = b.trace_id
            WHERE {" AND ".join(conds)}
            ORDER BY b.duration_ms DESC LIMIT ?
            """,
            [*params, int(limit)],
        )
        stacks = self._stacks({r["stack_id"] for r in rows if r["stack_id"] is not None})
        for r in rows:
            r["ts"] = iso(r["ts"])
            r["stack"] = stacks.get(r.pop("stack_id"), [])
        return rows

    def capture(self, trace_id: str) -> dict[str, Any] | None:
        """See :meth:`Store.capture`."""
        prefix = trace_id.strip().lower()
        if not prefix:
            raise StoreError("give a trace id (or a unique prefix of one)")
        if "captures" not in self._table_names():  # a read-only store of an older version
            rows = []
        else:
            rows = self._query(
                "SELECT * FROM captures WHERE starts_with(trace_id, ?) ORDER BY trace_id LIMIT 6",
                [prefix],
            )
        if len(rows) > 1:
            shown = ", ".join(r["trace_id"] for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
            raise StoreError(f"trace id prefix '{trace_id}' is ambiguous: it matches {shown}")
        if not rows:
            self.trace(prefix)  # unknown or ambiguous trace: its error; else no capture
            return None
        r = rows[0]
        r["ts"] = iso(r["ts"])
        try:
            r["headers"] = [tuple(p) for p in json.loads(r["headers"] or "[]")]
        except ValueError:
            r["headers"] = []
        r["redacted"] = [h for h in (r["redacted"] or "").split(",") if h]
        return r

    def _trace_id(self, trace_id: str) -> str:
        """The full id of a trace given by id or unique prefix (as ``trace``), else as given."""
        prefix = trace_id.strip().lower()
        ids = [
            r[0]
            for r in self._con.execute(
                "SELECT DISTINCT trace_id FROM requests WHERE starts_with(trace_id, ?) LIMIT 2",
                [prefix],
            ).fetchall()
        ]
        return ids[0] if len(ids) == 1 else prefix

    def _stacks(self, ids: set[int]) -> dict[int, list[dict[str, Any]]]:
        if not ids:
            return {}
        frames = dict(
            self._con.execute(
                "SELECT id, frames FROM stacks WHERE list_contains(?, id)", [sorted(ids)]
            ).fetchall()
        )
        loc_ids = sorted({i for fr in frames.values() for i in fr or ()})
        locs = {
            r[0]: {"file": r[1], "line": r[2], "function": r[3], "app": r[4]}
            for r in self._con.execute(
                "SELECT id, file, line, function, app FROM locations WHERE list_contains(?, id)",
                [loc_ids],
            ).fetchall()
        }
        unknown = {"file": None, "line": None, "function": None, "app": None}
        return {sid: [dict(locs.get(i, unknown)) for i in fr or ()] for sid, fr in frames.items()}

    def sql(self, query: str, limit: int = 10_000) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One read-only statement (SELECT, or EXPLAIN of one); at most ``limit`` rows."""
        stmt = self._read_only_statement(query)
        try:
            cur = self._con.execute(stmt)
            cols = [d[0] for d in cur.description or ()]
            rows = cur.fetchmany(max(0, int(limit))) if limit > 0 else []
        except duckdb.Error as e:
            raise StoreError(str(e)) from e
        return cols, rows

    def _read_only_statement(self, query: str) -> str:
        try:
            stmts = self._con.extract_statements(query)
        except duckdb.Error as e:
            raise StoreError(str(e)) from e
        if not stmts:
            raise StoreError("the query is empty")
        if len(stmts) > 1:
            raise StoreError(f"run one statement at a time (got {len(stmts)})")
        stmt = stmts[0]
        kind = stmt.type
        text = stmt.query
        if kind == duckdb.StatementType.EXPLAIN:
            inner = _EXPLAIN.sub("", text, count=1)
            try:
                inner_stmts = self._con.extract_statements(inner)
            except duckdb.Error:
                inner_stmts = []
            if len(inner_stmts) == 1 and inner_stmts[0].type in _READ_ONLY_TYPES:
                return text
        elif kind in _READ_ONLY_TYPES:
            return text
        name = str(kind).rsplit(".", 1)[-1]
        raise StoreError(
            f"only read-only queries are allowed (SELECT, or EXPLAIN of a SELECT); "
            f"this is a {name} statement"
        )

    def agent_drops(self) -> dict[str, Any]:
        """Counters summed over agent processes: the newest of each process's status file
        (DATA/agents/*.json) and STATS records, counter by counter."""
        per_proc: dict[tuple[str, int], dict[str, int]] = {}
        last_error, last_error_ns = "", -1
        for path in sorted(glob.glob(os.path.join(self.agents_dir, "*.json"))):
            try:
                with open(path, encoding="utf-8") as fh:
                    body = json.load(fh)
            except (OSError, ValueError):
                continue
            if not isinstance(body, dict):
                continue
            key = (str(body.get("host", path)), as_int(body.get("pid")) or 0)
            counters = per_proc.setdefault(key, {})
            for k, v in body.items():
                if k in ("pid", "updated_ns") or isinstance(v, bool):
                    continue
                if isinstance(v, int):
                    counters[k] = max(counters.get(k, 0), v)
            updated = as_int(body.get("updated_ns")) or 0
            err = body.get("last_error")
            if isinstance(err, str) and err and updated > last_error_ns:
                last_error, last_error_ns = err, updated
        for host, pid, name, value in self._con.execute(
            "SELECT host, pid, name, arg_max(value, ts) FROM agent_stats GROUP BY ALL"
        ).fetchall():
            counters = per_proc.setdefault((host, pid), {})
            counters[name] = max(counters.get(name, 0), value)
        out: dict[str, Any] = {
            "processes": len(per_proc),
            **dict.fromkeys(AGENT_COUNTERS, 0),
        }
        skip = {"queued", "service", "host"}
        for counters in per_proc.values():
            for k, v in counters.items():
                if k not in skip and not k.startswith(_SCHED_COUNTERS):
                    out[k] = out.get(k, 0) + v
        # requests (dropped_events counts evidence records, not requests)
        out["dropped_total"] = sum(
            v for k, v in out.items() if k.startswith("dropped_") and k != "dropped_events"
        )
        out["last_error"] = last_error
        return out


# STATS counters the sampler ships about CPU scheduling (cpu_starved reads them): figures of the
# process, not counts of lost data.
_SCHED_COUNTERS = ("sched_", "cgroup_", "cpus_", "load1_")


def _attr_value(value: str | None, num: float | None) -> Any:
    if num is None:
        return value
    if value is not None and re.fullmatch(r"-?\d+", value):
        return int(value)
    return num
