"""Cheap stack capture for the request path.

One module of ~500 lines: capture, the application/library classification it needs per frame
and the template frames it splices in are one walk, kept together so the hot path stays flat.

The hot path collects (code object, line) pairs only; turning them into file/line/function
records happens on the writer thread. Frames of perfsleuth's agent itself are skipped.

A frame is an *application* frame when its file is outside the standard library and
site-packages (perfsleuth's own demo counts as application code), or inside the directory of
an application package installed there: the package of the served app object (``perfsleuth
run`` passes it), Django's project (its settings, root URLconf and WSGI/ASGI application's
packages, read once Django's settings are configured), and the packages named in
``PERFSLEUTH_APP_PACKAGES``. A launcher script (a file
in a virtualenv's or the interpreter's ``bin/``: console-script shims such as ``bin/uvicorn``)
is never application code.

Template frames: while a template engine (Django's, Jinja2) is loaded, a captured stack also
carries the template lines being rendered (:mod:`perfsleuth.agent.templates`), as synthetic
frames ``(code, line)``: a code object made for the template's file whose name is the label
(``{% for c in checks %}``, ``{{ c.url }}``), with the template line as a plain (positive)
line number. A Django frame rendering a node is followed by the node's template line; a
Jinja2 template frame is replaced by its template line, followed by its enclosing loops'.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import CodeType, FrameType
from typing import Any

from perfsleuth.agent import templates

MAX_DEPTH = 64
_AGENT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_WIRE_DIR = os.path.join(os.path.dirname(_AGENT_DIR.rstrip(os.sep)), "wire") + os.sep
_DEMO_MARK = os.sep + os.path.join("perfsleuth", "demo") + os.sep
_modules = sys.modules


def _library_prefixes() -> tuple[str, ...]:
    paths = set()
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(name)
        if p:
            paths.add(os.path.realpath(p) + os.sep)
            paths.add(os.path.abspath(p) + os.sep)
    for p in sys.path:
        if p and ("site-packages" in p or "dist-packages" in p):
            paths.add(os.path.abspath(p) + os.sep)
    return tuple(sorted(paths))


def _script_dirs() -> frozenset[str]:
    """Directories of this interpreter's launcher scripts (console-script shims)."""
    dirs = set()
    try:
        user = sysconfig.get_path("scripts", f"{os.name}_user")
    except Exception:
        user = None
    for p in (sysconfig.get_paths().get("scripts"), os.path.dirname(sys.executable), user):
        if p:
            dirs.add(os.path.abspath(p))
            dirs.add(os.path.realpath(p))
    return frozenset(dirs)


_LIB = _library_prefixes()
_SCRIPTS = _script_dirs()
# id(code) -> (code, kind): kind True (application), False (library), None (perfsleuth agent:
# skip; also the frame of a thread pool's worker that runs a request's function, marked by the
# C hand-off, agent/_speedups.c, where the Python one has a frame of the agent's). Keyed by id
# because hashing a code object is not cached by CPython (80-700 ns); the code object is kept
# in the value so its id cannot be reused while the entry exists.
_kind: dict[int, tuple[CodeType, bool | None]] = {}

# ------------------------------------------------------------------ application packages

# Directories (with a trailing separator) or single-module files of application packages
# that live under a library prefix (site-packages).
_app_dirs: tuple[str, ...] = ()
# Package names given but not resolved yet (not imported yet, or not found).
_app_pending: list[str] = []
_app_known: set[str] = set()
_django_read = False
_app_lock = threading.Lock()


def _launcher(fn: str) -> bool:
    """Whether ``fn`` is a launcher script: a file in a ``bin``/``Scripts`` directory of this
    interpreter, of its user scheme or of a virtualenv (its parent holds ``pyvenv.cfg``), or
    a console-script shim pip wrote anywhere else."""
    d = os.path.dirname(fn)
    if d in _SCRIPTS:
        return True
    try:
        if os.path.basename(d) in ("bin", "Scripts") and os.path.isfile(
            os.path.join(os.path.dirname(d), "pyvenv.cfg")
        ):
            return True
        if fn.endswith(".py"):
            return False
        shim = _shims.get(fn)
        if shim is None:
            with open(fn, "rb") as fh:
                head = fh.read(2048)
            # what pip's (distlib's) shims do with their name before calling the entry point
            shim = b"sys.exit(" in head and any(m in head for m in _SHIM_MARKS)
            if len(_shims) > 10_000:
                _shims.clear()
            _shims[fn] = shim
        return shim
    except Exception:
        return False


