"""The staging folder, journal and lock beside DEST (``.NAME.dlstore-staging/``, ``-journal/``,
``-lock``) that make a conversion atomic, resumable and exclusive. ``commit.json`` holds the new
manifest's sha256 before the swap, so a run killed after it knows on resume that DEST is done."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from dlstore.durable import fsync_path, write_json_durably
from dlstore.errors import ConvertError
from dlstore.machine import process_alive
from dlstore.spec import MANIFEST
from dlstore.write.diskfull import disk_full_message

_RENAME_EXCHANGE = 2
LOCK_ATTEMPTS = 5
HELD_LOCKS: set[int] = set()


def release_inherited_locks() -> None:
    """In a forked worker: close the driver's lock descriptors (the lock ends with the driver)."""
    for fd in list(HELD_LOCKS):
        with contextlib.suppress(OSError):
            os.close(fd)
    HELD_LOCKS.clear()


def pid_alive(text: str) -> bool:
    """Whether the pid written in a lock file is running (unknown text: assume so)."""
    try:
        pid = int(text.split()[0])
    except (ValueError, IndexError):
        return True
    return pid <= 0 or process_alive(pid)


class Staging:
    """Context manager: lock, then resume or start the staging area; ``commit`` publishes it."""

    def __init__(
        self,
        dest: Path,
        plan: dict[str, Any],
        discard_mismatch: bool = False,
        entries: list[list[Any]] | str | None = None,  # the source rows, or them as JSON text
    ) -> None:
        self.dest, self.plan, self.discard_mismatch = Path(dest), self.normalised(plan), discard_mismatch
        self.entries = entries
        parent, name = self.dest.parent, self.dest.name
        self.path = parent / f".{name}.dlstore-staging"
        self.journal = parent / f".{name}.dlstore-journal"
        self.lock_path = parent / f".{name}.dlstore-lock"
        self.done: dict[int, list[dict[str, Any]]] = {}
        # Per unit: the first DIGEST_BYTES of each sample's sha256, packed (1M samples: 8 MB, not ~110).
        self.digests: dict[int, bytes] = {}
        self.unit_sums: dict[int, dict[str, str]] = {}
        self.fresh = True  # unit_sums: checksum key -> sha256 of the unit's bytes, taken by its worker
        self.already_published = False  # a previous run of this plan was killed after publishing DEST
        self._lock_fd: int | None = None

    @staticmethod
    def normalised(plan: dict[str, Any]) -> dict[str, Any]:
        """A plan as it reads back from JSON (tuples → lists), so plans compare equal."""
        return json.loads(json.dumps(plan))

    @staticmethod
    def pending(dest: Path) -> bool:
        """An unfinished (or unpublished) conversion to DEST left its journal."""
        return (Path(dest).parent / f".{Path(dest).name}.dlstore-journal" / "plan.json").is_file()

    def __enter__(self) -> Staging:
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConvertError(
                f"{self.dest.parent}: cannot create the folder for DEST ({e.strerror}); "
                "choose a DEST in a writable folder"
            ) from None
        self._lock()
        try:
            self._open()
        except BaseException:
            self._unlock()
            raise
        self.entries = None  # only needed to open; a row per source file is too much to keep
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        try:
            if error is not None:
                self._leave_only_what_resumes(error)
        finally:
            self._unlock()

    def _leave_only_what_resumes(self, error: BaseException) -> None:
        """A failed run leaves staging and journal only when they resume (saying so in its error)."""
        if not self.path.exists() and not self.journal.exists():
            return
        if not self.done and not (self.journal / "commit.json").exists():
            shutil.rmtree(self.path, ignore_errors=True)
            shutil.rmtree(self.journal, ignore_errors=True)
            return
        if isinstance(error, ConvertError) and error.args and "kept for the resume" not in str(error.args[0]):
            error.args = (
                f"{error.args[0]} (kept for the resume: {self.path} and {self.journal}; "
                "remove them to start over)",
                *error.args[1:],
            )

    # -- lock ---------------------------------------------------------------------------------------
    def _lock(self) -> None:
        for _ in range(LOCK_ATTEMPTS):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:  # a read-only folder: the first file this conversion writes
                raise self._unwritable(e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                # Held by a dead pid's leftover workers: replace the stale file, then lock the new one.
                stale = not pid_alive(holder)
                if stale:
                    self._remove_if_same(fd)
                os.close(fd)
                if stale:
                    continue
                raise ConvertError(
                    f"{self.dest}: another dlstore convert (pid {holder}) is writing this destination; "
                    f"wait for it to finish (lock {self.lock_path})"
                ) from None
            if not self._is_lock_file(fd):  # its holder removed it as we opened it: lock the new one
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
            except OSError as e:  # a full disk: its first write
                self._remove_if_same(fd)
                os.close(fd)
                raise self._unwritable(e) from None
            self._lock_fd = fd  # a dead holder's flock vanishes with it, so a stale lock never blocks
            HELD_LOCKS.add(fd)
            return
        raise ConvertError(
            f"{self.dest}: the lock {self.lock_path} kept changing hands; another dlstore convert is "
            "starting on this destination: wait for it, then re-run"
        )

    def _is_lock_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.lock_path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _remove_if_same(self, fd: int) -> None:
        """Unlink the lock file if it is still the one ``fd`` opened (not a successor's)."""
        if self._is_lock_file(fd):
            self.lock_path.unlink(missing_ok=True)

    def _unwritable(self, e: OSError) -> ConvertError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return ConvertError(disk_full_message(self.dest.parent, f"writing {self.lock_path.name}"))
        return ConvertError(
            f"{self.dest.parent}: cannot write there ({e.strerror}: {self.lock_path.name}); "
            "choose a DEST in a writable folder"
        )

    def _unlock(self) -> None:
        """Remove the lock file while still holding it (a waiter re-checks it locked the lock file)."""
        if self._lock_fd is not None:
            self._remove_if_same(self._lock_fd)
            HELD_LOCKS.discard(self._lock_fd)
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- resume -------------------------------------------------------------------------------------
    def _open(self) -> None:
        old_plan = self._read_json(self.journal / "plan.json")
        if isinstance(old_plan, dict):  # staged by a dlstore before ConvertOptions: today's layout
            from dlstore.write.conversion_plan import upgraded_plan

            old_plan = upgraded_plan(old_plan)
        if old_plan is not None and self._finish_interrupted_commit(old_plan):
            return
        if old_plan is not None and self.path.is_dir():
            changed = plan_changes(old_plan, self.plan)
            if not changed:
                self.fresh = False
                self.done = self._read_done()
                return
            if not self.discard_mismatch:
                raise ConvertError(
                    f"{self.dest}: an unfinished conversion is staged at {self.path} but {'; '.join(changed)}"
                    f"{self._first_changed_source(old_plan)}; re-run with the original sources and options "
                    "to resume, or pass --overwrite to discard it and start over"
                )
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(self.journal, ignore_errors=True)
        self.path.mkdir()
        self.journal.mkdir()
        if self.entries is not None:
            text = self.entries if isinstance(self.entries, str) else json.dumps(self.entries)
            write_json_durably(self.journal / "entries.json", text)
        write_json_durably(self.journal / "plan.json", json.dumps(self.plan, sort_keys=True))

    def _first_changed_source(self, old_plan: dict[str, Any]) -> str:
        if old_plan.get("fingerprint") == self.plan.get("fingerprint") or self.entries is None:
            return ""
        from dlstore.sourcefiles import first_difference

        old = self._read_json(self.journal / "entries.json")
        new = json.loads(self.entries) if isinstance(self.entries, str) else self.entries
        diff = first_difference(old, new) if isinstance(old, list) else None
        return f" (first changed source file: {diff})" if diff else ""

    def _finish_interrupted_commit(self, old_plan: dict[str, Any]) -> bool:
        """A run of this same plan was killed while publishing: complete it instead of redoing it."""
        marker = self._read_json(self.journal / "commit.json")
        if marker is None or plan_changes(old_plan, self.plan):
            return False
        if manifest_digest(self.dest) == marker.get("manifest_sha256"):
            self._clean_up()  # the swap happened; staging holds the previous cache, if anything
            self.already_published = True
            return True
        return False  # not swapped yet: staging holds the new cache and resumes (all units done)

    @staticmethod
    def _read_json(path: Path) -> Any:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _read_done(self) -> dict[int, list[dict[str, Any]]]:
        done: dict[int, list[dict[str, Any]]] = {}
        try:
            lines = (self.journal / "done.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return done
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the last line of a killed run may be partial; its unit is redone
            done[int(rec["unit"])] = rec["bad"]
            self.digests[int(rec["unit"])] = packed_digests(rec.get("sha256", []))
            self.unit_sums[int(rec["unit"])] = dict(rec.get("checksums", {}))
        return done

    def save_writer_options(self, options: dict[str, Any]) -> None:
        write_json_durably(self.journal / "writer.json", json.dumps(options))

    def writer_options(self) -> dict[str, Any] | None:
        """The layout options recorded after ``create``; None if a run died before recording them."""
        opts = self._read_json(self.journal / "writer.json")
        return dict(opts) if isinstance(opts, dict) else None

    def record_many(
        self,
        units: list[tuple[int, list[dict[str, Any]], list[str]]],
        sums: dict[int, dict[str, str]] | None = None,
    ) -> None:
        """Journal durable units with one fsync; ``sums``: unit -> the checksums its worker took."""
        if not units:
            return
        sums = sums or {}
        lines = "".join(
            json.dumps({"unit": k, "bad": bad, "sha256": digests or [], "checksums": sums.get(k, {})}) + "\n"
            for k, bad, digests in units
        )
        with open(self.journal / "done.jsonl", "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            # Counted once written: a re-run reads these lines even if Ctrl-C lands in the fsync.
            for k, bad, digests in units:
                self.done[k] = bad
                self.digests[k] = packed_digests(digests or [])
                self.unit_sums[k] = sums.get(k, {})
            os.fsync(f.fileno())

    def bad(self) -> list[dict[str, Any]]:
        return sorted((b for bad in self.done.values() for b in bad), key=lambda b: b["index"])

    # -- publish ------------------------------------------------------------------------------------
    def commit(self, overwrite: bool) -> None:
        """Publish staging as DEST: an atomic swap when DEST exists (old cache readable until then)."""
        write_json_durably(
            self.journal / "commit.json", json.dumps({"manifest_sha256": manifest_digest(self.path)})
        )
        try:
            self._swap_in(overwrite)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ConvertError(
                f"{self.dest}: cannot publish the finished cache there ({e.strerror}: {e.filename}); "
                f"it is complete in {self.path}: make DEST's folder writable (a mount point cannot be "
                "replaced: use a folder inside it as DEST), then re-run the same command"
            ) from None
        self._clean_up()

    def _swap_in(self, overwrite: bool) -> None:
        if self.dest.exists():
            if not overwrite:
                raise ConvertError(
                    f"{self.dest}: appeared during the conversion; pass --overwrite to replace it"
                )
            if _exchange(self.path, self.dest):
                fsync_path(self.dest.parent)
                shutil.rmtree(self.path, ignore_errors=True)  # now holds the previous cache
            else:
                old = self.dest.parent / f".{self.dest.name}.dlstore-old"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(self.dest, old)
                os.rename(self.path, self.dest)
                fsync_path(self.dest.parent)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.path, self.dest)
            fsync_path(self.dest.parent)

    def _clean_up(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(self.journal, ignore_errors=True)
        if self._lock_fd is None:  # held: ``_unlock`` removes it while still holding it
            self.lock_path.unlink(missing_ok=True)


def manifest_digest(root: Path) -> str | None:
    try:
        return hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        return None


# Plan keys as the user gives them (``options.size`` → ``--size``, ``option_flag``); these few by name.
_OPTION_NAMES = {"n": "number of source images", "dlstore": "dlstore major version", "options.seed": "seed"}


def option_flag(key: str) -> str:
    if key in _OPTION_NAMES:
        return _OPTION_NAMES[key]
    if key.startswith("options."):
        return "--" + key.rpartition(".")[2].replace("_", "-")
    return key


SOURCE_KEYS = ("fingerprint", "n")  # what the source decides, not the options
DERIVED_KEYS = ("unit_size",)  # follows from the options; never the first difference worth naming


def plan_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two plans, new value first: ``--size 64 was 32``."""
    out: list[str] = []
    for key in [*new, *(k for k in old if k not in new)]:  # the new plan's order: --format first
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += plan_changes(a, b, f"{prefix}{key}.")
        elif a != b and key == "fingerprint":
            out.append("the source files changed")
        elif a != b:
            out.append(f"{option_flag(prefix + key)} {_show(b)} was {_show(a)}")
    return out


def option_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Like plan_changes, leaving out what the source decides and what follows from the options."""
    skip = SOURCE_KEYS + DERIVED_KEYS
    return plan_changes(
        {k: v for k, v in old.items() if k not in skip}, {k: v for k, v in new.items() if k not in skip}
    )


def _show(value: Any) -> str:
    if value is None:  # an option given on one run only (recorded only when given)
        return "(default)"
    return value if isinstance(value, str) else json.dumps(value)


def _exchange(a: Path, b: Path) -> bool:
    """Linux renameat2(RENAME_EXCHANGE): swap two paths atomically. False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def packed_digests(sha256_hex: list[str]) -> bytes:
    """The first ``DIGEST_BYTES`` of each hex digest, concatenated (zeros for "")."""
    from dlstore.sourcefiles import DIGEST_BYTES

    width = 2 * DIGEST_BYTES
    return bytes.fromhex("".join(h[:width] if h else "0" * width for h in sha256_hex))
