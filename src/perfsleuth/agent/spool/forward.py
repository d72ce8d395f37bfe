"""Store and forward: ship the local spool to a collector (``perfsleuth server``).

With ``PERFSLEUTH_COLLECTOR=http://host:port`` (and ``PERFSLEUTH_TOKEN``, an ingest token), the
agent keeps writing its spool as always (the buffer) and one background thread per spool
directory (a lock file elects it among a prefork server's processes) sends each segment's new
bytes, gzip-compressed, to ``POST /api/ingest/segment`` with the offset they start at. The
collector's reply is the offset it holds, remembered per segment in ``SPOOL/forward.json`` so a
restart resumes where the collector is; a 409 names the offset to resend from. A segment that
is closed (``.seg``, or ``.open`` of a dead writer) and fully acknowledged is deleted.

Failures back off exponentially (1 s to 60 s). A refused token (401/403), and an ``https://``
collector whose certificate fails verification (``PERFSLEUTH_CA_FILE``: the CA bundle to trust
for the collector, instead of the system's), are said once in the status file's ``last_error``
and the spool keeps buffering. While the collector is away the
spool is kept under ``PERFSLEUTH_SPOOL_MAX_BYTES``: past 90 % of it the oldest segments are
deleted; their unsent requests are counted (``dropped_spool_cap``), as are the segments
(``forward_dropped_segments``), in the status file and, as a STATS record, in the store.

Nothing here runs on the request path, nothing raises into the app (stdlib only).

One module (~600 lines) because election, offsets, retries, TLS and the spool cap are one state
machine run by one thread: split, each part would need the others' state.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from perfsleuth.agent import recorder
from perfsleuth.agent.config import Config
from perfsleuth.agent.recorder import stats
from perfsleuth.agent.spool import status
from perfsleuth.wire import CLOSED_SUFFIX, REQUESTS, STATS
from perfsleuth.wire.counters import FORWARD

if TYPE_CHECKING:
    from perfsleuth.wire.segment import SegmentName

CHUNK_BYTES = 4 << 20  # raw bytes per request (the collector takes up to 16 MB)
ROUND_SECONDS = 1.0
BACKOFF_MAX = 60.0
DEAD_IDLE_SECONDS = 10.0  # an .open segment of a dead writer, this idle, is complete
CAP_SHARE = 0.9  # trim the spool to this share of its cap

for _name in FORWARD:
    stats.setdefault(_name, 0)

_thread: threading.Thread | None = None
_fw: Forwarder | None = None
_cfg: Config | None = None
_stop = threading.Event()
_lock_fd: int | None = None  # the lock file's descriptor once opened (closed in a forked child)


class Refused(Exception):
    """The collector refused the token (401/403)."""


# OpenSSL's verify codes that mean "no trusted CA signed it": a self-signed certificate (18,
# 19), an issuer not in the bundle (20, 21). Only these are fixed by PERFSLEUTH_CA_FILE.
_UNTRUSTED_CODES = frozenset({18, 19, 20, 21})
_NAME_HINT = (
    "its certificate does not name {host} ({why}); use a collector address the certificate"
    " names, or a certificate for {host}"
)
_VERIFY_HINTS = {  # not yet valid, expired, host name and IP address mismatch
    9: "its certificate is not valid yet ({why}); check the clocks of both hosts",
    10: "its certificate has expired ({why}); renew the server's certificate",
    62: _NAME_HINT,
    64: _NAME_HINT,
}


def tls_problem(e: BaseException, cfg: Config) -> str:
    """The status sentence for a failure to trust an https collector, else ''. The hint
    follows OpenSSL's verify code: only an unknown CA is fixed by PERFSLEUTH_CA_FILE."""
    import ssl
    from urllib.parse import urlsplit

    if isinstance(e, ssl.SSLCertVerificationError):
        why = e.verify_message or str(e)
        code = e.verify_code
        if code in _UNTRUSTED_CODES:
            fix = (
                f"PERFSLEUTH_CA_FILE {cfg.ca_file} did not sign it"
                if cfg.ca_file
                else "set PERFSLEUTH_CA_FILE to the CA that signed it"
            )
            return f"collector {cfg.collector}: its certificate is not trusted ({why}); {fix}"
        host = urlsplit(cfg.collector.strip()).hostname or cfg.collector
        said = _VERIFY_HINTS.get(code, "its certificate failed verification ({why})")
        return f"collector {cfg.collector}: " + said.format(why=why, host=host) + "; buffering"
    if isinstance(e, CaFileError):
        return f"PERFSLEUTH_CA_FILE {cfg.ca_file}: cannot load it ({e}); buffering"
    return ""


