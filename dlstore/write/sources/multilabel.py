"""``multilabel:FILE.csv``: rows ``path,labels`` (labels separated by spaces or ``|``; a header
row is skipped), images under ``--root`` (default: the CSV's folder). Field ``labels``: a multi-hot
uint8 vector over every label named (sorted: the field's ``classes``).

    dlstore convert multilabel:train.csv cache/ --root images --size 224"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.errors import SourceError
from dlstore.spec import FieldSpec
from dlstore.write.sources.folder import ListedSource, split_spec
from dlstore.write.sources.registry import SourceArgs, register_source

PREFIX = "multilabel:"


@register_source
@dataclass
class MultiLabelSource(ListedSource):
    claim_order = 24
    form = "multilabel:FILE.csv (path,labels rows; --root IMAGES)"

    hot: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint8))  # (n, classes)

    @classmethod
    def claims(cls, text: str) -> bool:
        return text.startswith(PREFIX)

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> MultiLabelSource:
        path = Path(split_spec(text, PREFIX))
        rows = read_rows(path)
        names = sorted({lab for _, labs in rows for lab in labs})
        if not names:
            raise SourceError(f"{path}: no labels in any row; rows are path,label1 label2 ...")
        column = {n: j for j, n in enumerate(names)}
        hot = np.zeros((len(rows), len(names)), np.uint8)
        for i, (_, labs) in enumerate(rows):
            hot[i, [column[lab] for lab in labs]] = 1
        fields = {"labels": FieldSpec("values", "uint8", (len(names),), classes=tuple(names))}
        root = Path(args.root) if args.root is not None else path.parent
        return cls.listed(
            root,
            [p for p, _ in rows],
            fields,
            "multilabel",
            f"{text} (images under {root})",
            annotations=path,
            hot=hot,
        )

    def raw_targets(self, i: int) -> dict[str, Any]:
        return {"labels": self.hot[i]}

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {"hot": self.hot[idx]}


def read_rows(path: Path) -> list[tuple[str, list[str]]]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            table = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
    except FileNotFoundError:
        raise SourceError(f"{path}: no such CSV file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise SourceError(f"{path}: not a readable CSV file ({e})") from None
    if table and [c.strip().lower() for c in table[0][:2]] == ["path", "labels"]:
        table = table[1:]
    rows = []
    for k, r in enumerate(table, 1):
        if len(r) < 2 or not r[0].strip():
            raise SourceError(f"{path}: row {k} {r} is not path,labels")
        rows.append((r[0].strip(), [lab for lab in re.split(r"[|\s]+", r[1].strip()) if lab]))
    return rows
