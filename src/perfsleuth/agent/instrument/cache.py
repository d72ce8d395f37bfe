"""Caches: redis-py (sync and ``redis.asyncio``) and pymemcache.

Every cache command issued inside a request becomes one ``cache`` call whose target is
``(COMMAND, first key or None)``; the writer thread templates the key
(``user:123:profile`` -> ``user:{id}:profile``). Values and any other argument are never
read or stored, and a key is only taken from commands known to carry one at that position:
``AUTH``, ``HELLO``, ``CONFIG SET``, ``ACL SETUSER``, ``ECHO``, scripts' bodies and module
commands we do not know are recorded by command name only.

Reads report ``hit``: ``GET``-like reads (``GET``, ``GETEX``, ``GETDEL``, ``HGET``,
``LINDEX``, ``JSON.GET``; pymemcache ``get``/``gets``) hit when a value came back, and
``bytes`` is the length of a ``bytes``/``str`` value; ``HGETALL`` hits when the hash is not
empty; multi-key reads (``MGET``, ``HMGET``, ``JSON.MGET``; pymemcache ``get_many``/
``gets_many``) record ``extra={"hits": h, "misses": m}`` and hit only when nothing missed.

* **redis-py** -- ``Redis.execute_command`` (every command method calls it), and on
  ``Pipeline``: ``execute`` (one call, target ``("PIPELINE", None)``,
  ``extra={"commands": n}``) and ``immediate_execute_command`` (``WATCH`` and the commands
  issued between ``WATCH`` and ``MULTI``). Buffering a command in a pipeline is not a round
  trip and is not recorded. The same four methods of ``redis.asyncio``.
* **pymemcache** -- the command methods of ``pymemcache.client.base.Client`` (aliases such
  as ``get_multi`` included). ``PooledClient``, ``HashClient`` and ``RetryingClient`` call a
  ``Client``, so each command is recorded once, with the key as the application gave it
  (no ``key_prefix``).

Outside a request ``start_call`` returns None and the wrappers only forward the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from perfsleuth.agent import recorder
from perfsleuth.agent.instrument._patch import mark, patch

_start_call = recorder.start_call
_internal_error = recorder.internal_error

# ---------------------------------------------------------------------------------------------
# Which argument is a command's first key (redis-py passes the command name first).

_KEY_FIRST = """
    GET SET SETEX PSETEX SETNX GETEX GETDEL GETSET GETRANGE SETRANGE SUBSTR STRLEN APPEND
    INCR INCRBY INCRBYFLOAT DECR DECRBY MGET MSET MSETNX MSETEX DEL UNLINK EXISTS TYPE
    EXPIRE PEXPIRE EXPIREAT PEXPIREAT EXPIRETIME PEXPIRETIME TTL PTTL PERSIST RENAME RENAMENX
    DUMP RESTORE TOUCH COPY LCS SORT SORT_RO WATCH
    HGET HSET HSETNX HMSET HMGET HGETALL HDEL HEXISTS HINCRBY HINCRBYFLOAT HKEYS HVALS HLEN
    HSTRLEN HSCAN HRANDFIELD HGETDEL HGETEX HSETEX HEXPIRE HPEXPIRE HEXPIREAT HPEXPIREAT HTTL
    HPTTL HEXPIRETIME HPEXPIRETIME HPERSIST
    LPUSH RPUSH LPUSHX RPUSHX LPOP RPOP LRANGE LLEN LINDEX LSET LREM LTRIM LINSERT LPOS LMOVE
    RPOPLPUSH BLPOP BRPOP BLMOVE BRPOPLPUSH
    SADD SREM SMEMBERS SISMEMBER SMISMEMBER SCARD SPOP SRANDMEMBER SMOVE SINTER SUNION SDIFF
    SINTERSTORE SUNIONSTORE SDIFFSTORE SSCAN
    ZADD ZREM ZRANGE ZREVRANGE ZRANGEBYSCORE ZREVRANGEBYSCORE ZRANGEBYLEX ZREVRANGEBYLEX
    ZRANGESTORE ZSCORE ZMSCORE ZINCRBY ZCARD ZCOUNT ZLEXCOUNT ZRANK ZREVRANK ZREMRANGEBYRANK
    ZREMRANGEBYSCORE ZREMRANGEBYLEX ZPOPMIN ZPOPMAX BZPOPMIN BZPOPMAX ZSCAN ZRANDMEMBER
    ZUNIONSTORE ZINTERSTORE ZDIFFSTORE
    PFADD PFCOUNT PFMERGE
    GEOADD GEODIST GEOHASH GEOPOS GEORADIUS GEORADIUSBYMEMBER GEORADIUS_RO
    GEORADIUSBYMEMBER_RO GEOSEARCH GEOSEARCHSTORE
    XADD XLEN XRANGE XREVRANGE XDEL XTRIM XACK XCLAIM XAUTOCLAIM XPENDING
    SETBIT GETBIT BITCOUNT BITPOS BITFIELD BITFIELD_RO
    JSON.GET JSON.SET JSON.DEL JSON.FORGET JSON.MGET JSON.TYPE JSON.MERGE JSON.NUMINCRBY
    JSON.STRLEN JSON.STRAPPEND JSON.ARRAPPEND JSON.ARRLEN JSON.ARRPOP JSON.OBJKEYS JSON.OBJLEN
    JSON.CLEAR JSON.TOGGLE
