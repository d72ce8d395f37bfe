"""The detector registry: kind name -> function(Context) -> list[Finding].

A detector module registers itself with :func:`register` when it is imported; importing
:mod:`perfsleuth.analysis.detectors` imports them all, so read :data:`DETECTORS` from there.
Each detector's settings and their defaults live in :data:`perfsleuth.analysis.config.DEFAULTS`
under the same kind name.
"""

from __future__ import annotations

from collections.abc import Callable

from perfsleuth.analysis.context import Context
from perfsleuth.analysis.finding import Finding

__all__ = ["DETECTORS", "Detector", "register"]

Detector = Callable[[Context], list[Finding]]

# In the order the detectors run (the order their modules are imported); ranking is by impact.
DETECTORS: dict[str, Detector] = {}


def register(kind: str) -> Callable[[Detector], Detector]:
    def deco(fn: Detector) -> Detector:
        DETECTORS[kind] = fn
        return fn

    return deco
