"""A base for sources that list image files under a folder with fields beside them (COCO, image +
mask folders, a multi-label CSV): the folder's decode, the names from the listing."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from dlstore.errors import SourceError
from dlstore.spec import FieldSpec
from dlstore.write.sources.folder import FolderSource


@dataclass
class ListedSource(FolderSource):
    """Images at ``root / names[i]``; ``fields`` declared by the kind; no image-level classes."""

    annotations: str = ""  # the file the fields come from (its sha256 is in the fingerprint)
    # Not an ImageFolder tree: no root is recorded to rescan as one.
    folder_tree: ClassVar[bool] = False

    @classmethod
    def listed(
        cls,
        root: Path,
        names: list[str],
        fields: dict[str, FieldSpec],
        kind: str,
        description: str,
        annotations: Path | None = None,
        **extra: object,
    ) -> ListedSource:
        """``names`` under ``root``, each stat'ed now (a missing one is refused, named)."""
        stats = []
        for name in names:
            try:
                st = os.stat(root / name)
            except OSError as e:
                raise SourceError(
                    f"{root / name}: listed by {description} but not readable ({e.strerror})"
                ) from None
            stats.append((st.st_size, st.st_mtime_ns))
        return cls(
            description=description,
            classes=(),
            names=names,
            labels=np.zeros(len(names), np.int64),
            stats=stats,
            kind=kind,
            root=Path(root).resolve(),
            fields=fields,
            annotations=str(annotations or ""),
            **extra,  # type: ignore[arg-type]
        )

    def targets_fingerprint(self) -> str:
        if not self.annotations:
            return ""
        return hashlib.sha256(Path(self.annotations).read_bytes()).hexdigest()

    @classmethod
    def local_root(cls, text: str) -> Path | None:
        return None  # the images' folder is named by --root or beside the listing: checked on open


def split_spec(text: str, prefix: str) -> str:
    """``PREFIX:REST`` → REST, refusing an empty one."""
    rest = text[len(prefix) :]
    if not rest:
        raise SourceError(f"{text}: give a path after {prefix!r}")
    return rest