"""
_KEY_POS: dict[str, int] = dict.fromkeys(_KEY_FIRST.split(), 1)
_KEY_POS.update(
    {
        # redis-py sends some two-word commands as one string
        "XINFO STREAM": 1,
        "XINFO GROUPS": 1,
        "XINFO CONSUMERS": 1,
        "XGROUP CREATE": 1,
        "XGROUP DESTROY": 1,
        "XGROUP SETID": 1,
        "XGROUP CREATECONSUMER": 1,
        "XGROUP DELCONSUMER": 1,
        "MEMORY USAGE": 1,
        "OBJECT": 2,  # OBJECT ENCODING key
        "BITOP": 2,  # BITOP AND destkey key ...
        # script, numkeys, key ...: a key only when numkeys > 0 (see _first_key)
        "EVAL": 3,
        "EVALSHA": 3,
        "EVAL_RO": 3,
        "EVALSHA_RO": 3,
        "FCALL": 3,
        "FCALL_RO": 3,
    }
)
_NUMKEYS = frozenset(("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"))

_SINGLE_READS = frozenset(("GET", "GETEX", "GETDEL", "HGET", "LINDEX", "JSON.GET"))
_MULTI_READS = frozenset(("MGET", "HMGET", "JSON.MGET"))
_NONEMPTY_READS = frozenset(("HGETALL",))
_READS = _SINGLE_READS | _MULTI_READS | _NONEMPTY_READS

_PIPELINE = ("PIPELINE", None)


def _key(key: Any) -> Any:
    """The key as text (bytes decoded), or None for a type whose text is meaningless."""
    if type(key) is str:
        return key
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key).decode("utf-8", "replace")
    if isinstance(key, (str, int, float)):
        return str(key)
    return None


def _command_name(cmd: Any) -> Any:
    if isinstance(cmd, (bytes, bytearray, memoryview)):
        cmd = bytes(cmd).decode("ascii", "replace")
    return str(cmd).upper()


def _first_key(cmd: str, pos: int, args: tuple[Any, ...]) -> Any:
    if cmd in _NUMKEYS:
        try:
            if int(args[2]) <= 0:
                return None
        except (IndexError, TypeError, ValueError):
            return None
    return _key(args[pos]) if len(args) > pos else None


def _redis_target(call: recorder.Call, args: tuple[Any, ...]) -> Any:
    """Set ``call.target`` = (COMMAND, first key); returns COMMAND (None if unknown)."""
    try:
        cmd = args[0]
        pos = _KEY_POS.get(cmd) if type(cmd) is str else None
        if pos is None:  # lower case, bytes, keyless or unknown: the slow path
            cmd = _command_name(cmd)
            pos = _KEY_POS.get(cmd)
            if pos is None:
                call.target = (cmd, None)
                return cmd
        if pos == 1 and len(args) > 1:
            key = args[1]
            call.target = (cmd, key if type(key) is str else _key(key))
        else:
            call.target = (cmd, _first_key(cmd, pos, args))
        return cmd
    except Exception:
        call.target = ("UNKNOWN", None)
        _internal_error()
        return None


def _value_bytes(value: Any) -> int | None:
    if type(value) is bytes or type(value) is str:
        return len(value)
    return None


def _redis_read(call: recorder.Call, cmd: str, result: Any) -> None:
    try:
        if cmd in _SINGLE_READS:
            call.hit = result is not None
            if result is not None:
                call.bytes = _value_bytes(result)
        elif cmd in _MULTI_READS:
            if isinstance(result, list):
                misses = result.count(None)
                call.hit = misses == 0
                call.extra = {"hits": len(result) - misses, "misses": misses}
        elif result is not None:  # HGETALL: {} (or []) when the key does not exist
            call.hit = len(result) > 0
    except Exception:
        _internal_error()


# ---------------------------------------------------------------------------------------------
# redis-py


def _wrap_redis_command(orig: Callable[..., Any]) -> Callable[..., Any]:
    def execute_command(self: Any, *args: Any, **options: Any) -> Any:
        call = _start_call("cache", "redis", None)
        if call is None:
            return orig(self, *args, **options)
        # fast path inline (cannot raise): an upper-case command with its key first
        cmd = args[0] if args else None
        if type(cmd) is str and _KEY_POS.get(cmd) == 1 and len(args) > 1 and type(args[1]) is str:
            call.target = (cmd, args[1])
        else:
            cmd = _redis_target(call, args)
        try:
            result = orig(self, *args, **options)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        if cmd in _READS:
            _redis_read(call, cmd, result)
        return result

    return mark(execute_command, orig)


def _wrap_redis_command_async(orig: Callable[..., Any]) -> Callable[..., Any]:
    async def execute_command(self: Any, *args: Any, **options: Any) -> Any:
        call = _start_call("cache", "redis", None)
        if call is None:
            return await orig(self, *args, **options)
        # fast path inline (cannot raise): an upper-case command with its key first
        cmd = args[0] if args else None
        if type(cmd) is str and _KEY_POS.get(cmd) == 1 and len(args) > 1 and type(args[1]) is str:
            call.target = (cmd, args[1])
        else:
            cmd = _redis_target(call, args)
        try:
            result = await orig(self, *args, **options)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        if cmd in _READS:
            _redis_read(call, cmd, result)
        return result

    return mark(execute_command, orig)


def _pipeline_size(pipe: Any) -> int:
    """Commands queued in a pipeline; -1 when nothing would be sent (execute returns [])."""
    try:
        n = len(pipe.command_stack)
        if n == 0 and not getattr(pipe, "watching", False):
            return -1
        return n
    except Exception:
        _internal_error()
        return 0


def _wrap_pipeline_execute(orig: Callable[..., Any]) -> Callable[..., Any]:
    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        n = _pipeline_size(self)
        call = _start_call("cache", "redis", _PIPELINE) if n >= 0 else None
        if call is None:
            return orig(self, *args, **kwargs)
        call.extra = {"commands": n}
        try:
            return orig(self, *args, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            raise
        finally:
            call.finish()

    return mark(execute, orig)


def _wrap_pipeline_execute_async(orig: Callable[..., Any]) -> Callable[..., Any]:
    async def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        n = _pipeline_size(self)
        call = _start_call("cache", "redis", _PIPELINE) if n >= 0 else None
        if call is None:
            return await orig(self, *args, **kwargs)
        call.extra = {"commands": n}
        try:
            return await orig(self, *args, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            raise
        finally:
            call.finish()

    return mark(execute, orig)


def _patch_redis_module(client: Any, *, is_async: bool) -> None:
    command = _wrap_redis_command_async if is_async else _wrap_redis_command
    execute = _wrap_pipeline_execute_async if is_async else _wrap_pipeline_execute
    patch(client.Redis, "execute_command", command)
    pipeline = getattr(client, "Pipeline", None)
    if pipeline is not None:
        patch(pipeline, "execute", execute)
        patch(pipeline, "immediate_execute_command", command)


def patch_redis(module: ModuleType) -> None:
    import redis.client

    _patch_redis_module(redis.client, is_async=False)
    try:
        import redis.asyncio.client
    except ImportError:  # redis-py < 4.2: no asyncio client
        return
    _patch_redis_module(redis.asyncio.client, is_async=True)


# ---------------------------------------------------------------------------------------------
# pymemcache


def _one_key(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    key = args[0] if args else kwargs.get(name)
    return key if type(key) is str else _key(key)


def _keys_info(keys: Any) -> tuple[Any, int | None]:
    """(first key, number of keys) of a get_many/set_many/delete_many argument, without
    consuming an iterator (a generator gives (None, None))."""
    if type(keys) is list or type(keys) is tuple:
        return (_key(keys[0]) if keys else None), len(keys)
    if isinstance(keys, (dict, set, frozenset)):
        return (_key(next(iter(keys))) if keys else None), len(keys)
    return None, None


def _wrap_mc(orig: Callable[..., Any], cmd: str) -> Callable[..., Any]:
    """A keyed command whose result is not inspected (set, delete, incr, ...)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call("cache", "memcached", None)
        if call is None:
            return orig(self, *args, **kwargs)
        try:
            call.target = (cmd, _one_key(args, kwargs, "key"))
        except Exception:
            call.target = (cmd, None)
            _internal_error()
        try:
            return orig(self, *args, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            raise
        finally:
            call.finish()

    return mark(method, orig)


def _wrap_mc_nokey(orig: Callable[..., Any], cmd: str) -> Callable[..., Any]:
    target = (cmd, None)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call("cache", "memcached", target)
        if call is None:
            return orig(self, *args, **kwargs)
        try:
            return orig(self, *args, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            raise
        finally:
            call.finish()

    return mark(method, orig)


def _wrap_mc_get(orig: Callable[..., Any], cmd: str) -> Callable[..., Any]:
    """``get(key, default=None)`` / ``gets(key, default=None, cas_default=None)``: hit when
    the result is not the default the library returns for a miss."""
    gets = cmd == "GETS"

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call("cache", "memcached", None)
        if call is None:
            return orig(self, *args, **kwargs)
        try:
            call.target = (cmd, _one_key(args, kwargs, "key"))
        except Exception:
            call.target = (cmd, None)
            _internal_error()
        try:
            result = orig(self, *args, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        try:
            if gets:
                cas_default = args[2] if len(args) > 2 else kwargs.get("cas_default")
                call.hit = result[1] is not cas_default
                value = result[0]
            else:
                default = args[1] if len(args) > 1 else kwargs.get("default")
                call.hit = result is not default
                value = result
            if call.hit:
                call.bytes = _value_bytes(value)
        except Exception:
            _internal_error()
        return result

    return mark(method, orig)


def _wrap_mc_many(orig: Callable[..., Any], cmd: str) -> Callable[..., Any]:
    """``get_many(keys)`` and friends: first key; reads also count hits and misses."""
    read = cmd.startswith("GET")
    arg = "values" if cmd == "SET_MANY" else "keys"

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start_call("cache", "memcached", None)
        if call is None:
            return orig(self, *args, **kwargs)
        n: int | None = None
        try:
            first, n = _keys_info(args[0] if args else kwargs.get(arg))
            call.target = (cmd, first)
            if not read:
                call.extra = {"keys": n}
        except Exception:
            call.target = (cmd, None)
            _internal_error()
        try:
            result = orig(self, *args, **kwargs)
        except BaseException as exc:
            call.error = type(exc).__name__
            call.finish()
            raise
        call.finish()
        if read:
            try:
                hits = len(result)
                if n is not None:
                    call.hit = hits >= n
                    call.extra = {"hits": hits, "misses": max(0, n - hits)}
                else:
                    call.extra = {"hits": hits}
            except Exception:
                _internal_error()
        return result

    return mark(method, orig)


_MEMCACHE: dict[str, tuple[Callable[[Callable[..., Any], str], Callable[..., Any]], str]] = {
    "get": (_wrap_mc_get, "GET"),
    "gets": (_wrap_mc_get, "GETS"),
    "get_many": (_wrap_mc_many, "GET_MANY"),
    "gets_many": (_wrap_mc_many, "GETS_MANY"),
    "set": (_wrap_mc, "SET"),
    "set_many": (_wrap_mc_many, "SET_MANY"),
    "add": (_wrap_mc, "ADD"),
    "replace": (_wrap_mc, "REPLACE"),
    "append": (_wrap_mc, "APPEND"),
    "prepend": (_wrap_mc, "PREPEND"),
    "cas": (_wrap_mc, "CAS"),
    "delete": (_wrap_mc, "DELETE"),
    "delete_many": (_wrap_mc_many, "DELETE_MANY"),
    "incr": (_wrap_mc, "INCR"),
    "decr": (_wrap_mc, "DECR"),
    "touch": (_wrap_mc, "TOUCH"),
    "stats": (_wrap_mc_nokey, "STATS"),
    "version": (_wrap_mc_nokey, "VERSION"),
    "flush_all": (_wrap_mc_nokey, "FLUSH_ALL"),
}


def patch_pymemcache(module: ModuleType) -> None:
    import pymemcache.client.base

    cls = pymemcache.client.base.Client
    for name, (wrap, cmd) in _MEMCACHE.items():
        patch(cls, name, functools.partial(_bound, wrap, cmd))


def _bound(
    wrap: Callable[[Callable[..., Any], str], Callable[..., Any]], cmd: str, orig: Any
) -> Callable[..., Any]:
    return wrap(orig, cmd)
