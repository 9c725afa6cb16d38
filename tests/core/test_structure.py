"""The tree's layering: no import cycle in harness/ or the built-in adapters, counting every import statement:
top-level, inside a function, and under `if TYPE_CHECKING:` (an import that only a type checker runs still makes
the two modules each other's dependency: a reader has to know both to know either)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    """Module name -> file, for harness/ and each adapters/*/amp_harness_* package."""
    found = {}
    for package in [ROOT / "harness", *sorted((ROOT / "adapters").glob("*/amp_harness_*"))]:
        for f in package.rglob("*.py"):
            parts = f.relative_to(package.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return found


def _imports(tree: ast.AST) -> list[str]:
    """The modules the import statements name, wherever they stand."""
    names, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a submodule imported by name
        todo += ast.iter_child_nodes(node)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, f in modules.items():
        graph[name] = set()
        for target in _imports(ast.parse(f.read_text())):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert {"harness.run.runner", "harness.run.process", "amp_harness_mxnet.profile"} <= set(graph)
    assert "harness.run.process" in graph["harness.run.executors.local"]  # the graph sees imports inside functions
    assert cycles(graph) == []


def test_an_import_only_a_type_checker_runs_counts():
    found = _imports(ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.b import C\n"))
    assert {"a.b", "a.b.C"} <= set(found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
