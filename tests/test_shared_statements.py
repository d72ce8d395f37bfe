"""Statements made with their literals written into the text are recorded as the first one made
with the same tokens (agent/_speedups.c: shared_statement; issue 22). The application's own
text is then let go when the application lets it go (kept until the writer had encoded the
request, thousands of such texts made an in-process app 15-20 % slower by themselves), and what
the writer makes of the calls is what it made of each text before.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable, Iterator

import pytest

from perfsleuth.agent import recorder, shipper
from perfsleuth.agent.spool import queue
from perfsleuth.agent.spool.encode import Encoder, Interned, encode_requests
from perfsleuth.wire import FINGERPRINT, REQUESTS
from perfsleuth.wire.segment import FILE_MAGIC, read_segment

SCAN = pytest.importorskip("perfsleuth.wire._fingerprint").SCAN  # the C tokenizer's pass

pytestmark = pytest.mark.skipif(recorder.speedups is None, reason="the C accelerator is not built")


def statement(i: int, j: int) -> str:
    """A statement as an f-string makes it: a trace id in a comment, an IN list of one of
    three lengths, literals inline (three shapes by tokens)."""
    ids = ", ".join(str(i * 7 + k) for k in range(j % 3 + 1))
    return (
        f"/* trace={i:032x} */ SELECT k FROM t WHERE k IN ({ids}) AND 'n-{i}' <> '' AND k > {j}.5"
    )


@pytest.fixture
def sharing(agent_data_dir: str) -> Iterator[Callable[[bool], None]]:
    """Finished requests are kept (recorder.configure's sink); call it to turn sharing on or
    off. The agent's configuration is put back afterwards."""

    def share(on: bool) -> None:
        recorder.speedups.configure(statement_scan=SCAN if on else None)

    yield share
    recorder.configure(shipper.enqueue, max_calls=20000, stacks_per_site=1)
    queue.share_statements()


def run(make: Callable[[int, int], str], n: int) -> tuple[recorder.ActiveRequest, list[int]]:
    """One request making ``n`` statements on sqlite (its statement cache off: it would hold
    the texts itself); returns the request and, for each statement, the references to its
    text that outlived the call."""
    got: list[recorder.ActiveRequest] = []
    recorder.configure(got.append, max_calls=20000, stacks_per_site=1)
    conn = sqlite3.connect(":memory:", cached_statements=0)
    conn.execute("CREATE TABLE t (k INTEGER, k0 INTEGER, k1 INTEGER, k2 INTEGER)")
    held = []
    req = recorder.speedups.begin("web", "GET", "/report")
    for i in range(n):
        sql = make(i, i)
        before = sys.getrefcount(sql)
        conn.execute(sql).fetchall()
        held.append(sys.getrefcount(sql) - before)
    recorder.speedups.end(req)
    conn.close()
    return got[0], held


def written(req: recorder.ActiveRequest) -> list[str]:
    """The normalised statement of each of the request's calls, as the writer makes them."""
    data = encode_requests([req], Interned(), encoder=Encoder(fingerprint_cpu_pct=None))
    recs = read_segment(FILE_MAGIC + data).records
    fps = {o["id"]: o["text"] for t, o in recs if t == FINGERPRINT}
    (batch,) = [o for t, o in recs if t == REQUESTS]
    return [fps[c["fp"]] for c in batch[0]["calls"]]


def test_a_statement_with_literals_inline_is_let_go_with_the_app_s_text(
    sharing: Callable[[bool], None],
) -> None:
    sharing(True)
    req, held = run(statement, 30)
    # The first of each shape is kept (it stands for the shape: site entry, keys, memos);
    # every later text is the application's alone once its call returns. Before: each one
    # was held (30 of 30).
    assert all(held[:3]) and held[3:] == [0] * 27, held
    assert req.site_list is not None and len(req.site_list) == 3
    assert [e[2] for e in req.site_list] == [statement(i, i) for i in range(3)]


def test_the_writer_makes_the_same_fingerprints_of_shared_statements(
    sharing: Callable[[bool], None],
) -> None:
    sharing(True)
    shared, _ = run(statement, 30)
    sharing(False)
    alone, held = run(statement, 30)
    assert all(held), held  # recorded as made: each text held by its site entry
    assert alone.site_list is not None and len(alone.site_list) == 30
    texts = written(shared)
    assert texts == written(alone)
    assert len(texts) == 30 and len(set(texts)) == 1  # IN lists collapse: one fingerprint
    assert texts[0] == "SELECT k FROM t WHERE k IN (...) AND ? <> ? AND k > ?"


def test_statements_of_other_tokens_are_not_shared(sharing: Callable[[bool], None]) -> None:
    def other(i: int, j: int) -> str:  # same literals, other tokens: an operator, a column
        return f"SELECT k FROM t WHERE k {'<>'[i % 2]} {i} AND k{i % 3} IS NULL"

    sharing(True)
    req, held = run(other, 12)
    assert all(held[:6]) and held[6:] == [0] * 6, held
    assert req.site_list is not None and len(req.site_list) == 6  # 2 operators x 3 columns
    assert len(set(written(req))) == 6


def test_the_shapes_kept_stay_within_their_bytes(sharing: Callable[[bool], None]) -> None:
    recorder.speedups.configure(statement_scan=SCAN, statement_bytes=20_000)

    def wide(i: int, j: int) -> str:  # a shape each: a column name of its own
        return f"SELECT k AS c{i} FROM t WHERE k = {i} AND 'x' <> '{'y' * 200}'"

    req, held = run(wide, 300)
    shapes, size = recorder.speedups.statement_shapes()
    assert 0 < size <= 20_000 and 0 < shapes < 300
    # each still recorded, a site each (the first of its shape: its site entry holds it)
    assert all(held) and req.site_list is not None and len(req.site_list) == 300
