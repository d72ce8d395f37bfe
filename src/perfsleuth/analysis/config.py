"""Detector settings: every threshold in one table, with where its default comes from.

Overrides, later ones winning:

1. a TOML file (``--config FILE``, else ``$PERFSLEUTH_CONFIG``, else ``./perfsleuth.toml``
   when it exists) with a ``[findings]`` table::

       [findings]
       ignore = ["3f2a9c1d0e4b"]          # finding ids to silence (one call site, one query)

       [findings.n_plus_one]
       min_repeats = 10

       [findings.slow_query]
       enabled = false

2. ``--set detector.name=value`` on the command line (``--set slow_query.enabled=false``).

Times are milliseconds, sizes bytes, shares fractions (0..1).
"""

from __future__ import annotations

import copy
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

CONFIG_ENV = "PERFSLEUTH_CONFIG"
CONFIG_FILE = "perfsleuth.toml"

# kind -> setting -> default. Every detector also takes ``enabled`` (default true).
DEFAULTS: dict[str, dict[str, Any]] = {
    "n_plus_one": {
        # Sentry's N+1 DB detector wants >= 5 repeated spans; fewer is usually a 1+1 load or a
        # short fixed list (nplusone's documented source of false positives).
        "min_repeats": 5,
        # DB and HTTP loops always; cache loops only when a loop in the source is found
        # (peers' users complain about Redis N+1 noise).
        "kinds": ["db", "http", "cache"],
        # The pattern must cost something: on average per affected request, the loop's span
        # from its first call to its last less one call, either this many ms (Sentry: 50 ms
        # for DB, 300 ms for HTTP) ...
        "min_ms_per_request": 50.0,
        # ... or this share of those requests' time (sub-ms SQLite calls still add up: the
        # lessons' Jira case is ~1 ms per call, 90,000 calls per export).
        "min_time_share": 0.10,
        # ... or repeat this often per request (median) whatever the time: one query per
        # item of a page of 20 (Rails' and Django's usual page sizes are 20-25) is the classic
        # N+1, 20 round trips on a networked database even when a local SQLite or a busy
        # machine (request time inflated by waiting for the CPU) hides their cost; nplusone
        # flags such loops by count alone.
        "min_repeats_any_cost": 20,
        # In a meaningful part of the endpoint's traffic, and seen more than once or twice
        # (Sentry reports an N+1 only after seeing it several times).
        "min_request_share": 0.05,
        "min_requests": 3,
    },
    "repeated_query": {
        # django-debug-toolbar's "duplicate": same SQL and same parameters, >= 2 times.
        "min_repeats": 2,
        "kinds": ["db", "cache"],
        # Only reads: a request-scoped cache can remove a repeated read, not a repeated write.
        "read_ops": ["SELECT", "WITH", "SHOW", "GET", "MGET", "HGET", "HGETALL", "EXISTS"],
        # The repeats must cost something: this share of the endpoint's time, or this many ms
        # per request that repeats. debug-toolbar lists every duplicate; a finding says why a
        # page is slow, and Wagtail's admin has a dozen genuine duplicates costing 0.03-1.3 %
        # of their pages.
        "min_time_share": 0.02,
        "min_ms_per_request": 1.0,
        "min_request_share": 0.05,
        "min_requests": 3,
    },
    "oversized_result": {
        # JDBC row-count alerts (FusionReactor) and the lessons: a query returning over a
        # million rows took a database to 100 % CPU; ORM parsing of results of 3 MB or more
        # blocked an event loop. 10,000 rows / 1 MB is far beyond any page a user can read.
        "max_rows": 10_000,
        "max_bytes": 1_000_000,
        "min_calls": 1,
        # Attribute keys an app may set with the number of rows it actually returned.
        "returned_rows_keys": ["rows_returned", "returned_rows", "result_rows", "items_returned"],
    },
    "slow_query": {
        # Peers flag single queries at 500-1000 ms (Sentry, debug-toolbar, Glowroot); a p95
        # is already an aggregate of many calls, so we go lower, but not to 100 ms: a call's
        # wall time includes waiting for the interpreter lock and the CPU, and on a starved
        # machine a primary-key lookup in the demo can reach a p95 of ~100 ms (median ~10 ms).
        "p95_ms": 250.0,
        "min_calls": 5,
        # ... in this many requests: five slow calls of one request are one slow request.
        "min_requests": 3,
        # ... and it must matter to its endpoint.
        "min_time_share": 0.05,
        "kinds": ["db"],
    },
    "upstream_latency": {
        # An endpoint is "dominated" by a host when over half its time is spent waiting on it,
        "min_time_share": 0.5,
        # or when at least half its requests call the host and the median of those spends over
        # half its time waiting on it (a few requests slowed by something else, a blocked loop
        # or a starved CPU, leave that unchanged while they sink the share of all the time).
        "min_typical_share": 0.5,
        # Typical wait per calling request (Sentry's N+1 API threshold is 300 ms in total;
        # anything under ~20 ms per request is not worth a finding of its own).
        "min_ms_per_request": 20.0,
        # ... and per call: many fast calls per request are an N+1 (n_plus_one reports it),
        # not a slow upstream. Sentry's slow-HTTP checks start at 500 ms a call; 20 ms is lenient.
        "min_ms_per_call": 20.0,
        "min_requests": 5,
    },
    "outlier_tenant": {
        # Graphite's lesson: one customer's slow upstream moved the site-wide P95. A tenant is
        # judged by its own requests against the rest of the endpoint's, never by the
        # endpoint's p95, which unrelated noise (an event-loop blocker) may set.
        "dimensions": ["tenant", "user"],
        "min_endpoint_requests": 30,
        # Enough requests on both sides for a median and a rank test to mean something.
        "min_requests": 5,
        "min_other_requests": 20,
        # Their share of the endpoint's time is this many times their share of its requests
        # (their mean over the endpoint's: others' slow tail, a blocker, pulls it down while
        # their median is 12x the others'; the rank test and the median say "as a rule"),
        "min_ratio": 1.5,
        # and large enough to matter,
        "min_time_share": 0.10,
        # and their median is this many times everyone else's (slow as a rule, not by the
        # chance of a few requests meeting a busy machine) ...
        "min_median_ratio": 2.0,
        # ... and at least this many ms above it: 0.5 against 0.1 ms is a large ratio of nothing.
        "min_median_gap_ms": 10.0,
        # Mann-Whitney U, one-sided: the chance that requests drawn from one distribution would
        # rank this far above the others' (Bonferroni-minded: an endpoint has many tenants).
        "max_p_value": 0.001,
        # A statement (or call) is named as theirs when they spend this share of its time or
        # more, per request, against the others ...
        "statement_min_share": 0.5,
        # ... and it explains this share of their time beyond the others' at least.
        "statement_min_excess_share": 0.25,
    },
    "chatty_endpoint": {
        # Many calls per request (median), the lessons' Jira case at the extreme (90,000).
        "min_calls_per_request": 30,
        # ... spread over many statements: when one fingerprint makes up most of them it is
        # an N+1, reported by n_plus_one.
        "max_top_fingerprint_share": 0.5,
        # ... and the calls are a big part of the endpoint's time ("DB-dominated").
        "min_call_time_share": 0.3,
        # Calls per request considered healthy; the time of the calls beyond it is the impact.
        "baseline_calls": 10,
        "min_requests": 3,
    },
    "large_request_body": {
        # Sentry's large-payload threshold (300 KB); the lessons' decisive find was a huge
        # form field re-parsed per thread.
        "min_bytes": 300_000,
        # ... whose size drives latency: the rank (Spearman) correlation of size and time over
        # the endpoint's requests (CPU time over those that have it, or duration),
        "min_correlation": 0.5,
        # ... and a one-sided 5 % test that it is not chance: five unrelated requests reach
        # 0.5 about one time in five; twelve need about 0.5, five about 0.83. When both fits
        # (CPU, duration) are tried, the better is held to half of it and its p-value doubled;
        # 0: never.
        "max_p_value": 0.05,
        "min_requests": 5,
    },
    "slow_request_hotspot": {
        # One application line holds this share of an endpoint's slow-request samples (the
        # lessons' stuck-in-URL-decoding thread: one frame in nearly every sample).
        "min_share": 0.3,
        # ... over enough evidence: 20 samples are 0.2 s of sampling at the default 10 ms.
        "min_samples": 20,
        "min_requests": 2,
        # A line whose samples mostly waited for the GIL is where a bystander stood, not a
        # hotspot, when the slow requests ran on the CPU for less than this share of their
        # time: another thread of the process computed (it has its own finding).
        "max_bystander_cpu": 0.05,
    },
    "event_loop_blocker": {
        # The agent records blocks of PERFSLEUTH_LOOP_BLOCK_MS (100 ms, the Graphite/Ashby
        # watchdogs' threshold) and more; one block can be a cold start, two are a pattern.
        "min_count": 2,
        # ... or a single block this long is reported anyway.
        "single_ms": 1000.0,
    },
    "gc_pressure": {
        # JVM tuning guides treat > 5-10 % of time in GC as a problem; collections must take
        # a notable share of the endpoint's time ...
        "min_time_share": 0.10,
        # ... and cost something per request on average,
        "min_ms_per_request": 5.0,
        # ... and still do without the costliest tenth of the endpoint's requests by GC time: a
        # few requests that met a full collection of a large heap (it happens to a random page
        # of a Flask-AppBuilder or Django admin each run) are the heap's cost, not the page's.
        "trim_share": 0.1,
        "min_requests": 10,
        # When this many endpoints or more are over the thresholds, at least service_coverage
        # of the endpoints with min_requests, and their shares are within service_spread (the
        # largest over the smallest) of each other, the collections are the service's (a large
        # long-lived heap that every full collection scans): one finding for the service.
        "service_min_endpoints": 3,
        "service_coverage": 0.75,
        "service_spread": 3.0,
    },
    "cpu_starved": {
        # Request threads (those the agent samples) wait in the run queue at least this share
        # of the time they are runnable: with one busy thread per core it is near 0; a share of
        # 0.5 means they wait for a CPU as long as they run (two runnable threads per core).
        "min_queue_share": 0.5,
        # ... over enough runnable time to judge (a second of CPU-bound request code).
        "min_runnable_ms": 1000.0,
        # Or the cgroup's CPU quota throttled the service in this share of its periods
        # (Kubernetes guides alert on 25 %) ...
        "min_throttled_share": 0.25,
        # ... for at least this long in the window.
        "min_throttled_ms": 1000.0,
    },
    "regression": {
        # Buckets of the time series (0: the window cut into about target_buckets buckets of a
        # round number of minutes; Sentry's statistical detectors use hourly p95s).
        "bucket_minutes": 0.0,
        "target_buckets": 48,
        # A bucket's p95 needs some requests; a series needs enough buckets to have a before
        # and an after (Sentry wants days of hourly data; a dozen buckets is the least).
        "min_bucket_requests": 5,
        "min_buckets": 12,
        # Each side of the breakpoint has this many buckets: a shift must have stayed.
        "min_side_buckets": 6,
        # Moving averages that spot a shift (in buckets): fast rises above slow.
        "fast_buckets": 3,
        "slow_buckets": 12,
        # Confirmed when the median p95 after is 20 % and 10 ms above the one before ...
        "min_change": 0.2,
        "min_change_ms": 10.0,
        # ... and the buckets after rank above those before (one-sided Mann-Whitney), and so
        # do the requests after: strict, as the best of many breakpoints is tested. On 900
        # synthetic flat noisy hourly histories this raised 1 false regression, and found 28 of
        # 30 steps of +50 % within one bucket (missed: two with 6 buckets after the step).
        "max_p_value": 2e-4,
        # Or the share of requests over one of these times rose by this much (absolute),
        # with this many such requests after the breakpoint.
        "slow_thresholds_ms": [1000.0, 2000.0, 5000.0],
        "min_rate_change": 0.02,
        "min_slow_requests": 10,
        # Week over week: the last hours against the same hours a week earlier (0: off).
        "week_hours": 24.0,
        # Requests after the breakpoint (and on each side week over week).
        "min_requests": 50,
    },
}

