"""Findings: :func:`find` runs the registered detectors over a window and ranks what they
report (a slow statement once: see EXPLAINS_SLOW_QUERY).

What a finding holds and how its confidence is graded is in :mod:`perfsleuth.analysis.finding`;
what a detector sees, in :mod:`perfsleuth.analysis.context`; the detectors themselves, one module
each, in :mod:`perfsleuth.analysis.detectors`, which registers them in
:mod:`perfsleuth.analysis.registry`.
"""

from __future__ import annotations

from datetime import timedelta

from perfsleuth.analysis.config import Config, load_config
from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding, assess
from perfsleuth.store.base import Store

__all__ = ["find"]

# One statement, one explanation: a slow_query finding yields to a finding of these kinds on the
# same endpoint and statement, which says why it is slow (the rows it moves into the client,
# one tenant's data), where slow_query would send the reader to the query's plan.
EXPLAINS_SLOW_QUERY = ("oversized_result", "outlier_tenant")


def find(
    store: Store,
    since: timedelta | None = None,
    endpoint: str | None = None,
    config: Config | None = None,
    kinds: list[str] | None = None,
) -> list[Finding]:
    """Run the enabled detectors (or only ``kinds``); findings sorted by impact, highest
    first (ties by kind, endpoint and id, so the order is stable)."""
    # Loaded on first use: importing perfsleuth.analysis (the CLI does) need not load every
    # detector and numpy.
    from perfsleuth.analysis.detectors import DETECTORS

    cfg = config or load_config()
    ctx = Context(store, cfg, since=since, endpoint=endpoint)
    out: list[Finding] = []
    if ctx.requests == 0:
        return out
    for kind, detect in DETECTORS.items():
        if kinds is not None and kind not in kinds:
            continue
        if not cfg.enabled.get(kind, True):
            continue
        out.extend(f for f in detect(ctx) if f.id not in cfg.ignore and assess(f, cfg))
    explained = {
        (f.endpoint, f.fingerprint) for f in out if f.kind in EXPLAINS_SLOW_QUERY and f.fingerprint
    }
    out = [f for f in out if f.kind != "slow_query" or (f.endpoint, f.fingerprint) not in explained]
    if endpoint is not None:  # service-wide findings (cpu_starved, gc_pressure's) are no one's
        out = [f for f in out if f.endpoint == endpoint]
    out.sort(key=lambda f: (-f.impact_ms_per_min, f.kind, f.endpoint, f.id))
    return out
