"""The writer side of the agent: finished requests and evidence go from a bounded queue to
spool segments on one background thread. :mod:`perfsleuth.agent.shipper` starts and stops it.

- ``queue``: the bounded queues (requests under a memory budget in bytes, evidence records)
  and what the request path does: ``enqueue``, ``emit``; nothing else runs there.
- ``encode``: requests -> wire records (``encode_requests``: the agent's encoder, which tests
  use to write spools the way the agent does); ``columns``: a batch's REQUESTS record;
  ``targets``: what a call's statement, URL or command is written as (its fingerprint).
- ``segment``: the open segment file of this process.
- ``writer``: the writer thread: drains the queues in bounded slices, writes, rotates, backs
  off after write errors.
- ``status``: the counters in ``DATA/agents/<host>-<pid>.json`` and the drop report at exit.
- ``forward``: with PERFSLEUTH_COLLECTOR, ships the spool to a ``perfsleuth server``.
"""

from __future__ import annotations

from perfsleuth.agent.recorder import stats
from perfsleuth.wire.counters import WRITER

for _name in WRITER:
    stats.setdefault(_name, 0)
