"""store.gc_pause: the cyclic collector off while ingest makes a batch's objects, what is alive
after frozen out of its sight until the batch is committed, and a freeze made by someone else
left alone."""

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


def test_what_a_pause_made_is_frozen_until_thawed_and_no_collection_walks_it() -> None:
    assert gc.get_freeze_count() == 0
    with gc_pause.paused():
        assert not gc.isenabled()
        made = [[i] for i in range(5_000)]  # tracked objects, alive after the block
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    # no collection owed: the first allocation after the block does not walk them
    assert gc.get_count()[0] < 100
    gc_pause.thaw()
    assert gc.get_freeze_count() == 0
    assert all(gc.is_tracked(m) for m in made[:10])


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with gc_pause.paused():
        pass
    assert not gc.isenabled()


def test_a_freeze_made_by_someone_else_first_is_left_alone() -> None:
    """A pre-fork freeze (an app's, gunicorn's --preload): nothing joins it, thaw keeps it."""
    theirs = [[i] for i in range(100)]
    gc.freeze()
    frozen = gc.get_freeze_count()
    assert frozen >= len(theirs)
    with gc_pause.paused():
        mine = [[i] for i in range(1_000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen  # not frozen with theirs: never undone alone
    gc_pause.thaw()
    assert gc.get_freeze_count() == frozen
    del mine
