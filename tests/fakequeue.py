"""Test helper: spool.queue's globals replaced by a queue of the test's own (monkeypatched back
at the test's end), and bare requests to put in it; what tests of ``enqueue`` (C and Python)
start from."""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest

from perfsleuth.agent import recorder
from perfsleuth.agent.spool import queue


def fake_queue(monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> dict[str, int]:
    """An empty queue with room for 100 requests and 100,000 bytes (unless ``overrides`` say
    otherwise); returns the drop counters it keeps."""
    stats = dict.fromkeys(["dropped_queue_full", "dropped_memory", "cache_resets"], 0)
    values: dict[str, Any] = {
        "queue_size": 100,
        "queue_limit": 100_000,
        "cache_limit": 100_000,
        "WAKE_AT": 1000,
        "_queue": collections.deque(),
        "_sizes": collections.deque(),
        "_queue_bytes": 0,
        "_site_cache": {},
        "_sites_seen": 0,
        "_site_cache_bytes": 0,
        "wake": threading.Event(),
        "on_full": lambda: None,
        "stats": stats,
        # the writer of the session's agent drains what queued() counts: with this queue in
        # place it takes nothing from it (it took a test's request between two enqueues once)
        "queued": lambda: 0,
    }
    for name, value in (values | overrides).items():
        monkeypatch.setattr(queue, name, value)
    return stats


def bare_request(calls: int | None = None, attrs: int | None = None, sites: int = 0) -> Any:
    """An ended request as enqueue sees it: ``calls`` rows, ``attrs`` attributes, ``sites``
    site entries with statements of 0, 1, ... characters after ``SELECT ``."""
    req = recorder.ActiveRequest.__new__(recorder.ActiveRequest)
    req.calls = None if calls is None else bytearray(calls * recorder.ROW)
    req.attrs = None if attrs is None else {f"a{k}": k for k in range(attrs)}
    req.site_list = [("db", "sqlite", "SELECT " + "x" * k, (), None) for k in range(sites)]
    return req
