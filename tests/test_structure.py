"""The package's shape: one-way imports between modules and between packages, the
layers docs/ARCHITECTURE.md draws, no dependency on tests/, files of one concept.

Imports are read from the source (every ``import`` statement, function-level ones
included: a lazy import is still an arrow), so a cycle fails here before it can
bite at import time.  A module's ``if __name__ == "__main__":`` block is an entry
point (the old ``python -m spel_mlx.<command>`` paths), not an arrow.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# import name -> folder, as pyproject.toml maps them
PACKAGES = {"spel_mlx": ROOT / "spel_mlx", "spel_mlx.metal": ROOT / "metal",
            "spel_mlx.converters": ROOT / "converters", "bench": ROOT / "bench"}
# the package roots every module needs (spel_mlx/__init__.py loads the BLAS): an edge to
# one of them alone is not an arrow
ROOTS = ("spel_mlx", "bench")
MAX_LINES = 500
# the source kinds whose files must stay one concept long, and where they live
SOURCE_KINDS = (".py", ".c", ".h", ".cpp", ".metal", ".sh")
SOURCE_FOLDERS = ("spel_mlx", "metal", "converters", "bench", "neon")
# Violations being restructured away: each entry leaves with its fix, and an entry that
# no longer violates fails the test, so the lists only shrink.
KNOWN_CYCLES = []
KNOWN_TESTS_REFS = set()
KNOWN_LONG = set()


def module_files() -> dict:
    """{module name: path} for every Python module of the package and bench/."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if any(name.startswith(other + ".") or name == other
                   for other in PACKAGES if other != pkg and other.startswith(pkg + ".")):
                continue     # a folder mapped to another package name
            out[name] = path
    return out


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_main_block(node) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test)


def import_graph() -> dict:
    """{module: set of package modules it imports}.  An edge to a root package's
    ``__init__`` alone (the BLAS-loading root every module needs) is not an arrow;
    one to a subpackage's ``__init__`` (spel_mlx.converters, spel_mlx.metal, ...) is."""
    files = module_files()
    graph = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        tree.body = [n for n in tree.body if not _is_main_block(n)]
        deps = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, path, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and t not in ROOTS:
                    deps.add(t)
        graph[mod] = deps
    return graph


def find_cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# pure command shims: the old `python -m spel_mlx.<command>` paths, entry points like cli/
SHIMS = {"spel_mlx.generate", "spel_mlx.info", "spel_mlx.corpus", "spel_mlx.train", "spel_mlx.train_report"}


def part_of(module: str) -> str:
    """The part a module belongs to, as docs/ARCHITECTURE.md names them: the subpackage
    or top-level module of spel_mlx (cli for entry points), bench for bench/."""
    parts = module.split(".")
    if parts[0] == "bench":
        return "bench"
    if module in SHIMS or parts[-1] == "__main__":
        return "cli"
    return parts[1] if len(parts) > 1 else "spel_mlx"


def part_graph(graph: dict) -> dict:
    out = {}
    for mod, deps in graph.items():
        a = part_of(mod)
        out.setdefault(a, set()).update(part_of(d) for d in deps if part_of(d) != a)
    return out


def documented_layers() -> list:
    """The layers of docs/ARCHITECTURE.md's machine-read block, top to bottom: [set of parts]."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("<!-- layers: read by tests/test_structure.py -->")[1].split("```")[1]
    return [{p.strip().rstrip("/") for p in line.split(",") if p.strip()}
            for line in block.strip().splitlines()[1:]]


def layering_violations(parts: dict, layers: list) -> list:
    level = {p: i for i, line in enumerate(layers) for p in line}
    bad = [f"{p}: not in docs/ARCHITECTURE.md's layers" for p in parts if p not in level]
    for a, deps in sorted(parts.items()):
        for b in sorted(deps):
            if b not in level:
                bad.append(f"{b}: not in docs/ARCHITECTURE.md's layers")
            elif a in level and level[b] <= level[a]:
                bad.append(f"{a} imports {b}, which is not below it")
    return sorted(set(bad))


def test_graph_sees_real_imports():
    g = import_graph()
    assert "spel_mlx.config" in g["spel_mlx.layout"]        # a known arrow is found
    assert "spel_mlx.converters" in g["spel_mlx.reader"]     # an edge into a mapped subpackage's __init__
    assert not any(d.startswith("spel_mlx.cli") for d in g["spel_mlx.synth"])   # a __main__ block is no arrow
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]   # negative control
    assert layering_violations({"x": {"y"}, "y": set()}, [{"y"}, {"x"}]) == ["x imports y, which is not below it"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert [c for c in cycles if c not in KNOWN_CYCLES] == [], f"import cycles: {cycles}"
    assert [c for c in KNOWN_CYCLES if c not in cycles] == [], "fixed: remove from KNOWN_CYCLES"


def test_no_cycles_between_packages():
    assert find_cycles(part_graph(import_graph())) == []


def test_imports_follow_the_documented_layers():
    assert layering_violations(part_graph(import_graph()), documented_layers()) == []


def _code_strings(tree) -> list:
    """String constants that are not docstrings."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_package_never_imports_tests():
    offenders = set()
    for mod, path in module_files().items():
        if not mod.startswith("spel_mlx"):
            continue
        if str(path.relative_to(ROOT)) in KNOWN_TESTS_REFS:
            offenders.add(str(path.relative_to(ROOT)))
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path} imports tests"
        paths = [s for s in _code_strings(tree) if re.search(r"(^|/)tests(/|$)", s)]
        assert not paths, f"{path} reaches into the tests tree: {paths}"
    assert offenders == KNOWN_TESTS_REFS, "fixed: remove from KNOWN_TESTS_REFS"


MAX_DECODING_PARAMS = 6


def test_decoding_functions_take_few_parameters():
    """No function in decoding/ takes more than MAX_DECODING_PARAMS parameters (self
    aside): a call's state and a constructor's options travel as objects."""
    wide = []
    for path in sorted((ROOT / "spel_mlx" / "decoding").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + \
                    [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                n = len([x for x in names if x not in ("self", "cls")])
                if n > MAX_DECODING_PARAMS:
                    wide.append(f"{path.name}:{node.lineno} {node.name} takes {n}")
    assert wide == []


@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_files_hold_one_concept(kind):
    """No source file of any kind over MAX_LINES lines outside the tests."""
    too_long = []
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*" + kind):
            rel = str(path.relative_to(ROOT))
            if "tests" in path.relative_to(ROOT).parts:
                continue
            n = sum(1 for _ in path.open(errors="replace"))
            if n > MAX_LINES and rel not in KNOWN_LONG:
                too_long.append(f"{rel}: {n} lines")
            elif n <= MAX_LINES and rel in KNOWN_LONG:
                too_long.append(f"{rel} is {n} lines now: remove it from KNOWN_LONG")
    gone = [k for k in KNOWN_LONG if Path(k).suffix == kind and not (ROOT / k).exists()]
    too_long += [f"{k} no longer exists: remove it from KNOWN_LONG" for k in gone]
    assert not too_long, "files over the size of one concept: " + ", ".join(too_long)
