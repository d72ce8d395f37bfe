"""A stack sample's state from its thread's scheduler counters, and the run-queue hand-back.

``classify`` names what a thread did over an interval (agent.sampler reads the counters). The
kernel adds a run-queue wait to a thread's counters only when the wait ends (the thread gets a
CPU): a thread queued across whole ticks shows no change over them, as a blocked one does, and
then more run-queue time than the interval had room for. ``HandBack`` keeps, per thread, its
latest consecutive intervals classed ``wait`` or ``gil`` (up to ``MAX_RESTATE``), each with the
sample taken of it if one was; a surplus goes back to them, latest first, as far as it reaches,
and their samples are restated (else a request thread computing at a low priority on a crowded
CPU reads 'wait' in nearly every sample). An interval with no sample (inside a recorded call,
a request that moved, at the sample limit) takes its share all the same.
"""

from __future__ import annotations

from typing import Any

# Intervals a thread keeps ready to be restated once its counters show the run-queue wait they
# spent (a second at the default 20 ms tick).
MAX_RESTATE = 50

CPU, STARVED, GIL, WAIT, CALL = "cpu", "starved", "gil", "wait", "call"

# (wall, CPU, run-queue, slices or None, the process's other threads' CPU) ns
Interval = tuple[int, int, int, int | None, int]
# (the sample's owner (its ``samples`` list is the one it was taken into while unshipped), that
# list, the sample's index, the interval); (None, None, -1, interval) while no sample was taken
_Entry = tuple[Any, list[Any] | None, int, Interval]


def classify(wall: int, cpu: int, queue: int, slices: int | None, others_cpu: int) -> str:
    """The state of a thread over ``wall`` ns in which it ran ``cpu`` ns, waited ``queue`` ns
    in the run queue and was scheduled ``slices`` times (None: no scheduler counters), while
    the process's other threads ran ``others_cpu`` ns."""
    if (cpu + queue) * 2 >= wall:
        return CPU if cpu >= queue else STARVED
    # A thread waiting for the GIL sleeps on a condition with a 5 ms timeout (the switch
    # interval) and wakes over and over; one blocked in I/O or a lock stays asleep.
    if slices is not None and slices >= 2 and others_cpu * 4 >= wall:
        return GIL
    return WAIT


class HandBack:
    """Per thread ident, its chain of intervals that may yet turn out starved."""

    def __init__(self) -> None:
        self.chains: dict[int, list[_Entry]] = {}

    def __bool__(self) -> bool:
        return bool(self.chains)

    def waited(self, ident: int, interval: Interval) -> None:
        """The thread's interval of this tick read 'wait' or 'gil' from its counters."""
        chain = self.chains.setdefault(ident, [])
        chain.append((None, None, -1, interval))
        if len(chain) > MAX_RESTATE:
            del chain[0]

    def sampled(self, ident: int, owner: Any, index: int) -> None:
        """A sample was taken of the thread's interval of this tick (``owner.samples[index]``)."""
        chain = self.chains.get(ident)
        if chain and chain[-1][0] is None:
            chain[-1] = (owner, owner.samples, index, chain[-1][3])

    def restate(self, ident: int, queued: int) -> None:
        """``queued`` ns of run-queue wait the thread's counters took in at this look that
        began before the last: its latest intervals classed 'wait' or 'gil' spent the part of
        them the counters left unexplained, the latest first; their samples say so."""
        for owner, samples, i, interval in reversed(self.chains.pop(ident, ())):
            wall, cpu, queue, slices, others = interval
            given = min(max(0, wall - cpu - queue), queued)
            queued -= given
            if given and owner is not None and samples is not None and owner.samples is samples:
                # a sample, not shipped yet
                offset, _, flat = samples[i]
                samples[i] = (offset, classify(wall, cpu, queue + given, slices, others), flat)
            if queued <= 0:
                break

    def broken(self, ident: int) -> None:
        """The thread's chain of ticks broke (it read something else, or was not read)."""
        self.chains.pop(ident, None)

    def keep(self, idents: Any) -> None:
        """Forget the chains of threads not in ``idents``."""
        for ident in [i for i in self.chains if i not in idents]:
            del self.chains[ident]
