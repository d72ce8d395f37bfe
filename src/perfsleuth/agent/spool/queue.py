"""The agent's bounded queues: what the request path hands to the writer thread.

``enqueue(req)`` appends a finished request if the queue holds fewer than ``queue_size``
requests and its estimated bytes fit the queue's share of the memory budget, else counts a
drop; nothing else happens on the request path. ``emit`` queues an evidence record (stack
samples, loop blockers, GC pauses, captures), built later on the writer thread.

The memory budget (PERFSLEUTH_MEMORY_BUDGET_MB), in bytes, is shared out so that the parts
together stay within it: 3/8 for the queued requests, 1/4 for request bodies held for
captures (agent.capture), 1/8 for the writer's caches (statements, fingerprints, stacks),
1/8 for the statements of the recorder's site cache (bounded on the request path: a stalled
writer must not let it grow) and 1/8 for the slice of the queue being encoded (the writer
drains the queue in slices of at most that many bytes, never all of a backlog at once).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from itertools import repeat, starmap
from typing import Any

from perfsleuth.agent import accel, recorder
from perfsleuth.agent.config import Config
from perfsleuth.agent.recorder import stats

# The writer also wakes when this many requests wait (else every PERFSLEUTH_FLUSH_SECONDS):
# each wake costs a thread switch and cold caches, so larger batches cost less per request.
WAKE_AT = 512
REQUEST_BYTES = 700  # an ActiveRequest, its strings and ints, the deque slots
SITE_ENTRY_BYTES = 400  # a site entry, its key and captured stack, beside the statement

# (record type, build): ``build(intern)`` returns the record's JSON body on the writer thread;
# ``intern(flat_stack)`` gives the stack id of a stacks.capture()-style tuple.
Intern = Callable[[tuple[Any, ...]], int | None]
Build = Callable[[Intern], dict[str, Any] | None]

queue_size: int | None = None  # None: the agent is not started, nothing is queued
queue_limit = 12 << 20
cache_limit = 4 << 20
slice_limit = 4 << 20

_queue: collections.deque[recorder.ActiveRequest] = collections.deque()
# The estimated bytes of each queued request (in _queue's order) and their sum. A request's
# estimate: its object and fields, its call rows, its attributes and, when it made site entries
# (the recorder's site cache grew: statements it ran for the first time), its statements and
# their entries. Repeated statements share their entries across requests: those cost nothing
# more, and their requests skip the look at their sites.
_sizes: collections.deque[int] = collections.deque()
_queue_bytes = 0
_site_cache = recorder._site_cache
_sites_seen = 0  # len(_site_cache) at the last enqueue
_site_cache_bytes = 0  # what the entries added to it since it was last cleared hold
_events: collections.deque[tuple[bytes, Build]] = collections.deque()

# Set to wake the writer before its next tick: threading.Event's interface; the accelerator's
# Waker takes the interpreter lock back as the agent's threads do (agent/_speedups.c, "agent
# threads and the GIL").
Waker: Callable[[], threading.Event] = accel.pick("Waker", threading.Event)
wake = Waker()


def _no_writer() -> None:
    pass


# Called when a request or event is dropped for want of room: restarts a dead writer thread
# (set by the writer module, which imports this one).
on_full: Callable[[], None] = _no_writer


def configure(cfg: Config) -> None:
    """Take the queue's size and the budget's shares from the agent's config."""
    global queue_size, queue_limit, cache_limit, slice_limit
    budget = max(1 << 20, int(cfg.memory_budget_mb * (1 << 20)))
    queue_limit, cache_limit, slice_limit = budget * 3 // 8, budget // 8, budget // 8
    queue_size = cfg.queue_size
    share_statements()


