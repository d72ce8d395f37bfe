"""``perfsleuth run -- CMD``: run a command with the agent in every Python process it starts.

The command replaces the launcher (``exec``, like ``ddtrace-run`` / ``opentelemetry-instrument``)
so signals from a process manager go straight to the server. Its environment gets:

* ``PERFSLEUTH_DATA`` (absolute) and ``PERFSLEUTH_SERVICE``;
* the ``bootstrap`` directory first on ``PYTHONPATH``: its ``sitecustomize`` starts the agent in
  every Python interpreter started from there on (gunicorn/uvicorn workers, reloaders,
  ``multiprocessing`` spawns) and then runs the ``sitecustomize`` it shadows;
* ``PERFSLEUTH_AGENT_PATH``: where this perfsleuth lives, for interpreters whose own
  ``sys.path`` does not have it;
* the package of the app object a server is told to serve (``uvicorn pkg.module:app``,
  ``gunicorn pkg.wsgi:application``) added to ``PERFSLEUTH_APP_PACKAGES``: an app installed
  into site-packages is application code (agent.stacks).

Forked workers inherit the running agent; the shipper gives them their own writer at fork.

Also runnable as ``python -m perfsleuth.agent.launch [--data DIR] [--service NAME] -- CMD...``.
"""

from __future__ import annotations

import os
import sys

# The launcher runs before the application and imports only os and sys: re, shutil and typing
# would double what this process costs, on every ``perfsleuth run``.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import NoReturn

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
# Servers taking the app to serve as ``module:attribute`` (``module:factory()`` for some)
SERVERS = frozenset({"uvicorn", "gunicorn", "hypercorn", "daphne", "granian", "waitress-serve"})


def _is_python(prog: str) -> bool:
    """Whether a program name is a Python interpreter's: python, python3.12, pypy3, ..."""
    for name in ("python", "pypy"):
        if prog.startswith(name):
            return all(c in "0123456789." for c in prog[len(name) :])
    return False


def _identifier(name: str) -> bool:
    return name.isascii() and name.isidentifier()


def _app_package(arg: str) -> str | None:
    """``pkg`` of an app spec ``pkg.module:attribute`` (``module:factory()`` too), else None."""
    module, colon, attribute = arg.partition(":")
    if not colon or not attribute or not (attribute[0] == "_" or attribute[0].isalpha()):
        return None
    if not attribute[0].isascii() or not all(_identifier(p) for p in module.split(".")):
        return None
    return module.split(".")[0]


def default_service(argv: Sequence[str]) -> str:
    """A service name for a command line: the program, or the script/module a Python runs."""
    if not argv:
        return "python"
    prog = os.path.basename(argv[0])
    if _is_python(prog):
        args = list(argv[1:])
        while args:
            a = args.pop(0)
            if a == "-m" and args:
                return args[0]
            if a.startswith("-m") and len(a) > 2:
                return a[2:]
            if a == "-c":
                return prog
            if a in ("-W", "-X", "-Q") and args:
                args.pop(0)
                continue
            if not a.startswith("-"):
                name = os.path.basename(a)
                return name[:-3] if name.endswith(".py") else name
    return prog or "python"


def served_packages(argv: Sequence[str]) -> list[str]:
    """The top-level packages of the app objects a server command serves: ``pkg`` for
    ``uvicorn pkg.module:app`` (or ``python -m uvicorn ...``, ``gunicorn pkg.wsgi:app``,
    ``--app=pkg.module:app``); [] for other commands."""
    if not argv:
        return []
    args = list(argv[1:])
    prog = os.path.basename(argv[0])
    if _is_python(prog):
        prog = ""
        while args:
            a = args.pop(0)
            if a == "-m" and args:
                prog = args.pop(0)
                break
            if a.startswith("-m") and len(a) > 2:
                prog = a[2:]
                break
            if not a.startswith("-"):
                break
    if prog.split(".")[0] not in SERVERS:
        return []
    found = []
    for a in args:
        if a.startswith("-"):
            if "=" not in a:
                continue
            a = a.split("=", 1)[1]
        top = _app_package(a)
        if top is not None and top not in SERVERS and top not in found:
            found.append(top)
    return found


def command_env(
    argv: Sequence[str], data_dir: str, service: str | None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment ``run_command`` gives the command."""
    env = dict(os.environ if base is None else base)
    env["PERFSLEUTH_DATA"] = os.path.abspath(data_dir)
    if service:
        env["PERFSLEUTH_SERVICE"] = service
    elif not env.get("PERFSLEUTH_SERVICE"):
        env["PERFSLEUTH_SERVICE"] = default_service(argv)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [p for p in parts if os.path.abspath(p) != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *parts])
    package_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PERFSLEUTH_AGENT_PATH"] = package_dir
    served = served_packages(argv)
    if served:
        named = [p.strip() for p in env.get("PERFSLEUTH_APP_PACKAGES", "").split(",")]
        env["PERFSLEUTH_APP_PACKAGES"] = ",".join(
            [p for p in named if p] + [p for p in served if p not in named]
        )
    return env


def _runnable(path: str) -> bool:
    return os.path.exists(path) and os.access(path, os.X_OK) and not os.path.isdir(path)


def resolve(program: str, env: dict[str, str]) -> str:
    """The executable ``program`` names, looked up in ``env``'s PATH as ``shutil.which`` does
    (not imported: launching stays light); FileNotFoundError if there is none. A PATH set but
    empty finds nothing (not the current directory); no PATH at all means the system's
    default (``confstr("CS_PATH")``, else ``os.defpath``)."""
    if os.path.dirname(program):
        if _runnable(program):
            return program
        raise FileNotFoundError(2, f"command not found: {program}", program)
    path = env.get("PATH")
    if path is None:
        try:
            path = os.confstr("CS_PATH")
        except (AttributeError, ValueError):
            path = os.defpath
    seen = set()
    for d in path.split(os.pathsep) if path else ():
        norm = os.path.normcase(d)
        if norm in seen:
            continue
        seen.add(norm)
        candidate = os.path.join(d, program)
        if _runnable(candidate):
            return candidate
    raise FileNotFoundError(2, f"command not found: {program}", program)


def run_command(argv: list[str], data_dir: str, service: str | None = None) -> NoReturn:
    """Replace this process with ``argv`` running under the agent.

    Raises FileNotFoundError when the command does not exist (and OSError when it cannot be
    executed); on success it does not return.
    """
    if not argv:
        raise ValueError("no command to run")
    env = command_env(argv, data_dir, service)
    executable = resolve(argv[0], env)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, list(argv), env)


def main(args: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m perfsleuth.agent.launch",
        description="Run a command with the perfsleuth agent installed.",
    )
    parser.add_argument("--data", default=os.environ.get("PERFSLEUTH_DATA", ".perfsleuth"))
    parser.add_argument("--service", default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    ns = parser.parse_args(list(sys.argv[1:] if args is None else args))
    argv = list(ns.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        parser.error("nothing to run: give the command after `--`")
    try:
        run_command(argv, ns.data, ns.service)
    except FileNotFoundError:
        print(f"perfsleuth run: command not found: {argv[0]}", file=sys.stderr)
        return 127
    except OSError as e:
        print(f"perfsleuth run: cannot run {argv[0]}: {e.strerror or e}", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main())
