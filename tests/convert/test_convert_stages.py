"""convert reports where its time went (ConvertResult.stages) and journals units in batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlstore.read.cache import open_cache
from dlstore.spec import read_spec
from dlstore.write.conversion import convert
from dlstore.write.options import ConvertOptions

WORKER_KEYS = (
    "workers_decode_s",
    "workers_digest_s",
    "workers_write_s",
    "workers_checksum_s",
    "workers_unit_other_s",
)
SETUP_KEYS = ("setup_scan_s", "setup_plan_s", "setup_staging_s", "setup_create_s")
FINALIZE_KEYS = ("finalize_writer_s", "finalize_metadata_s", "sync_tree_s", "checksums_s")


@pytest.mark.parametrize("workers", [1, 2])
def test_stages_cover_the_phases(image_tree: Path, tmp_path: Path, workers: int) -> None:
    res = convert(image_tree, tmp_path / "c", ConvertOptions(format="ram", size=16, workers=workers))
    st = res.stages
    for key in (
        "setup_s",
        "run_s",
        "startup_s",
        "journal_s",
        "finalize_s",
        "commit_s",
        "checksums_s",
        *WORKER_KEYS,
    ):
        assert st[key] >= 0.0, key
    assert st["workers"] == res.workers and st["workers_decode_s"] > 0
    # Worker time is measured inside the run, and the phases inside the whole conversion.
    assert sum(st[k] for k in WORKER_KEYS) <= res.workers * st["run_s"] + 0.05
    assert st["setup_s"] + st["run_s"] + st["finalize_s"] + st["commit_s"] <= res.seconds + 0.05
    # The fixed costs' parts add up to no more than the phase they split.
    assert all(st[k] >= 0.0 for k in SETUP_KEYS + FINALIZE_KEYS)
    assert sum(st[k] for k in SETUP_KEYS) <= st["setup_s"] + 1e-6
    assert sum(st[k] for k in FINALIZE_KEYS) <= st["finalize_s"] + 1e-6
    assert len(open_cache(tmp_path / "c")) == res.n
    assert_slot_spread(
        st, res.workers, -(-res.n // int(read_spec(tmp_path / "c").format_options["unit_size"]))
    )


def assert_slot_spread(st: dict[str, float], workers: int, units: int) -> None:
    """Units per worker (slot) and when the slots started and ended, consistent with the run."""
    assert 1 <= st["slots"] <= workers
    assert st["units_per_slot_min"] * st["slots"] <= units <= st["units_per_slot_max"] * st["slots"]
    assert 0 <= st["slot_first_start_min_s"] <= st["slot_first_start_max_s"] <= st["slot_last_end_max_s"]
    assert st["slot_first_start_min_s"] == pytest.approx(st["startup_s"])
    assert st["slot_last_end_min_s"] <= st["slot_last_end_max_s"] <= st["run_s"]


def test_many_units_with_a_bounded_window(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More units than the submission window (4 per worker): every unit is still written once."""
    from dlstore.formats.ram import RamWriter

    monkeypatch.setattr(RamWriter, "choose_unit_size", staticmethod(lambda image_bytes: 1))
    journaled: list[int] = []
    import dlstore.write.staging as staging_mod

    real = staging_mod.Staging.record_many

    def spy(self, units, sums=None):  # type: ignore[no-untyped-def]
        journaled.extend(k for k, _, _ in units)
        real(self, units, sums)

    monkeypatch.setattr(staging_mod.Staging, "record_many", spy)
    res = convert(image_tree, tmp_path / "c", ConvertOptions(format="ram", size=16, workers=2))
    assert sorted(journaled) == list(range(res.n)) and res.n > 4 * 2
    assert len(open_cache(tmp_path / "c")) == res.n


