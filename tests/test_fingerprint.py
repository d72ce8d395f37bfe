"""SQL / URL / cache-key normalisation, stable ids and the parameter hash (wire.fingerprint)."""

from __future__ import annotations

import pytest

from perfsleuth.wire import fingerprint as fpr


@pytest.mark.parametrize(
    ("sql", "normalized", "op"),
    [
        ("SELECT * FROM t WHERE id = 5 AND name = 'bob'",
         "SELECT * FROM t WHERE id = ? AND name = ?", "SELECT"),
        ("select a from t where id in (1, 2, 3)", "select a from t where id in (...)", "SELECT"),
        ("SELECT a  FROM\n t WHERE x = $1", "SELECT a FROM t WHERE x = ?", "SELECT"),
        ("INSERT INTO t (a,b) VALUES (1,'x'), (2,'y')", "INSERT INTO t (a,b) VALUES (...)",
         "INSERT"),
        ("select 1.5e3, -2, x'ff' from t -- secret 42", "select ?, ?, ? from t", "SELECT"),
        ("update t set a = %s where id = %(id)s", "update t set a = ? where id = ?", "UPDATE"),
    ],
)  # fmt: skip
def test_sql_literals_become_placeholders(sql: str, normalized: str, op: str) -> None:
    assert fpr.normalize_sql(sql) == normalized
    assert fpr.sql_operation(fpr.normalize_sql(sql)) == op


def test_sql_values_never_survive_normalisation() -> None:
    text = fpr.normalize_sql("SELECT * FROM users WHERE email = 'alice@example.com' AND pin = 4711")
    assert "alice" not in text and "4711" not in text


def test_same_statement_shape_same_fingerprint_id() -> None:
    a = fpr.sql_fingerprint_id(fpr.normalize_sql("select * from t where id in (1,2)"))
    b = fpr.sql_fingerprint_id(fpr.normalize_sql("SELECT * FROM t WHERE id IN (7, 8, 9, 10)"))
    c = fpr.sql_fingerprint_id(fpr.normalize_sql("select * from u where id in (1,2)"))
    assert a != c
    # keyword case is kept as written, so only same-case statements share an id
    assert a == fpr.sql_fingerprint_id(fpr.normalize_sql("select * from t where id in (3)"))
    assert b != a


def test_url_and_cache_key_templates() -> None:
    assert (
        fpr.url_template("/users/123/orders/550e8400-e29b-41d4-a716-446655440000")
        == "/users/{id}/orders/{uuid}"
    )
    assert fpr.url_template("/a/deadbeefdeadbeef/x?y=1") == "/a/{hex}/x"
    assert fpr.cache_key_template("user:123:profile") == "user:{id}:profile"
    assert fpr.cache_key_template("session:abcdef0123456789abcdef") == "session:{hex}"


def test_stable_id_is_deterministic_and_63_bit() -> None:
    ids = {fpr.stable_id("a", i) for i in range(1000)}
    assert len(ids) == 1000
    assert all(0 <= i < 2**63 for i in ids)
    assert fpr.stable_id("x", 1, "f") == fpr.stable_id("x", 1, "f")


def test_params_hash_same_values_same_hash() -> None:
    assert fpr.params_hash((1, "a")) == fpr.params_hash((1, "a"))
    assert fpr.params_hash([1, "a"]) == fpr.params_hash((1, "a"))  # drivers pass either
    assert fpr.params_hash((1, "a")) != fpr.params_hash((2, "a"))
    assert fpr.params_hash({"b": 2, "a": 1}) == fpr.params_hash({"a": 1, "b": 2})
    assert fpr.params_hash({"a": 1}) != fpr.params_hash({"a": 2})


def test_params_hash_absent_and_unhashable() -> None:
    assert fpr.params_hash(None) is None
    assert fpr.params_hash(()) is None
    assert fpr.params_hash([]) is None
    assert fpr.params_hash({}) is None
    nested = ([1, 2], {"x": [3]})  # unhashable inside: hashed through its text
    assert fpr.params_hash(nested) == fpr.params_hash(([1, 2], {"x": [3]}))
    assert fpr.params_hash(nested) != fpr.params_hash(([1, 3], {"x": [3]}))
    h = fpr.params_hash((1,))
    assert h is not None and 0 <= h < 2**63


