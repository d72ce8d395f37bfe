"""Which library gets which patch: one line per supported library.

Keys are module names as imported by the application; values are "module:function" of a
patch function taking that module (imported only when the library is).
"""

from perfsleuth.agent.instrument import register

P = "perfsleuth.agent.instrument"
F = "perfsleuth.agent.frameworks"

# Databases (statements, rows, parameter hashes, connection-pool waits)
register("sqlite3", f"{P}.dbapi:patch_sqlite3")
register("psycopg", f"{P}.dbapi:patch_psycopg")
register("psycopg2", f"{P}.dbapi:patch_psycopg2")
register("pymysql", f"{P}.dbapi:patch_pymysql")
register("asyncpg", f"{P}.asyncpg:patch")
register("sqlalchemy", f"{P}.sqlalchemy:patch")
register("django.db.backends.sqlite3.base", f"{P}.django_db:patch_sqlite_backend")

# HTTP clients
register("urllib3", f"{P}.http:patch_urllib3")
register("httpx", f"{P}.http:patch_httpx")
register("aiohttp", f"{P}.http:patch_aiohttp")

# Caches
register("redis", f"{P}.cache:patch_redis")
register("pymemcache", f"{P}.cache:patch_pymemcache")

# Thread pools: which thread runs a request's sync code (for the stack sampler)
register("anyio.to_thread", f"{P}.threads:patch_anyio")
register("asyncio.threads", f"{P}.threads:patch_asyncio_threads")
register("concurrent.futures.thread", f"{P}.handoff:patch_futures")

# Frameworks: endpoint names come from their routers
register("starlette.applications", f"{F}.asgi:patch_starlette")
register("flask.app", f"{F}.wsgi:patch_flask")
register("django.core.handlers.base", f"{F}.django:patch_django")
register("uvicorn.server", f"{F}.asgi:patch_uvicorn")

# multiprocessing's children leave through os._exit: a finalizer flushes them
register("multiprocessing.util", "perfsleuth.agent.shipper:hook_multiprocessing")

# Heap snapshots on SIGUSR2: gunicorn resets the signal in workers, takes it in the master
register("gunicorn.workers.base", "perfsleuth.agent.heap:patch_gunicorn_worker")
register("gunicorn.arbiter", "perfsleuth.agent.heap:patch_gunicorn_arbiter")
