"""The detector registry: kind name -> function(Context) -> list[Finding].

Each detector is a small module here; its settings and their defaults live in
:data:`perfsleuth.analysis.config.DEFAULTS` under the same kind name.
"""

from __future__ import annotations

from collections.abc import Callable

from perfsleuth.analysis.findings import Context, Finding

Detector = Callable[[Context], list[Finding]]

DETECTORS: dict[str, Detector] = {}


def register(kind: str) -> Callable[[Detector], Detector]:
    def deco(fn: Detector) -> Detector:
        DETECTORS[kind] = fn
        return fn

    return deco


# Imported for their registration (order = the order they run in; ranking is by impact).
from perfsleuth.analysis.detectors import (  # noqa: E402
    chatty_endpoint,
    cpu_starved,
    event_loop_blocker,
    gc_pressure,
    large_request_body,
    n_plus_one,
    outlier_tenant,
    oversized_result,
    regression,
    repeated_query,
    slow_query,
    slow_request_hotspot,
    upstream_latency,
)

__all__ = [
    "DETECTORS",
    "Detector",
    "chatty_endpoint",
    "cpu_starved",
    "event_loop_blocker",
    "gc_pressure",
    "large_request_body",
    "n_plus_one",
    "outlier_tenant",
    "oversized_result",
    "register",
    "regression",
    "repeated_query",
    "slow_query",
    "slow_request_hotspot",
    "upstream_latency",
]
