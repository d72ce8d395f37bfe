"""Stack samples of slow requests, taken from the evidence thread (FusionReactor-style).

Once a request has been in flight for ``sample_after_ms``, each tick takes one sample of where
its code is (the tick before it gets there reads its thread, so that the first sample is taken
at the mark: agent.evidence wakes for it, from the requests' start times):

- a sync request (WSGI, or a sync endpoint running in a thread pool: ``req.worker``): the
  stack of its thread;
- an async request whose task (or a task it started: a middleware's ``call_next`` runs the
  endpoint in a child task) is running on the loop right now: the loop thread's stack;
- an async request that is awaiting: the await chain (``cr_await``) of its task, outermost
  first, or, when it started tasks of its own, of the one it is waiting for: samples parked at
  ``await call_next(request)`` point at what runs below it, not at the await.

Each sample has a state, from the sampled thread's scheduler counters since the previous tick
(``/proc/self/task/<tid>/schedstat``: time on the CPU, time runnable in the run queue, times
scheduled), over the time between the two reads (a tick can stall before it reads: the
evidence thread waiting for a CPU or for the interpreter lock):

- ``cpu``: runnable at least half the time, more of it on the CPU than in the run queue;
- ``starved``: runnable at least half the time, more of it waiting for a CPU (a machine with
  more busy threads than cores, or a cgroup CPU quota: throttled time counts as run-queue
  wait): the code is CPU-bound all the same;
- ``gil``: mostly neither, but woken repeatedly while other threads of the process used the
  CPU: waiting for the interpreter lock another thread holds;
- ``wait``: blocked (I/O, a lock, a sleep), and every sample of an awaiting task;
- ``call``: inside a recorded DB / HTTP / cache call (the call's own timing explains it).

A state is about the interval since the previous tick, a stack about this moment: a request
that changed places in between (its sync code went to a thread-pool worker, or came back from
one to await the response's sending) gets no sample at that tick, as the interval was spent
partly elsewhere (the evidence thread often takes the interpreter lock the moment a worker
lets it go, before the loop resumes the request: about one request in three of a sync
endpoint would otherwise end on a 'wait' sample).

Run-queue wait the kernel adds to a thread's counters only once it ends goes back to the
intervals it was spent in (agent.handback, with ``classify``). The process's CPU time
('others', for ``gil``) is read next to the threads' counters, at the tick's first read.

Without schedstat (not Linux) the thread's CPU clock alone decides ``cpu`` or ``wait``.
Schedstat is read for each thread serving a request in flight: every tick for the threads of
sampled requests, every ``LOOK_EVERY_NS`` for the others (one ``pread`` a thread); a thread's
file is open while it serves a request in flight (and for a few idle threads). Those
threads' run and run-queue times, and the cgroup's CPU throttling (``cpu.stat``), are shipped
as STATS counters about once a second while they change (analysis.detectors.cpu_starved reads
them).

Samples are kept per request up to ``samples_per_request`` (more are counted in
``samples_dropped``) and shipped as one SAMPLES record when the request ends, or in chunks
while a very long request is still running, so a request stuck for minutes is visible before
it finishes.

It is one module because the sampling thread, the stack and await-chain walks and the
scheduler and cgroup counters that classify a sample all serve its tick (the watchdog
reuses only ``frames_flat``).
"""

from __future__ import annotations

import contextvars
import gc
import os
import sys
import threading
import time
import weakref
from types import FrameType
from typing import Any

from perfsleuth.agent import accel, recorder, shipper, stacks
from perfsleuth.agent.config import Config
from perfsleuth.agent.handback import CALL, CPU, GIL, WAIT, HandBack, classify
from perfsleuth.agent.handback import STARVED as STARVED
from perfsleuth.wire import SAMPLES, STATS

