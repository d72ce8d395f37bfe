"""What the WSGI, ASGI and Django integrations and the shipper share: endpoint names from a
method and a router template, the identity (user/tenant) headers of the agent's config, bounded
header values, the request size and the tags of ``perfsleuth load``'s requests.

It imports only the recorder, so every integration and the shipper can import it."""

from __future__ import annotations

from typing import Any

from perfsleuth.agent import recorder

_current = recorder._current

STANDARD_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"}
)
# Never recorded, even when configured as the user/tenant header.
SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "x-auth-token"}
)
MAX_IDENTITY_CHARS = 256


def method_label(method: str) -> str:
    """The method as used in endpoint names: arbitrary client tokens collapse into OTHER."""
    return method if method in STANDARD_METHODS else "OTHER"


def unmatched(method: str) -> str:
    return method_label(method) + " <unmatched>"


def endpoint(method: str, template: str) -> str:
    return f"{method_label(method)} {template}"


class Identity:
    """The configured user/tenant header names in the forms each server interface uses."""

    __slots__ = ("tenant_b", "tenant_env", "user_b", "user_env")

    def __init__(self, user: str, tenant: str) -> None:
        u = _safe_header(user)
        t = _safe_header(tenant)
        self.user_b = u.encode("latin-1") if u else None  # ASGI: lowercased bytes names
        self.tenant_b = t.encode("latin-1") if t else None
        self.user_env = _environ_key(u) if u else None  # WSGI / Django META
        self.tenant_env = _environ_key(t) if t else None


def _safe_header(name: str) -> str | None:
    name = (name or "").strip().lower()
    if not name or name in SECRET_HEADERS:
        return None
    return name


def _environ_key(name: str) -> str:
    return "HTTP_" + name.upper().replace("-", "_")


_identity = Identity("x-user", "x-tenant")  # the settings' defaults, until configure()


def configure(cfg: Any) -> None:
    """Take the identity header names from the agent's config (the shipper's start calls it)."""
    global _identity
    _identity = Identity(cfg.user_header or "", cfg.tenant_header or "")


def identity() -> Identity:
    """The identity header names of the running agent's config."""
    return _identity


def identity_value(raw: Any) -> str | None:
    """A header value as stored (bounded); bytes from ASGI are latin-1 per the HTTP spec."""
    if raw is None:
        return None
    if type(raw) is bytes:  # ASGI's: the common case first
        return raw[:MAX_IDENTITY_CHARS].decode("latin-1") or None
    if isinstance(raw, bytearray):
        raw = bytes(raw[:MAX_IDENTITY_CHARS]).decode("latin-1")
    return str(raw)[:MAX_IDENTITY_CHARS] or None


def content_length(raw: Any) -> int | None:
    if raw is None:
        return None
    try:
        n = int(raw)
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


def read_environ(req: recorder.ActiveRequest, environ: Any) -> bool:
    """Identity headers and request size from a WSGI environ / Django ``request.META``: whether
    the request has a body (a Content-Length above 0, or a chunked one)."""
    ident = identity()
    if ident.user_env is not None:
        v = environ.get(ident.user_env)
        if v:
            req.user = identity_value(v)
    if ident.tenant_env is not None:
        v = environ.get(ident.tenant_env)
        if v:
            req.tenant = identity_value(v)
    v = environ.get(LOAD_ENV)
    if v:
        load_tags(req, v)
    size = environ.get("CONTENT_LENGTH")
    if size in _NO_BODY:
        req.req_bytes = 0
        return "HTTP_TRANSFER_ENCODING" in environ
    req.req_bytes = content_length(size) or 0
    return True


_NO_BODY = (None, "", "0")  # CONTENT_LENGTH of a request without a body


# ``perfsleuth load`` marks its requests "<run id>;<side>": tags load_run and load_side, so that
# ``compare --by tag:load_side`` can split the targets' data by side.
LOAD_HEADER = "x-perfsleuth-load"
LOAD_ENV = "HTTP_X_PERFSLEUTH_LOAD"


def load_tags(req: recorder.ActiveRequest, raw: Any) -> None:
    value = identity_value(raw)
    if not value:
        return
    run, _, side = value.partition(";")
    tags = req.tags
    if tags is None:
        tags = req.tags = {}
    tags["load_run"] = run[:64]
    if side:
        tags["load_side"] = side[:64]


def set_endpoint(template: str | None, method: str | None = None) -> None:
    """Name the current request's endpoint from a router template (first router wins)."""
    req = _current.get()
    if req is None or req.endpoint or not template:
        return
    req.endpoint = endpoint(method or req.method, template)
