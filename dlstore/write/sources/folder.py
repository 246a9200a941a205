"""An ImageFolder-style tree: ROOT/<class>/<image>, any path no other kind claims."""

from __future__ import annotations

import difflib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dlstore.errors import ImageDecodeError, SourceError
from dlstore.sourcefiles import scan_tree
from dlstore.spec import FieldSpec
from dlstore.write.sources.encoded import EncodedSource
from dlstore.write.sources.registry import SourceArgs, register_source


@register_source
@dataclass
class FolderSource(EncodedSource):
    """Class subfolders scanned like ``ImageFolder`` (hidden skipped, symlinks followed, GIFs kept)."""

    claim_order = 1000
    form = "a folder of class subfolders (ImageFolder layout)"

    root: Path = Path(".")
    root_mtime_ns: int = 0
    scan_errors: list[tuple[str, str]] = field(default_factory=list)

    def where(self, i: int) -> Path:
        return self.root / self.names[i]

    def read_bytes(self, i: int) -> bytes:
        path = self.root / self.names[i]
        try:
            return path.read_bytes()
        except OSError as e:
            raise ImageDecodeError(f"{path}: cannot decode image ({type(e).__name__}: {e})") from e

    def open_image(self, i: int) -> Any:
        from PIL import Image

        return Image.open(self.root / self.names[i])

    @classmethod
    def claims(cls, text: str) -> bool:
        return True  # any path: asked last, and a path that is no folder gets scan_tree's message

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> FolderSource:
        if not Path(text).is_dir():
            raise SourceError(
                f"{text}: {missing_path(Path(text))}; `dlstore convert --help` lists the kinds of SOURCE"
            )
        return cls.scanned(Path(text))

    @classmethod
    def local_root(cls, text: str) -> Path | None:
        return Path(text)

    @classmethod
    def scanned(cls, root: Path, kind: str = "folder") -> FolderSource:
        scan = scan_tree(root)
        return cls(
            description=str(scan.root),
            classes=scan.classes,
            names=scan.names,
            labels=scan.labels,
            stats=scan.stats,
            kind=kind,
            root=scan.root,
            scan_errors=scan.errors,
            root_mtime_ns=scan.root_mtime_ns,
        )


def scan_folder(root: Path, kind: str = "folder") -> FolderSource:
    return FolderSource.scanned(Path(root), kind)


def missing_path(path: Path) -> str:
    """What is wrong with a path that is no folder, and the nearest name that exists (a typo)."""
    if path.exists():
        return "neither a folder of class subfolders nor a file of a known SOURCE kind"
    parent = path.parent
    names = [p.name for p in parent.iterdir() if not p.name.startswith(".")] if parent.is_dir() else []
    near = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return "no such file or folder" + (f" (did you mean {parent / near[0]}?)" if near else "")


# --- listed images: files under a folder named by an annotation file, with fields ------------------------


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
