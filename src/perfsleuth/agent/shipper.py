"""The writer side of the agent, as the rest of the agent sees it: start, flush, shutdown.

Finished requests go to a bounded queue (``enqueue``, agent.spool.queue) and evidence records
through ``emit``; one background thread per process writes them to spool segments
(agent.spool.writer). This module starts it, flushes it at exit (atexit, SIGTERM where the app
left it at its default, multiprocessing's children) and gives a forked child (gunicorn workers,
multiprocessing) a writer of its own.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any

from perfsleuth.agent import cpushare, recorder
from perfsleuth.agent.config import Config
from perfsleuth.agent.frameworks import common as frameworks_common
from perfsleuth.agent.recorder import stats
from perfsleuth.agent.spool import queue, status, writer
from perfsleuth.agent.spool.queue import Intern, emit, enqueue

__all__ = [
    "Intern",
    "call_text",
    "config",
    "emit",
    "enqueue",
    "flush",
    "hook_multiprocessing",
    "shutdown",
    "start",
    "stats",
]

_cfg: Config | None = None


def call_text(kind: str, target: Any) -> str:
    """The fingerprint text of a call (normalised SQL, URL template, cache command)."""
    from perfsleuth.agent.spool.targets import call_text as text

    return text(kind, target)


def __getattr__(name: str) -> Any:
    if name == "BATCH_MAX":  # the encoder is imported when first used, not at start
        from perfsleuth.agent.spool.encode import BATCH_MAX

        return BATCH_MAX
    raise AttributeError(name)


def config() -> Config | None:
    """The running agent's config (None before start)."""
    return _cfg


def start(cfg: Config) -> None:
    global _cfg
    _cfg = cfg
    queue.configure(cfg)
    recorder.configure(
        enqueue,
        max_calls=cfg.max_calls,
        stacks_per_site=cfg.stacks_per_site,
        cpu_sample=1.0 if cfg.cpu_sample is None else cfg.cpu_sample,
    )
    # PERFSLEUTH_CPU_SAMPLE=auto: the writer thread moves the share with the traffic
    cpushare.configure(automatic=cfg.cpu_sample is None, rate=cfg.cpu_sample_per_s)
    frameworks_common.configure(cfg)
    from perfsleuth.agent import capture

    capture.configure(cfg, emit)
    writer.start(cfg)
    if cfg.collector:  # store and forward to a perfsleuth server
        from perfsleuth.agent.spool import forward

        forward.start(cfg)
    _install_sigterm()
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:  # else when it is imported (instrument.registry)
        hook_multiprocessing(mp_util)


def hook_multiprocessing(mp_util: Any) -> None:
    """Make multiprocessing's children flush at exit (see _MultiprocessingHook); called with
    ``multiprocessing.util`` when it is imported, so the agent's start does not import it."""
    try:
        mp_util.register_after_fork(_mp_hook, _MultiprocessingHook.after_fork)
    except Exception:
        recorder.internal_error()


def flush(timeout: float = 5.0) -> None:
    """Write everything queued now (called at exit; also handy in tests and benchmarks)."""
    w = writer.writer
    if w is None or _cfg is None:
        return
    if writer.dead():
        # Writer died (bug or injected fault): do not run its code on the caller's thread;
        # account for what it will never write and leave a status file behind.
        stats["dropped_writer_dead"] += queue.discard()
        writer.write_status()
        return
    lock = writer.lock
    if not lock.acquire(timeout=timeout):
        return
    try:
        w.drain()
        if w.seg is not None and _cfg.fsync == "always":
            os.fsync(w.seg.fh.fileno())
        writer.write_status()
    except Exception:
        recorder.internal_error()
    finally:
        lock.release()


def shutdown() -> None:
    """Flush and close the open segment (renamed to .seg), then say on stderr how many
    requests could not be written, if any. Registered with atexit."""
    w, cfg = writer.writer, _cfg
    if w is None or cfg is None:
        return
    flush()
    lock = writer.lock
    if lock.acquire(timeout=5.0):
        try:
            # still queued: could not be written in time
            stats["dropped_shutdown"] += queue.discard()
            w.close()
            writer.writer = None  # once: atexit after a SIGTERM flush has nothing left to do
        except Exception:
            recorder.internal_error()
        finally:
            lock.release()
    else:
        stats["dropped_shutdown"] += queue.queued()
        status.write(cfg, queued=queue.queued(), writer_dead=writer.dead())
    forward = sys.modules.get("perfsleuth.agent.spool.forward")
    if forward is not None:  # ship the segment just closed, bounded
        forward.at_exit()
    status.report_drops()


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM in a process that left it at its default: write what is queued, then die of
    it as the default would have (atexit does not run on a signal death)."""
    try:
        evidence = sys.modules.get("perfsleuth.agent.evidence")
        if evidence is not None:
            evidence.flush()
        shutdown()
    except Exception:
        recorder.internal_error()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    """Flush on SIGTERM where the application has no handler of its own (Django's runserver,
    a plain script); one installed later replaces this one, as it should."""
    try:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError, AttributeError):
        pass


def _after_fork_in_child() -> None:
    """A forked worker (gunicorn, multiprocessing) gets its own queue, segment and thread.

    Requests queued in the parent at fork time are the parent's to write: drop our copy.
    """
    queue.after_fork_in_child()
    for k in stats:
        stats[k] = 0
    if _cfg is not None:
        writer.start(_cfg)


class _MultiprocessingHook:
    """multiprocessing children leave through os._exit, which skips atexit. They run
    multiprocessing's finalizers first, but clear the inherited ones after fork: so register a
    finalizer from multiprocessing's own after-fork hook (this object must stay alive)."""

    @staticmethod
    def after_fork(_: object) -> None:
        try:
            import multiprocessing.util

            multiprocessing.util.Finalize(None, shutdown, exitpriority=100)
        except Exception:
            recorder.internal_error()


_mp_hook = _MultiprocessingHook()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)
