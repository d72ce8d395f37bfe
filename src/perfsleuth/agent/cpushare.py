"""Which share of the requests gets its CPU time measured, when PERFSLEUTH_CPU_SAMPLE is
``auto`` (the default): every request while the process ends fewer than
PERFSLEUTH_CPU_SAMPLE_PER_S (200) a second, and above that a random share that adds up to about
that many a second.

Why a rate and not every request: a thread's CPU clock is a system call on Linux (thread
clocks have no vDSO), ~1 µs in a tight loop and ~4.5 µs inside a request on a virtual machine
whose caches the kernel entry cools; a WSGI request reads it about once, a FastAPI request
about four times (the loop's steps and the worker's run). At 200 measured requests a second
that is at most ~4 ms of CPU a second whatever the traffic, while a busy service's every
request would pay it. 200 a second is plenty for what reads ``cpu_ms`` (per-endpoint means,
``large_request_body``'s fit), and a quiet service, or a quiet endpoint's share of the traffic
below the rate, is measured whole.

The writer thread calls :func:`tick` after each drain (every PERFSLEUTH_FLUSH_SECONDS): once a
second it takes the rate of requests ended over the last second and sets the recorder's share
(recorder.set_cpu_sample: the trace id's low bits draw the requests, the same draw in C and in
Python). Nothing on the request path changes: begin() compares the draw with a threshold, as
with a fixed share.
"""

from __future__ import annotations

import time

from perfsleuth.agent import recorder

WINDOW_S = 1.0  # the rate is taken over at least this long

auto = False  # whether tick() sets the share (PERFSLEUTH_CPU_SAMPLE=auto)
per_s = 200.0  # requests a second measured, at most (about: a random share)
share = 1.0  # the share set last
_mark: tuple[float, int] | None = None  # (monotonic time, requests_recorded) at the window's start


def configure(*, automatic: bool, rate: float) -> None:
    """Start (``automatic``) or stop setting the share; ``rate``: requests a second to
    measure (0 or less: no limit, every request)."""
    global auto, per_s, share, _mark
    auto = automatic
    per_s = rate
    share = 1.0
    _mark = None
    if automatic:
        recorder.set_cpu_sample(1.0)


def share_for(requests_per_s: float, rate: float) -> float:
    """The share of requests to measure so that about ``rate`` a second are (all when fewer
    come, or when ``rate`` is 0 or less: no limit)."""
    if rate <= 0 or requests_per_s <= rate:
        return 1.0
    return rate / requests_per_s


def tick(now: float | None = None) -> None:
    """Set the share from the requests ended since the window began, once the window is a
    second long (called by the writer thread; never raises into it)."""
    global share, _mark
    if not auto:
        return
    try:
        now = time.monotonic() if now is None else now
        ended = recorder.stats["requests_recorded"]
        if _mark is None or ended < _mark[1]:
            _mark = (now, ended)
            return
        took = now - _mark[0]
        if took < WINDOW_S:
            return
        new = share_for((ended - _mark[1]) / took, per_s)
        _mark = (now, ended)
        # a new threshold only when the share moves by more than a tenth (or to or from 1)
        if new != share and (new == 1.0 or share == 1.0 or abs(new - share) > 0.1 * share):
            share = new
            recorder.set_cpu_sample(new)
    except Exception:
        recorder.internal_error()
