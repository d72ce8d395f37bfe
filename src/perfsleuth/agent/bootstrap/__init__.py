"""Start-up hook directory put on PYTHONPATH by ``perfsleuth run`` (see ``sitecustomize``).

Only ``sitecustomize.py`` matters here; this package marker keeps packaging and type checking
simple and has no effect on the hook (a directory on sys.path is not imported as a package).
"""
