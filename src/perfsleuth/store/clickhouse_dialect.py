"""The one place where DuckDB's SQL becomes ClickHouse's: the analysis layer, the server and the
store's own readers write their ~60 queries once, in DuckDB's dialect against the logical
schema (:mod:`perfsleuth.store.schema`); :func:`to_clickhouse` transpiles each with SQLGlot at
``query()`` time, then rewrites the few functions whose ClickHouse counterparts differ in
meaning, not only in name.

Why a transpiler and not hand-written pairs: the queries live in ~20 modules and change with the
detectors; pairs would double every query and drift. SQLGlot already knows the renames
(``arg_max`` -> ``argMax``, ``list_contains`` -> ``has``, ``starts_with`` -> ``startsWith``,
``any_value`` -> ``any``, ``x::T`` -> ``CAST``, ``//``), so what is left here is short and
written down once:

* exact quantiles: ``quantile_cont`` and ``median`` interpolate linearly between the two nearest
  values (R-7): ClickHouse's ``quantileExactInclusive`` is the same estimator (its ``quantile``
  samples a reservoir, so findings would differ between engines);
* ``mode`` (ClickHouse has none) -> the most common value from ``sumMap`` counts, ties to the
  smallest value (DuckDB's ties go to the value seen first, which depends on the row order of
  each engine: only a tie, like two URLs called once each, can name another example);
* ``first`` -> ``any``; ``epoch``/``epoch_us``/``epoch_ms`` -> ``toUnixTimestamp64*``;
  ``hash(a, b)`` -> ``cityHash64``;
* parameters (``?``) become typed literals: the HTTP interface and chDB bind differently, and a
  literal plans the same on both.

The session settings that give DuckDB's meaning to ClickHouse (LEFT JOIN misses are NULL,
aggregates over no rows are NULL, a column name wins over a SELECT alias, UTC) are
:data:`SESSION_SETTINGS`; every connection sets them.

A query SQLGlot cannot carry over is written in the shared subset (store.md) where it lives; a
parse is cached per query text, so transpiling costs once per distinct query.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

import sqlglot
from sqlglot import exp
from sqlglot.tokens import TokenType

from perfsleuth.store.schema import TABLES

__all__ = ["SESSION_SETTINGS", "literal", "read_only_clickhouse", "to_clickhouse"]

# Settings every ClickHouse connection runs with (server and chDB alike).
SESSION_SETTINGS: dict[str, Any] = {
    "join_use_nulls": 1,  # a LEFT JOIN miss is NULL, not the type's default
    "aggregate_functions_null_for_empty": 1,  # sum/max over no rows is NULL
    "prefer_column_name_to_alias": 1,  # WHERE duration_ms > 5 means the column, not an alias
    "session_timezone": "UTC",
    "mutations_sync": 1,
    "enable_named_columns_in_function_tuple": 1,  # tuple(x AS a): DuckDB's {'a': x}
}


def to_clickhouse(sql: str, params: Sequence[Any] = (), database: str | None = None) -> str:
    """``sql`` (DuckDB's dialect, ``?`` parameters) as ClickHouse SQL with ``params`` inlined;
    with ``database``, tables named without one are that database's (CTEs aside)."""
    tree = _transpiled(sql, database)
    if not params:
        return tree.sql(dialect="clickhouse")
    values = [literal(p) for p in params]

    def bind(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Placeholder) and str(node.this).isdigit():
            return values[int(node.this) - 1].copy()
        return node

    return tree.transform(bind, copy=True).sql(dialect="clickhouse")


@functools.lru_cache(maxsize=512)
def _transpiled(sql: str, database: str | None) -> Any:
    tree: Any = sqlglot.parse_one(_number_placeholders(sql), read="duckdb")
    # bottom-up, so that a rewritten node's arguments are rewritten already
    for node in reversed(list(tree.walk())):
        new = _rewrite(node)
        if new is not node:
            if node is tree:
                tree = new
            else:
                node.replace(new)
    if database:
        _qualify(tree, database)
        _read_final(tree)
    return tree


def _read_final(tree: Any) -> None:
    """The keyed tables (ReplacingMergeTree: fingerprints, locations, stacks, captures, ...)
    read ``FINAL``: two collectors (or a re-run) can store a key twice until a background merge,
    and a join on a doubled dictionary row would double the rows joined to it. These tables are
    small, so the merge at read time is cheap."""
    keyed = {name for name, t in TABLES.items() if t.key}
    ctes = {c.alias_or_name for c in tree.find_all(exp.CTE)}
    for t in list(tree.find_all(exp.Table)):
        if (
            t.name in keyed
            and t.name not in ctes
            and isinstance(t.parent, exp.From | exp.Join)
            and isinstance(t.this, exp.Identifier)
        ):
            t.replace(exp.Final(this=t.copy()))


def _qualify(tree: Any, database: str) -> None:
    ctes = {c.alias_or_name for c in tree.find_all(exp.CTE)}
    for t in tree.find_all(exp.Table):
        if not t.args.get("db") and t.name not in ctes and isinstance(t.this, exp.Identifier):
            t.set("db", exp.to_identifier(database, quoted=True))


# Scalar functions that reach outside the store (files, hosts, programs)
_EXTERNAL_FUNCTIONS = frozenset(
    {"file", "url", "s3", "hdfs", "executable", "remote", "remotesecure", "azureblobstorage"}
)


def read_only_clickhouse(sql: str, database: str) -> str:
    """A console statement in ClickHouse's SQL with its tables in ``database``; ValueError
    unless it is one SELECT (a UNION, a WITH, ...)."""
    try:
        stmts = [s for s in sqlglot.parse(sql, read="clickhouse") if s is not None]
    except sqlglot.errors.ParseError as e:
        raise ValueError(f"syntax error: {str(e).splitlines()[0]}") from e
    if not stmts:
        raise ValueError("the query is empty")
    if len(stmts) > 1:
        raise ValueError(f"run one statement at a time (got {len(stmts)})")
    tree = stmts[0]
    if not isinstance(tree, exp.Query):
        raise ValueError(
            "only read-only queries are allowed (SELECT); "
            f"this is a {type(tree).__name__.upper()} statement"
        )
    for f in tree.find_all(exp.Anonymous):
        if str(f.this).lower() in _EXTERNAL_FUNCTIONS:
            raise ValueError(f"{f.this}() is disabled in the console: it reads files or hosts")
    for t in tree.find_all(exp.Table):
        if not isinstance(t.this, exp.Identifier):  # file(), url(), s3(), remote(), ...
            raise ValueError(
                f"table functions are disabled in the console ({t.this.sql('clickhouse')}): "
                "it reads tables only (the store's, and ClickHouse's system tables)"
            )
    _qualify(tree, database)
    return tree.sql(dialect="clickhouse")


def _number_placeholders(sql: str) -> str:
    """``?`` -> ``$1``, ``$2``, ... (outside literals), so that bound values keep their order
    whatever order the tree is walked in."""
    out, last, n = [], 0, 0
    for tok in sqlglot.Tokenizer().tokenize(sql) if "?" in sql else ():
        if tok.token_type == TokenType.PLACEHOLDER and tok.text == "?":
            n += 1
            out.append(sql[last : tok.start])
            out.append(f"${n}")
            last = tok.end + 1
    out.append(sql[last:])
    return "".join(out)


def _param_agg(name: str, params: list[exp.Expression], arg: exp.Expression) -> exp.Expression:
    # SQLGlot renders ``this(expressions)(params)``: ClickHouse's ``name(parameters)(argument)``
    return exp.ParameterizedAgg(this=name, expressions=params, params=[arg])


def _rewrite(node: exp.Expression) -> exp.Expression:
    if isinstance(node, exp.Select):
        # ClickHouse names an unaliased ``p.endpoint`` "p.endpoint"; DuckDB "endpoint"
        for i, e in enumerate(node.expressions):
            if isinstance(e, exp.Column) and e.table and not isinstance(e.this, exp.Star):
                node.expressions[i] = exp.alias_(e, e.name, quoted=True)
        return node
    if isinstance(node, exp.Struct):
        items = []
        for e in node.expressions:
            if isinstance(e, exp.PropertyEQ | exp.Slice | exp.EQ):
                name, value = e.this, e.expression
            elif isinstance(e, exp.Alias):
                name, value = e.args["alias"], e.this
            else:
                raise ValueError(f"cannot carry {node.sql('duckdb')} to ClickHouse")
            items.append(exp.alias_(value, str(name.name if hasattr(name, "name") else name)))
        return exp.Anonymous(this="tuple", expressions=items)
    if isinstance(node, exp.ArrayAgg):
        return _array_agg(node.this)
    if (
        isinstance(node, exp.Bracket)
        and len(node.expressions) == 1
        and isinstance(node.expressions[0], exp.Slice)
    ):
        # DuckDB's list[a:b] (1-based, both ends in) -> arraySlice(list, a, b - a + 1)
        sl = node.expressions[0]
        start = sl.this or exp.Literal.number(1)
        args = [node.this, start]
        if sl.expression is not None:
            length = exp.Add(
                this=exp.Sub(this=sl.expression, expression=start.copy()),
                expression=exp.Literal.number(1),
            )
            args.append(length)
        return exp.Anonymous(this="arraySlice", expressions=args)
    if isinstance(node, exp.ArgMax | exp.ArgMin) and node.args.get("count") is not None:
        # max_by(x, key, n): the n values of x with the largest keys, largest first
        n = node.args["count"]
        pairs = exp.Anonymous(
            this="groupArray",
            expressions=[exp.Tuple(expressions=[node.expression, node.this])],
        )
        order = "arrayReverseSort" if isinstance(node, exp.ArgMax) else "arraySort"
        return sqlglot.parse_one(
            f"arraySlice(arrayMap(x_ -> x_.2, {order}(x_ -> x_.1, __pairs)), 1, __n)",
            read="clickhouse",
        ).transform(
            lambda x: (
                pairs
                if isinstance(x, exp.Column) and x.name == "__pairs"
                else (n if isinstance(x, exp.Column) and x.name == "__n" else x)
            )
        )
    if isinstance(node, exp.PercentileCont):
        q = node.expression
        if isinstance(q, exp.Array):
            return _param_agg("quantilesExactInclusive", list(q.expressions), node.this)
        return _param_agg("quantileExactInclusive", [q], node.this)
    if isinstance(node, exp.Median):
        return _param_agg("quantileExactInclusive", [exp.Literal.number(0.5)], node.this)
    if isinstance(node, exp.Mode):
        # counts per value (sumMap: keys sorted), the first key with the largest count
        x = node.this
        sm = "sumMapIf([assumeNotNull(__x)], [toUInt64(1)], __x IS NOT NULL)"
        tmpl = f"if(count(__x) = 0, NULL, ({sm}).1[indexOf(({sm}).2, arrayMax(({sm}).2))])"
        return sqlglot.parse_one(tmpl, read="clickhouse").transform(
            lambda n: x.copy() if isinstance(n, exp.Column) and n.name == "__x" else n
        )
    if isinstance(node, exp.First):
        return exp.Anonymous(this="any", expressions=[node.this])
    if isinstance(node, exp.TimeToUnix):
        return exp.Div(
            this=exp.Anonymous(this="toUnixTimestamp64Micro", expressions=[node.this]),
            expression=exp.Literal.number(1_000_000.0),
        )
    if isinstance(node, exp.Anonymous):
        name = str(node.this).lower()
        if name == "epoch_us":
            return exp.Anonymous(this="toUnixTimestamp64Micro", expressions=node.expressions)
        if name == "epoch_ms":
            return exp.Anonymous(this="toUnixTimestamp64Milli", expressions=node.expressions)
        if name == "hash":
            return exp.Anonymous(this="cityHash64", expressions=node.expressions)
    return node


def _array_agg(arg: exp.Expression) -> exp.Expression:
    """DuckDB's ``list([DISTINCT] x [ORDER BY k])`` in ClickHouse (its arrays leave NULLs
    out, as the queries here filter them anyway)."""
    order = None
    if isinstance(arg, exp.Order):
        order, arg = arg, arg.this
    distinct = isinstance(arg, exp.Distinct)
    if distinct:
        arg = arg.expressions[0]

    def fn(name: str, *args: exp.Expression) -> exp.Expression:
        return exp.Anonymous(this=name, expressions=list(args))

    if order is None:
        return fn("groupUniqArray" if distinct else "groupArray", arg)
    keys = order.expressions
    desc = bool(keys[0].args.get("desc"))
    sort = "arrayReverseSort" if desc else "arraySort"
    key = keys[0].this
    if distinct and key == arg:
        return fn(sort, fn("groupUniqArray", arg))
    pairs = fn("groupArray", exp.Tuple(expressions=[key, arg]))
    lam = sqlglot.parse_one(f"arrayMap(x_ -> x_.2, {sort}(x_ -> x_.1, __p))", read="clickhouse")
    out = lam.transform(lambda x: pairs if isinstance(x, exp.Column) and x.name == "__p" else x)
    return fn("arrayDistinct", out) if distinct else out


def literal(value: Any) -> exp.Expression:
    """A ClickHouse literal for a parameter value."""
    if value is None:
        return exp.Null()
    if isinstance(value, bool):
        return exp.Boolean(this=value)
    if isinstance(value, int):
        return exp.Literal.number(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return exp.Anonymous(this="toFloat64", expressions=[exp.Literal.string(str(value))])
        return exp.Literal.number(repr(value))
    if isinstance(value, str):
        return exp.Literal.string(value)
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        text = value.strftime("%Y-%m-%d %H:%M:%S.%f")
        return exp.Anonymous(
            this="toDateTime64",
            expressions=[
                exp.Literal.string(text),
                exp.Literal.number(6),
                exp.Literal.string("UTC"),
            ],
        )
    if isinstance(value, date):
        return exp.Anonymous(this="toDate", expressions=[exp.Literal.string(value.isoformat())])
    if isinstance(value, timedelta):
        return exp.Interval(
            this=exp.Literal.number(int(value.total_seconds() * 1_000_000)),
            unit=exp.Var(this="MICROSECOND"),
        )
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value) if isinstance(value, set | frozenset) else list(value)
        return exp.Array(expressions=[literal(v) for v in items])
    raise TypeError(f"cannot pass a {type(value).__name__} to ClickHouse as a parameter")