_shims: dict[str, bool] = {}  # file (not .py) -> whether it is a console-script shim
_SHIM_MARKS = (b"-script\\.pyw", b"removesuffix('.exe')", b'removesuffix(".exe")')


def add_app_packages(names: Any) -> None:
    """Count the packages (or modules) named as application code: a comma-separated string
    or an iterable of dotted names. They are located when imported (nothing is imported
    here); what they hold is application code from then on, even in site-packages."""
    if isinstance(names, str):
        names = names.split(",")
    added = False
    for raw in names:
        name = str(raw).strip()
        if name and name.replace(".", "").replace("_", "").isalnum() and name not in _app_known:
            _app_known.add(name)
            _app_pending.append(name)
            added = True
    if added:
        _resolve_app_packages()


def app_packages() -> tuple[str, ...]:
    """The directories (and module files) counted as application code under site-packages."""
    _resolve_app_packages()
    return _app_dirs


def _location(name: str) -> str | None:
    """Where an imported package or module lives: its directory (with a trailing separator)
    or its file; None while it is not imported (its frames cannot run before it is)."""
    mod = _modules.get(name)
    if mod is None:
        return None
    for p in list(getattr(mod, "__path__", None) or []):
        if isinstance(p, str) and os.path.isdir(p):
            return os.path.abspath(p) + os.sep
    f = getattr(mod, "__file__", None)
    return os.path.abspath(f) if isinstance(f, str) else None


# Django settings naming the project's own modules
_DJANGO_PROJECT = ("SETTINGS_MODULE", "ROOT_URLCONF", "WSGI_APPLICATION", "ASGI_APPLICATION")


def _django_packages() -> list[str]:
    """Django's project, once Django's settings are configured: the top-level packages of
    the settings module, the root URLconf and the WSGI/ASGI application, and every
    INSTALLED_APPS module but Django's own (``django.contrib.*``): an installed app runs as
    part of the project (its views, models and template tags serve its pages), and where it
    loops over queries is where the fix goes, in the project or in the app's release. Django
    is never imported here, nor its settings loaded."""
    global _django_read
    conf = _modules.get("django.conf")
    if conf is None:
        return []
    try:
        settings = conf.settings
        if not settings.configured:
            return []
        _django_read = True
        tops = set()
        for name in _DJANGO_PROJECT:
            value = getattr(settings, name, None)
            if isinstance(value, str) and value:
                tops.add(value.split(".")[0])
        tops.discard("django")
        names = sorted(tops)
        for app in getattr(settings, "INSTALLED_APPS", ()):
            if isinstance(app, str) and app.split(".")[0] != "django":
                names.append(_app_module(app))
        return names
    except Exception:
        _django_read = True
        return []


def _app_module(entry: str) -> str:
    """The module of an INSTALLED_APPS entry (an app module, or an AppConfig's dotted path)."""
    if entry in _modules:
        return entry
    parent, _, last = entry.rpartition(".")
    if parent and last[:1].isupper():  # "polls.apps.PollsConfig"
        cls = getattr(_modules.get(parent), last, None)
        name = getattr(cls, "name", None)
        if isinstance(name, str):
            return name
        return parent.rpartition(".")[0] or parent
    return entry


def _resolve_app_packages() -> None:
    """Locate the named packages imported since the last call (and Django's project once its
    settings are configured). Runs on the request threads and the writer's: under a lock."""
    global _app_dirs
    with _app_lock:
        if not _django_read and "django.conf" in _modules:
            for name in _django_packages():
                if name not in _app_known:
                    _app_known.add(name)
                    _app_pending.append(name)
        if not _app_pending:
            return
        found = []
        for name in list(_app_pending):
            where = _location(name)
            if where is not None:
                _app_pending.remove(name)
                found.append(where)
        new = [w for w in found if w not in _app_dirs]
        if not new:
            return
        _app_dirs = tuple(sorted({*_app_dirs, *new}))
        # codes classified as library before may be the application's now (in place: the C
        # accelerator holds this dict; its own marks of agent frames are kept)
        for key, (_, kind) in list(_kind.items()):
            if kind is False:
                _kind.pop(key, None)


def _file_kind(fn: str) -> bool | None:
    if fn.startswith((_AGENT_DIR, _WIRE_DIR)):
        return None
    if _DEMO_MARK in fn:
        return True
    if fn.startswith("<"):
        return False
    if fn.startswith(_LIB):
        if _app_pending or not _django_read:
            _resolve_app_packages()
        return bool(_app_dirs) and fn.startswith(_app_dirs)
    return not _launcher(fn)


