"""The package's layers (docs/architecture.md): each folder imports only the floors below it, the
write side (convert/) and the read side (read/) are siblings that never import each other, and at
most 8 modules sit directly in dlstore/."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import dlstore

PACKAGE = Path(dlstore.__file__).parent
# Lowest floor first. The root modules and storage/ are the ground every side stands on.
LAYERS = ["(root)", "storage", "formats", "datasets", "gpu", "read", "write", "bench", "cli"]
SIBLINGS = {("read", "write"), ("write", "read")}  # same floor: neither imports the other


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "(root)"


def imported(path: Path) -> set[str]:
    """Every dlstore module a file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dlstore"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("dlstore")}
    return out


def test_each_layer_imports_only_layers_above_it() -> None:
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        mine = rel[0] if len(rel) > 1 else "(root)"
        for module in imported(path):
            theirs = layer_of(module)
            if LAYERS.index(theirs) > LAYERS.index(mine) or (mine, theirs) in SIBLINGS:
                wrong.append(f"{'/'.join(rel)} imports {module}")
    assert wrong == []


def test_at_most_eight_modules_at_the_root() -> None:
    assert len(list(PACKAGE.glob("*.py"))) <= 8


def test_storage_is_the_ground_floor() -> None:
    """storage/ imports nothing of dlstore but itself and the root modules."""
    wrong = [
        f"storage/{path.name} imports {module}"
        for path in (PACKAGE / "storage").glob("*.py")
        for module in imported(path)
        if layer_of(module) not in ("(root)", "storage")
    ]
    assert wrong == []


def test_public_convert_is_the_function_and_no_package_is_callable() -> None:
    import dlstore.write.imageops as imageops  # the ``import a.b.c as m`` form resolves attributes
    from dlstore import convert
    from dlstore.write.conversion import convert as function

    assert convert is function and imageops.__name__ == "dlstore.write.imageops"
    assert type(importlib.import_module("dlstore.write")) is types.ModuleType
