"""The floors rule of docs/architecture.md: a file imports only from its own floor or below, never
up; and no two modules import each other, directly or round a longer circle.

Floors, top to bottom: ``lang/`` → ``runtime/entrypoints/`` → ``runtime/`` (the engine core) →
``runtime/models/`` → ``runtime/layers/`` → ``runtime/distributed/`` → ``kernels/``,
``radix_cache/``. Every import counts, including those inside functions and ``TYPE_CHECKING``
blocks: a lazy import up the floors, or round a circle, is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# (folder, floor): the longest matching folder decides; higher floors may import lower ones.
FLOORS = [
    ("lang", 7),
    ("runtime/entrypoints", 6),
    ("runtime", 5),
    ("runtime/models", 4),
    ("runtime/layers", 3),
    ("runtime/distributed", 2),
    ("kernels", 0),
    ("radix_cache", 0),
]
TOP = 8  # the root package (``import radixlm``) re-exports everything: only tests and examples use it


def _floor_of_path(rel: str) -> int | None:
    best = None
    for folder, floor in FLOORS:
        if (rel == folder or rel.startswith(folder + "/")) and (best is None or len(folder) > len(best[0])):
            best = (folder, floor)
    return None if best is None else best[1]


def floor_of_module(module: str) -> int | None:
    """The floor of ``radixlm.x.y`` (None for modules outside radixlm)."""
    parts = module.split(".")
    if parts[0] != "radixlm":
        return None
    floor = _floor_of_path("/".join(parts[1:])) if len(parts) > 1 else None
    return TOP if floor is None else floor  # the root package or a name it re-exports


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``; ``from radixlm.p import x`` yields ``radixlm.p.x``
(the module ``x`` where there is one, else a name in ``radixlm.p``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module and node.module.split(".")[0] == "radixlm":
                found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def violations(root: Path = ROOT) -> list[str]:
    """Every import that goes up the floors (or is relative), as ``path:line: message``."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        floor = _floor_of_path(rel)
        if floor is None:
            continue
        for line, module in imported_modules(ast.parse(path.read_text(), rel)):
            if module.startswith("."):
                bad.append(f"{rel}:{line}: relative import {module} (imports are absolute and prefixed)")
                continue
            target = floor_of_module(module)
            if target is not None and target > floor:
                bad.append(f"{rel}:{line}: imports {module}, a higher floor")
    return bad


def module_name(rel: str) -> str:
    """``radixlm.a.b`` for ``a/b.py`` (``a/__init__.py`` is ``radixlm.a``)."""
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["radixlm", *parts])


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the radixlm modules it imports anywhere in its body (packages resolve to ``__init__``)."""
    files = {module_name(p.relative_to(root).as_posix()): p for p in sorted(root.rglob("*.py")) if _floor_of_path(p.relative_to(root).as_posix()) is not None}

    def known(module: str) -> str | None:
        while module and module not in files:
            module = module.rpartition(".")[0]
        return module or None

    graph = {}
    for name, path in files.items():
        targets = {known(m) for _, m in imported_modules(ast.parse(path.read_text(), str(path))) if m.startswith("radixlm.")}
        graph[name] = {m for m in targets if m is not None and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        cycles.append(sorted(group))
    return cycles


def test_no_module_imports_from_a_higher_floor():
    assert violations() == []


def test_no_modules_import_each_other_in_a_circle():
    assert import_cycles(import_graph()) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"runtime/a.py": "from radixlm.runtime.b import x", "runtime/b.py": "def f():\n    from radixlm.runtime.a import y"}, [["radixlm.runtime.a", "radixlm.runtime.b"]]),
        ({"runtime/a.py": "import radixlm.runtime.b", "runtime/b.py": "from radixlm.runtime import c", "runtime/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from radixlm.runtime.a import A"}, [["radixlm.runtime.a", "radixlm.runtime.b", "radixlm.runtime.c"]]),
        ({"runtime/p/__init__.py": "from radixlm.runtime.p.m import M", "runtime/p/m.py": "import torch"}, []),
        ({"runtime/a.py": "from radixlm.runtime.b import x", "runtime/b.py": "import radixlm.kernels"}, []),
    ],
)
def test_cycle_check_finds_exactly_the_circles(tmp_path, files, expected):
    for rel, source in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source + "\n")
    assert import_cycles(import_graph(tmp_path)) == expected


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        ("kernels/k.py", "from radixlm.runtime.layers.forward_batch import ForwardBatch", 1),
        ("kernels/k.py", "def f():\n    from radixlm.runtime.disk_cache import cache_dir", 1),
        ("radix_cache/r.py", "import radixlm.lang.ir", 1),
        ("runtime/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from radixlm.lang import gen", 1),
        ("runtime/x.py", "from radixlm import Engine", 1),
        ("runtime/x.py", "from radixlm.runtime.entrypoints.server import app", 1),
        ("runtime/x.py", "from .engine import Engine", 1),
        ("runtime/entrypoints/s.py", "from radixlm.runtime.engine import Engine\nfrom radixlm.kernels import cpu_ext", 0),
        ("lang/p.py", "from radixlm.runtime.engine import Engine\nfrom radixlm.radix_cache import RadixCache", 0),
        ("kernels/k.py", "from radixlm.radix_cache.pool import PAD_SLOT\nimport torch", 0),
    ],
)
def test_layering_check_flags_exactly_the_upward_imports(tmp_path, rel, source, expected):
    path = tmp_path / rel
    path.parent.mkdir(parents=True)
    path.write_text(source + "\n")
    assert len(violations(tmp_path)) == expected, violations(tmp_path)
