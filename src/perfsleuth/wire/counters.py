"""The names of the counters an agent keeps about its own data (stdlib only).

Every agent process writes them to its status file (``DATA/agents/<host>-<pid>.json``); the
store sums them over processes for ``perfsleuth top`` (a name no process reported counts 0).
They live here, below both, so that the agent and the store read one list.
"""

from __future__ import annotations

# Counted on the request path (agent.recorder).
RECORDER = ("requests_recorded", "calls_dropped", "internal_errors")

# Counted by the writer (agent.spool). ``dropped_*`` are requests (``dropped_events``: evidence
# records) recorded but never written, by reason.
WRITER = (
    "requests_written",
    "dropped_queue_full",
    "dropped_write_error",
    "dropped_spool_full",
    "dropped_writer_dead",
    "write_errors",
    "writer_restarts",
    "segments_written",
    "events_written",
    "dropped_events",
    "dropped_memory",
    "dropped_shutdown",
    "dropped_spool_deleted",
    "fingerprints_skipped",
    "cache_resets",
)

# Counted by the forwarder (agent.spool.forward, with PERFSLEUTH_COLLECTOR): what it sent, its
# errors, and what it dropped (``dropped_*``: requests; ``forward_*_segments``: segments).
FORWARD = (
    "forward_bytes_sent",
    "forward_segments_sent",
    "forward_errors",
    "forward_auth_errors",
    "forward_dropped_segments",
    "forward_rejected_segments",
    "dropped_spool_cap",
    "dropped_forward_rejected",
)

AGENT = RECORDER + WRITER + FORWARD
