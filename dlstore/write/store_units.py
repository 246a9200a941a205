"""Dask workers writing a URL DEST's units straight to the object store: each task writes its unit
in a temporary folder (seeded with the writer's layout), uploads it under
``.dlstore-staging/units-<plan>/`` and returns its sha256s, journaled (``remote_units.jsonl``) before
the unit is done; ``publish`` copies them to their keys. Units not files of their own keep the spool."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlstore.checksums import digest_key, keys_for
from dlstore.storage.stores import RemoteStore

STAGING = ".dlstore-staging"  # the staging prefix of dlstore.write.publish
SUMS = "remote_units.jsonl"  # in the driver's journal folder: unit → its objects' checksums


@dataclass
class StoreUnits:
    """Where the workers put units, and the layout they start from (picklable: a URL, no client)."""

    store: RemoteStore
    prefix: str  # relative to the store's root: ``.dlstore-staging/units-<plan digest>``
    skeleton_files: dict[str, bytes] = field(default_factory=dict)
    skeleton_dirs: list[str] = field(default_factory=list)

    def capture(self, root: Path) -> None:
        """The layout ``writer.create()`` made (metadata and folders), before any unit."""
        self.skeleton_dirs = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir())
        self.skeleton_files = {
            p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()
        }


def units_prefix(plan: dict[str, Any]) -> str:
    """The staging prefix of a conversion's units: one per plan."""
    digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    return f"{STAGING}/units-{digest}"


def convert_unit_to_store(job: Any, k: int) -> Any:
    """A Dask task: ``convert_job_unit`` uploaded; a sixth item: {checksum key: sha256}."""
    from dlstore.write.unit_work import convert_job_unit

    units: StoreUnits = job.store_units
    tmp = Path(tempfile.mkdtemp(prefix=f"dlstore-unit{k}-"))
    try:
        for rel in units.skeleton_dirs:
            (tmp / rel).mkdir(parents=True, exist_ok=True)
        for rel, data in units.skeleton_files.items():
            (tmp / rel).write_bytes(data)
        local = copy.copy(job)
        local.writer = copy.copy(job.writer)
        local.writer.root = tmp
        result = convert_job_unit(local, k)
        written = sorted(
            p
            for p in tmp.rglob("*")
            if p.is_file() and p.relative_to(tmp).as_posix() not in units.skeleton_files
        )
        for p in written:
            units.store.put_file(p, f"{units.prefix}/{p.relative_to(tmp).as_posix()}")
        sums = {key: digest_key(tmp, key) for key in keys_for(tmp, written)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (*result, sums)  # result's own unit checksums are {}: its units are files of their own


def convert_unit_to_store_in_process(k: int) -> Any:
    """``convert_unit_to_store`` in a decode process (the job ``_init_worker`` installed)."""
    from dlstore.write.unit_work import installed_job

    return convert_unit_to_store(installed_job(), k)


def journal_sums(journal: Path, results: list[Any]) -> None:
    """Before the units are journaled as done: their objects' checksums, durably."""
    lines = "".join(json.dumps({"unit": r[0], "checksums": r[5]}) + "\n" for r in results)
    with open(journal / SUMS, "a", encoding="utf-8") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())


def journaled_sums(journal: Path, done: set[int]) -> dict[str, str]:
    """The checksums of every unit journaled as done (a torn last line belongs to an unfinished one)."""
    out: dict[str, str] = {}
    try:
        lines = (journal / SUMS).read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry["unit"] in done:
            out.update(entry["checksums"])
    return out