_perf = time.perf_counter_ns
CHUNK = 100  # samples per record while a request is still in flight
MAX_TRACKED = 64  # requests sampled at once; more slow requests in flight are skipped
FIGURES_EVERY_NS = 1_000_000_000  # process figures (STATS) at most this often
# Threads serving requests that are not being sampled: their scheduler counters this often (a
# pread each; sampled threads are read every tick).
LOOK_EVERY_NS = 100_000_000
# Threads whose scheduler counters (a small tuple each) are kept between their requests; a
# schedstat file is kept open while its thread serves a request in flight, and for up to
# MAX_IDLE_FILES idle threads (the latest opened): a pool's threads take turns at requests, and
# an open, read and close at each look cost 3-4 times the read alone.
MAX_BASELINES = 128
MAX_IDLE_FILES = 8
# A loop's tasks are listed (to find the tasks each awaiting request started) at most every
# LIST_EVERY_NS, or LIST_NS_PER_TASK per task when there are many (a listing costs about 1 us a
# task: at most 1 % of a core), and not at all past MAX_TASKS_LISTED (one listing holds the GIL).
LIST_EVERY_NS = 50_000_000
LIST_NS_PER_TASK = 100_000
MAX_TASKS_LISTED = 2000

recorder.stats.update({"samples_taken": 0, "samples_dropped": 0})


def _running_tasks() -> dict[Any, Any] | None:
    """asyncio's table of each loop's running task (the Python one; None where it is C's).
    Read only once a request has a task, so asyncio is imported by then: a WSGI app's agent
    never imports it."""
    aio = sys.modules.get("asyncio")
    table = getattr(getattr(aio, "tasks", None), "_current_tasks", None)
    return table if type(table) is dict else None


def frames_flat(frame: FrameType | None, limit: int = stacks.MAX_DEPTH) -> tuple[Any, ...]:
    """(code, line, ...) innermost first, skipping the agent's own frames anywhere (its ASGI
    and WSGI wrappers sit in the middle of a request's stack)."""
    out: list[Any] = []
    f = frame
    classify_code = stacks.classify
    while f is not None and len(out) < 2 * limit:
        code = f.f_code
        if classify_code(code) is not None:
            out.append(code)
            out.append(f.f_lineno)
        f = f.f_back
    return tuple(out)


def _chain(task: Any) -> list[FrameType]:
    """The frames of a task's await chain, outermost first."""
    chain: list[FrameType] = []
    coro = task.get_coro()
    for _ in range(stacks.MAX_DEPTH):
        if coro is None:
            break
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        chain.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain


def coroutine_flat(task: Any) -> tuple[Any, ...]:
    """The await chain of an asyncio task, as frames_flat would give it (innermost first)."""
    out: list[Any] = []
    for frame in reversed(_chain(task)):
        if stacks.classify(frame.f_code) is not None:
            out.append(frame.f_code)
            out.append(frame.f_lineno)
    return tuple(out)


def _app_frames(flat: tuple[Any, ...]) -> int:
    return sum(1 for code in flat[::2] if stacks.classify(code))


def _task_frame(task: Any) -> FrameType | None:
    try:
        coro = task.get_coro()
        return getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
    except Exception:
        return None


def _on_stack(frame: FrameType | None, target: FrameType) -> bool:
    f = frame
    while f is not None:
        if f is target:
            return True
        f = f.f_back
    return False


def task_context(task: Any) -> contextvars.Context | None:
    """The context a task's steps run in (only a reference: safe from another thread)."""
    get_context = getattr(task, "get_context", None)  # 3.12+
    if get_context is not None:
        ctx = get_context()
        return ctx if isinstance(ctx, contextvars.Context) else None
    for obj in gc.get_referents(task):  # 3.11's C task: its context is one of its referents
        if type(obj) is contextvars.Context:
            return obj
    return None


def _request_of(task: Any) -> Any:
    ctx = task_context(task)
    return None if ctx is None else ctx.get(recorder._current)


# ----------------------------------------------------------------- scheduler and cgroup figures


def _pread_at_0(fd: int, n: int) -> bytes:
    return os.pread(fd, n, 0)


# A /proc file's bytes without letting the interpreter lock go (an agent thread gets it back
# late: agent/_speedups.c, "agent threads and the GIL"); /proc reads never block.
_read_held = accel.pick("read_held", _pread_at_0)


def read_schedstat(fd: int) -> tuple[int, int, int] | None:
    """(ns on the CPU, ns runnable in the run queue, times scheduled) from an open schedstat."""
    try:
        parts = _read_held(fd, 128).split()
        return int(parts[0]), int(parts[1]), int(parts[2])
    except (OSError, ValueError, IndexError):
        return None


