"""What a call's target (a SQL statement, an HTTP method and URL, a cache command and key) is
written as: its fingerprint text (literals out, so that calls differing only in values share
it), or, past the fingerprinting budget, a hash of its text.
"""

from __future__ import annotations

from typing import Any

from perfsleuth.wire import FINGERPRINT
from perfsleuth.wire import fingerprint as fpr
from perfsleuth.wire.segment import encode_json, encode_payload

MASK63 = (1 << 63) - 1
MASK64 = (1 << 64) - 1
_KIND_JSON: dict[str, bytes] = {}


def host_of(target: Any) -> str:
    """The host of an HTTP call's URL (without credentials)."""
    url = str(target[1]) if isinstance(target, tuple) and len(target) >= 2 else str(target)
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit("@", 1)[-1]


def unfingerprinted(kind: str, target: Any, text_hash: int) -> tuple[int, bytes]:
    """(id, FINGERPRINT record) of a target the writer had no CPU left to normalise: named by
    a hash of its text (statements differing in a literal differ here too), never the text
    itself. Made in a few string operations: skipping must cost far less than normalising
    (the text's hash is cached by the str; it differs between processes, as do these ids)."""
    size = len(target) if type(target) is str else 0
    fid = hash((kind, text_hash, size)) & MASK63
    kind_json = _KIND_JSON.get(kind) or _KIND_JSON.setdefault(kind, encode_json(str(kind)))
    body = b'{"id":%d,"kind":%s,"text":"[not fingerprinted: %d chars, hash %016x]","op":"OTHER"}'
    return fid, encode_payload(FINGERPRINT, body % (fid, kind_json, size, text_hash & MASK64))


def call_text(kind: str, target: Any) -> str:
    """The fingerprint text of a call (normalised SQL, URL template, cache command)."""
    return fingerprint_text(kind, target)[0]


def fingerprint_text(kind: str, t: Any) -> tuple[str, str]:
    """(fingerprint text, operation) of a call's target."""
    if kind == "db":
        text = fpr.normalize_sql(str(t))
        return text, fpr.sql_operation(text)
    if kind == "http":
        method, url = (t[0], t[1]) if isinstance(t, tuple) else ("GET", str(t))
        rest = str(url).split("://", 1)[-1]
        host, _, path = rest.partition("/")
        host = host.rsplit("@", 1)[-1]  # never keep credentials in a URL
        return f"{str(method).upper()} {host}{fpr.url_template('/' + path)}", str(method).upper()
    if isinstance(t, tuple):
        cmd = str(t[0]).upper()
        key = fpr.cache_key_template(str(t[1])) if len(t) > 1 and t[1] is not None else ""
        return (f"{cmd} {key}".strip(), cmd)
    return (str(t).upper(), str(t).upper())
