"""Time windows of API requests: ``since`` (15m, 1h, 24h, 7d, all) looking back from now, or
all data, with the fleet filters (one host, one service), and the time buckets charts use."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from perfsleuth.analysis import text

# Chart buckets: the smallest of these giving at most MAX_BUCKETS points over the window.
STEPS_S = (1, 5, 10, 30, 60, 300, 600, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400)
MAX_BUCKETS = 120
WEEK = timedelta(days=7)


class BadRange(ValueError):
    """A time range the API cannot use; the message says how to write one."""


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def parse_duration(value: str) -> timedelta:
    seconds = text.span_seconds(value)
    if seconds is None:
        raise BadRange(
            f"invalid since {value!r}: use a number and a unit (s, m, h, d, w) such as 15m, "
            "1h, 24h or 7d, or 'all'"
        )
    if not 1 <= seconds <= 10 * 365 * 86400:
        raise BadRange(f"invalid since {value!r}: between 1 second and ten years")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class Window:
    """[start, end) in naive UTC; ``since`` when it is relative to now (what store.top and
    friends take), None for all data or an absolute range. ``host`` / ``service``: only the
    requests of that host or service (None: all; "": those that carry none)."""

    start: datetime | None
    end: datetime | None
    since: timedelta | None
    label: str
    host: str | None = None
    service: str | None = None

    @property
    def only(self) -> dict[str, str]:
        """The fleet filters as the store's ``only`` argument."""
        return {k: v for k, v in (("host", self.host), ("service", self.service)) if v is not None}

    @property
    def relative(self) -> bool:
        return self.since is not None and self.end is None

    def bounds(self, first: datetime | None, last: datetime | None) -> tuple[datetime, datetime]:
        """Concrete [start, end] for charts: open ends take the data's first/last time."""
        now = utcnow()
        end = self.end or (now if self.since is not None else (last or now))
        start = self.start or first or end - timedelta(hours=1)
        if end <= start:
            end = start + timedelta(seconds=1)
        return start, end


def window(since: str | None, host: str | None = None, service: str | None = None) -> Window:
    if since is None or since.strip().lower() in ("", "all"):
        return Window(None, None, None, "all", host, service)
    d = parse_duration(since)
    return Window(utcnow() - d, None, d, since.strip(), host, service)


def step_seconds(start: datetime, end: datetime) -> int:
    span = (end - start).total_seconds()
    for s in STEPS_S:
        if span / s <= MAX_BUCKETS:
            return s
    return STEPS_S[-1] * max(1, int(span / STEPS_S[-1] / MAX_BUCKETS) + 1)