def cgroup_cpu_dir(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> str:
    """The directory holding this process's cgroup ``cpu.stat`` (v2, or v1's cpu controller),
    or '' when there is none."""
    try:
        with open(proc_cgroup, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return ""
    candidates: list[str] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":
            candidates += [os.path.join(root, path), root]
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                candidates += [os.path.join(root, mount, path), os.path.join(root, mount)]
    for d in candidates:
        if os.path.isfile(os.path.join(d, "cpu.stat")):
            return d.rstrip("/")
    return ""


def read_cpu_stat(cg_dir: str) -> dict[str, int]:
    """Throttling counters of a cgroup: periods, throttled (periods), throttled_us."""
    out: dict[str, int] = {}
    try:
        with open(os.path.join(cg_dir, "cpu.stat"), encoding="utf-8") as fh:
            raw = dict(line.split()[:2] for line in fh if len(line.split()) >= 2)
    except (OSError, ValueError):
        return out
    try:
        if "nr_periods" in raw:
            out["periods"] = int(raw["nr_periods"])
        if "nr_throttled" in raw:
            out["throttled"] = int(raw["nr_throttled"])
        if "throttled_usec" in raw:  # v2
            out["throttled_us"] = int(raw["throttled_usec"])
        elif "throttled_time" in raw:  # v1, in ns
            out["throttled_us"] = int(raw["throttled_time"]) // 1000
    except ValueError:
        return {}
    return out


def cpu_limit(cg_dir: str) -> float | None:
    """CPUs the cgroup's quota allows (None: no quota)."""
    try:
        with open(os.path.join(cg_dir, "cpu.max"), encoding="utf-8") as fh:  # v2
            quota, period = [*fh.read().split(), "100000"][:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(cg_dir, "cpu.cfs_quota_us"), encoding="utf-8") as fh:  # v1
            q = int(fh.read())
        with open(os.path.join(cg_dir, "cpu.cfs_period_us"), encoding="utf-8") as fh:
            p = int(fh.read())
        return q / p if q > 0 and p > 0 else None
    except (OSError, ValueError):
        return None


def cpus_available(cg_dir: str) -> float:
    try:
        n = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        n = float(os.cpu_count() or 1)
    limit = cpu_limit(cg_dir) if cg_dir else None
    return min(n, limit) if limit else n


class _Tracked:
    __slots__ = ("place", "placed_at", "req", "samples", "sent", "since", "taken")

    def __init__(self, req: recorder.ActiveRequest, since: int) -> None:
        self.req = req
        self.since = since  # when it was first sampled (perf_counter_ns)
        self.samples: list[tuple[int, str, tuple[Any, ...]]] = []  # (offset ns, state, flat)
        self.taken = 0
        self.sent = 0
        # Where its code was at its last sampling tick (the thread running it; an async
        # request's loop thread whether it ran or awaited), and that tick's number.
        self.place = 0
        self.placed_at = -1


_samplers: weakref.WeakSet[Sampler] = weakref.WeakSet()
# In a forked child, the thread that forked and its kernel thread id: Python 3.11 leaves that
# thread's ``native_id`` at the parent's, and its schedstat file is under its own id.
_forked: tuple[threading.Thread, int] | None = None


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: close the schedstat files it inherited
    (registered before agent.evidence's hook, which then starts a new sampler)."""
    global _forked
    _forked = (threading.current_thread(), threading.get_native_id())
    for s in list(_samplers):
        s._forget(set())


os.register_at_fork(after_in_child=_after_fork_in_child)


class Sampler:
    def __init__(self, cfg: Config) -> None:
        self.after_ns = int(cfg.sample_after_ms * 1e6)
        # The evidence thread's fast tick (evidence._run sleeps this long while sampling).
        self.interval_ns = int(max(0.001, cfg.sample_interval_ms / 1000) * 1e9)
        # A request's thread is read one tick before the request is due (it is "armed"), so
        # that the due tick already has the interval to classify and takes the first sample
        # at ``sample_after_ms``: a first read only sets a baseline.
        self.armed = False  # this tick armed a request: the next tick is a fast one
        # When the next request in flight is to be armed (perf_counter_ns; 0: none in flight
        # short of it): the evidence thread sleeps until then rather than a whole idle tick.
        self.wake_at = 0
        self.clock = _perf  # the clock of requests' start times (a test can drive its own)
        self.limit = max(1, cfg.samples_per_request)
        self.tracked: dict[int, _Tracked] = {}
        # thread ident -> (when read ns, CPU ns, run-queue ns, slices or None, process CPU ns,
        # tick, kernel thread id or None) at the previous look
        self.seen: dict[int, tuple[int, int, int, int | None, int, int, int | None]] = {}
        self.ticks = 0
        # thread ident -> open schedstat file (-1: none), while the thread serves a request
        self.fds: dict[int, int] = {}
        self.natives: dict[int, int | None] = {}  # thread ident -> kernel thread id at open
        self.states: dict[int, str | None] = {}  # this tick's state per thread
        # this tick's interval per thread: (wall, CPU, run-queue, slices, others' CPU) ns
        self.intervals: dict[int, tuple[int, int, int, int | None, int]] = {}
        # each thread's latest intervals classed 'wait' or 'gil' from its counters
        self.unsure = HandBack()
        # id(loop) -> (when listed, when to list again, id(request) -> tasks started in its
        # context)
        self.loop_tasks: dict[int, tuple[int, int, dict[int, list[Any]]]] = {}
        self.schedstat = os.path.isdir("/proc/self/task")
        # Process figures shipped as STATS counters (cumulative over this process's life).
        self.figures = {"sched_run_ns": 0, "sched_queue_ns": 0, "sched_wall_ns": 0}
        self.cg_dir = cgroup_cpu_dir()
        self.cg_base = read_cpu_stat(self.cg_dir) if self.cg_dir else {}
        self.cpus = cpus_available(self.cg_dir)
        self.figures_at = 0
        self.looked_at = 0
        self.proc_cpu = -1  # the process's CPU ns at this tick's first thread read (-1: none)
        self.shipped: dict[str, int] = {}
        _samplers.add(self)

    def tick(self, frames: dict[int, FrameType] | None = None) -> None:
        now = self.clock()
        self.ticks += 1
        if now - self.figures_at >= FIGURES_EVERY_NS:
            self.figures_at = now
            self.ship_figures()
        inflight = list(recorder.inflight.values())
        due, arm = self._due(inflight, now)
        for key in [k for k, t in self.tracked.items() if k not in recorder.inflight]:
            self._ship(self.tracked.pop(key), final=True)
        self.states = {}
        self.intervals = {}
        self.proc_cpu = -1  # read at this tick's first schedstat read
        # The scheduler figures (cpu_starved) cover every thread serving a request, not only
        # those of slow requests (a service of short requests starves all the same): looked at
        # every LOOK_EVERY_NS, their baselines kept while the thread lives (between two
        # requests a thread is not runnable, so the figures take in its requests' time only;
        # past MAX_IDLE_FILES idle threads, a schedstat file is closed and opened again at the
        # thread's next request).
        if self.schedstat and inflight and now - self.looked_at >= LOOK_EVERY_NS:
            self.looked_at = now
            for ident in {r.thread if r.worker is None else r.worker for r in inflight}:
                self._state(ident)
        for r in arm:
            self._state(r.thread if r.worker is None else r.worker)
        if not due:
            self._settle(inflight)
            self.loop_tasks.clear()
            return
        if frames is None:
            frames = sys._current_frames()
        for req in due:
            t = self.tracked.get(id(req))
            if t is None:
                if len(self.tracked) >= MAX_TRACKED:
                    recorder.stats["samples_dropped"] += 1
                    continue
                t = self.tracked[id(req)] = _Tracked(req, now)
            self._sample(t, frames, now)
        self._settle(inflight)

    def _due(
        self, inflight: list[recorder.ActiveRequest], now: int
    ) -> tuple[list[recorder.ActiveRequest], list[recorder.ActiveRequest]]:
        """The requests in flight for ``sample_after_ms`` (to sample now) and those that will
        be by the next fast tick (to arm now); sets ``armed`` and ``wake_at`` (when the next
        of the others is to be armed)."""
        after, lead = self.after_ns, self.interval_ns
        due: list[recorder.ActiveRequest] = []
        arm: list[recorder.ActiveRequest] = []
        wake = 0
        for r in inflight:
            at = r.start + after
            if now >= at:
                due.append(r)
            elif now + lead >= at:
                arm.append(r)
            elif wake == 0 or at - lead < wake:
                wake = at - lead
        self.armed = bool(arm)
        self.wake_at = wake
        return due, arm

    def _settle(self, inflight: list[recorder.ActiveRequest]) -> None:
        """End of a tick: close the files of idle threads, forget those that ended, and the
        samples to restate of threads not looked at (their chain of ticks broke). A tick that
        read no thread (most of them) only closes the files of idle threads past
        ``MAX_IDLE_FILES``."""
        if self.states:
            serving = self._serving(inflight)
            idle = [i for i in self.fds if i not in serving]
            self._forget(self._alive(serving), serving.union(idle[-MAX_IDLE_FILES:]))
        elif len(self.fds) > MAX_IDLE_FILES:
            serving = {r.thread if r.worker is None else r.worker for r in inflight}
            idle = [i for i in self.fds if i not in serving]
            for ident in idle[: max(0, len(idle) - MAX_IDLE_FILES)]:
                fd = self.fds.pop(ident)
                self.natives.pop(ident, None)
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        if self.unsure:
            self.unsure.keep(self.states)

    def _serving(self, inflight: list[recorder.ActiveRequest]) -> set[int]:
        """The threads serving a request in flight (or sampled this tick): their schedstat
        files stay open; an idle thread's is closed past MAX_IDLE_FILES (its baseline stays:
        reopened, the file has the same counters)."""
        serving = {r.thread if r.worker is None else r.worker for r in inflight}
        serving.update(self.states)
        return serving

    def _alive(self, serving: set[int]) -> set[int]:
        """The threads with a baseline that still run (past MAX_BASELINES of them, only those
        serving a request now)."""
        active = threading._active  # type: ignore[attr-defined]
        alive = {i for i in self.seen if i in active}
        if len(alive) > MAX_BASELINES:
            alive &= serving
        return alive

    def _forget(self, keep: set[int], keep_open: set[int] | None = None) -> None:
        """Drop the baselines of threads not in ``keep`` and close the schedstat files of
        threads not in ``keep_open`` (default: ``keep``)."""
        for ident in [i for i in self.seen if i not in keep]:
            del self.seen[ident]
        if keep_open is None:
            keep_open = keep
        self.unsure.keep(keep_open & keep)
        for ident in [i for i in self.fds if i not in keep_open or i not in keep]:
            fd = self.fds.pop(ident, -1)
            self.natives.pop(ident, None)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _close(self, ident: int) -> None:
        self.seen.pop(ident, None)
        self.natives.pop(ident, None)
        fd = self.fds.pop(ident, -1)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def _open(self, ident: int) -> int:
        fd = -1
        thread = threading._active.get(ident)  # type: ignore[attr-defined]
        forked = _forked
        native = forked[1] if forked and forked[0] is thread else getattr(thread, "native_id", None)
        if self.schedstat and native is not None:
            try:
                fd = os.open(f"/proc/self/task/{native}/schedstat", os.O_RDONLY)
            except OSError:
                fd = -1
        self.fds[ident] = fd
        self.natives[ident] = native
        return fd

    def _sched(self, ident: int) -> tuple[int, int, int, int] | None:
        """(CPU ns, run-queue ns, slices, when read: perf_counter_ns) of a thread."""
        fd = self.fds.get(ident)
        if fd is None:
            fd = self._open(ident)
        if fd < 0:
            return None
        at = self.clock()
        got = read_schedstat(fd)
        if got is None:
            # The thread ended, and its ident may be another thread's now: start over.
            self._close(ident)
            fd = self._open(ident)
            at = self.clock()
            got = read_schedstat(fd) if fd >= 0 else None
        return None if got is None else (*got, at)

    def _state(self, ident: int) -> str | None:
        """The thread's state since the last look (None at the first look: a baseline)."""
        if ident in self.states:
            return self.states[ident]
        state: str | None = None
        proc_cpu = self.proc_cpu
        if proc_cpu < 0:
            # The process's CPU time, next to the threads' reads (a tick can stall between
            # its start and its reads), so that 'others' covers each thread's own interval.
            proc_cpu = self.proc_cpu = time.process_time_ns()
        sched = self._sched(ident)
        slices: int | None
        if sched is not None:
            cpu, queue, slices, at = sched
        else:
            if ident not in threading._active:  # type: ignore[attr-defined]
                # A thread that ended with a request still in flight: its pthread id is
                # stale (pthread_getcpuclockid on it can crash the process). It has no state.
                self.states[ident] = None
                return None
            at = self.clock()
            try:
                cpu = time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
            except (OSError, AttributeError, OverflowError):
                self.states[ident] = CPU  # no per-thread clock: a running thread is the guess
                return CPU
            queue, slices = 0, None
        native = self.natives.get(ident)
        prev = self.seen.get(ident)
        if prev is not None and prev[6] != native:
            prev = None  # the ident is another thread's now (its file was reopened)
        self.seen[ident] = (at, cpu, queue, slices, proc_cpu, self.ticks, native)
        if prev is not None and at > prev[0]:
            wall, d_cpu, d_queue = at - prev[0], cpu - prev[1], queue - prev[2]
            if prev[5] == self.ticks - 1:  # a state is about the last tick's interval only
                queue_here = d_queue
                if d_cpu + d_queue > wall:
                    # Run-queue time past what this interval left room for began before it.
                    queue_here = max(0, wall - d_cpu)
                    if self.unsure:
                        self.unsure.restate(ident, d_queue - queue_here)
                d_slices = None if slices is None or prev[3] is None else slices - prev[3]
                others = max(0, proc_cpu - prev[4] - d_cpu)
                state = classify(wall, d_cpu, queue_here, d_slices, others)
                interval = (wall, d_cpu, queue_here, d_slices, others)
                self.intervals[ident] = interval
                if state is WAIT or state is GIL:
                    self.unsure.waited(ident, interval)  # it may yet turn out starved
            if sched is not None:
                f = self.figures
                f["sched_run_ns"] += d_cpu
                f["sched_queue_ns"] += d_queue
                f["sched_wall_ns"] += wall
        if state is not WAIT and state is not GIL:
            self.unsure.broken(ident)
        self.states[ident] = state
        return state

    def _kids(self, t: _Tracked, now: int) -> list[Any]:
        """Unfinished tasks started in the request's context, other than its own. One listing
        of a loop's tasks serves every request awaiting on it until it is due again."""
        req = t.req
        try:
            loop = req.task.get_loop()
        except Exception:
            return []
        at, due, by_req = self.loop_tasks.get(id(loop), (0, 0, {}))
        # A listing from before this request was first sampled may predate its tasks.
        if now >= due or at < t.since:
            by_req = {}
            try:
                tasks = sys.modules["asyncio"].all_tasks(loop)
            except Exception:
                tasks = set()
            if len(tasks) <= MAX_TASKS_LISTED:
                for k in tasks:
                    r = _request_of(k)
                    if r is not None and k is not getattr(r, "task", None):
                        by_req.setdefault(id(r), []).append(k)
            due = now + max(LIST_EVERY_NS, len(tasks) * LIST_NS_PER_TASK)
            self.loop_tasks[id(loop)] = (now, due, by_req)
        return [k for k in by_req.get(id(req), ()) if not k.done()]

    def _parked_flat(self, t: _Tracked, now: int) -> tuple[Any, ...]:
        """Where an awaiting request waits: its own await chain, or the chain of the task it
        started that goes deepest into application code (the endpoint below a middleware's
        ``await call_next``), or nothing when its tasks show no application frame yet."""
        kids = self._kids(t, now)
        own = coroutine_flat(t.req.task)
        if not kids:
            return own
        best: tuple[Any, ...] = ()
        best_key = (0, 0)
        for k in kids:
            flat = coroutine_flat(k)
            key = (_app_frames(flat), len(flat))
            if key > best_key:
                best, best_key = flat, key
        if best_key[0] == 0:
            # Nothing of the application runs below the await yet: keep only the library part
            # of the own chain, so the await line is not charged with it.
            lib: list[Any] = []
            for i in range(0, len(own), 2):
                if not stacks.classify(own[i]):
                    lib += own[i : i + 2]
            return tuple(lib)
        return best

    def _sample(self, t: _Tracked, frames: dict[int, FrameType], now: int) -> None:
        req = t.req
        worker = req.worker
        flat: tuple[Any, ...] = ()
        state: str | None
        place = req.thread
        counted = True  # the state is from the thread's counters (else: an awaiting task)
        if worker is not None and worker in frames:
            place = worker
            state = self._state(worker)
            flat = frames_flat(frames[worker])
        elif req.task is not None:
            loop_frame = frames.get(req.thread)
            coro_frame = _task_frame(req.task)
            if coro_frame is not None and _on_stack(loop_frame, coro_frame):
                running = True
            else:
                running = False
                try:
                    running_tasks = _running_tasks()
                    current = running_tasks.get(req.task.get_loop()) if running_tasks else None
                except Exception:
                    current = None
                if current is not None and current is not req.task:
                    running = _request_of(current) is req  # a task the request started
            if running:
                state = self._state(req.thread)
                flat = frames_flat(loop_frame)
            else:
                state, counted = WAIT, False
                flat = self._parked_flat(t, now)
        elif req.thread in frames:
            state = self._state(req.thread)
            flat = frames_flat(frames[req.thread])
        else:
            return
        moved = t.placed_at == self.ticks - 1 and t.place != place
        t.place, t.placed_at = place, self.ticks
        if state is None or not flat or moved:
            # The first look at a thread only sets its baseline; a request that moved to or
            # from a worker since the last tick spent the interval partly elsewhere.
            return
        if req.open_call():
            state, counted = CALL, False  # inside a recorded call: the call explains it
        t.taken += 1
        if len(t.samples) + t.sent >= self.limit:
            recorder.stats["samples_dropped"] += 1
            return
        recorder.stats["samples_taken"] += 1
        t.samples.append((now - req.start, state, flat))
        if counted and (state is WAIT or state is GIL) and place in self.intervals:
            self.unsure.sampled(place, t, len(t.samples) - 1)
        if len(t.samples) >= CHUNK:
            self._ship(t, final=False)

    def ship_figures(self) -> None:
        """Ship the process figures as a STATS record when they changed since the last one."""
        counters = dict(self.figures)
        if self.cg_dir:
            cur = read_cpu_stat(self.cg_dir)
            for k, v in cur.items():
                counters[f"cgroup_{k}"] = max(0, v - self.cg_base.get(k, 0))
        if counters == self.shipped or (not self.shipped and not any(counters.values())):
            return  # unchanged, or nothing to say yet (a gunicorn master never has)
        self.shipped = counters
        body = dict(counters)
        body["cpus_milli"] = int(self.cpus * 1000)
        try:
            body["load1_milli"] = int(os.getloadavg()[0] * 1000)
        except OSError:
            pass
        ts = time.time_ns()
        pid = os.getpid()
        shipper.emit(STATS, lambda intern: {"ts": ts, "pid": pid, "counters": body})

    def _ship(self, t: _Tracked, *, final: bool) -> None:
        samples, t.samples = t.samples, []
        if not samples and not (final and t.sent):
            return
        t.sent += len(samples)
        req = t.req
        dropped = t.taken - t.sent if final else 0

        def build(intern: shipper.Intern) -> dict[str, Any]:
            return {
                "id": f"{req.trace_id:016x}",
                "ts": req.start_wall,
                "endpoint": req.endpoint if final else "",
                "method": req.method,
                "path": req.path,
                "final": final,
                "dropped": dropped,
                "samples": [[off, st, intern(flat)] for off, st, flat in samples],
            }

        shipper.emit(SAMPLES, build)

    def flush(self) -> None:
        for key in list(self.tracked):
            t = self.tracked[key]
            if key not in recorder.inflight:
                del self.tracked[key]
                self._ship(t, final=True)
        self.ship_figures()