# The C tokenizer (wire/_fingerprint.c) against the Python reference, on statements as apps
# write them and on odd inputs: unterminated quotes and comments, dollar quotes with and
# without tags, non-ASCII letters, digits and spaces, NUL, placeholders of every driver.
ODD_SQL = [
    "",
    "   ",
    "SELECT 1",
    "select * from t where a = 'it''s' and b = E'\\n' and c = x'ff' and d = N'é'",
    "SELECT $$body$$, $tag$ a $$ b $tag$, $a$ unterminated",
    "select $1, $23, $, $$, $x, $x$",
    "/* traceparent='00-abc-01' */ SELECT a -- trailing 42\nFROM t /* unterminated",
    'select [col], [a b], "q""uoted", `back``tick`, "open',
    "update t set a = %s, b = %(name)s, c = %(bad) where d = :id and e = ::text and f=:x",
    "select 0x1F, 0x, 1e5, 1.e-3, .5, 1.5E+10, 3.14, 12abc, a12, -7, - 8, (-9)",
    "select ٣ + ٤, ʼn, café, naïve, '\u3000', a\u3000b, \u00a0x",
    "select 'unterminated",
    "select \x00 from t\x00",
    "SELECT * FROM t WHERE id IN (1, 2, 3) AND x in(?) AND y IN ( ? , ? ) AND z ıN (1)",
    "INSERT INTO t (a, b) VALUES (1, 'x'), (2, DEFAULT), (NULL, ?) ; ",
    "insert into t values (1, now()), (2, 3)",
    "select a-1, b = -1, c = (- 2), d =-?",
    "SELECT 😀 FROM t WHERE e = '😀'",
    "\t\n select\r\n1 ;;",
    "select a::int, b:: c, :1, ?::jsonb",
]


@pytest.mark.skipif(fpr._c_tokens is None, reason="C tokenizer not built")
def test_c_tokenizer_gives_the_python_tokens_on_odd_inputs() -> None:
    import random

    for sql in ODD_SQL:
        assert fpr._c_tokens(sql) == fpr._tokens(sql), sql
    # random strings over the characters each alternative of the scanner turns on
    pieces = [*"abXYZ_ eExXnN019.+-*/$'\"`[]()%s?:;,\n\t=<>", "é", "٣", "\u3000", "\x00",
              "😀", "--", "/*", "*/", "$$", "$a$", "''", "0x1F", "1e5", "%(x)s", "::",
              " IN (", "VALUES", "İ", "ı", "ſ",
              # Latin-1 letters and non-letters (a 1-byte str's identifier table), comment ends
              "ª", "µ", "ÿ", "×", "\xa0", "\x85", "*", "/", "**/", "a$"]  # fmt: skip
    rng = random.Random(7)
    for _ in range(20000):
        sql = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert fpr._c_tokens(sql) == fpr._tokens(sql), repr(sql)


def test_normalize_with_and_without_c_tokenizer_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    with_c = [fpr.normalize_sql(s) for s in ODD_SQL]
    monkeypatch.setattr(fpr, "_c_tokens", None)
    assert [fpr.normalize_sql(s) for s in ODD_SQL] == with_c
    assert (
        fpr.normalize_sql("SELECT * FROM t WHERE x ıN (1, 2)") == "SELECT * FROM t WHERE x ıN (...)"
    )
    assert fpr.normalize_sql("insert into t values (DEFAULT, NULL)") == "insert into t values (...)"


@pytest.mark.skipif(fpr._c_tokens is None, reason="C tokenizer not built")
def test_tokens_scanned_in_a_batch_are_the_tokens_of_each() -> None:
    import random

    rng = random.Random(11)
    pieces = [*"abX_ eE019.-'\"`[]()%s?:;,\n", "é", "😀", "--", "/*", "$$", "0x1F", " IN ("]
    batch: list[object] = [
        "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))) for _ in range(500)
    ]
    batch[3:3] = [b"SELECT 1", None, 7, ""]  # not str: None in the answer
    res = fpr.sql_tokens_many(batch)
    assert res is not None
    tokens, ns = res
    assert ns >= 0
    assert tokens == [fpr._tokens(s) if type(s) is str else None for s in batch]
    # past 16,384 characters the lock is released while scanning: the same tokens
    big = [*batch, "SELECT " + ", ".join(f"'{k}' AS c{k}" for k in range(3000))] * 2
    res = fpr.sql_tokens_many(big)
    assert res is not None
    assert res[0] == [fpr._tokens(s) if type(s) is str else None for s in big]
    empty = fpr.sql_tokens_many([])
    assert empty is not None and empty[0] == []
    # equal tokens come as one str (made and hashed once)
    same = fpr.sql_tokens_many(["SELECT 1", "SELECT 'a'", "select 1", "SELECT 2"])
    assert same is not None
    a, b, c, d = same[0]
    assert a == b == d == "SELECT ?" and a is b is d and c == "select ?"
    # texts of every width (ASCII, Latin-1, 2- and 4-byte characters) giving the same tokens,
    # and tokens keeping their non-ASCII characters: the str of each is the reference's
    widths = ["SELECT 'x'", "SELECT 'é'", "SELECT '٣'", "SELECT '😀'", "SELECT é", "SELECT ٣"]
    res = fpr.sql_tokens_many(widths * 2)
    assert res is not None
    assert res[0] == [fpr._tokens(s) for s in widths * 2]
    assert [t.isascii() for t in res[0][:4]] == [True] * 4


def test_normalize_is_the_tokens_then_the_rest() -> None:
    for sql in ODD_SQL:
        assert fpr.finish_sql(fpr.sql_tokens(sql)) == fpr.normalize_sql(sql), sql
