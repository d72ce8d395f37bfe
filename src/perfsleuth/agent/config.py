"""Agent settings, read from PERFSLEUTH_* environment variables (keyword overrides win).

- PERFSLEUTH_DATA (./.perfsleuth): data dir; segments go to DATA/spool
- PERFSLEUTH_SERVICE (argv[0] name): service name stored with every request
- PERFSLEUTH_VERSION (the git commit of the working directory's checkout, if any): the release
  stored with every request (``perfsleuth compare --by release``)
- PERFSLEUTH_DISABLED (0): 1 installs nothing
- PERFSLEUTH_USER_HEADER (x-user), PERFSLEUTH_TENANT_HEADER (x-tenant): request headers
  holding the user and tenant ids
- PERFSLEUTH_QUEUE_SIZE (10000): finished requests waiting for the writer; past it, drop
- PERFSLEUTH_MEMORY_BUDGET_MB (32): bytes the agent may hold: queued requests (their call rows,
  statements, attributes, captured bodies), the batch being encoded and the writer's caches;
  a request past it is dropped and counted (dropped_memory)
- PERFSLEUTH_FINGERPRINT_CPU_PCT (5): the share of one core the writer may spend fingerprinting
  statements it has not seen; past it a new statement keeps its timing and a hash of its text
  but no normalised text (counted: fingerprints_skipped)
- PERFSLEUTH_MAX_CALLS (20000): calls kept per request; the rest are only counted
- PERFSLEUTH_CPU_SAMPLE (auto): whose CPU time (requests.cpu_ms) is measured; the others' is
  NULL. ``auto``: every request while the process ends fewer than PERFSLEUTH_CPU_SAMPLE_PER_S
  (200) a second, above that a random share that adds up to about that many (agent.cpushare:
  a thread CPU clock reading is a system call, ~4.5 µs inside a request). A number from 0 to 1:
  that share of the requests, whatever the traffic (1 every request, 0 none). Drawn from the
  trace id at each request's start
- PERFSLEUTH_SEGMENT_BYTES (8000000), PERFSLEUTH_SEGMENT_SECONDS (30): segment rotation
- PERFSLEUTH_FLUSH_SECONDS (0.2): how often the writer wakes up to write
- PERFSLEUTH_FSYNC (rotate): rotate fsyncs when a segment closes; always after every write
  batch; never leaves it to the OS
- PERFSLEUTH_SPOOL_MAX_BYTES (1000000000): spool size cap; past it new requests are dropped
  (forwarding to a collector: past 90 % of it the oldest segments are dropped and counted)
- PERFSLEUTH_COLLECTOR (""): a ``perfsleuth server`` URL (http://host:port or https://) to
  forward the spool to (agent.spool.forward); PERFSLEUTH_TOKEN: its ingest token;
  PERFSLEUTH_CA_FILE: the CA bundle (PEM) an https collector's certificate must chain to,
  instead of the system's CAs
- PERFSLEUTH_HOST (the machine's name): the host stored with every request
- PERFSLEUTH_STACKS_PER_SITE (1): full stacks captured per (statement, call site) and
  request; later repeats reuse the last one captured (an N+1 loop has one stack)
- PERFSLEUTH_EVIDENCE (1): 0 turns off the runtime-evidence thread (stack samples of slow
  requests, event-loop blockers, GC pauses)
- PERFSLEUTH_SAMPLE_AFTER_MS (300): a request in flight this long gets its stack sampled...
- PERFSLEUTH_SAMPLE_INTERVAL_MS (20): ...every this often until it ends (each sample makes
  the evidence thread take the GIL: ~1 % of a sampled request's speed at 20 ms)...
- PERFSLEUTH_SAMPLES_PER_REQUEST (500): ...at most this many times (the rest are counted)
- PERFSLEUTH_LOOP_BLOCK_MS (100): an asyncio loop that runs no callback for this long is blocked
- PERFSLEUTH_GC_EVENT_MS (1): collections at least this long are stored as GC pause events
  (every collection's time is added to the requests in flight either way)
- PERFSLEUTH_CAPTURE (1): 0 keeps no replayable captures of requests (agent.capture)
- PERFSLEUTH_CAPTURE_SLOW_MS (500): requests this slow are captured (also 5xx, flagged ones)
- PERFSLEUTH_CAPTURE_SAMPLE (0.01): share of the other requests captured at random...
- PERFSLEUTH_CAPTURE_SAMPLE_PER_MIN (60): ...at most this many a minute (a busy service would
  otherwise write one every few milliseconds; slow, failed and flagged requests are not capped)
- PERFSLEUTH_CAPTURE_BODY_MAX (65536): body bytes kept; larger bodies: size, hash, truncated
- PERFSLEUTH_CAPTURE_SECRETS (0): 1 keeps the values of secret headers (redacted by default)
- PERFSLEUTH_REDACT_HEADERS (""): comma list of more header names to redact
- PERFSLEUTH_HEAP (1): 0 installs no SIGUSR2 heap-histogram handler (agent.heap)
- PERFSLEUTH_APP_PACKAGES (""): comma list of packages that are application code even when
  installed in site-packages (``perfsleuth run`` adds the served app object's package; Django's
  project is found from its settings): their frames name call sites and blockers
- PERFSLEUTH_SPEEDUPS (1): 0 leaves out the C accelerator (agent/_speedups.c, built at install
  when a compiler is there): the Python code records the same values, at more cost per call
"""

from __future__ import annotations

import os
import sys


