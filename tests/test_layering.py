"""The floors rule of DESIGN.md: a file imports only from its own floor or below, never up.

Floors, top to bottom: ``lang/`` → ``runtime/entrypoints/`` → ``runtime/`` → ``kernels/``,
``radix_cache/``. Every import counts, including those inside functions and ``TYPE_CHECKING``
blocks: a lazy import up the floors is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# (folder, floor): the longest matching folder decides; higher floors may import lower ones.
FLOORS = [("lang", 3), ("runtime/entrypoints", 2), ("runtime", 1), ("kernels", 0), ("radix_cache", 0)]
TOP = 4  # the root package (``import radixlm``) re-exports everything: only tests and examples use it


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
    """(line, module) of every import in ``tree``; ``from radixlm import x`` yields ``radixlm.x``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module == "radixlm":
                found += [(node.lineno, f"radixlm.{alias.name}") for alias in node.names]
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


def test_no_module_imports_from_a_higher_floor():
    assert violations() == []


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        ("kernels/k.py", "from radixlm.runtime.forward_batch import ForwardBatch", 1),
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
