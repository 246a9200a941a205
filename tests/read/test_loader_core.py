"""One loader vocabulary (``LoaderCore``): every loader takes the same core, shards an epoch the same way
under DDP (``num_replicas``/``rank``), says ``order`` (``shuffle=`` warns), and ``ChunkSampler`` takes
the dataset itself."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlstore import CachedDataset, convert, open_cache
from dlstore.convert.sources import ArraySource
from dlstore.formats import FORMATS
from dlstore.read.gpu_decode import DecodeLoader
from dlstore.read.loader_core import LoaderCore
from dlstore.read.loaders import PinnedLoader, ResidentLoader
from dlstore.read.sampler import ChunkSampler

PAYLOAD_FORMAT = next(f.name for f in FORMATS.values() if f.ragged_ok)
LOADERS = [PinnedLoader, ResidentLoader, DecodeLoader]
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


def test_every_loader_takes_the_whole_core_with_the_same_defaults() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(LoaderCore)}
    for loader in LOADERS:
        params = inspect.signature(loader).parameters
        assert set(fields) <= set(params), loader.__name__
        for name, default in fields.items():
            if default is not dataclasses.MISSING:
                assert params[name].default == default, (loader.__name__, name)
                assert params[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_core_is_validated_once_with_errors_that_name_the_fix(ram_cache: Path) -> None:
    with pytest.raises(ValueError, match="order must be one of auto, chunk, random, sequential"):
        PinnedLoader(ram_cache, 8, device="cpu", order="shuffled")
    with pytest.raises(ValueError, match=r"rank 2 not in \[0, 2\)"):
        DecodeLoader(ram_cache, 8, device="cpu", num_replicas=2, rank=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'ordr'"):
        ResidentLoader(ram_cache, 8, device="cpu", ordr="random")
    with pytest.raises(ValueError, match="pass them to open_cache"):
        PinnedLoader(open_cache(ram_cache), 8, device="cpu", cache_dir="/tmp/x")
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        ResidentLoader(ram_cache, 0, device="cpu")


def record_decode_reads(loader: DecodeLoader) -> list[int]:
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
        loader = DecodeLoader(
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
    lengths = {len(DecodeLoader(jpeg_cache, 4, device="cpu", num_replicas=3, rank=r)) for r in range(3)}
    assert lengths == {-(-N // 3) // 4}


def record_resident_batches(loader: ResidentLoader) -> list[int]:
    seen: list[int] = []
    batch = loader.batch

    def recording(idx: torch.Tensor) -> Any:
        seen.extend(idx.tolist())
        return batch(idx)

    loader.batch = recording  # type: ignore[method-assign]
    return seen


def test_resident_loader_shards_an_epoch_across_ranks(ram_cache: Path) -> None:
    shares = []
    for rank in range(2):
        loader = ResidentLoader(ram_cache, 5, device="cpu", order="random", num_replicas=2, rank=rank)
        seen = record_resident_batches(loader)
        cache = open_cache(ram_cache)
        for x, _ in loader:
            assert x.shape[1:] == (3, 8, 8)
        assert torch.equal(x, torch.from_numpy(cache.read(seen[-5:])).permute(0, 3, 1, 2))
        shares.append(seen)
    assert len(shares[0]) == len(shares[1]) == N // 2
    assert sorted(shares[0] + shares[1]) == list(range(N))


def test_shuffle_is_the_old_spelling_of_order_and_warns(ram_cache: Path) -> None:
    with pytest.warns(DeprecationWarning, match="say order='sequential'") as caught:
        old = ResidentLoader(ram_cache, 8, device="cpu", shuffle=False)
    assert caught[0].filename == __file__  # points at the caller's line
    assert old.order == "sequential"
    new = ResidentLoader(ram_cache, 8, device="cpu", order="sequential")
    assert all(torch.equal(a[1], b[1]) for a, b in zip(old, new))
    assert torch.cat([y for _, y in new]).tolist() == open_cache(ram_cache).labels.tolist()
    with pytest.warns(DeprecationWarning, match="order='random'"):
        assert ResidentLoader(ram_cache, 8, device="cpu", shuffle=True).order == "random"
    with warnings.catch_warnings(), pytest.raises(TypeError, match="both shuffle= and order="):
        warnings.simplefilter("ignore", DeprecationWarning)
        ResidentLoader(ram_cache, 8, device="cpu", shuffle=True, order="random")


def test_resident_auto_order_is_a_device_shuffle_that_set_epoch_replays(ram_cache: Path) -> None:
    loader = ResidentLoader(ram_cache, 8, device="cpu", drop_last=False)
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
