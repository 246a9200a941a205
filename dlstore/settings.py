"""Every ``DLSTORE_*`` environment variable, read in one place (docs/environment.md's table is
made from ``SETTINGS``; ``tests/test_settings.py`` checks that they agree and that nothing else reads one).

Values are read when asked for, not at import, so a variable set by a test or by a parent process before
it starts a worker takes effect. Folders default under ``$XDG_CACHE_HOME/dlstore`` (``~/.cache/dlstore``).

>>> from dlstore import settings
>>> settings.flag("DLSTORE_SHM_SLOTS")
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # what an unset variable means, in words for folders
    help: str


SETTINGS = {
    s.name: s
    for s in [
        Setting(
            "DLSTORE_SPOOL",
            "~/.cache/dlstore/spool",
            "where a cache for an s3:// or gs:// DEST is built before its upload",
        ),
        Setting(
            "DLSTORE_REMOTE_CACHE", "~/.cache/dlstore/remote", "the read-through chunk cache of remote caches"
        ),
        Setting("DLSTORE_DEMO_DIR", "~/.cache/dlstore", "where the demo dataset's images are generated once"),
        Setting(
            "DLSTORE_BENCH_CACHE",
            "~/.cache/dlstore/bench",
            "where `dlstore bench` keeps the caches it builds",
        ),
        Setting(
            "DLSTORE_JPEG_DECODER",
            "auto",
            "CPU JPEG decoder: auto (simplejpeg when installed), simplejpeg or pillow",
        ),
        Setting(
            "DLSTORE_SHM_SLOTS",
            "1",
            "0: DataLoader workers hand batches over as torch does (the escape hatch if shared slots fail)",
        ),
    ]
}


def get(name: str) -> str:
    """The variable's value, or its default."""
    return os.environ.get(name) or SETTINGS[name].default


def flag(name: str) -> bool:
    """An on/off switch: anything but ``0`` is on."""
    return get(name) != "0"


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlstore"


def folder(name: str, under_cache: str) -> Path:
    """A folder setting: the variable's path, else ``cache_home() / under_cache``."""
    value = os.environ.get(name)
    return Path(value).expanduser() if value else cache_home() / under_cache
