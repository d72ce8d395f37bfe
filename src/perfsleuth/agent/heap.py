"""Heap histograms on demand, without extra OS permissions (``perfsleuth heap PID``).

The agent installs a SIGUSR2 handler when the application has none (a handler of its own, or
SIG_IGN, is left alone) and then writes ``DATA/agents/heap-PID.ready`` to say that this
process answers. The handler only writes a byte to a pipe (async-signal-safe, whatever the
interrupted thread held); a daemon thread reading the pipe takes the snapshot: a full
collection, then every object the garbage collector tracks (instances, containers; not ints
or strings) reachable from the modules and the threads' frames, counted by type with its
shallow size (``sys.getsizeof``), written to ``DATA/heap/heap-PID-TIMESTAMP.json``. Two
snapshots diffed show what grows.

gunicorn resets SIGUSR2 in its workers (installed again right after) and takes it in its
master (the marker is then removed, so the CLI never signals a master into re-executing).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import types
from types import ModuleType
from typing import Any

TOP = 500  # types per snapshot (by shallow bytes, then by count)
CHECK_SECONDS = 5.0  # how often the reader thread checks that SIGUSR2 is still the agent's

_cfg: Any = None
_pipe: tuple[int, int] | None = None
_pid = 0


def marker_path(data_dir: str, pid: int) -> str:
    return os.path.join(data_dir, "agents", f"heap-{pid}.ready")


_marker = marker_path


def process_started(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat's 22nd field):
    with the PID it names one process, where a PID alone may have been reused. None when
    unknown (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        # the command name (field 2) is in parentheses and may hold spaces or ")"
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _on_signal(signum: int, frame: Any) -> None:
    pipe = _pipe
    if pipe is not None:
        with contextlib.suppress(OSError):
            os.write(pipe[1], b"h")


def install(cfg: Any) -> bool:
    """Take SIGUSR2 if the application has no handler for it (main thread only)."""
    global _cfg
    _cfg = cfg
    try:
        if (
            not getattr(cfg, "heap", True)
            or threading.current_thread() is not threading.main_thread()
        ):
            return False
        current = signal.getsignal(signal.SIGUSR2)
        if current is not _on_signal and current not in (signal.SIG_DFL, None):
            check()
            return False
        _start_reader()
        signal.signal(signal.SIGUSR2, _on_signal)
        os.makedirs(os.path.join(cfg.data_dir, "agents"), exist_ok=True)
        with open(_marker(cfg.data_dir, os.getpid()), "w") as fh:
            pid = os.getpid()
            json.dump(
                {
                    "pid": pid,
                    "started": process_started(pid),
                    "signal": "SIGUSR2",
                    "service": cfg.service,
                },
                fh,
            )
        return True
    except Exception:
        return False


def check() -> None:
    """Remove this process's marker when SIGUSR2 is no longer ours (the app took it)."""
    cfg = _cfg
    if cfg is None:
        return
    try:
        if signal.getsignal(signal.SIGUSR2) is not _on_signal:
            with contextlib.suppress(FileNotFoundError):
                os.remove(_marker(cfg.data_dir, os.getpid()))
    except Exception:
        pass


def _start_reader() -> None:
    global _pipe, _pid
    if _pipe is not None and _pid == os.getpid():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)  # a flood of signals must never block the handler
    _pipe, _pid = (r, w), os.getpid()
    threading.Thread(target=_read, args=(r,), name="perfsleuth-heap", daemon=True).start()


def _read(fd: int) -> None:
    while True:
        try:
            ready, _, _ = select.select([fd], [], [], CHECK_SECONDS)
            if not ready:
                # An application that takes SIGUSR2 after the agent started: drop the marker,
                # so that `perfsleuth heap` never sends the signal to its handler.
                if _cfg is not None and signal.getsignal(signal.SIGUSR2) is not _on_signal:
                    check()
                    _stop_reader(fd)
                    return
                continue
            if not os.read(fd, 64):
                return
            write_snapshot()
        except Exception:
            time.sleep(1.0)  # never spin on a broken pipe


def _stop_reader(fd: int) -> None:
    global _pipe
    pipe = _pipe
    if pipe is not None and pipe[0] == fd:
        _pipe = None  # a later install() starts a new reader
        for end in pipe:
            with contextlib.suppress(OSError):
                os.close(end)


def _roots() -> list[Any]:
    """Where the walk starts: every module, and every thread's frames with their locals (a
    running frame's object does not show its locals to ``gc.get_referents``)."""
    roots: list[Any] = []
    for frame in sys._current_frames().values():
        f: Any = frame
        while f is not None:
            roots.append(f)
            # not the walk's own locals: it would count what it found twice over
            if f.f_code not in _OWN_CODE:
                with contextlib.suppress(Exception):
                    roots.extend(f.f_locals.values())
            f = f.f_back
    # the modules last: walked first (the walk pops), the locals then add what only they hold
    roots.append(sys.modules)
    roots.extend(list(sys.modules.values()))
    return roots