def classify(code: CodeType) -> bool | None:
    hit = _kind.get(id(code))
    if hit is not None:
        return hit[1]
    if not templates_on:
        check_engines()
    kind = _file_kind(code.co_filename)
    if len(_kind) > 200_000:  # code objects of exec()'d strings could grow this forever
        _kind.clear()
    _kind[id(code)] = (code, kind)
    return kind


def is_app_file(filename: str) -> bool:
    """Same rule as :func:`classify`, for a file name (used by the writer and the store)."""
    return bool(_file_kind(filename))


# --------------------------------------------------------------------- template frames

# Set once a template engine is loaded: stacks then carry template frames, and call sites
# under a template are told apart by their template lines (template_key).
templates_on = False
# Called once when templates_on is set (the recorder tells the C accelerator, whose site path
# then hands the calls under a template line to Python's).
on_templates: Any = None

# (file, label) -> the synthetic code object of a template line (identity matters: the
# recorder and the writer compare stacks by their code objects)
_synthetic: dict[tuple[str, str], CodeType] = {}


def check_engines() -> bool:
    """Whether a template engine is loaded (sets templates_on the first time it is)."""
    global templates_on
    if not templates_on and templates.engines_loaded():
        templates_on = True
        hook = on_templates
        if hook is not None:
            try:
                hook()
            except Exception:
                pass
    return templates_on


def engine_imported(module: Any) -> None:
    """Import hook of the template engines' modules (``perfsleuth run`` registers it): sets
    templates_on before the first request, whose stacks may run through a template."""
    check_engines()


_UNNAMED = compile("None", "<template>", "eval")


def synthetic(file: str, label: str) -> CodeType:
    """The code object standing for template lines of ``file`` labelled ``label``."""
    key = (file, label)
    code = _synthetic.get(key)
    if code is None:
        # the file is a constant too: code objects compare equal by content, not file
        try:
            code = compile(repr(file), file, "eval").replace(co_name=label, co_qualname=label)
        except Exception:  # a file name compile refuses (a NUL in it)
            code = _UNNAMED.replace(co_name=label, co_qualname=label)
        if len(_synthetic) > 50_000:
            _synthetic.clear()
        _synthetic[key] = code
    return code


def _template_frames(f: FrameType, engine: int, out: list[Any]) -> None:
    """Append the frames ``f`` stands for (a template engine's)."""
    if engine == templates.DJANGO:
        out.append(f.f_code)
        out.append(~f.f_lasti)
        pos = templates.django_position(f)
        if pos is not None:
            out.append(synthetic(pos[0], pos[2]))
            out.append(pos[1])
        return
    positions = templates.jinja_positions(f)
    if not positions:
        out.append(f.f_code)
        out.append(~f.f_lasti)
    for fn, line, label in positions:
        out.append(synthetic(fn, label))
        out.append(line)


def template_key(frame: FrameType | None) -> tuple[str, int] | None:
    """The innermost template line (file, line) being rendered above ``frame``, up to where
    :func:`capture` stops; None when there is none (or no engine is loaded). Two calls from
    one Python line under different template lines have different keys. (The walk stops at
    the innermost template frame: it runs for every call under a template. One template
    line reached through two others, an include in two loops, is one site of a request.)"""
    if not templates_on:
        return None
    f = frame
    while f is not None and classify(f.f_code) is None:
        f = f.f_back
    n = 0
    steps = _template_steps
    while f is not None and n < MAX_DEPTH:
        hit = steps.get(id(f.f_code))  # one look-up a frame: this walk runs for every call
        step = hit[1] if hit is not None else _template_step(f)
        if step:
            if step == _STOP:
                return None
            if templates.engine_of(f) == templates.DJANGO:
                return templates.django_key(f)
            return templates.jinja_key(f)
        f = f.f_back
        n += 1
    return None


# What template_key does at a frame of a code: go on (0), stop with the key of a template
# engine's frame (_ENGINE), or stop without one at the agent's frame (_STOP). By id(code), the
# code kept in the value (as _kind); a code's step never changes (its file and name decide).
_template_steps: dict[int, tuple[CodeType, int]] = {}
_ENGINE, _STOP = 1, 2


def _template_step(f: FrameType) -> int:
    code = f.f_code
    step = _STOP if classify(code) is None else _ENGINE if templates.engine_of(f) else 0
    if len(_template_steps) > 200_000:
        _template_steps.clear()
    _template_steps[id(code)] = (code, step)
    return step


# ------------------------------------------------------------------------------ capture