# The evidence each detector's findings rest on: kind -> {count in Finding.evidence: the setting
# above holding its floor}. A finding with a count under its floor is not raised; above it, the
# counts grade how sure the finding is (see perfsleuth.analysis.finding.assess). A new detector
# adds one line here.
EVIDENCE_FLOORS: dict[str, dict[str, str]] = {
    "n_plus_one": {"requests_with_pattern": "min_requests"},
    "repeated_query": {"requests_with_repeats": "min_requests"},
    "oversized_result": {"calls": "min_calls"},
    "slow_query": {"calls": "min_calls", "requests": "min_requests"},
    "upstream_latency": {"requests_calling": "min_requests"},
    "outlier_tenant": {"requests": "min_requests", "other_requests": "min_other_requests"},
    "chatty_endpoint": {"requests": "min_requests"},
    "large_request_body": {
        "requests_with_large_body": "min_requests",
        "requests_fitted": "min_requests",
    },
    "slow_request_hotspot": {"slow_requests": "min_requests", "samples": "min_samples"},
    "event_loop_blocker": {"blocks": "min_count"},
    "gc_pressure": {"requests": "min_requests"},
    # Only the figure of the condition that fired is graded: runnable time, or throttled time.
    "cpu_starved": {"runnable_ms": "min_runnable_ms", "throttled_ms": "min_throttled_ms"},
    "regression": {"requests_after": "min_requests"},
}

