"""Imported at start-up by every Python interpreter run under ``perfsleuth run``.

``perfsleuth run`` puts this directory first on PYTHONPATH, so ``site`` imports this module as
``sitecustomize`` in the command and in every Python process it starts (gunicorn and uvicorn
workers, reloaders, multiprocessing spawns). It starts the perfsleuth agent, then runs the
``sitecustomize`` this one shadows, if any (a distribution's or a virtualenv's), the way ``site``
would have. It never raises: whatever goes wrong, the application starts as it would without it.

Plain syntax only (it parses on Python 2.7): the command may run any interpreter, where the
agent simply does not start if that Python cannot run it.
"""

import os
import sys


def _import_agent():
    try:
        import perfsleuth.agent as agent

        return agent
    except ImportError:
        pass
    # An interpreter whose sys.path lacks perfsleuth: borrow the launcher's copy just long
    # enough to import the package (its submodules are then found through the package).
    path = os.environ.get("PERFSLEUTH_AGENT_PATH")
    if not path or not os.path.isdir(os.path.join(path, "perfsleuth")):
        return None
    for name in [m for m in sys.modules if m == "perfsleuth" or m.startswith("perfsleuth.")]:
        del sys.modules[name]  # a half-imported package from the failed attempt
    sys.path.insert(0, path)
    try:
        import perfsleuth.agent as agent

        return agent
    except ImportError:
        return None
    finally:
        try:
            sys.path.remove(path)
        except ValueError:
            pass


def _start_agent():
    try:
        agent = _import_agent()
        if agent is None:
            return
        service = None
        if not os.environ.get("PERFSLEUTH_SERVICE"):
            # sys.argv is not set yet at this point of start-up; orig_argv is (3.10+).
            from perfsleuth.agent.launch import default_service

            service = default_service(getattr(sys, "orig_argv", None) or [sys.executable])
        if not agent.start(service=service):
            return
        # uvicorn ends a SIGTERM shutdown by re-raising the signal, which skips atexit.
        from perfsleuth.agent import instrument

        if "uvicorn.server" not in instrument.PATCHES:
            instrument.register("uvicorn.server", "perfsleuth.agent.frameworks.asgi:patch_uvicorn")
        # Stacks carry template lines once a template engine is loaded: know it at import,
        # before a request's first stack is taken.
        for name in ("django.template.base", "jinja2.runtime"):
            if name not in instrument.PATCHES:
                instrument.register(name, "perfsleuth.agent.stacks:engine_imported")
    except Exception:
        pass


def _chain():
    """Run the next ``sitecustomize`` on sys.path, as ``site`` would have without us."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.get("sitecustomize")
    removed = []
    try:
        for i in range(len(sys.path) - 1, -1, -1):
            entry = sys.path[i]
            try:
                same = os.path.abspath(entry or os.curdir) == here
            except Exception:
                same = False
            if same:
                removed.append((i, entry))
                del sys.path[i]
        if not removed:
            return
        sys.modules.pop("sitecustomize", None)
        import importlib.util

        if importlib.util.find_spec("sitecustomize") is None:
            return
        try:
            import importlib

            importlib.import_module("sitecustomize")
        except Exception as exc:
            # What site.py does for a failing sitecustomize.
            if sys.flags.verbose:
                sys.excepthook(*sys.exc_info())
            else:
                sys.stderr.write(
                    "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                    + exc.__class__.__name__
                    + ": "
                    + str(exc)
                    + "\n"
                )
    except Exception:
        pass
    finally:
        for i, entry in reversed(removed):
            sys.path.insert(i, entry)
        if sys.modules.get("sitecustomize") is None and ours is not None:
            sys.modules["sitecustomize"] = ours


_start_agent()
_chain()
