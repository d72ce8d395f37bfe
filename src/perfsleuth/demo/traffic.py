"""The demo's traffic: a weighted mix over every demo endpoint from several tenants, one of them
(megacorp) much larger, sent by a few keep-alive client threads."""

from __future__ import annotations

import http.client
import random
import re
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from typing import Any

from perfsleuth.demo import db

SEARCH_TERMS = ("lamp", "ketle", "cedr", "backpak", "jaket", "sierra", "glaicer", "mug")
# tenant -> share of traffic: megacorp sends a fifth of the requests but, being big, costs more.
TENANT_WEIGHTS = {db.BIG_TENANT: 20, **{t: 20 for t in db.TENANTS}}


class Client:
    """One keep-alive connection per server, reconnecting after errors."""

    def __init__(self, base: str) -> None:
        u = urllib.parse.urlsplit(base)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.conn: http.client.HTTPConnection | None = None

    def request(
        self, method: str, path: str, headers: dict[str, str], body: bytes | None = None
    ) -> int:
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                self.conn.request(method, path, body=body, headers=headers)
                resp = self.conn.getresponse()
                resp.read()
                return resp.status
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    return 0
        return 0


# A note's pasted log: 300 KB to 3 MB, log-uniform (as many notes of 300-950 KB as of 0.95-3 MB).
# The ten-fold spread lets the size's share of the time show through the delays a busy machine
# adds to each request; 0.6-1.2 MB did not (busy runs: Pearson r = 0.30 against duration over
# 6 requests, -0.49 against CPU time in another).
NOTE_BYTES = (300_000, 3_000_000)


def note_size(rng: random.Random) -> int:
    low, high = NOTE_BYTES
    return int(low * (high / low) ** rng.random())


def _note_body(rng: random.Random) -> bytes:
    fields = {
        "customer_id": str(rng.randrange(1, db.CUSTOMERS)),
        "subject": "Order arrived damaged",
        "body": "pasted log: " + "x" * note_size(rng),
        "priority": "high",
        "channel": "email",
        "agent": "sam",
        "tags": "damage,refund",
        "lang": "en",
    }
    return urllib.parse.urlencode(fields).encode()


ENDPOINTS = 13  # distinct endpoints in the mix below
# Endpoints whose detector fits a line, not a count: large_request_body correlates the notes'
# time with their size, which a handful of requests on a busy machine does not settle.
MIN_EACH = {("POST", "/admin/notes"): 12}


def _key(req: tuple[str, str, str, bytes | None]) -> tuple[str, str]:
    """(method, path with numbers folded): one key per endpoint of the mix."""
    return req[1], re.sub(r"\d+", "N", req[2].split("?")[0])


def _pick(
    rng: random.Random, customers: dict[str, list[int]]
) -> tuple[str, str, str, bytes | None]:
    """(server, method, path, body) of one request."""
    tenant = rng.choices(list(TENANT_WEIGHTS), weights=list(TENANT_WEIGHTS.values()))[0]
    cid = rng.choice(customers[tenant])
    order_id = rng.randrange(1, 59_000)
    mix: list[tuple[int, tuple[str, str, str, bytes | None]]] = [
        (4, ("shop", "GET", "/health", None)),
        (12, ("shop", "GET", f"/products?page={rng.randrange(1, 25)}", None)),
        (14, ("shop", "GET", f"/products/{rng.randrange(1, db.PRODUCTS + 1)}", None)),
        (18, ("shop", "GET", f"/orders/{order_id}", None)),
        (12, ("shop", "GET", f"/customers/{cid}/orders", None)),
        (1, ("shop", "GET", "/reports/top-customers", None)),
        (5, ("shop", "GET", f"/shipping/quote?customer_id={cid}&weight_g=1200", None)),
        (1, ("shop", "POST", "/catalog/import", b'{"feed": "northwind"}')),
        (2, ("shop", "GET", f"/search?q={rng.choice(SEARCH_TERMS)}", None)),
        (10, ("legacy", "GET", f"/admin/customers/{cid}", None)),
        (1, ("legacy", "GET", f"/admin/export.csv?page={rng.randrange(1, 7)}", None)),
        (2, ("legacy", "POST", "/admin/notes", None)),
        (2, ("legacy", "GET", "/admin/health", None)),
    ]
    server, method, path, body = rng.choices([m for _, m in mix], weights=[w for w, _ in mix])[0]
    if path == "/admin/notes":
        body = _note_body(rng)
    return server, method, path, body


def drive(
    shop_url: str,
    legacy_url: str,
    seconds: float,
    *,
    concurrency: int = 8,
    seed: int = 7,
    min_each: int = 6,
    on_progress: Callable[[float, int], Any] | None = None,
) -> dict[str, Any]:
    """Send the mix for ``seconds`` from ``concurrency`` threads; returns counts by status.

    Every endpoint is requested at least once first, so even a short run covers all of them,
    and the run goes on past ``seconds`` until each has been requested ``min_each`` times
    (``MIN_EACH`` for those that need more): on a slow or busy machine a short run still has
    enough of every endpoint for the detectors (their ``min_requests`` are 3 to 5), which a
    time-bound mix alone does not promise.
    """
    customers = {t: db.customers_of(t) for t in TENANT_WEIGHTS}
    lock = threading.Lock()
    statuses: Counter[int] = Counter()
    sent = [0]
    deadline = time.monotonic() + seconds
    began = time.monotonic()

    per_endpoint: Counter[tuple[str, str]] = Counter()

    def send(clients: dict[str, Client], rng: random.Random, req: tuple) -> None:
        server, method, path, body = req
        tenant = rng.choices(list(TENANT_WEIGHTS), weights=list(TENANT_WEIGHTS.values()))[0]
        headers = {"X-Tenant": tenant, "X-User": f"{tenant}-user{rng.randrange(1, 30)}"}
        if body is not None:
            ctype = (
                "application/json" if body.startswith(b"{") else "application/x-www-form-urlencoded"
            )
            headers["Content-Type"] = ctype
        status = clients[server].request(method, path, headers, body)
        with lock:
            statuses[status] += 1
            sent[0] += 1
            per_endpoint[_key(req)] += 1

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        clients = {"shop": Client(shop_url), "legacy": Client(legacy_url)}
        while time.monotonic() < deadline:
            send(clients, rng, _pick(rng, customers))

    # One of each first: every endpoint appears even in a very short run.
    rng0 = random.Random(seed)
    first = {"shop": Client(shop_url), "legacy": Client(legacy_url)}
    seen: set[tuple[str, str]] = set()
    while len(seen) < ENDPOINTS:
        req = _pick(rng0, customers)
        if _key(req) not in seen:
            seen.add(_key(req))
            send(first, rng0, req)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if on_progress is not None:
            on_progress(min(time.monotonic() - began, seconds), sent[0])
        time.sleep(0.25)
    for t in threads:
        t.join()
    # Top up the endpoints a slow run left short (rare ones are drawn from the same mix).
    while True:
        short = {k for k in seen if per_endpoint[k] < max(min_each, MIN_EACH.get(k, 0))}
        if not short:
            break
        req = _pick(rng0, customers)
        if _key(req) in short:
            send(first, rng0, req)
    if on_progress is not None:
        on_progress(seconds, sent[0])
    elapsed = time.monotonic() - began
    errors = sum(n for s, n in statuses.items() if s == 0 or s >= 500)
    return {
        "requests": sent[0],
        "seconds": round(elapsed, 1),
        "errors": errors,
        "statuses": {str(s): n for s, n in sorted(statuses.items())},
    }
