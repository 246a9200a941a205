"""The wheel holds every package: pyproject's explicit list equals the packages on disk.

An editable install (what `make test` uses) imports from the tree and cannot notice a package missing from
the list; a plain `pip install dlstore` then fails with ModuleNotFoundError at the first import of it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _on_disk() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in config["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = _on_disk()
    assert on_disk - listed == set(), (
        f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(on_disk - listed)}"
    )
    assert listed - on_disk == set(), f"listed in pyproject.toml but not on disk: {sorted(listed - on_disk)}"
