"""Phase 2 of a conversion, the run: every unit decoded and written by a ``Runner`` (in-process, a
process pool, or ``dask_engine.DaskRunner``). ``run_units`` journals what they hand back and turns a
worker's death, Ctrl-C and ``--strict`` into one message each."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from typing import Any, Protocol

from PIL import Image

from dlstore.errors import ConvertError, ConvertInterrupted, ImageDecodeError
from dlstore.formats.base import CacheWriter
from dlstore.machine import usable_cores
from dlstore.write.progress import ProgressCounter
from dlstore.write.sizes import count
from dlstore.write.staging import Staging
from dlstore.write.store_units import journal_sums
from dlstore.write.unit_work import Job, UnitResult, _init_worker, convert_job_unit, convert_unit

Done = Callable[[list[UnitResult]], None]


class Runner(Protocol):
    """Runs a conversion's units and hands each result back to the driver as it finishes."""

    def start(self, n_units: int) -> int:
        """Get ready for ``n_units`` units (a cluster up); returns how many run at once."""
        ...

    def run(self, job: Job, todo: list[int], done: Done) -> None:
        """Run ``todo``, calling ``done(results)`` here as they finish; a unit's error is raised here."""
        ...

    def lost_worker(self, error: BaseException) -> str | None:
        """What to tell the user when ``error`` means a worker died; None when it does not."""
        ...

    def finish(self, t0: float) -> dict[str, float]:
        """Stop what ``start`` started; seconds by stage (``t0``: the monotonic start, for timelines)."""
        ...


class InProcessRunner:
    """One worker: the units run in this process, one after another."""

    def start(self, n_units: int) -> int:
        return 1

    def run(self, job: Job, todo: list[int], done: Done) -> None:
        limit = Image.MAX_IMAGE_PIXELS  # the caller's process: its own limit again afterwards
        try:
            for k in todo:
                done([convert_job_unit(job, k)])
        finally:
            Image.MAX_IMAGE_PIXELS = limit

    def lost_worker(self, error: BaseException) -> str | None:
        return None

    def finish(self, t0: float) -> dict[str, float]:
        return {}


class PoolRunner:
    """A process pool on this machine; each worker decodes and writes whole units."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.cpu_limit_s = 0.0  # a worker spinning longer than this is killed (``unit_work``)

    def start(self, n_units: int) -> int:
        return self.workers

    def run(self, job: Job, todo: list[int], done: Done) -> None:
        self.cpu_limit_s = 3 * job.decode_timeout + 1
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker, initargs=(job,))
        # A bounded window: ``wait`` walks every pending future, O(units²) with all of them submitted.
        queue = iter(todo)
        try:
            pending: set[Future[UnitResult]] = {
                pool.submit(convert_unit, k) for k in islice(queue, 4 * self.workers)
            }
            while pending:
                # Not FIRST_EXCEPTION: without an error it waits for the whole window's slowest unit.
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                results = [fut.result() for fut in finished]  # re-raises a worker's error here
                pending |= {pool.submit(convert_unit, k) for k in islice(queue, len(finished))}
                done(results)
        except BaseException:
            stop_pool(pool)
            raise
        pool.shutdown(wait=True)

    def lost_worker(self, error: BaseException) -> str | None:
        if not isinstance(error, BrokenProcessPool):
            return None
        return (
            "a conversion worker died (killed, out of memory, or a decoder crashed or spun for more than "
            f"{self.cpu_limit_s:g} s of CPU)"
        )

    def finish(self, t0: float) -> dict[str, float]:
        return {}


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """End the workers now (Ctrl-C must return within seconds); an unfinished unit is redone on resume."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        p.terminate()
    pool.shutdown(wait=True, cancel_futures=True)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def local_runner(workers: int | None, n_units: int) -> InProcessRunner | PoolRunner:
    """``workers`` processes (default: all usable cores, at most one per unit; one: in this process)."""
    count = max(1, min(usable_cores() if workers is None else workers, n_units))
    return InProcessRunner() if count == 1 else PoolRunner(count)


def workers_reason(asked: int | None, used: int, n_units: int, unit_size: int, cluster: bool) -> str:
    """Why the run used ``used`` workers, in words: one worker writes a whole unit."""
    if cluster:
        return f"the Dask cluster's {count(used, 'worker')}"
    wanted = usable_cores() if asked is None else asked
    if used < wanted:
        given = f"the {count(wanted, 'worker')} asked for" if asked else f"the {wanted} usable cores"
        return (
            f"only {count(n_units, 'unit')} of work, fewer than {given}: one worker writes a whole unit "
            f"of up to {count(unit_size, 'image')}"
        )
    return "as asked (--workers)" if asked is not None else f"all {count(used, 'usable core')}"


def run_units(
    runner: Runner, job: Job, todo: list[int], staging: Staging, ledger: UnitLedger, counter: ProgressCounter
) -> None:
    """Run ``todo``, journaling then counting each unit; an early stop says how far it got and how on."""

    def done(results: list[UnitResult]) -> None:
        on_store = [r for r in results if len(r) > 5]  # units the workers wrote to an object store
        if on_store:
            journal_sums(staging.journal, on_store)  # the objects' digests first, then "done"
        ledger.record([r[:5] for r in results])  # the objects' checksums are journaled apart
        for res in results:
            counter.add(len(job.writer.unit_range(res[0])))

    ledger.started = time.monotonic()  # the units are handed out now (a cluster is up)
    try:
        runner.run(job, todo, done)
    except KeyboardInterrupt:
        raise ConvertInterrupted(
            f"interrupted: {done_images(job.writer, staging)} of {job.writer.n} done; "
            "re-run the same command to resume"
        ) from None
    except ImageDecodeError as e:
        raise ConvertError(
            f"--strict: stopped at the first undecodable image: {e}; "
            f"{done_images(job.writer, staging)} of {job.writer.n} done; fix or remove the "
            "file and re-run with --overwrite (or drop --strict to skip and report it)"
        ) from None
    except Exception as e:
        lost = runner.lost_worker(e)
        if lost is None:
            raise
        raise ConvertError(
            f"{lost}; {done_images(job.writer, staging)} of {job.writer.n} done; "
            "re-run the same command to resume"
        ) from None


def done_images(writer: CacheWriter, staging: Staging) -> int:
    return sum(len(writer.unit_range(k)) for k in staging.done)


# --- the ledger: finished units journaled, --max-bad, the workers' time ----------------------------------


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
        """How evenly the units went round the slots: units per slot, first starts and last ends."""
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