def snapshot(top: int = TOP) -> dict[str, Any]:
    """Live objects by type: count and shallow bytes, largest first.

    The objects are those the garbage collector tracks (instances, containers; not ints or
    strings) that can be reached from the modules and the threads' frames, found by walking
    ``gc.get_referents``. Not ``gc.get_objects()``: its list holds a reference to every tracked
    object, a tuple another thread is still filling in (``tuple(generator)``) included, and
    that thread's resize of the tuple then fails with SystemError in application code. Such a
    tuple is referenced by the C code building it only: no walk reaches it. (Objects only C
    code holds, such as the descriptors of built-in types, are not counted either.) Sizes come
    from ``__sizeof__`` where it is built in; one written in Python is not run (it could do
    anything), the object's base size stands instead."""
    gc.collect()
    is_tracked = gc.is_tracked
    referents = gc.get_referents
    # Which objects were seen: a bit per 16 bytes of address (a tracked object and the
    # collector's header before it take more than that, so no two live ones share a bit), a
    # bytearray per MiB of address space used. A set of ids costs some 75 bytes per object.
    seen: dict[int, bytearray] = {}
    # the objects found, by type: they stay alive (and their addresses theirs) while the walk
    # holds them, and each type's count and bytes are then taken in C (len, sum of map)
    found: dict[type, list[Any]] = {}
    # Only tracked objects are pushed (untracked ones, ints and strings mostly, are most of the
    # edges and are not counted): filter() drops them in C, without a turn of this loop each.
    stack = list(filter(is_tracked, _roots()))
    while stack:
        o = stack.pop()
        i = id(o)
        bits = seen.get(i >> 20)
        if bits is None:
            bits = seen[i >> 20] = bytearray(8192)
        byte = (i >> 7) & 8191
        bit = 1 << ((i >> 4) & 7)
        if bits[byte] & bit:
            continue
        bits[byte] |= bit
        t = type(o)
        objs = found.get(t)
        if objs is None:
            objs = found[t] = []
        objs.append(o)
        stack.extend(filter(is_tracked, referents(o)))
    del stack, seen
    counts = {t: len(objs) for t, objs in found.items()}
    sizes = {t: _bytes(t, objs) for t, objs in found.items()}
    del found
    rows = [(_name(t), n, sizes.get(t, 0)) for t, n in counts.items()]
    by_bytes = sorted(rows, key=lambda r: (-r[2], -r[1], r[0]))[:top]
    by_count = sorted(rows, key=lambda r: (-r[1], r[0]))[:top]
    kept = {r[0]: {"type": r[0], "count": r[1], "bytes": r[2]} for r in by_bytes + by_count}
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "service": getattr(_cfg, "service", ""),
        "ts": time.time_ns(),
        "objects": sum(counts.values()),
        "bytes": sum(sizes.values()),
        "types": sorted(kept.values(), key=lambda r: (-int(r["bytes"]), -int(r["count"]))),
        "note": "objects tracked by the garbage collector; shallow sizes (sys.getsizeof)",
    }


def _bytes(t: type, objs: list[Any]) -> int:
    """The shallow bytes of ``objs``, all of type ``t``: ``sys.getsizeof`` where ``__sizeof__``
    is built in, else the base size (a ``__sizeof__`` written in Python is not run)."""
    native = not isinstance(getattr(t, "__sizeof__", None), types.FunctionType)
    size = sys.getsizeof if native else object.__sizeof__
    try:
        return sum(map(size, objs))
    except Exception:
        total = 0
        for o in objs:
            with contextlib.suppress(Exception):
                total += size(o)
        return total


_OWN_CODE = frozenset({_roots.__code__, snapshot.__code__})


def _name(t: type) -> str:
    mod = getattr(t, "__module__", None)
    qual = getattr(t, "__qualname__", None) or t.__name__
    return qual if mod in (None, "builtins") else f"{mod}.{qual}"


def write_snapshot() -> str | None:
    cfg = _cfg
    if cfg is None:
        return None
    snap = snapshot()
    folder = os.path.join(cfg.data_dir, "heap")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"heap-{snap['pid']}-{snap['ts']}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(snap, fh)
    os.replace(tmp, path)  # the CLI waits for the final name only
    return path


def _after_fork_in_child() -> None:
    global _pipe
    _pipe = None  # the parent's pipe and reader thread are the parent's
    cfg = _cfg
    if cfg is not None and signal.getsignal(signal.SIGUSR2) is _on_signal:
        install(cfg)


def _at_exit() -> None:
    cfg = _cfg
    if cfg is not None and _pid == os.getpid():
        with contextlib.suppress(Exception):
            os.remove(_marker(cfg.data_dir, os.getpid()))


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)


# --------------------------------------------------------------------------------- gunicorn


def patch_gunicorn_worker(module: ModuleType) -> None:
    """Workers reset every signal gunicorn knows (SIGUSR2 included): take it again after."""
    _after(getattr(module, "Worker", None), lambda: install(_cfg) if _cfg is not None else None)


def patch_gunicorn_arbiter(module: ModuleType) -> None:
    """The master uses SIGUSR2 to re-execute itself: drop the marker once it took it."""
    _after(getattr(module, "Arbiter", None), check)


def _after(cls: Any, hook: Any) -> None:
    original = getattr(cls, "init_signals", None)
    if original is None or getattr(original, "_perfsleuth_original", None) is not None:
        return

    @functools.wraps(original)
    def init_signals(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            hook()
        return result

    init_signals._perfsleuth_original = original  # type: ignore[attr-defined]
    cls.init_signals = init_signals
