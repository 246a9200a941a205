"""A file list: a CSV (header row) or JSON-lines file of one image and its label per row, the images
under ``--root`` (default: the list's folder). The path column is the first of ``PATH_COLUMNS``; the
label column is ``--label`` (default ``label``), read by ``labels_from_values``. A row without a path
or label goes to ``skipped.json`` (``--strict`` stops). The fingerprint is the list's sha256 and the
root: an image replaced under the same name is noticed only by ``verify --deep``."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.checksums import file_sha256
from dlstore.errors import SourceError
from dlstore.write.sources.encoded import EncodedSource, labels_from_values, stop_if_strict, unreadable
from dlstore.write.sources.registry import SourceArgs, register_source

DEFAULT_LABEL = "label"
PATH_COLUMNS = ("path", "file", "filename", "image", "image_path")
SUFFIXES = (".csv", ".jsonl", ".ndjson")


def read_rows(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows) of a CSV or JSON-lines file; each row keeps its line number as ``_line``."""
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        rows = [{**row, "_line": reader.line_num} for row in reader]
        return list(reader.fieldnames or []), rows
    rows, columns = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise SourceError(f"{path}:{n}: not a JSON object ({e}); one JSON object per line") from e
        if not isinstance(doc, dict):
            raise SourceError(f"{path}:{n}: not a JSON object; one JSON object per line")
        columns.update(dict.fromkeys(doc))
        rows.append({**doc, "_line": n})
    return list(columns), rows


@register_source
@dataclass
class FileListSource(EncodedSource):
    claim_order = 120
    form = "list.csv | list.jsonl (path,label columns) [--root IMAGES] [--label COLUMN]"

    image_root: Path = Path(".")
    list_file: Path = Path(".")
    list_sha256: str = ""
    lines: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # each sample's line
    label_column: str = DEFAULT_LABEL
    scan_errors: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def claims(cls, text: str) -> bool:
        return text.lower().endswith(SUFFIXES)

    @classmethod
    def local_root(cls, text: str) -> Path | None:
        return None  # a cache inside the images' folder is never read back as a listed image

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> FileListSource:
        path = Path(text)
        if not path.is_file():
            raise SourceError(f"{path}: no such list file; give a CSV or JSON-lines file of path,label rows")
        columns, rows = read_rows(path)
        label = args.label or DEFAULT_LABEL
        path_col = next((c for c in PATH_COLUMNS if c in columns), None)
        if path_col is None or label not in columns:
            want = (
                f"a path column ({', '.join(PATH_COLUMNS)})"
                if path_col is None
                else f"label column {label!r}"
            )
            raise SourceError(
                f"{path}: no {want}; its columns: {', '.join(columns) or 'none'}"
                + ("; name the label column with --label COLUMN" if path_col else "")
            )
        names, values, lines, errors = [], [], [], []
        for row in rows:
            where = f"{path.name}:{row['_line']}"
            p, v = row.get(path_col), row.get(label)
            if p in (None, ""):
                errors.append((where, f"no {path_col!r} in this row"))
            elif v in (None, ""):
                errors.append((where, f"{p}: no label ({label!r} is empty)"))
            else:
                names.append(str(p))
                values.append(int(v) if isinstance(v, str) and v.strip().lstrip("-").isdigit() else v)
                lines.append(row["_line"])
            stop_if_strict(errors, args)
        classes, labels = labels_from_values(values, f"{path} column {label!r}")
        root = Path(args.root) if args.root is not None else path.parent
        return cls(
            description=str(path),
            classes=classes,
            names=names,
            labels=labels,
            kind="filelist",
            image_root=root.resolve(),
            list_file=path.resolve(),
            list_sha256=file_sha256(path),
            lines=np.asarray(lines, np.int64),
            label_column=label,
            scan_errors=errors,
        )

    def read_bytes(self, i: int) -> bytes:
        file = self.image_root / self.names[i]
        try:
            return file.read_bytes()
        except OSError as e:
            raise unreadable(f"{file} (line {int(self.lines[i])} of {self.list_file.name})", e) from e

    def reopen(self) -> dict[str, Any]:
        return {"source": str(self.list_file), "root": str(self.image_root), "label": self.label_column}

    def source_files(self) -> list[Path]:
        return [self.image_root / n for n in self.names]

    def open_image(self, i: int) -> Any:
        from PIL import Image

        return Image.open(self.image_root / self.names[i])  # PIL from the path, as the list's users do

    def fingerprint(self) -> str:
        doc = [self.classes, self.label_column, self.list_sha256, os.fspath(self.image_root), len(self)]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {"lines": self.lines[idx]}

    def info(self) -> dict[str, Any]:
        return {**super().info(), "image_root": str(self.image_root), "label_column": self.label_column}
