"""The open segment file of this process: ``DATA/spool/<host>-<pid>-<ns>-<seq>.open``, renamed
to ``.seg`` when complete (wire.segment has the byte layout).

Durability (``PERFSLEUTH_FSYNC``): ``rotate`` (default) fsyncs a segment when it is closed,
so an application crash loses nothing already written (the OS has it) and a machine crash
loses at most the open segment; ``always`` fsyncs after every batch (the writer does);
``never`` leaves it to the OS.
"""

from __future__ import annotations

import os
import socket
import time

from perfsleuth.agent import accel
from perfsleuth.agent.config import Config
from perfsleuth.agent.recorder import stats
from perfsleuth.agent.spool.encode import Interned
from perfsleuth.agent.spool.status import HOST, unlink
from perfsleuth.wire import CLOSED_SUFFIX, FORMAT_VERSION, HEADER, OPEN_SUFFIX
from perfsleuth.wire.segment import FILE_MAGIC, encode_record, segment_base

# os.write and os.stat's (st_dev, st_ino), the interpreter lock taken back as the agent's
# threads do (agent/_speedups.c, "agent threads and the GIL")
_write = accel.pick("write", os.write)


def _file_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


file_id = accel.pick("file_id", _file_id)

AGENT_VERSION = "0.1.0"


class Segment(Interned):
    """The open segment file and what has been interned in it."""

    def __init__(self, cfg: Config, seq: int) -> None:
        super().__init__()
        self.cfg = cfg
        name = segment_base(HOST, os.getpid(), time.time_ns(), seq)
        self.base = os.path.join(cfg.spool_dir, name)
        self.path = self.base + OPEN_SUFFIX
        self.opened = time.monotonic()
        self.size = 0
        self.partial = 0
        os.makedirs(cfg.spool_dir, exist_ok=True)
        self.fh = open(self.path, "ab", buffering=0)  # noqa: SIM115 - lives across batches
        st = os.fstat(self.fh.fileno())
        self.file_id = (st.st_dev, st.st_ino)
        self.requests = 0  # written into this file: lost with it if it is deleted
        self.events = 0
        header = {
            "v": FORMAT_VERSION,
            "host": cfg.host or socket.gethostname(),
            "pid": os.getpid(),
            "service": cfg.service,
            "version": cfg.version,
            "agent": AGENT_VERSION,
            "started_ns": time.time_ns(),
        }
        try:
            self.write(FILE_MAGIC + encode_record(HEADER, header))
        except OSError:  # a full disk: no empty segment left behind by each retry
            self.fh.close()
            unlink(self.path)
            raise
        self.header_size = self.size

    def write(self, data: bytes) -> None:
        """Write all of ``data``; on failure ``self.partial`` says how much did land."""
        view = memoryview(data)
        self.partial = 0
        while view:
            n = _write(self.fh.fileno(), view)
            if not n:
                raise OSError("short write")
            view = view[n:]
            self.partial += n
            self.size += n

    def gone(self) -> bool:
        """Whether the file was deleted under us (its spool directory removed, say): what is
        written to it then lands nowhere."""
        try:
            return file_id(self.path) != self.file_id
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:
            return False

    def due(self) -> bool:
        return (
            self.size >= self.cfg.segment_bytes
            or time.monotonic() - self.opened >= self.cfg.segment_seconds
        )

    def close(self, *, complete: bool = True) -> None:
        try:
            if self.cfg.fsync != "never":
                os.fsync(self.fh.fileno())
        finally:
            self.fh.close()
            if complete and self.size <= self.header_size:
                unlink(self.path)  # a header and nothing else: nothing to read
            elif complete:
                os.replace(self.path, self.base + CLOSED_SUFFIX)
                stats["segments_written"] += 1
