"""The cyclic garbage collector kept off the objects ingest makes.

A spool batch or an OTLP payload is made of hundreds of thousands of small objects (records
read and decoded, spans, the columns built from them), none in a cycle, all freed by reference
counting once the batch is committed. Left to the collector they were walked at every
collection while they lived, and, promoted to its oldest generation, they set off full
collections that walked the server's other objects too (spool ingest of 50k requests x 10
calls: 5 full collections, 0.36-0.38 of ~2.1 s CPU; OTLP over HTTP: ~8 % of the server's CPU,
benchmarks/README.md). So:

- :func:`paused` turns the collector off for a block that makes such objects (blocks of several
  threads overlap: the first one in turns it off, the last one out turns it on again if it was
  on) and, on the way out, moves what is alive out of its sight (``gc.freeze``, constant time:
  the collection a disabled collector owes would walk them all);
- :func:`thaw` gives the frozen objects back to it (``gc.unfreeze``) once their batches are
  committed: the spool ingest at the end of a run, the OTLP queue after each commit.

A freeze made by someone else first (a pre-fork freeze) is left alone: nothing is frozen here
while it stands, and :func:`thaw` never undoes it.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_inside = 0  # paused blocks in flight
_was_enabled = True  # the collector's state when the first of them began
_ours = False  # whatever is frozen was frozen here: thaw may undo it


@contextmanager
def paused() -> Iterator[None]:
    """The collector off in the block; what is alive at the end of the last overlapping
    block frozen until :func:`thaw`."""
    global _inside, _was_enabled, _ours
    with _lock:
        if _inside == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                if _ours or not gc.get_freeze_count():
                    gc.freeze()
                    _ours = True
                if _was_enabled:
                    gc.enable()


def thaw() -> None:
    """Give what :func:`paused` froze back to the collector (a block still in flight freezes
    what it made when it ends)."""
    global _ours
    with _lock:
        if _ours:
            gc.unfreeze()
            _ours = False
