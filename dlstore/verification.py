"""``verify``: recompute every checksum in the manifest; name the first file that differs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dlstore.conversion import file_sha256
from dlstore.spec import MANIFEST, parse_relpath, read_spec


@dataclass
class VerifyResult:
    root: str
    ok: bool
    checked: int
    problems: list[str] = field(default_factory=list)

    @property
    def first_problem(self) -> str:
        return self.problems[0] if self.problems else ""


def verify(path: str | Path) -> VerifyResult:
    """Check every data file against the manifest's sha256, and that no data file is unlisted."""
    root = Path(path)
    spec = read_spec(root)
    problems: list[str] = []
    for name, digest in sorted(spec.checksums.items()):
        file = root / parse_relpath(name, root / MANIFEST)
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file_sha256(file) != digest:
            problems.append(f"{file}: checksum mismatch (modified or truncated)")
    listed = set(spec.checksums) | {MANIFEST}
    extra = [p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in listed]
    problems += [f"{p}: not part of this cache (unexpected file)" for p in sorted(extra)]
    return VerifyResult(root=str(root), ok=not problems, checked=len(spec.checksums), problems=problems)
