"""The package's import graph has no cycles, counting imports inside functions too.

A cycle hidden in a function-level import still ties two modules' concerns together (each
needs the other loaded to work) and breaks as soon as either moves its import to the top.
"""

import ast
from pathlib import Path

import longattn

ROOT = Path(longattn.__file__).parent


def _modules() -> dict:
    """Dotted module name -> source path for every module of the package."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _targets(mods: dict, name: str, node) -> list:
    """The package modules an import statement in module ``name`` loads."""
    is_pkg = mods[name].name == "__init__.py"
    pkg = name if is_pkg else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        wanted = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    found = []
    for w in wanted:
        while w and w not in mods:
            w = w.rpartition(".")[0]
        if w.startswith("longattn") and w != name:
            found.append(w)
    return found


def import_graph() -> dict:
    mods = _modules()
    graph = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(_targets(mods, name, node))
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_imports():
    g = import_graph()
    # cli/common.py imports the sparse wiring inside a function only
    assert "longattn.sparse.policy" in g["longattn.cli.common"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []
