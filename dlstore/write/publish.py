"""Publishing a finished local cache to an object store atomically, never touching an object that is
not dlstore's: those a manifest lists and its ``.dlstore-staging/`` prefix (``Ownership``).

1. Every file, manifest first, goes under ``.dlstore-staging/<id>/`` (a re-run skips those there);
   the old cache stays readable. Units Dask workers wrote are already staged (``store_units``).
2. What the old generation owns goes to ``.dlstore-staging/replacing.json``; its manifest is deleted.
3. Staged objects are copied server-side to their keys; old objects not listed anew are deleted.
4. The manifest is written last, in one PUT: the cache appears complete or not at all.
5. The staging prefix is removed."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlstore import settings
from dlstore.checksums import split_key
from dlstore.errors import CacheCorruptError, CacheExistsError, DlstoreError
from dlstore.spec import MANIFEST, parse_manifest
from dlstore.storage.stores import RemoteStore, RemoteStoreError
from dlstore.write.conversion_plan import recorded_plan
from dlstore.write.progress import UPLOAD, Progress, ProgressCounter
from dlstore.write.store_units import units_prefix

STAGING = ".dlstore-staging"
REPLACING = f"{STAGING}/replacing.json"  # what the generation being replaced owns (step 2)
Log = Callable[[str], None]


def listed_files(manifest: bytes, where: str) -> set[str]:
    """The objects a manifest owns: every file its checksums cover, and itself."""
    try:
        checksums = json.loads(manifest)["checksums"]
        return {split_key(key)[0] for key in checksums} | {MANIFEST}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CacheCorruptError(
            f"{where}: this manifest cannot be read, so dlstore cannot tell which objects beside it are "
            "its own and will not delete any; remove the old cache's objects yourself, or choose another "
            "prefix"
        ) from None


@dataclass
class Ownership:
    """What is under a URL before a publish, and which of it is dlstore's."""

    objects: dict[str, int]  # every object under the prefix → size
    has_cache: bool  # a complete cache (its manifest) is there now
    owned: set[str] = field(default_factory=set)  # listed by that manifest or by a publish under way
    foreign: list[str] = field(default_factory=list)  # everything else outside the staging prefix

    @property
    def in_progress(self) -> bool:
        """A killed publish left its staged manifest or its replacement record."""
        return any(
            rel.startswith(f"{STAGING}/") and rel.endswith(f"/{MANIFEST}") for rel in self.objects
        ) or (REPLACING in self.objects)


SURVEY_ATTEMPTS = 3


def survey(store: RemoteStore) -> Ownership:
    """The prefix listed, dlstore's objects apart; listed again if a listed manifest is gone."""
    gone: FileNotFoundError | None = None
    for _ in range(SURVEY_ATTEMPTS):
        try:
            return survey_once(store)
        except FileNotFoundError as e:
            if isinstance(e, DlstoreError):
                raise
            gone = e
    raise RemoteStoreError(
        f"{gone.filename if gone else store.url}: listed under {store.url} but gone when read, "
        f"{SURVEY_ATTEMPTS} times (another dlstore publishing there, or a store losing objects); re-run "
        "the same command once it has settled"
    )


def survey_once(store: RemoteStore) -> Ownership:
    objects = store.sizes()
    owned: set[str] = set()
    if MANIFEST in objects:
        owned |= listed_files(store.get_bytes(MANIFEST), store.where(MANIFEST))
    for rel in objects:
        if rel.startswith(f"{STAGING}/") and rel.endswith(f"/{MANIFEST}"):
            owned |= listed_files(store.get_bytes(rel), store.where(rel))
    if REPLACING in objects:
        try:
            owned |= set(json.loads(store.get_bytes(REPLACING))["files"])
        except (ValueError, KeyError, TypeError):
            raise CacheCorruptError(
                f"{store.where(REPLACING)}: the record of an interrupted replacement cannot be read; "
                "remove it once you have checked the objects under the prefix, then re-run"
            ) from None
    foreign = sorted(rel for rel in objects if not rel.startswith(f"{STAGING}/") and rel not in owned)
    return Ownership(objects, MANIFEST in objects, owned, foreign)


def examples(names: list[str], k: int = 3) -> str:
    more = f", and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def check_ownership(store: RemoteStore) -> Ownership:
    """Refuse a destination that holds anything dlstore does not own; returns what is there."""
    there = survey(store)
    if there.foreign and store.is_bucket_root:
        raise CacheExistsError(
            f"{store.url}: is a bucket's root and holds {len(there.foreign)} other object(s) "
            f"({examples(there.foreign)}); a cache takes a bucket's root only while it is empty; "
            f"choose a prefix of its own, e.g. {store.url}/NAME"
        )
    if there.foreign and not there.has_cache and not there.in_progress:
        raise CacheExistsError(
            f"{store.url}: exists and is not a dlstore cache (no {MANIFEST}; holds "
            f"{len(there.foreign)} object(s): {examples(there.foreign)}); refusing to replace it even "
            "with --overwrite; choose another prefix"
        )
    return there


