"""The evidence thread's heap size never comes from gc.get_objects(): its list holds a
reference to every tracked object, a tuple another thread is still filling in included, and
that thread's tuple() then fails with SystemError (seen in CI, in app code)."""

from __future__ import annotations

import gc
import sys
from typing import Any

from perfsleuth.agent import gcwatch, recorder


def test_the_heap_is_sized_without_listing_its_objects(monkeypatch: Any) -> None:
    def forbidden(*_: Any) -> list[Any]:
        raise AssertionError("gc.get_objects() from the evidence thread")

    monkeypatch.setattr(gc, "get_objects", forbidden)
    monkeypatch.setattr(gcwatch, "_heap_due", [True, 0.0])
    gcwatch.sample_heap(1e9)
    assert recorder.stats["gc_heap_objects"] > 0
    assert abs(recorder.stats["gc_heap_objects"] - sys.getallocatedblocks()) < 100_000
