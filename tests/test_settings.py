"""Every DLSTORE_* variable is read by dlstore/settings.py and nowhere else, and each has its help."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dlstore
from dlstore import settings

PACKAGE = Path(dlstore.__file__).parent


def environ_reads(tree: ast.AST) -> list[str]:
    """DLSTORE_* names read from the environment directly: ``os.environ.get/[...]``, ``os.getenv``."""
    out = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in ENVIRON_CALLS:
            target = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            target = node.slice
        if isinstance(target, ast.Constant) and str(target.value).startswith("DLSTORE_"):
            out.append(str(target.value))
    return out


ENVIRON_CALLS = {"os.environ.get", "os.getenv", "environ.get", "getenv"}


def test_no_module_but_settings_reads_a_dlstore_variable() -> None:
    readers = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "settings.py"
        for name in environ_reads(ast.parse(path.read_text()))
    ]
    assert readers == []


def test_every_name_asked_for_is_declared() -> None:
    asked = set()
    for path in PACKAGE.rglob("*.py"):
        asked |= set(re.findall(r"settings\.(?:get|flag|folder)\(\"(DLSTORE_[A-Z_]+)\"", path.read_text()))
    assert asked and asked <= set(settings.SETTINGS)


def test_values_are_read_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DLSTORE_SHM_SLOTS", "0")
    assert settings.flag("DLSTORE_SHM_SLOTS") is False
    monkeypatch.delenv("DLSTORE_SHM_SLOTS")
    assert settings.flag("DLSTORE_SHM_SLOTS") is True
    monkeypatch.setenv("DLSTORE_SPOOL", str(tmp_path))
    assert settings.folder("DLSTORE_SPOOL", "spool") == tmp_path
    monkeypatch.delenv("DLSTORE_SPOOL")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.folder("DLSTORE_SPOOL", "spool") == tmp_path / "xdg" / "dlstore" / "spool"


def test_the_environment_page_lists_every_setting_with_its_default() -> None:
    page = (PACKAGE.parent / "docs" / "environment.md").read_text()
    rows = dict(re.findall(r"^\| `(DLSTORE_[A-Z_]+)` \| `([^`]*)` \|", page, flags=re.M))
    assert rows == {s.name: s.default for s in settings.SETTINGS.values()}
