"""``demo``: the generated demo dataset (``dlstore.datasets.demo``), read as a folder."""

from __future__ import annotations

from dataclasses import dataclass

from dlstore.write.sources.folder import FolderSource
from dlstore.write.sources.registry import SourceArgs, register_source


@register_source
@dataclass
class DemoSource(FolderSource):
    claim_order = 10
    form = "demo"

    @classmethod
    def claims(cls, text: str) -> bool:
        return text == "demo"

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> FolderSource:
        from dlstore.datasets.demo import ensure_demo

        return cls.scanned(ensure_demo(n_images=args.demo_images), kind="demo")

    @classmethod
    def local_root(cls, text: str) -> None:
        return None
