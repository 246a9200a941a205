"""Byte counts (decimal, as ``df -H``) and counts of things ("1 worker", "2 workers")."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1234567`` → ``"1.2 MB"``; under 1000 bytes, whole bytes."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "worker")`` → ``"1 worker"``, ``count(2, "class", "classes")`` → ``"2 classes"``."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