def test_the_pool_hands_out_units_without_waiting_for_the_whole_window(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unit 0 finishes only once every other unit is journaled (or after 20 s): a pool that waited for
    its whole window of 4 units per worker before handing out more would journal unit 0 within the
    first window instead of last."""
    import time

    import dlstore.write.unit_work as unit_work
    from dlstore.formats.ram import RamWriter

    monkeypatch.setattr(RamWriter, "choose_unit_size", staticmethod(lambda image_bytes: 1))
    dest = tmp_path / "c"
    journal = dest.parent / f".{dest.name}.dlstore-journal" / "done.jsonl"
    real = unit_work.convert_job_unit

    def unit_zero_last(job, k):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 20
        while k == 0 and time.monotonic() < deadline:
            if journal.exists() and journal.read_text().count("\n") >= job.writer.n_units - 1:
                break
            time.sleep(0.01)
        return real(job, k)

    monkeypatch.setattr(unit_work, "convert_job_unit", unit_zero_last)  # inherited by the forked workers
    spy: list[int] = []
    import dlstore.write.staging as staging_mod

    record_many = staging_mod.Staging.record_many

    def record(self, units, sums=None):  # type: ignore[no-untyped-def]
        spy.extend(k for k, _, _ in units)
        record_many(self, units, sums)

    monkeypatch.setattr(staging_mod.Staging, "record_many", record)
    res = convert(image_tree, dest, ConvertOptions(format="ram", size=16, workers=2))
    assert res.n > 4 * 2 + 1 and spy[-1] == 0 and sorted(spy) == list(range(res.n))


def _unit_ranges(checksums: dict[str, str], name: str) -> list[tuple[int, int]]:
    from dlstore.checksums import split_key

    spans = [split_key(k)[1:] for k in checksums if split_key(k)[0] == name]
    return sorted((offset, int(length or 0)) for offset, length in spans)


@pytest.mark.parametrize(("workers", "range_bytes"), [(1, 64 << 20), (2, 64 << 20), (2, 1000)])
def test_workers_checksum_their_units_as_they_write_them(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, range_bytes: int
) -> None:
    """A writer that digests its units (ram: one range per slab, cut at RANGE_BYTES) spares finalize
    a second read of the pixels; the ranges tile the file and match its bytes."""
    import dlstore.checksums as checksums
    import dlstore.write.finish as finish
    from dlstore.checksums import mismatches
    from dlstore.formats.ram import RamWriter
    from dlstore.spec import read_spec
    from dlstore.write.verification import verify

    monkeypatch.setattr(RamWriter, "choose_unit_size", staticmethod(lambda image_bytes: 3))
    monkeypatch.setattr(checksums, "RANGE_BYTES", range_bytes)  # forked workers inherit it
    asked: list[str] = []
    real = finish.checksum_keys
    monkeypatch.setattr(finish, "checksum_keys", lambda root, keys: asked.extend(keys) or real(root, keys))
    dest = tmp_path / "c"
    res = convert(image_tree, dest, ConvertOptions(format="ram", size=16, workers=workers))
    spec = read_spec(dest)
    images = "images.npy"
    ranges = _unit_ranges(spec.checksums, images)
    units = -(-res.n // 3)
    assert (len(ranges) == units if range_bytes > 3 * 16 * 16 * 3 + 200 else len(ranges) > units) and ranges[
        0
    ][0] == 0
    assert max(length for _, length in ranges) <= range_bytes
    assert all(a + la == b for (a, la), (b, _) in zip(ranges, ranges[1:]))  # contiguous, no overlap
    assert ranges[-1][0] + ranges[-1][1] == (dest / images).stat().st_size
    assert asked == []  # finalize read none of them: the workers' digests were used
    assert mismatches(dest, spec.checksums) == []
    assert res.stages["workers_checksum_s"] > 0
    assert verify(dest).ok
    with open(dest / images, "r+b") as f:  # one flipped byte inside the last unit is caught
        f.seek(-5, 2)
        byte = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert not verify(dest).ok


def test_units_journaled_without_their_checksums_are_digested_at_the_end(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal written by a version whose workers did not digest units (or a writer that returned
    nothing) still gets a complete, correct manifest: finalize reads those ranges itself."""
    from dlstore.checksums import mismatches
    from dlstore.formats.ram import RamWriter
    from dlstore.spec import read_spec

    monkeypatch.setattr(RamWriter, "choose_unit_size", staticmethod(lambda image_bytes: 3))
    monkeypatch.setattr(RamWriter, "unit_checksums", lambda self, k, images: {})
    dest = tmp_path / "c"
    res = convert(image_tree, dest, ConvertOptions(format="ram", size=16, workers=2))
    spec = read_spec(dest)
    assert len(_unit_ranges(spec.checksums, "images.npy")) == -(-res.n // 3)
    assert mismatches(dest, spec.checksums) == []
