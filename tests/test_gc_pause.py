"""store.gc_pause: the cyclic collector off while ingest makes a batch's objects, what is alive
after frozen out of its sight until the batch is committed, and a freeze made by someone else
left alone. Objects are checked one by one (the process's other threads free frozen objects
and move the counts meanwhile)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from perfsleuth.store import gc_pause


@pytest.fixture(autouse=True)
def _collector_as_it_was() -> Iterator[None]:
    gc_pause.thaw()
    gc.unfreeze()
    enabled = gc.isenabled()
    yield
    gc_pause.thaw()
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def frozen(obj: object) -> bool:
    """Whether the collector keeps ``obj`` out of its sight (tracked, in no generation)."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_what_a_pause_made_is_frozen_until_thawed() -> None:
    with gc_pause.paused():
        assert not gc.isenabled()
        made = [[i] for i in range(5_000)]  # tracked objects, alive after the block
    assert gc.isenabled()
    assert frozen(made[0]) and frozen(made[-1])
    gc_pause.thaw()
    assert not frozen(made[0]) and not frozen(made[-1])


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with gc_pause.paused():
        pass
    assert not gc.isenabled()


def test_a_freeze_made_by_someone_else_first_is_left_alone() -> None:
    """A pre-fork freeze (an app's, gunicorn's --preload): nothing joins it, thaw keeps it."""
    theirs = [[i] for i in range(100)]
    gc.freeze()
    assert frozen(theirs[0])
    with gc_pause.paused():
        mine = [[i] for i in range(1_000)]
    assert gc.isenabled()
    assert not frozen(mine[0])  # not frozen with theirs: it could never be undone alone
    gc_pause.thaw()
    assert frozen(theirs[0])
