"""Publishing a finished local cache to an object store, atomically, on a store without rename.

The protocol (object stores have no rename, but a single PUT is atomic):

1. Every file but the manifest is uploaded under a staging prefix ``URL/.dlstore-staging/<id>/``,
   ``<id>`` being a digest of the new manifest's checksums. A re-run after a kill finds that prefix
   and skips the objects already there with the right size (resume); the previous cache at URL stays
   complete and readable all along.
2. If a previous cache exists (``overwrite``), its manifest is deleted first: from then on readers
   refuse it (no manifest, no cache) instead of mixing generations.
3. Each staged object is copied to its final key server-side (no bytes through this machine), and
   objects of the previous generation that the new manifest does not list are deleted.
4. The manifest is written last, in one PUT: the cache appears complete or not at all.
5. The staging prefix is removed.

Units that Dask workers wrote to the store themselves (``dlstore.build.store_units``) are already
staged, under ``URL/.dlstore-staging/units-<plan>/``: the manifest lists them, the local folder does
not hold them, and step 3 copies them from there like the rest.

Readers open only a cache whose manifest exists, and check every object they download against the
manifest's sha256 (``dlstore.read.remote``), so a truncated or half-copied object is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dlstore.build.store_units import units_prefix
from dlstore.checksums import split_key
from dlstore.errors import CacheCorruptError, CacheExistsError
from dlstore.read.stores import RemoteStore, RemoteStoreError
from dlstore.spec import MANIFEST

STAGING = ".dlstore-staging"
Log = Callable[[str], None]


def check_remote_destination(store: RemoteStore, overwrite: bool) -> bool:
    """True when a complete cache is already at the URL; refuse it without ``overwrite``."""
    exists = store.exists(MANIFEST)
    if exists and not overwrite:
        raise CacheExistsError(f"{store.url}: already holds a dlstore cache; pass --overwrite to replace it")
    return exists


def check_writable(store: RemoteStore) -> None:
    """One empty object written and deleted under the staging prefix, before any work: a missing
    bucket or credentials that may not write fail now, not at the upload after the conversion."""
    probe = f"{STAGING}/write-check-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        store.put_bytes(b"", probe)
        store.delete([probe])
    except FileNotFoundError as e:
        raise RemoteStoreError(
            f"{store.url}: cannot write there ({e}); create the bucket or choose an existing one"
        ) from None
    except PermissionError as e:
        raise RemoteStoreError(
            f"{store.url}: writing is denied ({e}); use credentials that may write there "
            "(--storage-options or the store's environment, e.g. AWS_ACCESS_KEY_ID / AWS_PROFILE)"
        ) from None


def staging_id(manifest: bytes) -> str:
    checksums = json.loads(manifest)["checksums"]
    return hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()[:16]


def local_files(root: Path) -> dict[str, int]:
    """Relative name → size of every file of the finished local cache except the manifest."""
    return {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def staged_units(manifest: bytes, files: dict[str, int]) -> dict[str, str]:
    """Files the manifest lists that are not in the local folder → their staged key on the store
    (units written there by the workers)."""
    doc = json.loads(manifest)
    listed = {split_key(key)[0] for key in doc["checksums"]}
    remote = sorted(listed - set(files) - {MANIFEST})
    if not remote:
        return {}
    prefix = units_prefix(doc["source"]["plan"])
    return {rel: f"{prefix}/{rel}" for rel in remote}


def publish(root: Path, store: RemoteStore, overwrite: bool, log: Log | None = None) -> int:
    """Upload the complete cache at ``root`` to ``store`` by the protocol above; returns its bytes."""
    manifest = (root / MANIFEST).read_bytes()
    files = local_files(root)
    units = staged_units(manifest, files)
    unit_sizes: dict[str, int] = {}
    if units:
        unit_sizes = store.sizes(units_prefix(json.loads(manifest)["source"]["plan"]))
        missing = [rel for rel in units if rel not in unit_sizes]
        if missing:
            raise CacheCorruptError(
                f"{store.where(units[missing[0]])}: a unit the workers wrote is missing from the store "
                f"({len(missing)} missing); re-run with --overwrite to rebuild"
            )
    prefix = f"{STAGING}/{staging_id(manifest)}"
    staged = store.sizes(prefix)
    todo = [rel for rel, size in files.items() if staged.get(rel) != size]
    if log and len(todo) < len(files):
        log(
            f"resuming the upload to {store.url}: {len(files) - len(todo)} of {len(files)} objects already staged"
        )
    parallel(lambda rel: store.put_file(root / rel, f"{prefix}/{rel}"), todo)
    had_cache = check_remote_destination(store, overwrite)
    if had_cache:
        store.delete([MANIFEST])  # the old generation stops opening before any of its objects change
    parallel(lambda rel: store.copy(f"{prefix}/{rel}", rel), list(files))
    parallel(lambda rel: store.copy(units[rel], rel), list(units))
    keep = set(files) | set(units)
    stale = [rel for rel in store.sizes() if not rel.startswith(f"{STAGING}/") and rel not in keep]
    store.delete([rel for rel in stale if rel != MANIFEST])
    store.put_bytes(manifest, MANIFEST)
    store.delete(sorted(f"{prefix}/{rel}" for rel in files) + sorted(units.values()))
    return sum(files.values()) + sum(unit_sizes[rel] for rel in units) + len(manifest)


def parallel(fn: Callable[[str], None], items: list[str], threads: int = 16) -> None:
    if not items:
        return
    with ThreadPoolExecutor(min(threads, len(items))) as ex:
        list(ex.map(fn, items))


def spool_dir(url: str) -> Path:
    """Where a cache for ``url`` is built before its upload (``DLSTORE_SPOOL`` or ~/.cache/dlstore/spool)."""
    base = os.environ.get("DLSTORE_SPOOL") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dlstore", "spool"
    )
    return Path(base) / hashlib.sha256(url.encode()).hexdigest()[:16] / "cache"


def convert_to_store(
    url: str,
    storage_options: dict[str, Any] | None,
    overwrite: bool,
    log: Log | None,
    build: Callable[[Path], Any],
) -> Any:
    """Build locally (resumable, as any conversion), publish to ``url``, drop the spool folder."""
    store = RemoteStore(url, storage_options)
    check_remote_destination(store, overwrite)  # refuse before any work
    check_writable(store)
    spool = spool_dir(url)
    result = build(spool)
    result.bytes_on_disk = publish(spool, store, overwrite, log)
    result.dest = url
    shutil.rmtree(spool.parent, ignore_errors=True)
    return result