# Floors that grade a finding without holding it back: one block of event_loop_blocker's
# ``single_ms`` or more is reported (as "low").
SOFT_FLOORS: frozenset[tuple[str, str]] = frozenset({("event_loop_blocker", "blocks")})


class ConfigError(ValueError):
    """A setting that does not exist or has the wrong type; the message is one sentence."""


@dataclass
class Config:
    settings: dict[str, dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(DEFAULTS))
    enabled: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(DEFAULTS, True))
    ignore: set[str] = field(default_factory=set)  # finding ids to silence

    def get(self, kind: str, name: str) -> Any:
        return self.settings[kind][name]

    def set(self, kind: str, name: str, value: Any) -> None:
        """Set one setting, converting ``value`` (str from the CLI) to the default's type."""
        if kind not in DEFAULTS:
            raise ConfigError(f"unknown detector {kind!r}; known: {', '.join(DEFAULTS)}")
        if name == "enabled":
            self.enabled[kind] = _convert(True, value, f"{kind}.enabled")
            return
        if name not in DEFAULTS[kind]:
            known = ", ".join(["enabled", *DEFAULTS[kind]])
            raise ConfigError(f"unknown setting {kind}.{name}; {kind} has: {known}")
        self.settings[kind][name] = _convert(DEFAULTS[kind][name], value, f"{kind}.{name}")

    def apply(self, assignment: str) -> None:
        """``detector.name=value`` (lists comma-separated)."""
        key, sep, value = assignment.partition("=")
        kind, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(
                f"invalid setting {assignment!r}: use detector.name=value, "
                "e.g. n_plus_one.min_repeats=10"
            )
        self.set(kind, name.strip(), value.strip())

    def load_toml(self, path: str) -> None:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"the config file {path} is not valid TOML: {e}") from e
        table = doc.get("findings", {})
        if not isinstance(table, dict):
            raise ConfigError(f"[findings] in {path} must be a table")
        for kind, body in table.items():
            if kind == "ignore":
                if not isinstance(body, list):
                    raise ConfigError(f"findings.ignore in {path} must be a list of finding ids")
                self.ignore.update(str(x) for x in body)
                continue
            if not isinstance(body, dict):
                raise ConfigError(f"findings.{kind} in {path} must be a table")
            for name, value in body.items():
                self.set(kind, name, value)


def _convert(default: Any, value: Any, where: str) -> Any:
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            low = str(value).strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, list):
            if isinstance(value, list):
                return [str(v) for v in value]
            return [v.strip() for v in str(value).split(",") if v.strip()]
        return str(value)
    except (TypeError, ValueError) as e:
        kind = type(default).__name__ if not isinstance(default, list) else "list"
        raise ConfigError(f"invalid value {value!r} for {where}: expected a {kind}") from e


def load_config(path: str | None = None, assignments: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file (explicit, ``$PERFSLEUTH_CONFIG`` or ``./perfsleuth.toml``),
    then ``detector.name=value`` assignments."""
    cfg = Config()
    path = path or os.environ.get(CONFIG_ENV) or None
    if path is None and os.path.isfile(CONFIG_FILE):
        path = CONFIG_FILE
    if path is not None:
        cfg.load_toml(path)
    for a in assignments:
        cfg.apply(a)
    return cfg
