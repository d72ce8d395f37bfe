"""The detectors, one module each; importing this package registers them all in
:data:`perfsleuth.analysis.registry.DETECTORS` (kind name -> function(Context) -> list[Finding]).

Each detector's settings and their defaults live in :data:`perfsleuth.analysis.config.DEFAULTS`
under the same kind name.
"""

from __future__ import annotations

# Imported for their registration (order = the order they run in; ranking is by impact).
from perfsleuth.analysis.detectors import (
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
from perfsleuth.analysis.registry import DETECTORS, Detector

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
    "regression",
    "repeated_query",
    "slow_query",
    "slow_request_hotspot",
    "upstream_latency",
]