def share_statements() -> None:
    """Let the accelerator record a statement as the first one made with the same tokens
    (agent/_speedups.c: shared_statement), in a quarter of the caches' share of the budget
    at most: statements with their literals written in are then let go when the app lets
    them go."""
    c = recorder.speedups
    if c is None or not hasattr(c, "statement_shapes"):  # off, or a build without sharing
        return
    try:  # the C tokenizer alone: wire.fingerprint's import (its regexes) costs milliseconds
        from perfsleuth.wire._fingerprint import SCAN
    except ImportError:  # not built, or built before it had SCAN
        SCAN = None
    try:
        c.configure(statement_scan=SCAN, statement_bytes=cache_limit // 4)
    except Exception:
        recorder.internal_error()


def enqueue(req: recorder.ActiveRequest) -> None:
    global _queue_bytes, _sites_seen, _site_cache_bytes
    size_cap = queue_size
    if size_cap is None:
        return
    if len(_queue) >= size_cap:
        stats["dropped_queue_full"] += 1
        on_full()
        return
    calls = req.calls
    size = REQUEST_BYTES
    if calls is not None:
        # the rows' buffer as allocated: the accelerator grows it ahead (by half again, at
        # least 4 rows), so its length can be a quarter of what it holds
        size += calls.__alloc__() if type(calls) is bytearray else len(calls)
        if len(_site_cache) != _sites_seen:
            grew = 0
            for entry in req.site_list or ():
                target = entry[2]
                grew += SITE_ENTRY_BYTES + (len(target) if type(target) is str else 0)
            size += grew
            _site_cache_bytes += grew
            if _site_cache_bytes > cache_limit:
                recorder.forget_sites()  # loses reuse only: requests hold their own entries
                _site_cache_bytes = 0
                stats["cache_resets"] += 1
            _sites_seen = len(_site_cache)
    if req.attrs is not None:
        size += 128 * len(req.attrs)
    if _queue_bytes + size > queue_limit:
        stats["dropped_memory"] += 1
        wake.set()
        on_full()
        return
    _queue_bytes += size
    _sizes.append(size)
    _queue.append(req)
    if len(_queue) == WAKE_AT:
        wake.set()


# enqueue's common case in C when the accelerator is there (agent/_speedups.c: the same reads and
# writes of this module's globals; the rest, drops and a grown site cache, goes to this one).
python_enqueue = enqueue
if recorder.speedups is not None and hasattr(recorder.speedups, "enqueue"):
    try:
        recorder.speedups.configure_queue(globals(), python_enqueue)
        enqueue = recorder.speedups.enqueue
    except Exception:
        recorder.internal_error()


def emit(rtype: bytes, build: Build) -> bool:
    """Queue one event record (a wire.EVENT_TYPES type); never blocks. ``build`` runs on the
    writer thread, so the caller hands over references and does no encoding. Returns False
    (and counts ``dropped_events``) when the agent is off or the queue is full."""
    size_cap = queue_size
    if size_cap is None:
        return False
    if len(_events) >= size_cap:
        stats["dropped_events"] += 1
        return False
    _events.append((rtype, build))
    return True


def queued() -> int:
    """Requests waiting for the writer."""
    return len(_queue)


def take(max_bytes: int) -> list[recorder.ActiveRequest]:
    """Pop queued requests up to ``max_bytes`` of estimated size (at least one). The writer
    (under its lock) is the only taker; the request path appends meanwhile."""
    global _queue_bytes
    n = len(_queue)
    if _queue_bytes <= max_bytes:
        # all the queue holds now, popped in C loops (what comes meanwhile stays queued);
        # enqueue appends a request's size before the request, so the first n sizes are theirs
        taken = list(starmap(_queue.popleft, repeat((), n)))
        total = sum(starmap(_sizes.popleft, repeat((), min(n, len(_sizes)))))
    else:
        taken = []
        total = 0
        while _queue and total < max_bytes:
            taken.append(_queue.popleft())
            total += _sizes.popleft() if _sizes else 0
    _queue_bytes = sum(_sizes) if len(_sizes) < 4096 else max(0, _queue_bytes - total)
    return taken


def take_events() -> list[tuple[bytes, Build]]:
    events = []
    while _events:
        events.append(_events.popleft())
    return events


def has_events() -> bool:
    return bool(_events)


def discard() -> int:
    """Empty the request queue (its requests will never be written): how many it held."""
    global _queue_bytes
    n = len(_queue)
    _queue.clear()
    _sizes.clear()
    _queue_bytes = 0
    return n


def forget_sites() -> None:
    """Empty the recorder's site cache (the writer's caches were cleared: its keys hold the
    same statements)."""
    global _site_cache_bytes
    recorder.forget_sites()
    _site_cache_bytes = 0


def after_fork_in_child() -> None:
    """A forked child starts with empty queues: what its parent queued is the parent's."""
    global wake
    discard()
    _events.clear()
    wake = Waker()
