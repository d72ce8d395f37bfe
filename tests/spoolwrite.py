"""Test helper: write spool segments with the real wire encoder, in the shapes the agent's
shipper writes (header first; L/S/F dictionary records before the first record using them;
times in ns; ids stable 63-bit hashes)."""

from __future__ import annotations

import hashlib
import os
import random
import time
from typing import Any

from perfsleuth.store.spool import local_host
from perfsleuth.wire import FINGERPRINT, HEADER, LOCATION, REQUEST, STACK, STATS
from perfsleuth.wire.segment import FILE_MAGIC, encode_record

MS = 1_000_000  # ns


def stable_id(*parts: Any) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def call(
    kind: str = "db",
    text: str = "SELECT * FROM items WHERE id = ?",
    *,
    dur_ms: float = 1.0,
    off_ms: float = 0.0,
    system: str | None = None,
    op: str | None = None,
    site: tuple[str, int, str] | None = ("app/views.py", 10, "show"),
    stack: list[tuple[str, int, str, bool]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A call spec for SegmentWriter.request; ``fields`` go to the record as is (rows, ph...)."""
    return {
        "kind": kind,
        "text": text,
        "dur_ms": dur_ms,
        "off_ms": off_ms,
        "system": system or {"db": "postgresql", "http": "http", "cache": "redis"}.get(kind, kind),
        "op": op or text.split()[0].upper(),
        "site": site,
        "stack": stack,
        "fields": fields,
    }


class SegmentWriter:
    """One segment file, DATA/spool/<host>-<pid>-<ns>-<seq>.open, renamed .seg by close()."""

    def __init__(
        self,
        data_dir: str,
        *,
        service: str = "shop",
        pid: int = 4242,
        seq: int = 1,
        host: str | None = None,
        header: bool = True,
    ) -> None:
        spool = os.path.join(data_dir, "spool")
        os.makedirs(spool, exist_ok=True)
        self.base = os.path.join(spool, f"{host or local_host()}-{pid}-{time.time_ns()}-{seq:06d}")
        self.path = self.base + ".open"
        self.service = service
        self.requests: list[dict[str, Any]] = []
        self._emitted: set[tuple[bytes, int]] = set()
        data = FILE_MAGIC
        if header:
            data += encode_record(
                HEADER,
                {"v": 1, "host": "testbox", "pid": pid, "service": service, "agent": "test"},
            )
        self.write(data)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def write(self, data: bytes) -> None:
        with open(self.path, "ab") as fh:
            fh.write(data)

    def _dict(self, out: list[bytes], rtype: bytes, body: dict[str, Any]) -> int:
        if (rtype, body["id"]) not in self._emitted:
            self._emitted.add((rtype, body["id"]))
            out.append(encode_record(rtype, body))
        return int(body["id"])

    def _location(self, out: list[bytes], file: str, line: int, func: str, app: bool) -> int:
        lid = stable_id(file, line, func)
        body = {"id": lid, "file": file, "line": line, "func": func, "app": app}
        return self._dict(out, LOCATION, body)

    def encode(self, c: dict[str, Any], out: list[bytes]) -> dict[str, Any]:
        fid = stable_id(c["kind"], c["text"])
        self._dict(
            out, FINGERPRINT, {"id": fid, "kind": c["kind"], "text": c["text"], "op": c["op"]}
        )
        rec: dict[str, Any] = {
            "kind": c["kind"],
            "system": c["system"],
            "fp": fid,
            "off": round(c["off_ms"] * MS),
            "dur": round(c["dur_ms"] * MS),
        }
        if c["stack"]:
            ids = [self._location(out, *fr) for fr in c["stack"]]
            rec["stack"] = self._dict(out, STACK, {"id": stable_id(*ids), "frames": ids})
        if c["site"] is not None:
            rec["site"] = self._location(out, *c["site"], True)
        rec.update(c["fields"])
        return rec

    def request(
        self,
        endpoint: str = "GET /items",
        *,
        ts_ns: int | None = None,
        dur_ms: float = 10.0,
        status: int | None = 200,
        calls: list[dict[str, Any]] = (),  # type: ignore[assignment]
        kind: str = "web",
        trace_id: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Append one request record (and the dictionary records it needs first)."""
        out: list[bytes] = []
        method, _, path = endpoint.partition(" ")
        body: dict[str, Any] = {
            "id": trace_id or f"{random.getrandbits(64) or 1:016x}",
            "ts": ts_ns if ts_ns is not None else time.time_ns(),
            "dur": round(dur_ms * MS),
            "kind": kind,
            "method": method if kind == "web" else "TASK",
            "endpoint": endpoint,
            "path": path or endpoint,
            "status": status,
            "calls": [self.encode(c, out) for c in calls],
        }
        body.update({k: v for k, v in fields.items() if v is not None})
        out.append(encode_record(REQUEST, body))
        self.write(b"".join(out))
        self.requests.append(body)
        return body

    def stack(self, frames: list[tuple[str, int, str, bool]]) -> int:
        """Append the records of a stack ((file, line, function, app), outermost first) and
        return its id, for runtime-evidence records that name stacks."""
        out: list[bytes] = []
        ids = [self._location(out, *fr) for fr in frames]
        sid = self._dict(out, STACK, {"id": stable_id(*ids), "frames": ids})
        self.write(b"".join(out))
        return sid

    def event(self, rtype: bytes, body: Any) -> None:
        """Append one runtime-evidence record (samples, blocker, GC, capture) as given."""
        self.write(encode_record(rtype, body))

    def stats(self, counters: dict[str, int]) -> None:
        self.write(encode_record(STATS, dict(counters, ts=time.time_ns())))

    def close(self) -> str:
        os.replace(self.path, self.base + ".seg")
        self.path = self.base + ".seg"
        return self.path
