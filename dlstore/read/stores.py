"""Where a cache lives. Today only a local (or mounted) folder; this is the one place that decides,
so remote stores (fsspec URLs) can be added here without touching the commands that take a path."""

from __future__ import annotations

import os
import re
from pathlib import Path

from dlstore.errors import UnsupportedStoreError

# "s3://b/k", and also "s3:/b/k": what pathlib makes of a URL (it collapses "//"). Two letters at
# least, so a Windows drive ("C:/") is not mistaken for a scheme.
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/")


def parse_store_path(path: str | os.PathLike[str]) -> Path:
    """A cache location → a local Path; a URL (``s3://``, ``gs://``, ``http://``, ...) is refused
    instead of becoming a local folder named ``s3:``. ``file://`` URLs name a local path."""
    text = os.fspath(path)
    match = _URL.match(text)
    if match is None:
        return Path(text)
    scheme = match["scheme"].lower()
    if scheme == "file" and text.startswith("file://"):
        return Path(text[len("file://") :])
    raise UnsupportedStoreError(
        f"{text}: remote cache locations ({scheme}://) are not supported by this dlstore; "
        "give a local folder (or a mounted file system path), or convert locally and copy the "
        "folder to the remote store"
    )
