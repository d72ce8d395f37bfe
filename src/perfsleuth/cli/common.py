"""Shared plumbing for the CLI: errors and exit codes, option types, parsing and output."""

from __future__ import annotations

import datetime as _dt
import decimal
import functools
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from perfsleuth.analysis import text
from perfsleuth.store.base import Damage, IngestReport, Store, StoreError, StoreLocked
from perfsleuth.suggest import did_you_mean

EXIT_STATE = 1  # the store cannot be used right now (locked, empty, I/O)
EXIT_USAGE = 2  # bad input
EXIT_DAMAGED = 3  # ingest found damaged spool data
EXIT_INTERRUPTED = 130

DEFAULT_DATA = ".perfsleuth"

DataOpt = Annotated[
    str,
    typer.Option(
        "--data",
        envvar="PERFSLEUTH_DATA",
        metavar="DIR",
        help="Data directory (spool and database).",
        show_envvar=True,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON only (nothing else on stdout).")
]
SinceOpt = Annotated[
    str | None,
    typer.Option("--since", metavar="AGE", help="Only requests newer than this: 15m, 1h, 24h, 7d."),
]

PortOpt = Annotated[int, typer.Option("--port", help="Port to listen on.")]


def split_hosts(allow_host: list[str] | None) -> list[str]:
    """The host names of repeated ``--allow-host`` values, each maybe comma-separated."""
    return [h.strip() for v in allow_host or () for h in v.split(",") if h.strip()]


class CLIError(Exception):
    """A problem the user can act on: one sentence on stderr and a non-zero exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def one_line(message: object) -> str:
    """The first meaningful line of an error message (engines like to add caret diagrams)."""
    for line in str(message).splitlines():
        line = line.strip()
        if line:
            return line
    return str(message).strip() or "unknown error"


def fail(message: str, code: int) -> NoReturn:
    typer.echo(f"perfsleuth: {one_line(message)}", err=True)
    raise typer.Exit(code)


F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn the errors a user can act on into one line on stderr and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CLIError as e:
            fail(e.message, e.code)
        except StoreLocked as e:
            fail(str(e), EXIT_STATE)
        except StoreError as e:
            fail(str(e), EXIT_STATE)
        except KeyboardInterrupt:
            fail("interrupted", EXIT_INTERRUPTED)

    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- parsing


def parse_since(value: str | None) -> timedelta | None:
    """'15m', '1h', '24h', '7d' (also s and w) -> timedelta; None or 'all' -> None."""
    if value is None or value.strip().lower() in ("", "all"):
        return None
    seconds = text.span_seconds(value)
    if seconds is None:
        raise CLIError(
            f"invalid --since {value!r}: use a number and a unit (s, m, h, d, w), "
            "like 15m, 1h, 24h or 7d"
        )
    if seconds < 1:
        raise CLIError(f"invalid --since {value!r}: the window must be a second or longer")
    if seconds > 100 * 365 * 86400:
        raise CLIError(f"invalid --since {value!r}: that is more than a hundred years")
    return timedelta(seconds=seconds)


def positive(value: int | None, flag: str) -> None:
    if value is not None and value <= 0:
        raise CLIError(f"invalid {flag} {value}: it must be a positive number")


# ---------------------------------------------------------------------------------- output


def out_console() -> Console:
    """Console for stdout; wide when not a terminal so piped tables do not wrap."""
    width = None
    if not sys.stdout.isatty() and not os.environ.get("COLUMNS"):
        width = 200
    return Console(highlight=False, width=width, soft_wrap=False)


def err_console() -> Console:
    return Console(stderr=True, highlight=False)


def _json_default(o: Any) -> Any:
    if isinstance(o, _dt.datetime | _dt.date | _dt.time):
        return o.isoformat()
    if isinstance(o, _dt.timedelta):
        return o.total_seconds()
    if isinstance(o, decimal.Decimal):
        return float(o)
    if isinstance(o, bytes | bytearray | memoryview):
        return bytes(o).hex()
    if isinstance(o, uuid.UUID):
        return str(o)
    if isinstance(o, set | frozenset | tuple):
        return list(o)
    return str(o)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=_json_default, ensure_ascii=False, indent=2) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------- the store


def spool_bytes(data_dir: str) -> int:
    """Bytes waiting in the spool (closed and open segments)."""
    try:
        return sum(
            e.stat().st_size
            for e in os.scandir(os.path.join(data_dir, "spool"))
            if e.is_file() and e.name.endswith((".seg", ".open"))
        )
    except OSError:
        return 0


def open_checked(data_dir: str, *, read_only: bool = False) -> Store:
    from perfsleuth.store import open_store

    if read_only and not os.path.isdir(data_dir):
        raise CLIError(empty_message(data_dir), EXIT_STATE)
    return open_store(data_dir, read_only=read_only)


def close_quietly(store: Store) -> None:
    try:
        store.close()
    except Exception:
        pass


@contextmanager
def opened(data_dir: str, *, read_only: bool = False) -> Iterator[Store]:
    store = open_checked(data_dir, read_only=read_only)
    try:
        yield store
    finally:
        close_quietly(store)


@contextmanager
def store_for_reading(data_dir: str, *, ingest: bool) -> Iterator[Store]:
    """A store with the spool ingested first (quietly, damage still warned about) when
    ``ingest``. When another process holds the database for writing, reading goes on without
    ingesting if the engine allows it."""
    if not ingest:
        with opened(data_dir, read_only=os.path.isdir(data_dir)) as store:
            yield store
        return
    try:
        store = open_checked(data_dir)
        writable = True
    except StoreLocked:
        store = open_checked(data_dir, read_only=True)
        writable = False
        typer.echo(
            "perfsleuth: the database is busy (locked by another process), "
            "showing what is already ingested",
            err=True,
        )
    try:
        if writable:
            warn_damage(store.ingest(), data_dir)
        yield store
    finally:
        close_quietly(store)


def empty_message(data_dir: str) -> str:
    return (
        f"no requests recorded yet in {data_dir} — run your app under "
        "`perfsleuth run -- ...` or try `perfsleuth demo`"
    )


def ensure_not_empty(store: Store, data_dir: str) -> list[str]:
    endpoints = store.endpoints()
    if not endpoints:
        raise CLIError(empty_message(data_dir), EXIT_STATE)
    return endpoints


def _base(name: str) -> str:
    name = os.path.basename(name)
    for suffix in (".seg", ".open"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def damage_sentences(report: IngestReport, data_dir: str) -> list[str]:
    corrupt = os.path.join(data_dir, "spool", "corrupt") + os.sep
    quarantined = {_base(q): os.path.basename(q) for q in report.quarantined}
    out = []
    by_segment: dict[str, list[Damage]] = {}
    for d in report.damaged:
        by_segment.setdefault(os.path.basename(d.segment), []).append(d)
    for name, ds in by_segment.items():
        where = (
            f"the file was moved to {corrupt}"
            if _base(name) in quarantined
            else "the file stays in the spool until its writer is done"
        )
        reasons = sorted({d.reason for d in ds if d.reason})
        why = f" ({'; '.join(reasons)})" if reasons else ""
        if len(ds) == 1:
            what = f"{ds[0].length:,} bytes at offset {ds[0].offset:,} could not be read"
        else:
            what = (
                f"{len(ds)} ranges of {sum(d.length for d in ds):,} bytes in all, the first at "
                f"offset {min(d.offset for d in ds):,}, could not be read"
            )
        out.append(
            f"segment {name} is damaged: {what}{why}; the good records were ingested and {where}."
        )
    named = {_base(d.segment) for d in report.damaged}
    for base, q in sorted(quarantined.items()):
        if base not in named:
            out.append(f"segment {q} could not be read and was moved to {corrupt}.")
    for t in report.truncated_tails:
        name = os.path.basename(t)
        if _base(name) not in named:
            out.append(
                f"segment {name} ends in a cut-off record (its writer probably crashed or ran "
                "out of disk); everything before the cut was ingested."
            )
    return out


def warn_damage(report: IngestReport, data_dir: str) -> None:
    for sentence in damage_sentences(report, data_dir):
        typer.echo(f"perfsleuth: warning: {sentence}", err=True)


def check_endpoint(store: Store, endpoint: str, data_dir: str) -> None:
    """Raise a usage error naming the closest known endpoint when ``endpoint`` has no data."""
    known = ensure_not_empty(store, data_dir)
    if endpoint in known:
        return
    hint = did_you_mean(endpoint, known) or "; `perfsleuth top` lists the endpoints."
    raise CLIError(f"unknown endpoint {endpoint!r} in {data_dir}{hint}")