def capture(frame: FrameType | None) -> tuple[Any, ...]:
    """The stack above ``frame``, innermost first, as a flat tuple ``(code, where, code, where,
    ...)`` (flat so the writer can key it with two slices). The agent's own innermost frames
    (its wrappers) are skipped, and the stack stops at the next frame of the agent's: where the
    request entered the application (the ASGI/WSGI layer, a thread-pool hand-off), so the
    server's and the thread's frames above it, the same for every call, are neither walked nor
    stored. At most MAX_DEPTH frames (template frames come on top).

    ``where`` is ``~f_lasti`` (negative), not the line: ``f_lineno`` decodes the line table
    at every frame (~40 ns each), the writer does it once per distinct place (:func:`line`).
    Stacks taken off the request path (sampler, watchdog) carry plain line numbers, and so do
    template frames."""
    if templates_on or check_engines():
        return _capture_templates(frame)
    f = frame
    while f is not None and classify(f.f_code) is None:
        f = f.f_back
    out: list[Any] = []
    kinds = _kind
    n = 0
    while f is not None and n < MAX_DEPTH:
        code = f.f_code
        hit = kinds.get(id(code))
        if (hit[1] if hit is not None else classify(code)) is None:
            break
        out.append(code)
        out.append(~f.f_lasti)
        f = f.f_back
        n += 1
    return tuple(out)


def _capture_templates(frame: FrameType | None) -> tuple[Any, ...]:
    """:func:`capture` with template frames."""
    f = frame
    while f is not None and classify(f.f_code) is None:
        f = f.f_back
    out: list[Any] = []
    kinds = _kind
    engine_of = templates.engine_of
    n = 0
    while f is not None and n < MAX_DEPTH:
        code = f.f_code
        hit = kinds.get(id(code))
        if (hit[1] if hit is not None else classify(code)) is None:
            break
        e = engine_of(f)
        if e:
            _template_frames(f, e, out)
        else:
            out.append(code)
            out.append(~f.f_lasti)
        f = f.f_back
        n += 1
    return tuple(out)


def same(frame: FrameType | None, flat: tuple[Any, ...]) -> bool:
    """Whether :func:`capture` of ``frame`` would give ``flat``, found without building it
    (built when a template engine is loaded: template frames are read from the frames)."""
    if templates_on or check_engines():
        return _same_templates(frame, flat)
    f = frame
    while f is not None and classify(f.f_code) is None:
        f = f.f_back
    return same_from(f, flat)


def same_from(f: FrameType | None, flat: tuple[Any, ...]) -> bool:
    """Whether the frames from ``f`` up (no agent frames skipped first) are ``flat``: the same
    code objects at the same instructions, ending where :func:`capture` stops (the root,
    MAX_DEPTH or an agent frame). Template frames are not read: a stack that has them never
    matches. (:func:`same` after its skip, and the thread-pool hand-off's origin cache.)"""
    n = len(flat)
    i = 0
    while f is not None and i < n:
        if f.f_code is not flat[i] or ~f.f_lasti != flat[i + 1]:
            return False
        f = f.f_back
        i += 2
    if i != n:
        return False
    if f is None or n >= 2 * MAX_DEPTH:
        return True
    code = f.f_code
    hit = _kind.get(id(code))
    return (hit[1] if hit is not None else classify(code)) is None


def _same_templates(frame: FrameType | None, flat: tuple[Any, ...]) -> bool:
    """:func:`same` with template frames: compared frame by frame as
    :func:`_capture_templates` would make them, up to the first difference."""
    f = frame
    while f is not None and classify(f.f_code) is None:
        f = f.f_back
    n = len(flat)
    i = 0
    depth = 0
    kinds = _kind
    engines = templates._engine
    while f is not None and depth < MAX_DEPTH:
        code = f.f_code
        hit = kinds.get(id(code))
        if (hit[1] if hit is not None else classify(code)) is None:
            break
        e = engines.get(id(code))
        engine = e[1] if e is not None else templates.engine_of(f)
        if not engine:
            if i >= n or flat[i] is not code or flat[i + 1] != ~f.f_lasti:
                return False
            i += 2
        else:
            part: list[Any] = []
            _template_frames(f, engine, part)
            for j in range(0, len(part), 2):
                if i >= n or flat[i] is not part[j] or flat[i + 1] != part[j + 1]:
                    return False
                i += 2
        f = f.f_back
        depth += 1
    return i == n


def line(code: CodeType, where: int) -> int:
    """The line number of a ``where`` of :func:`capture` (a line number passes through)."""
    if where >= 0:
        return where
    lasti = ~where
    for start, end, lineno in code.co_lines():
        if start <= lasti < end:
            return lineno if lineno is not None else code.co_firstlineno
    return code.co_firstlineno


add_app_packages(os.environ.get("PERFSLEUTH_APP_PACKAGES", ""))