class CaFileError(Exception):
    """PERFSLEUTH_CA_FILE cannot be read as a CA bundle."""


class Forwarder:
    def __init__(self, cfg: Config) -> None:
        import re
        from urllib.parse import urlsplit

        self.cfg = cfg
        url = urlsplit(cfg.collector.strip())
        self.https = url.scheme == "https"
        self.netloc = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if self.https else 80)
        self.prefix = url.path.rstrip("/")
        self.agent = re.sub(r"[^A-Za-z0-9_.]", "_", cfg.host or status.HOST)[:64] or "agent"
        self.spool = cfg.spool_dir
        self.state_path = os.path.join(self.spool, "forward.json")
        self.acked: dict[str, int] = {}
        self.conn: Any = None
        self.lock_fd: int | None = None
        self.backoff = 0.0
        self.said = ""  # the refusal or TLS failure said in the status (once, not every retry)
        # The drop counters as last sent in a STATS record after a round that reached the
        # collector: a record written while it was down can be trimmed away with its segment.
        self.reported = _drop_counters()
        self.timeout = 30.0
        self.deadline: float | None = None  # at exit: stop shipping past it

    # ---------------------------------------------------------------- state

    def load(self) -> None:
        import json

        try:
            with open(self.state_path, encoding="utf-8") as fh:
                got = json.load(fh)
            self.acked = {str(k): int(v) for k, v in got.items() if isinstance(v, int)}
        except (OSError, ValueError, AttributeError):
            self.acked = {}

    def save(self) -> None:
        import json

        tmp = self.state_path + f".{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self.acked, fh)
            os.replace(tmp, self.state_path)
        except OSError:
            status.unlink(tmp)

    def elected(self) -> bool:
        """Whether this process forwards this spool (one per spool, by an flock)."""
        if self.lock_fd is not None:
            return True
        try:
            import fcntl

            os.makedirs(self.spool, exist_ok=True)
            global _lock_fd
            fd = _lock_fd = os.open(
                os.path.join(self.spool, "forward.lock"), os.O_RDWR | os.O_CREAT, 0o644
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                _lock_fd = None
                os.close(fd)
                return False
            self.lock_fd = fd
            self.load()
            return True
        except Exception:
            return False

    # ---------------------------------------------------------------- the spool

    def segments(self) -> list[tuple[str, str, bool, int]]:
        """(base, path, complete, size) of the spool's segments, oldest name first."""
        from perfsleuth.wire.segment import parse_segment_name  # imported on this thread

        out: dict[str, tuple[str, str, bool, int]] = {}
        try:
            entries = list(os.scandir(self.spool))
        except OSError:
            return []
        now = time.time()
        for e in entries:
            name = parse_segment_name(e.name)
            if name is None:
                continue
            try:
                st = e.stat()
            except OSError:
                continue
            closed = name.closed
            if not closed:
                closed = _writer_dead(name) and now - st.st_mtime >= DEAD_IDLE_SECONDS
            if name.base not in out or name.closed:
                out[name.base] = (name.base, e.path, closed, st.st_size)
        return [out[k] for k in sorted(out)]

    def trim(self, segs: list[tuple[str, str, bool, int]]) -> list[tuple[str, str, bool, int]]:
        """Delete the oldest complete segments while the spool is over its share of the cap."""
        cap = int(self.cfg.spool_max_bytes * CAP_SHARE)
        total = sum(s[3] for s in segs)
        if total <= cap:
            return segs
        kept = []
        dropped = 0
        for seg in segs:
            base, path, complete, size = seg
            if total > cap and complete:
                lost = _requests_from(path, self.acked.get(base, 0))
                status.unlink(path)
                total -= size
                self.acked.pop(base, None)
                stats["forward_dropped_segments"] += 1
                stats["dropped_spool_cap"] += lost
                dropped += 1
                continue
            kept.append(seg)
        if dropped:
            self.save()
            _emit_counters()
        return kept

    # ---------------------------------------------------------------- shipping

    def left(self) -> float | None:
        """Seconds left before the exit deadline (None: no deadline)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def socket_timeout(self) -> float:
        left = self.left()
        return self.timeout if left is None else max(0.01, min(self.timeout, left))

    def connection(self) -> Any:
        if self.conn is None:
            import http.client

            if self.https:
                self.conn = http.client.HTTPSConnection(
                    self.netloc, self.port, timeout=self.socket_timeout(), context=self.tls()
                )
            else:
                self.conn = http.client.HTTPConnection(
                    self.netloc, self.port, timeout=self.socket_timeout()
                )
        return self.conn

    def tls(self) -> Any:
        """The TLS context: certificates verified against PERFSLEUTH_CA_FILE when set (a
        private CA, without changing what the application itself trusts), else the system's
        CAs (SSL_CERT_FILE / SSL_CERT_DIR move those for the whole process)."""
        import ssl

        try:
            return ssl.create_default_context(cafile=self.cfg.ca_file or None)
        except (OSError, ssl.SSLError) as e:
            raise CaFileError(str(e)) from None

    def drop_connection(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def post(self, base: str, offset: int, data: bytes, final: bool) -> tuple[int, dict[str, Any]]:
        import json
        import zlib
        from urllib.parse import quote

        comp = zlib.compressobj(1, zlib.DEFLATED, 31)
        body = comp.compress(data) + comp.flush()
        path = (
            f"{self.prefix}/api/ingest/segment?agent={quote(self.agent)}&segment={quote(base)}"
            f"&offset={offset}&final={int(final)}"
        )
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Encoding": "gzip",
            "Authorization": f"Bearer {self.cfg.token}",
        }
        conn = self.connection()
        try:
            # At exit no socket wait goes past the deadline (connect, send, the reply).
            conn.timeout = self.socket_timeout()
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            conn.request("POST", path, body=body, headers=headers)
            if conn.sock is not None:
                conn.sock.settimeout(self.socket_timeout())
            resp = conn.getresponse()
            raw = resp.read(65536)
        except Exception:
            self.drop_connection()
            raise
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = {}
        if not isinstance(reply, dict):
            reply = {}
        return resp.status, reply

    def ship(self, base: str, path: str, complete: bool, size: int) -> None:
        """Send a segment's bytes past the acknowledged offset; delete it once complete."""
        offset = self.acked.get(base, 0)
        if offset >= size and not complete:
            return
        for _ in range(1000):  # a 409 may move the offset; bounded all the same
            if self.past_deadline():
                return
            end = min(size, offset + CHUNK_BYTES)
            data = _read(path, base, self.spool, offset, end - offset)
            if data is None:
                self.acked.pop(base, None)
                return
            final = complete and offset + len(data) >= size
            code, reply = self.post(base, offset, data, final)
            held = reply.get("held")
            if code in (401, 403):
                raise Refused(f"{code}: {reply.get('error') or 'refused'}")
            if code in (400, 413, 415):
                # The collector will never take these bytes: say why, and leave the segment
                # out (deleted once complete) rather than hold every later one back.
                status.error(f"collector refused segment {base}: {reply.get('error', code)}"[:300])
                if complete:
                    stats["forward_rejected_segments"] += 1
                    stats["dropped_forward_rejected"] += _requests_from(path, offset)
                    status.unlink(path)
                    self.acked.pop(base, None)
                    self.save()
                    _emit_counters()
                return
            if code == 409 and isinstance(held, int) and 0 <= held <= size:
                offset = held
                self.acked[base] = held
                self.save()
                continue
            if code != 200 or not isinstance(held, int):
                raise OSError(f"the collector answered {code}: {reply.get('error', '')}"[:300])
            stats["forward_bytes_sent"] += max(0, held - offset)
            offset = held
            self.acked[base] = held
            if reply.get("complete") and complete:
                stats["forward_segments_sent"] += 1
                status.unlink(path)
                self.acked.pop(base, None)
                self.save()
                return
            self.save()
            if offset >= size:
                return

    def round(self) -> None:
        if not self.elected():
            return
        segs = self.trim(self.segments())
        present = {s[0] for s in segs}
        if any(b not in present for b in self.acked):
            self.acked = {b: v for b, v in self.acked.items() if b in present}
            self.save()
        for seg in segs:
            if self.deadline is None and _stop.is_set():
                return
            if self.past_deadline():
                return
            self.ship(*seg)
        if self.said:
            if status.last_error == self.said:
                status.error("")
            self.said = ""
        drops = _drop_counters()
        if drops != self.reported:  # the collector is up: this record is shipped next round
            self.reported = drops
            _emit_counters()

    def past_deadline(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def run(self) -> None:
        while not _stop.is_set():
            try:
                self.round()
                self.backoff = 0.0
                wait = ROUND_SECONDS
            except Refused as e:
                stats["forward_auth_errors"] += 1
                self.say(f"collector {self.cfg.collector} refused the token ({e}); buffering")
                wait = self._next_backoff()
            except Exception as e:
                stats["forward_errors"] += 1
                self.drop_connection()
                problem = tls_problem(e, self.cfg)
                if problem:
                    self.say(problem)
                wait = self._next_backoff()
            if _stop.wait(wait):
                return

    def say(self, msg: str) -> None:
        if self.said != msg:  # said once, not every retry
            self.said = msg
            status.error(msg)

    def _next_backoff(self) -> float:
        self.backoff = min(BACKOFF_MAX, max(1.0, self.backoff * 2))
        return self.backoff


def _writer_dead(name: SegmentName) -> bool:
    """Whether the writer a segment's name names (this host) is gone: a process that no longer
    exists, or an earlier process with this process's pid (a restart with a stable hostname
    and pid, pid 1 in a container): its segment was opened before this process started."""
    if name.host != status.HOST or name.pid is None or name.started_ns is None:
        return False
    pid = name.pid
    if pid == os.getpid():
        born = _started_ns()
        return born is not None and name.started_ns < born
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


_born: tuple[int, int | None] | None = None  # (pid, its start as wall-clock ns)


def _started_ns() -> int | None:
    """When this process started (wall clock, ns; rounded down to the clock tick), from
    /proc/self/stat; None where that is not known (then no own-pid segment counts as dead)."""
    global _born
    pid = os.getpid()
    if _born is not None and _born[0] == pid:
        return _born[1]
    born: int | None = None
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22: starttime
        hz = os.sysconf("SC_CLK_TCK")
        since_start = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - ticks * 1_000_000_000 // hz
        born = time.time_ns() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        born = None
    _born = (pid, born)
    return born


def _read(path: str, base: str, spool: str, offset: int, n: int) -> bytes | None:
    """``n`` bytes at ``offset`` of a segment (following its .open -> .seg rename)."""
    for p in (path, os.path.join(spool, base + CLOSED_SUFFIX)):
        try:
            with open(p, "rb") as fh:
                fh.seek(offset)
                return fh.read(n)
        except FileNotFoundError:
            continue
    return None


def _requests_from(path: str, offset: int) -> int:
    """Requests in the REQUESTS records starting at or after ``offset`` (best effort)."""
    import json

    from perfsleuth.wire.segment import _HEAD, FILE_MAGIC, HEAD_SIZE

    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return 0
    pos, n, count = len(FILE_MAGIC), len(data), 0
    while n - pos >= HEAD_SIZE:
        _magic, rtype, length, _crc = _HEAD.unpack_from(data, pos)
        start = pos + HEAD_SIZE
        if start + length > n:
            break
        if rtype == REQUESTS and pos >= offset:
            nul = data.find(b"\0", start, start + length)
            try:
                head = json.loads(data[start : nul if nul >= 0 else start + length])
                count += int(head.get("n", 0))
            except (ValueError, AttributeError, TypeError):
                pass
        pos = start + length
    return count


_DROPS = ("forward_dropped_segments", "dropped_spool_cap", "dropped_forward_rejected")


def _drop_counters() -> tuple[int, ...]:
    return tuple(stats.get(k, 0) for k in _DROPS)


def _emit_counters() -> None:
    """The drop counters as a STATS record, so that the collector's store (top) has them."""
    try:
        from perfsleuth.agent.spool.queue import emit

        body = {k: stats[k] for k in _DROPS}
        ts, pid = time.time_ns(), os.getpid()
        emit(STATS, lambda _intern: {"ts": ts, "pid": pid, "counters": dict(body)})
    except Exception:
        recorder.internal_error()


def _run(cfg: Config) -> None:
    global _fw
    try:
        # Imported here, not at the agent's start, and while a fork waits (see
        # agent.spool.writer._importing: a child forked mid-import would hang on it).
        from perfsleuth.agent.spool import writer

        with writer._importing:
            import fcntl  # noqa: F401
            import http.client  # noqa: F401
            import json  # noqa: F401
            import re  # noqa: F401
            import urllib.parse  # noqa: F401
            import zlib  # noqa: F401

            import perfsleuth.wire.segment  # noqa: F401
        fw = _fw = Forwarder(cfg)
        fw.run()
    except BaseException as e:  # dies quietly; the spool keeps buffering
        status.error(f"forwarder died: {type(e).__name__}: {e}")
        recorder.internal_error()


def start(cfg: Config) -> None:
    """Start this process's forwarding thread when ``cfg.collector`` is set."""
    global _thread, _cfg
    try:
        _cfg = cfg
        if not cfg.collector or (_thread is not None and _thread.is_alive()):
            return
        _stop.clear()
        t = threading.Thread(target=_run, args=(cfg,), name="perfsleuth-forward", daemon=True)
        t.start()
        _thread = t
    except Exception:
        recorder.internal_error()


def stop() -> None:
    _stop.set()


def at_exit(timeout: float = 3.0) -> None:
    """At the agent's shutdown (its last segment just closed): stop the thread and ship what
    is left in one last round, bounded by ``timeout`` seconds; what is not sent stays in the
    spool for the next start."""
    fw, t = _fw, _thread
    if fw is None or fw.lock_fd is None or fw.said:
        return
    _stop.set()
    try:
        # One deadline for all of it: waiting for the thread, then the last round (checked
        # before each chunk; no socket wait goes past it).
        deadline = time.monotonic() + timeout
        if t is not None:
            t.join(timeout)
            if t.is_alive():  # in the middle of a request: it stays where it is
                return
        fw.drop_connection()
        fw.deadline = deadline
        fw.round()
        status.write(fw.cfg)
    except Exception:
        pass


def _after_fork_in_child() -> None:
    # The parent's thread is not the child's; the child competes for the lock anew. The
    # inherited lock descriptor is closed: the flock stays with the parent (it has its own
    # descriptor), and a child outliving the parent does not keep every process from being
    # elected.
    global _thread, _fw, _lock_fd
    fd, _lock_fd = _lock_fd, None
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    _thread = _fw = None
    if _cfg is not None:
        start(_cfg)


os.register_at_fork(after_in_child=_after_fork_in_child)