def _flag(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


class Config:
    # A plain class (its defaults are class attributes, all immutable): importing dataclasses
    # cost the agent's start milliseconds.

    data_dir: str = ".perfsleuth"
    service: str = ""
    version: str = ""
    disabled: bool = False
    user_header: str = "x-user"
    tenant_header: str = "x-tenant"
    queue_size: int = 10000
    memory_budget_mb: float = 32.0
    fingerprint_cpu_pct: float = 5.0
    max_calls: int = 20000
    cpu_sample: float | None = None  # None: auto (agent.cpushare)
    cpu_sample_per_s: float = 200.0
    segment_bytes: int = 8_000_000
    segment_seconds: float = 30.0
    flush_seconds: float = 0.2
    fsync: str = "rotate"
    spool_max_bytes: int = 1_000_000_000
    collector: str = ""
    token: str = ""
    ca_file: str = ""
    host: str = ""
    stacks_per_site: int = 1
    evidence: bool = True
    sample_after_ms: float = 300.0
    sample_interval_ms: float = 20.0
    samples_per_request: int = 500
    loop_block_ms: float = 100.0
    gc_event_ms: float = 1.0
    capture: bool = True
    capture_slow_ms: float = 500.0
    capture_sample: float = 0.01
    capture_sample_per_min: int = 60
    capture_body_max: int = 65536
    capture_secrets: bool = False
    redact_headers: str = ""
    heap: bool = True
    app_packages: str = ""  # read by agent.stacks at import (stacks.add_app_packages)
    # Test-only fault injection: "writer_crash" makes the writer thread die on every batch;
    # "evidence_crash" makes every evidence tick and GC callback raise; "capture_crash" makes
    # every capture decision and body tap raise.
    fault: str = ""

    @property
    def spool_dir(self) -> str:
        return os.path.join(self.data_dir, "spool")

    @property
    def agents_dir(self) -> str:
        return os.path.join(self.data_dir, "agents")


def load(**overrides: object) -> Config:
    """Build the config from the environment; unknown or malformed values fall back to defaults."""
    cfg = Config()
    env = os.environ
    for name in Config.__annotations__:
        raw = env.get("PERFSLEUTH_" + ("DATA" if name == "data_dir" else name.upper()))
        if raw is None or raw == "":
            continue
        default = getattr(cfg, name)
        try:
            if isinstance(default, bool):
                value: object = _flag(raw)
            elif isinstance(default, int):
                value = int(raw)
            elif isinstance(default, float):
                value = float(raw)
            else:
                value = raw
        except ValueError:
            continue  # a typo in an env var must not stop the app
        setattr(cfg, name, value)
    for k, v in overrides.items():
        if v is not None and hasattr(cfg, k):
            setattr(cfg, k, v)
    cfg.cpu_sample = parse_share(cfg.cpu_sample)
    cfg.data_dir = os.path.abspath(str(cfg.data_dir))
    cfg.user_header = cfg.user_header.lower()
    cfg.tenant_header = cfg.tenant_header.lower()
    if not cfg.service:
        cfg.service = os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python")
    if not cfg.version:
        cfg.version = git_commit(os.getcwd())
    cfg.version = cfg.version.strip()[:64]
    return cfg


def clamp_share(value: object) -> float:
    """A share between 0 and 1 (a NaN or a value that is no number: 1, every request)."""
    share = parse_share(value)
    return 1.0 if share is None else share


def parse_share(value: object) -> float | None:
    """PERFSLEUTH_CPU_SAMPLE's value: a share between 0 and 1, or None for ``auto`` (also for
    an empty, NaN or malformed value: a typo must not turn the measurement off)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        share = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if share != share:
        return None
    return min(1.0, max(0.0, share))


def cpu_sample_of() -> float:
    """The share PERFSLEUTH_CPU_SAMPLE sets (``auto``, empty or malformed: 1, auto's start)."""
    return clamp_share(os.environ.get("PERFSLEUTH_CPU_SAMPLE"))


def git_commit(start: str) -> str:
    """The commit checked out in the git work tree holding ``start`` (12 hex digits), read
    from .git's files (no git process at start-up); "" when there is none or it cannot be
    read."""
    try:
        d = os.path.abspath(start)
        for _ in range(32):
            git = os.path.join(d, ".git")
            if os.path.isfile(git):  # a linked work tree or submodule: "gitdir: PATH"
                with open(git, encoding="utf-8") as fh:
                    line = fh.read(4096).strip()
                if not line.startswith("gitdir:"):
                    return ""
                git = os.path.join(d, line[len("gitdir:") :].strip())
            if os.path.isdir(git):
                return _head_commit(git)
            parent = os.path.dirname(d)
            if parent == d:
                return ""
            d = parent
    except (OSError, UnicodeDecodeError):
        pass
    return ""


def _head_commit(git: str) -> str:
    with open(os.path.join(git, "HEAD"), encoding="utf-8") as fh:
        head = fh.read(4096).strip()
    if not head.startswith("ref:"):
        return head[:12] if _is_sha(head) else ""
    ref = head[len("ref:") :].strip()
    common = git
    try:  # a linked work tree keeps its branches in the main repository's directory
        with open(os.path.join(git, "commondir"), encoding="utf-8") as fh:
            common = os.path.join(git, fh.read(4096).strip())
    except OSError:
        pass
    for base in (git, common):
        try:
            with open(os.path.join(base, ref), encoding="utf-8") as fh:
                sha = fh.read(4096).strip()
            return sha[:12] if _is_sha(sha) else ""
        except OSError:
            continue
    try:
        with open(os.path.join(common, "packed-refs"), encoding="utf-8") as fh:
            for line in fh:
                sha, _, name = line.strip().partition(" ")
                if name == ref and _is_sha(sha):
                    return sha[:12]
    except OSError:
        pass
    return ""


def _is_sha(text: str) -> bool:
    return len(text) >= 40 and all(c in "0123456789abcdef" for c in text[:40])