def check_writable(store: RemoteStore) -> None:
    """A missing bucket or read-only credentials fail now (a probe object), not after the conversion."""
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


def staged_units(manifest: bytes, files: dict[str, int]) -> dict[str, str]:
    """Listed files not in the local folder (units the workers wrote) → their staged key."""
    doc = json.loads(manifest)
    listed = {split_key(key)[0] for key in doc["checksums"]}
    remote = sorted(listed - set(files) - {MANIFEST})
    if not remote:
        return {}
    prefix = units_prefix(manifest_plan(manifest))
    return {rel: f"{prefix}/{rel}" for rel in remote}


def manifest_plan(manifest: bytes) -> dict[str, Any]:
    """The plan a manifest was built from (its units' staging prefix is named after it)."""
    plan = recorded_plan(parse_manifest(manifest, Path(MANIFEST)))
    if plan is None:
        raise CacheCorruptError(f"{MANIFEST}: records no options; re-run with --overwrite to rebuild")
    return plan


def check_units_staged(store: RemoteStore, manifest: bytes, units: dict[str, str]) -> dict[str, int]:
    """The sizes of the units the workers staged; a missing one is a damaged conversion."""
    if not units:
        return {}
    sizes = store.sizes(units_prefix(manifest_plan(manifest)))
    missing = [rel for rel in units if rel not in sizes]
    if missing:
        raise CacheCorruptError(
            f"{store.where(units[missing[0]])}: a unit the workers wrote is missing from the store "
            f"({len(missing)} missing); re-run with --overwrite to rebuild"
        )
    return {rel: sizes[rel] for rel in units}


@dataclass(frozen=True)
class Published:
    """A publish's bytes on the store, objects, and those an interrupted attempt had staged."""

    bytes: int
    objects: int
    already_staged: int


def publish(
    root: Path, store: RemoteStore, overwrite: bool, log: Log | None = None, progress: Progress | None = None
) -> Published:
    """Upload the cache at ``root`` to ``store`` as above; ``progress`` gets the bytes uploaded."""
    manifest = (root / MANIFEST).read_bytes()
    local = (p for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST)
    files = {p.relative_to(root).as_posix(): p.stat().st_size for p in local}  # all but the manifest
    units = staged_units(manifest, files)
    unit_sizes = check_units_staged(store, manifest, units)
    there = check_ownership(store)  # again: the prefix may have changed meanwhile
    if there.has_cache and not overwrite:
        raise CacheExistsError(f"{store.url}: already holds a dlstore cache; pass --overwrite to replace it")
    staging_id = hashlib.sha256(json.dumps(json.loads(manifest)["checksums"], sort_keys=True).encode())
    prefix = f"{STAGING}/{staging_id.hexdigest()[:16]}"
    staged = store.sizes(prefix)
    todo = [rel for rel, size in files.items() if staged.get(rel) != size]  # the rest: a resumed upload
    store.put_bytes(manifest, f"{prefix}/{MANIFEST}")  # from now on the listed objects are known as ours
    counter = ProgressCounter(progress, UPLOAD, "bytes", sum(files[rel] for rel in todo))

    def upload(rel: str) -> None:
        store.put_file(root / rel, f"{prefix}/{rel}")
        counter.add(files[rel])

    parallel(upload, todo)
    if there.owned:  # the generation being replaced, recorded before its manifest goes
        store.put_bytes(json.dumps({"files": sorted(there.owned)}).encode(), REPLACING)
    if there.has_cache:
        store.delete([MANIFEST])  # the old generation stops opening before any of its objects change
    parallel(lambda rel: store.copy(f"{prefix}/{rel}", rel), list(files))
    parallel(lambda rel: store.copy(units[rel], rel), list(units))
    keep = set(files) | set(units) | {MANIFEST}
    store.delete(sorted(rel for rel in there.owned - keep if rel in there.objects))
    store.put_bytes(manifest, MANIFEST)
    store.delete([f"{STAGING}/{rel}" for rel in sorted(store.sizes(STAGING))])  # all of it: superseded
    if log and there.foreign:
        log(
            f"kept {len(there.foreign)} object(s) under {store.url} that are not dlstore's ({examples(there.foreign)})"
        )
    size = sum(files.values()) + sum(unit_sizes.values()) + len(manifest)
    return Published(size, len(files), len(files) - len(todo))


def parallel(fn: Callable[[str], None], items: list[str], threads: int = 16) -> None:
    if not items:
        return
    with ThreadPoolExecutor(min(threads, len(items))) as ex:
        list(ex.map(fn, items))


def spool_dir(url: str) -> Path:
    """Where a cache for ``url`` is built before its upload (``DLSTORE_SPOOL`` or ~/.cache/dlstore/spool)."""
    return settings.folder("DLSTORE_SPOOL", "spool") / hashlib.sha256(url.encode()).hexdigest()[:16] / "cache"
