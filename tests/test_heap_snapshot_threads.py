"""A heap snapshot (``perfsleuth heap PID``) must not break the application's other threads:
``gc.get_objects()`` lists every tracked object, a tuple another thread is still filling in
from a generator included, and while that list holds it the other thread's resize of the tuple
fails (``SystemError: bad argument to internal function``; before, at the first snapshot).
The snapshot walks from the modules and frames instead, which never reaches such a tuple."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from perfsleuth.agent import heap


def items(n: int) -> Iterator[int]:
    yield from range(n)


def test_a_snapshot_never_breaks_a_tuple_being_built_in_another_thread() -> None:
    errors: list[BaseException] = []
    stop = threading.Event()
    built = [0]

    def build() -> None:
        # tuple() of a generator starts small and resizes the tuple as items come
        while not stop.is_set():
            try:
                t = tuple(items(5000))
                assert len(t) == 5000
                built[0] += 1
            except BaseException as e:  # the failure under test
                errors.append(e)
                return

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        snaps = 0
        while snaps < 15 and not errors:
            snap = heap.snapshot(top=20)
            assert snap["objects"] > 1000 and snap["types"]
            snaps += 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, f"after {snaps} snapshots: {errors[0]!r}"
    assert built[0] > 0


class _Shared(list):  # type: ignore[type-arg]
    pass


class _Leaf:
    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        self.own = [shared, shared]


def test_each_object_is_counted_once_however_many_refer_to_it() -> None:
    """The walk marks what it has seen by address: an object referred to from many places is
    counted once, and every distinct one is counted."""
    shared = _Shared([1, 2, 3])
    leaves = [_Leaf(shared) for _ in range(3000)]
    again = [leaves, leaves, tuple(leaves)]
    types = {t["type"]: t for t in heap.snapshot(top=100_000)["types"]}
    mod = __name__
    assert types[f"{mod}._Shared"]["count"] == 1
    assert types[f"{mod}._Leaf"]["count"] == len(leaves)
    assert types["list"]["count"] >= len(leaves) + 2
    del again
