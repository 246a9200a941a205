"""``verify``: every checksum of the manifest recomputed, the first file that differs named; also
``skipped.json`` against the labels, and the source against its record (``deep``: by content)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlstore.checksums import file_sha256, listed_files, mismatches, regular_files, size_problems, split_key
from dlstore.errors import CacheCorruptError
from dlstore.sourcefiles import SourceRecord, inside_root, read_record, recorded_root, source_status
from dlstore.spec import MANIFEST, SKIPPED_FILE, CacheSpec, manifest_digest, parse_relpath, read_spec
from dlstore.storage.mirror import fetch_manifest
from dlstore.storage.stores import RemoteStore, parse_store_path


@dataclass
class VerifyResult:
    root: str
    ok: bool
    checked: int
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sources_hashed: int = 0

    @property
    def first_problem(self) -> str:
        return self.problems[0] if self.problems else ""


def verify(
    path: str | Path,
    deep: bool = False,
    source: str | Path | None = None,
    storage_options: dict[str, Any] | None = None,
) -> VerifyResult:
    """Check every file against the manifest's sha256, no file unlisted, ``skipped.json`` against
    the manifest, the source unchanged (``deep``: by content; ``source``: where it moved). A URL is checked
    object by object; its source is not."""
    root = parse_store_path(path)
    if isinstance(root, str):
        return verify_remote(RemoteStore(root, storage_options))
    spec = read_spec(root)
    edited = manifest_problems(root)  # then its source is not opened as it says (deep)
    problems = edited + checksum_problems(root, spec)
    if not problems:
        problems += skipped_problems(root, spec)
    notes: list[str] = []
    status = source_status(root, source)
    if status.stale:
        problems.append(f"stale: {status.message}")
    elif not status.checked and not (deep and spec.source.get("reopen")):  # deep: re-hashed below
        notes.append(status.message)
    hashed = 0
    if deep and not edited:
        deep_problems, hashed = source_content_problems(root, source)
        problems += deep_problems
    return VerifyResult(
        root=str(root),
        ok=not problems,
        checked=len(spec.checksums),
        problems=problems,
        notes=notes,
        sources_hashed=hashed,
    )


def manifest_problems(root: Path) -> list[str]:
    """The manifest against the digest of its own content (caches from before it kept none)."""
    path = root / MANIFEST
    doc = json.loads(path.read_text(encoding="utf-8"))  # read_spec has parsed it already
    if "digest" not in doc or doc["digest"] == manifest_digest(doc):
        return []
    return [
        f"{path}: edited since conversion (its content no longer matches its digest: classes, counts or "
        f"shapes may be wrong); rebuild the cache with `dlstore convert SOURCE {root} --overwrite`"
    ]


def checksum_problems(root: Path, spec: CacheSpec) -> list[str]:
    """Non-regular files (never read), bytes no checksum covers, every checksum, unlisted files."""
    for name in spec.checksums:
        parse_relpath(split_key(name)[0], root / MANIFEST)
    try:
        present = regular_files(root)
    except CacheCorruptError as e:  # a symlink, FIFO, device or socket: nothing is read through it
        return [str(e)]
    problems = size_problems(root, spec.checksums, present)
    problems += [
        p for p in mismatches(root, spec.checksums) if not any(p.split(":")[0] in q for q in problems)
    ]
    listed = listed_files(spec.checksums) | {MANIFEST}
    extra = [root / rel for rel in present if rel not in listed]
    return problems + [f"{p}: not part of this cache (unexpected file)" for p in sorted(extra)]


def skipped_problems(root: Path, spec: CacheSpec) -> list[str]:
    """Every image missing from the cache is listed once in skipped.json with its path and reason."""
    path = root / SKIPPED_FILE
    try:
        skipped = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return [f"{path}: unreadable ({e})"]
    if not isinstance(skipped, list) or not all(_is_skip_entry(s) for s in skipped):
        return [f"{path}: expected a list of {{index, path, reason}} objects"]
    indexed = [s["index"] for s in skipped if s["index"] is not None]
    expected = spec.n_stored - spec.n
    if len(indexed) != expected or len(set(indexed)) != len(indexed):
        return [f"{path}: lists {len(indexed)} skipped images, the manifest says {expected}"]
    record = read_record(root)
    names = record.names if record is not None else []
    for s in skipped:
        if s["index"] is not None and names and (s["index"] >= len(names) or names[s["index"]] != s["path"]):
            return [
                f"{path}: entry {s['index']} names {s['path']!r}, which is not source sample {s['index']}"
            ]
    return []


def _is_skip_entry(s: Any) -> bool:
    return (
        isinstance(s, dict)
        and isinstance(s.get("path"), str)
        and isinstance(s.get("reason"), str)
        and (s.get("index") is None or isinstance(s.get("index"), int))
    )


def source_content_problems(root: Path, source: str | Path | None) -> tuple[list[str], int]:
    """Re-hash every source file recorded with a digest; name those whose content changed."""
    record = read_record(root)
    if record is None:
        return [f"{root}: no source record; cannot check the source by content"], 0
    recorded = recorded_root(read_spec(root))
    if recorded is None and source is None:
        reopen = read_spec(root).source.get("reopen")
        if isinstance(reopen, dict):
            return reopened_problems(record, reopen)
        return [], 0  # torchvision arrays, a Dataset object given in Python: nothing to open again
    src_root = Path(source) if source is not None else recorded
    assert src_root is not None
    if not src_root.is_dir():
        return [f"source root {src_root} not found; pass the dataset's new location with --source DIR"], 0
    files = dict(zip(record.names, inside_root(src_root, record.names)))

    def now(name: str) -> str:
        file = files[name]
        if file is None:
            raise ValueError(
                f"{src_root}: the source record names {name!r}, outside the source root; not opened "
                f"(the cache may be tampered with): rebuild it with `dlstore convert {src_root} {root} --overwrite`"
            )
        try:
            return file_sha256(file)
        except OSError as e:
            raise ValueError(f"{file}: cannot read source file ({e.strerror})") from None

    return rehashed(record, now, lambda name: str(files[name]))


def rehashed(
    record: SourceRecord, now: Callable[[str], str], named: Callable[[str], str]
) -> tuple[list[str], int]:
    """Each recorded digest against ``now(name)`` (ValueError: a problem to report as it says)."""
    problems: list[str] = []
    hashed = 0
    for k, name in enumerate(record.names):
        digest = record.digest(k)
        if not digest:
            continue
        try:
            got = now(name)
        except ValueError as e:
            problems.append(str(e))
            continue
        hashed += 1
        if not got.startswith(digest):
            problems.append(f"{named(name)}: source content changed since conversion (sha256 differs)")
    return problems, hashed


def reopened_problems(record: SourceRecord, reopen: dict[str, Any]) -> tuple[list[str], int]:
    """Open the source again as the manifest says; re-hash each sample against its recorded digest."""
    from dlstore.errors import DlstoreError
    from dlstore.write.sources import open_source

    try:
        root = reopen.get("root")
        src = open_source(
            reopen["source"],
            root=Path(root) if root else None,
            label=reopen.get("label"),
            fields=tuple(reopen.get("fields") or ()),
        )
    except (DlstoreError, OSError, KeyError) as e:
        return [f"source {reopen.get('source')}: cannot open it again to check by content ({e})"], 0
    where = {name: i for i, name in enumerate(src.names)}

    def now(name: str) -> str:
        if name not in where:
            raise ValueError(f"{name}: no longer in the source {reopen['source']}")
        return src.digest(where[name], missing_ok=True)

    return rehashed(record, now, str)


def verify_remote(store: RemoteStore) -> VerifyResult:
    """Every listed object downloaded and checked; unlisted objects (but staging) are problems."""
    from dlstore.write.publish import STAGING

    raw, spec = fetch_manifest(store)
    listing = store.sizes()
    listed = listed_files(spec.checksums)
    with tempfile.TemporaryDirectory(prefix="dlstore-verify-") as tmp:
        root = Path(tmp)
        (root / MANIFEST).write_bytes(raw)
        for rel in sorted(listed & set(listing)):  # a missing one is reported by mismatches
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            store.get_file(rel, root / rel)
        present = {rel: (root / rel).stat().st_size for rel in listed & set(listing)}
        problems = manifest_problems(root) + size_problems(root, spec.checksums, present)
        problems += mismatches(root, spec.checksums)
        problems = problems or skipped_problems(root, spec)
        problems = [p.replace(str(root), store.url) for p in problems]
    extra = sorted(
        k for k in listing if k not in listed and k != MANIFEST and not k.startswith(f"{STAGING}/")
    )
    problems += [f"{store.where(k)}: not part of this cache (unexpected object)" for k in extra]
    return VerifyResult(
        root=store.url,
        ok=not problems,
        checked=len(spec.checksums),
        problems=problems,
        notes=[f"{store.url}: a remote cache; its source folder is not checked"],
    )
