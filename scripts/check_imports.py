"""Find import circles between perfsleuth's modules.

Builds the graph of module-level imports in src/perfsleuth (imports inside functions and under
``if TYPE_CHECKING:`` are left out: they run after both modules are loaded) and prints every
elementary cycle. Exits 1 when a cycle is found that is not allowed. With ``--deferred`` imports
inside functions count too: a circle closed by a deferred import still ties its modules together.

A cycle is allowed when every edge in it is allowed, by ``--allow A:B`` (module A may import B) or
by a line ``A:B`` in the ``--allow-file`` (``#`` starts a comment). Module names are dotted and
relative to the package root, e.g. ``store.base:store.duckdb_store``. For src/perfsleuth the
allow-list is scripts/import_cycles_allowed.txt unless ``--allow-file`` names another.

    python scripts/check_imports.py [--deferred] [--allow A:B ...] [--allow-file F] [-v]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "src" / "perfsleuth"
DEFAULT_ALLOW_FILE = Path(__file__).resolve().parent / "import_cycles_allowed.txt"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([root.name, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _deferred_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement but those under ``if TYPE_CHECKING:`` (for ``--deferred``)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skipped.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skipped:
            yield node


def _top_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is loaded: module level, including those in
    ``if``/``try``/``with`` blocks, but not in functions, classes or ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level_imports(node.body)
            for handler in node.handlers:
                yield from _top_level_imports(handler.body)
            yield from _top_level_imports(node.orelse)
            yield from _top_level_imports(node.finalbody)
        elif isinstance(node, ast.With):
            yield from _top_level_imports(node.body)


def build_graph(root: Path, deferred: bool = False) -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        modules[module_name(path, root)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imports = _deferred_imports(tree) if deferred else _top_level_imports(tree.body)
        for node in imports:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts)
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                targets.append(mod)
                # ``from pkg import sub`` imports the submodule pkg.sub when it exists.
                targets.extend(f"{mod}.{alias.name}" for alias in node.names)
            for target in targets:
                # An import of a.b.c loads a, a.b and a.b.c; the edge that matters for a circle
                # is to the deepest of them that is one of our modules.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle, each once, starting at its smallest module name (Johnson's idea,
    by plain depth-first search from each start node over nodes greater than the start: the
    graph is small)."""
    cycles: list[list[str]] = []
    nodes = sorted(graph)
    for start in nodes:
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        path = [start]
        on_path = {start}
        while stack:
            _, successors = stack[-1]
            advanced = False
            for nxt in successors:
                if nxt == start:
                    cycles.append(list(path))
                elif nxt > start and nxt not in on_path:
                    stack.append((nxt, iter(sorted(graph[nxt]))))
                    path.append(nxt)
                    on_path.add(nxt)
                    advanced = True
                    break
            if not advanced:
                stack.pop()
                on_path.discard(path.pop())
    return cycles


def _qualify(name: str, package: str) -> str:
    return name if name == package or name.startswith(package + ".") else f"{package}.{name}"


def parse_allowed(pairs: list[str], package: str) -> set[tuple[str, str]]:
    allowed: set[tuple[str, str]] = set()
    for pair in pairs:
        a, sep, b = pair.partition(":")
        if not sep or not a.strip() or not b.strip():
            raise SystemExit(f"check_imports: --allow wants A:B, got {pair!r}")
        allowed.add((_qualify(a.strip(), package), _qualify(b.strip(), package)))
    return allowed


def read_allow_file(path: Path) -> list[str]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.partition("#")[0].strip()
        if line:
            pairs.append(line)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the package directory")
    parser.add_argument(
        "--allow", action="append", default=[], metavar="A:B", help="module A may import B"
    )
    parser.add_argument(
        "--allow-file",
        type=Path,
        default=None,
        help=f"a file of A:B lines (default {DEFAULT_ALLOW_FILE.name} next to this script)",
    )
    parser.add_argument(
        "--deferred",
        action="store_true",
        help="count imports inside functions too (circles hidden by a deferred import)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print allowed circles too")
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    allow_file = args.allow_file
    if allow_file is None and DEFAULT_ALLOW_FILE.exists() and root == DEFAULT_ROOT:
        allow_file = DEFAULT_ALLOW_FILE
    pairs = list(args.allow)
    if allow_file is not None:
        pairs += read_allow_file(allow_file)
    allowed = parse_allowed(pairs, root.name)

    graph = build_graph(root, deferred=args.deferred)
    bad = known = 0
    for cycle in find_cycles(graph):
        edges = list(zip(cycle, cycle[1:] + cycle[:1], strict=True))
        is_known = all(edge in allowed for edge in edges)
        known += is_known
        bad += not is_known
        if args.verbose or not is_known:
            label = "known" if is_known else "CYCLE"
            print(f"{label}: {' -> '.join([*cycle, cycle[0]])}")
    sys.stdout.flush()
    if bad:
        print(f"{bad} import circle(s) not allowed, {known} allowed", file=sys.stderr)
        return 1
    print(f"no import circle but {known} allowed" if known else "no import circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
