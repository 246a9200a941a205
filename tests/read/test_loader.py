"""``dlstore.Loader``: it picks its path from the cache and the machine (``via`` forces one), every path
shards an epoch the same way under DDP (``num_replicas``/``rank``), ``ChunkSampler`` takes the dataset
itself, and caches written by an earlier commit still open."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlstore import CachedDataset, DlstoreError, Loader, Remote, convert, open_cache
from dlstore.formats import FORMATS
from dlstore.read.sampler import ChunkSampler
from dlstore.write.sources import ArraySource

PAYLOAD_FORMAT = next(f.name for f in FORMATS.values() if f.ragged_ok)
N = 40  # even: two ranks' shares are then disjoint (an odd count pads one rank with a repeat)


def array_source(n: int = N, side: int = 8) -> ArraySource:
    rng = np.random.default_rng(11)
    return ArraySource(
        description="t",
        classes=("a", "b", "c"),
        names=[str(i) for i in range(n)],
        labels=rng.integers(0, 3, n),
        kind="test",
        data=rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8),
    )


@pytest.fixture(scope="module")
def jpeg_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 fixed-size JPEG payloads in chunks of 6 (the payload layout DecodeLoader reads)."""
    dest = tmp_path_factory.mktemp("core") / "jpeg"
    with pytest.MonkeyPatch.context() as m:
        # 8x8 RGB JPEGs are budgeted at a tenth of their 192 raw bytes: 6 of them per unit
        m.setattr(FORMATS[PAYLOAD_FORMAT].payload_writer, "target_unit_bytes", 6 * (192 // 10))
        convert(
            array_source(), dest, format=PAYLOAD_FORMAT, size=8, resize="stretch", codec="jpeg", workers=1
        )
    return dest


@pytest.fixture(scope="module")
def ram_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("core") / "ram"
    convert(array_source(), dest, format="ram", size=8, resize="stretch", workers=1)
    return dest


def test_auto_picks_the_path_from_the_cache_and_the_machine(ram_cache: Path, jpeg_cache: Path) -> None:
    assert Loader(ram_cache, 8, device="cpu").via == "pinned"  # resident only on a GPU, by itself
    assert Loader(jpeg_cache, 8, device="cpu").via == "decode"
    assert Loader(ram_cache, 8, device="cpu", via="resident").via == "resident"
    assert Loader(ram_cache, 8, device="cpu", via="resident").order == "random"  # what auto means there
    assert Loader(ram_cache, 8, device="cpu").order == "auto"


def test_one_signature_with_no_pass_through() -> None:
    params = inspect.signature(Loader).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in ("via", "order", "seed", "drop_last", "num_replicas", "rank", "fields", "transform"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_every_path_yields_the_same_batches_in_the_same_order(ram_cache: Path) -> None:
    """The same order whatever the path; within a batch the pinned path reads in storage order."""
    batches = {
        via: [sorted(x.flatten(1).tolist()) for x, _ in Loader(ram_cache, 8, device="cpu", via=via, seed=4)]
        for via in ("pinned", "resident")
    }
    assert batches["pinned"] == batches["resident"]


def test_bad_arguments_get_errors_that_name_the_fix(ram_cache: Path) -> None:
    with pytest.raises(ValueError, match="order must be one of auto, chunk, random, sequential"):
        Loader(ram_cache, 8, device="cpu", order="shuffled")
    with pytest.raises(ValueError, match=r"rank 2 not in \[0, 2\)"):
        Loader(ram_cache, 8, device="cpu", num_replicas=2, rank=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'ordr'"):
        Loader(ram_cache, 8, device="cpu", ordr="random")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="pass it to open_cache"):
        Loader(open_cache(ram_cache), 8, device="cpu", remote=Remote(cache_dir="/tmp/x"))
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        Loader(ram_cache, 0, device="cpu")
    with pytest.raises(ValueError, match="via must be one of auto, pinned, resident, decode"):
        Loader(ram_cache, 8, device="cpu", via="gpu")
    with pytest.raises(ValueError, match="via='decode' crops these to one size"):
        Loader(OLD / "zarr-jpeg", 8, device="cpu", via="pinned")  # ragged
    with pytest.raises(DlstoreError, match="use via='pinned', or raise resident_budget"):
        Loader(ram_cache, 8, device="cpu", via="resident", resident_budget=1e-12)


def record_decode_reads(loader: Loader) -> list[int]:
    """The dataset indices the loader reads (on the CPU path every batch is one read_images)."""
    seen: list[int] = []
    read = loader.cache.read_images

    def recording(index: Any) -> Any:
        seen.extend(np.asarray(index).tolist())
        return read(index)

    loader.cache.read_images = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("order", ["chunk", "random"])
def test_decode_loader_shards_an_epoch_across_ranks(jpeg_cache: Path, order: str) -> None:
    shares, counts = [], []
    for rank in range(2):
        loader = Loader(
            jpeg_cache, 4, device="cpu", order=order, seed=3, drop_last=False, num_replicas=2, rank=rank
        )
        seen = record_decode_reads(loader)
        labels = torch.cat([y for _, y in loader]).tolist()
        assert sorted(labels) == sorted(loader.cache.labels[seen].tolist())  # the yields are those reads
        shares.append(set(seen))
        counts.append((len(seen), len(loader)))
    assert counts[0] == counts[1] == (N // 2, N // 2 // 4)  # equal shares, equal batch counts
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(range(N))


def test_decode_loader_ranks_get_the_same_number_of_batches_when_the_epoch_does_not_split(
    jpeg_cache: Path,
) -> None:
    lengths = {len(Loader(jpeg_cache, 4, device="cpu", num_replicas=3, rank=r)) for r in range(3)}
    assert lengths == {-(-N // 3) // 4}


def record_resident_batches(loader: Loader) -> list[int]:
    seen: list[int] = []
    batch = loader._path.batch

    def recording(idx: torch.Tensor) -> Any:
        seen.extend(idx.tolist())
        return batch(idx)

    loader._path.batch = recording
    return seen


def test_resident_loader_shards_an_epoch_across_ranks(ram_cache: Path) -> None:
    shares = []
    for rank in range(2):
        loader = Loader(ram_cache, 5, device="cpu", via="resident", order="random", num_replicas=2, rank=rank)
        seen = record_resident_batches(loader)
        cache = open_cache(ram_cache)
        for x, _ in loader:
            assert x.shape[1:] == (3, 8, 8)
        assert torch.equal(x, torch.from_numpy(cache.read(seen[-5:])).permute(0, 3, 1, 2))
        shares.append(seen)
    assert len(shares[0]) == len(shares[1]) == N // 2
    assert sorted(shares[0] + shares[1]) == list(range(N))


def test_resident_auto_order_is_a_device_shuffle_that_set_epoch_replays(ram_cache: Path) -> None:
    loader = Loader(ram_cache, 8, device="cpu", via="resident", drop_last=False)
    assert loader.order == "random"
    first = torch.cat([y for _, y in loader])
    second = torch.cat([y for _, y in loader])
    loader.set_epoch(0)
    assert torch.equal(torch.cat([y for _, y in loader]), first)
    assert sorted(first.tolist()) == sorted(second.tolist()) == sorted(open_cache(ram_cache).labels.tolist())


def test_chunk_sampler_takes_the_dataset_itself(jpeg_cache: Path) -> None:
    ds = CachedDataset(jpeg_cache)
    direct = list(ChunkSampler(ds, num_replicas=2, rank=1, seed=4, window=2))
    cache = ds.cache
    assert cache.reader.unit == 6
    assert direct == list(ChunkSampler(cache, num_replicas=2, rank=1, seed=4, window=2))
    assert direct == list(ChunkSampler(cache.positions, 6, num_replicas=2, rank=1, seed=4, window=2))
    assert len(direct) == N // 2
    with pytest.raises(TypeError, match="pass the images per chunk too"):
        ChunkSampler(cache.positions, num_replicas=2, rank=1)


OLD = Path(__file__).parent / "caches_4e04c2e"  # written by commit 4e04c2e (tests/read/caches_4e04c2e)


@pytest.mark.parametrize("name", ["ram", "npz", "zarr", "zarr-jpeg"])
def test_caches_written_by_4e04c2e_still_open(name: str) -> None:
    expected = np.load(OLD / "expected.npz")
    cache = open_cache(OLD / name)
    assert cache.labels.tolist() == expected[f"{name}-labels"].tolist()
    got = cache.read_images(np.arange(len(cache))) if cache.ragged else cache.read(np.arange(len(cache)))
    assert np.array_equal(np.stack([np.asarray(g) for g in got]), expected[name])
    crop = (lambda images: torch.stack(images)) if cache.ragged else None
    loader = Loader(OLD / name, 4, device="cpu", order="sequential", drop_last=False, transform=crop)
    labels = expected[f"{name}-labels"].tolist()
    assert [sorted(y.tolist()) for _, y in loader] == [sorted(labels[i : i + 4]) for i in range(0, 12, 4)]
    dataset = CachedDataset(OLD / name)
    assert np.array_equal(dataset[3][0].permute(1, 2, 0).numpy(), expected[name][3])
