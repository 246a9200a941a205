"""The ledger of a run: units journaled, ``--max-bad`` checked, the workers' time by kind."""

from __future__ import annotations

import time
from typing import Any

from dlstore.errors import ConvertError
from dlstore.write.staging import Staging
from dlstore.write.unit_work import UnitResult


class UnitLedger:
    """Journals finished units, aborts once the bad images exceed ``max_bad``, times the workers."""

    def __init__(self, n: int, max_bad: float, staging: Staging) -> None:
        self.n, self.max_bad, self.staging = n, max_bad, staging
        self.started = time.monotonic()  # reset when the units are handed out
        self.journal_s = 0.0
        self.worker = dict.fromkeys(("decode", "digest", "write", "checksum", "unit_other"), 0.0)
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.slots: dict[float, list[float]] = {}  # slot → [units, its first start, its last end]

    def record(self, results: list[UnitResult]) -> None:
        """Journal finished units, with one fsync for all of them."""
        t0 = time.perf_counter()
        self.staging.record_many(
            [(k, bad, digests) for k, bad, digests, _, _ in results], {r[0]: r[4] for r in results if r[4]}
        )
        self.journal_s += time.perf_counter() - t0
        kinds = ("decode", "digest", "write", "checksum")
        for *_, times, _ in results:
            for key in kinds:
                self.worker[key] += times.get(key, 0.0)
            # Inside the unit but none of the four: per-unit overhead (the rest is start-up and waits).
            spent = times["end"] - times["start"]
            self.worker["unit_other"] += max(0.0, spent - sum(times.get(k, 0.0) for k in kinds))
            self.starts.append(times["start"])
            self.ends.append(times["end"])
            slot = self.slots.setdefault(times.get("slot", -1.0), [0.0, times["start"], times["end"]])
            slot[0] += 1
            slot[1], slot[2] = min(slot[1], times["start"]), max(slot[2], times["end"])
        if any(r[1] for r in results):
            check_bad_fraction(self.staging.bad(), self.n, self.max_bad, final=False)

    def stages(self, n_workers: int) -> dict[str, float]:
        """Seconds: start-up, the run, journaling, worker time by kind (summed) and the rest."""
        now = time.monotonic()
        run = now - self.started
        out = {
            "workers": float(n_workers),
            "run_s": run,
            "startup_s": min(self.starts) - self.started if self.starts else 0.0,
            "journal_s": self.journal_s,
            "after_last_unit_s": now - max(self.ends) if self.ends else 0.0,
        }
        out.update({f"workers_{k}_s": v for k, v in self.worker.items()})
        out["workers_other_or_idle_s"] = max(0.0, n_workers * run - sum(self.worker.values()))
        out.update(self.slot_spread())
        return out

    def slot_spread(self) -> dict[str, float]:
        """How evenly the units went round the slots (worker or decode processes): units per slot and
        the spread of first starts and last ends, after the units were handed out."""
        if not self.slots:
            return {}
        units, firsts, lasts = zip(*self.slots.values(), strict=True)
        return {
            "slots": float(len(self.slots)),
            "units_per_slot_min": min(units),
            "units_per_slot_max": max(units),
            "slot_first_start_min_s": min(firsts) - self.started,
            "slot_first_start_max_s": max(firsts) - self.started,
            "slot_last_end_min_s": min(lasts) - self.started,
            "slot_last_end_max_s": max(lasts) - self.started,
        }


def check_bad_fraction(bad: list[dict[str, Any]], n: int, max_bad: float, final: bool = True) -> None:
    """More than ``max_bad`` of all n images undecodable (or all of them) aborts the conversion."""
    if not n or not bad or (len(bad) < n and len(bad) / n <= max_bad):
        return
    first = "; ".join(f"{b['path']}: {b['reason']}" for b in bad[:3])
    when = "" if final else " (stopped early)"
    raise ConvertError(
        f"{len(bad)} of {n} images could not be decoded{when}, more than --max-bad {max_bad:g} "
        f"of them; nothing was marked complete. First: {first}. Fix or remove the files and "
        "re-run with --overwrite, or raise --max-bad"
    )
