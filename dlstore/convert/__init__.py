"""Writing a cache: sources → decode, orient, pre-resize → a format's writer, through staging and a
journal; publishing to an object store; verification and staleness checks of a finished cache.

The package is also the public function: ``from dlstore import ConvertOptions, convert;
convert(SOURCE, DEST, ConvertOptions(size=64))`` calls ``dlstore.convert.conversion.convert``. One name serves both because Python binds an imported
subpackage as its parent's attribute: a function ``dlstore.convert`` beside a package
``dlstore.convert`` would be replaced by the package at the first ``import dlstore.convert.…``.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from dlstore.convert.conversion import convert

        return convert(*args, **kwargs)

    @property
    def __signature__(self) -> Any:
        import inspect

        from dlstore.convert.conversion import convert

        return inspect.signature(convert)


def __getattr__(name: str) -> Any:
    if name == "convert":
        from dlstore.convert.conversion import convert

        return convert
    if name == "ConvertOptions":
        from dlstore.convert.options import ConvertOptions

        return ConvertOptions
    raise AttributeError(f"module 'dlstore.convert' has no attribute {name!r}")


sys.modules[__name__].__class__ = _CallablePackage
