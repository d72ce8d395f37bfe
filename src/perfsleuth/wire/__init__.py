"""The record format shared by the agent, the collector and the store (stdlib only; the
server's :mod:`perfsleuth.wire.inflate` takes ISA-L when it is installed).

A spool *segment* is one file written by one process: a file header followed by records.
See :mod:`perfsleuth.wire.segment` for the byte layout and :mod:`perfsleuth.wire.fingerprint`
for the normalisation that turns a SQL statement or URL into a fingerprint.
"""

FORMAT_VERSION = 1  # the file layout (wire.segment); a record type never changes meaning

# Record types (one ASCII byte each).
HEADER = b"H"  # {"v", "host", "pid", "service", "version", "agent", "started_ns", "argv0"}
LOCATION = b"L"  # {"id", "file", "line", "func", "app"}: one interned code location
STACK = b"S"  # {"id", "frames": [location ids, outermost first]}
FINGERPRINT = b"F"  # {"id", "kind", "text", "op"}: a normalised statement / URL / command
REQUESTS = b"N"  # a batch of finished requests as columns, calls as agent rows (wire.batch)
STATS = b"T"  # cumulative agent counters of this process (drops, errors)
# Runtime evidence, one JSON object per event (collected by the store as ``Batch.events``):
SAMPLES = b"P"  # stack samples of one slow request
BLOCKER = b"B"  # one event-loop blocker
GC = b"G"  # GC pauses
CAPTURE = b"C"  # a replayable request capture

EVENT_TYPES = frozenset({SAMPLES, BLOCKER, GC, CAPTURE})
RECORD_TYPES = frozenset({HEADER, LOCATION, STACK, FINGERPRINT, REQUESTS, STATS}) | EVENT_TYPES
# R and Q, the one-request records of the agent before REQUESTS, are not read (no release wrote
# them: perfsleuth is at 0.1.0, unreleased) and not to be reused: a segment holding them is
# damage ("unknown record type").

# Segment file names: "<host>-<pid>-<started_ns>-<seq>" + OPEN_SUFFIX while written,
# renamed to + CLOSED_SUFFIX once complete (rename is atomic on POSIX).
OPEN_SUFFIX = ".open"
CLOSED_SUFFIX = ".seg"
