"""A full disk anywhere in a conversion (zarr's writes included) ends in one message: what was
being written, where, the space needed and free, and that the same command resumes."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dlstore.errors import ConvertError
from dlstore.write.sizes import human_bytes


@contextmanager
def disk_full_as_error(where: Path, what: str, need: int | None = None) -> Iterator[None]:
    """ENOSPC or EDQUOT inside → ConvertError naming ``where``; ``need``: the cache's bytes, if known."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ConvertError(disk_full_message(where, what, need)) from None


def disk_full_message(where: Path, what: str, need: int | None = None) -> str:
    needs = f"the cache needs up to {human_bytes(need)} (uncompressed) and " if need else ""
    return (
        f"disk full while {what} under {where}: {needs}{human_bytes(free_bytes(where))} is free; "
        "free space and re-run the same command to resume (finished parts are kept)"
    )


def free_bytes(where: Path) -> int:
    """Free space on the disk of ``where``, or of its nearest existing parent."""
    for folder in (Path(where), *Path(where).parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return 0
