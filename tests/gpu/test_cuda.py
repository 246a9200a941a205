"""CUDA paths (run on a GPU machine: ``pytest -m gpu``); skipped without CUDA."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dlstore import Loader, convert, open_cache
from dlstore.gpu import GpuAugment
from dlstore.write.sources import ArraySource

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    n = 300
    data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    data[:, 0, 0, 0], data[:, 0, 0, 1] = np.arange(n) % 256, np.arange(n) // 256
    src = ArraySource(
        description="t",
        classes=("a", "b"),
        names=[str(i) for i in range(n)],
        labels=rng.integers(0, 2, n),
        kind="test",
        data=data,
    )
    dest = tmp_path_factory.mktemp("gpu") / "zarr"
    convert(src, dest, format="zarr", size=32, resize="stretch", workers=1)
    return dest


def ids(x: torch.Tensor) -> list[int]:
    return (x[:, 0, 0, 0].long() + 256 * x[:, 1, 0, 0].long()).tolist()


@pytest.mark.parametrize("slow", [False, True])
def test_pinned_loader_on_cuda_matches_plain_reads(cache_dir: Path, slow: bool) -> None:
    cache = open_cache(cache_dir)
    ref = torch.from_numpy(cache.read(np.arange(len(cache)))).permute(0, 3, 1, 2)
    loader = Loader(cache_dir, batch_size=16, device="cuda", drop_last=False, via="pinned")
    seen = []
    for x, y in loader:
        assert x.is_cuda and y.is_cuda
        if slow:  # keep the GPU busy so copies and refills would collide if the ring were wrong
            a = torch.randn(2048, 2048, device="cuda")
            for _ in range(20):
                a = a @ a / 2048
            time.sleep(0.005)
        idx = ids(x.cpu())
        assert torch.equal(x.cpu(), ref[idx]) and y.cpu().tolist() == cache.labels[idx].tolist()
        seen += idx
    assert sorted(seen) == list(range(len(cache)))


def test_resident_loader_on_cuda(cache_dir: Path) -> None:
    cache = open_cache(cache_dir)
    ref = torch.from_numpy(cache.read(np.arange(len(cache)))).permute(0, 3, 1, 2)
    seen = []
    for x, _ in Loader(cache_dir, batch_size=32, device="cuda", drop_last=False, via="resident"):
        idx = ids(x.cpu())
        assert torch.equal(x.cpu(), ref[idx])
        seen += idx
    assert sorted(seen) == list(range(len(cache)))


def test_auto_holds_a_cache_that_fits_the_budget_on_the_gpu(cache_dir: Path) -> None:
    assert Loader(cache_dir, batch_size=32, device="cuda").via == "resident"
    assert Loader(cache_dir, batch_size=32, device="cuda", resident_budget=1e-12).via == "pinned"


def test_gpu_augment_matches_cpu(cache_dir: Path) -> None:
    x = torch.from_numpy(open_cache(cache_dir).read(np.arange(64))).permute(0, 3, 1, 2)
    aug = GpuAugment(24, degrees=15, mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2))
    params = aug.sample_params(64, 32, 32, "cpu")
    cpu = aug(x, params)
    cuda_params = type(params)(**{k: getattr(params, k).cuda() for k in params.__dataclass_fields__})
    gpu = aug.cuda()(x.cuda(), cuda_params).cpu()
    assert torch.allclose(cpu, gpu, atol=1e-3)


def test_resident_cuda_graph_matches_eager(cache_dir: Path) -> None:
    aug = GpuAugment(24, degrees=10).cuda()
    graphed = Loader(
        cache_dir,
        batch_size=32,
        device="cuda",
        transform=aug,
        cuda_graph=True,
        order="sequential",
        via="resident",
    )
    eager = Loader(cache_dir, batch_size=32, device="cuda", order="sequential", via="resident")
    for (gx, gy), (_, ey) in zip(graphed, eager):
        assert gx.shape == (32, 3, 24, 24) and torch.equal(gy, ey)
        assert gx.abs().sum() > 0  # the replay wrote the output
    torch.manual_seed(0)
    first = next(iter(graphed))[0].clone()
    second = next(iter(graphed))[0].clone()
    assert not torch.equal(first, second)  # fresh random parameters on every replay


def test_cuda_graphed_transform_matches_eager() -> None:
    from dlstore.gpu.graphs import CudaGraphed

    def light(x: torch.Tensor) -> torch.Tensor:
        return (x.float() / 255 - 0.5).flip(-1)

    graphed = CudaGraphed(light)
    for seed in range(3):
        x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, device="cuda", generator=None)
        x = x.contiguous(memory_format=torch.channels_last) if seed else x
        torch.manual_seed(seed)
        assert torch.equal(graphed(x), light(x))


def test_pinned_loader_graphed_transform(cache_dir: Path) -> None:
    aug = GpuAugment(24, degrees=10).cuda()
    loader = Loader(cache_dir, batch_size=64, device="cuda", transform=aug, cuda_graph=True, via="pinned")
    shapes = [tuple(x.shape) for x, _ in loader]
    assert shapes and all(s == (64, 3, 24, 24) for s in shapes)


def test_image_batch_pins_in_parallel(cache_dir: Path) -> None:
    from torch.utils.data import DataLoader

    from dlstore import CachedDataset

    ds = CachedDataset(cache_dir)
    for workers in (0, 2):
        loader = DataLoader(ds, batch_size=100, num_workers=workers, pin_memory=True)
        x, y = next(iter(loader))
        assert type(x) is torch.Tensor and x.is_pinned() and y.is_pinned()
        assert torch.equal(x, torch.stack([ds[i][0] for i in range(100)]))


def copies_read_from_pinned_slots(cache_dir: Path, batches: int = 30) -> tuple[int, int]:
    """(batches whose device copy differs from what the host batch held, batches checked): a 2-worker
    DataLoader with pin_memory=True, each batch copied with ``.cuda(non_blocking=True)`` behind ~10 ms
    of queued GPU work and dropped at once, so the workers would refill its slot before the device
    reads it if a page-locked slot went back on release."""
    from torch.utils.data import DataLoader

    from dlstore import CachedDataset

    ds = CachedDataset(cache_dir)
    ref = torch.stack([ds[i][0] for i in range(len(ds))]).cuda()
    loader = DataLoader(
        ds, batch_size=16, shuffle=True, num_workers=2, pin_memory=True, persistent_workers=True
    )
    copied: list[tuple[torch.Tensor, list[int]]] = []
    while len(copied) < batches:
        for x, _ in loader:
            expect = ids(x)  # what the host batch holds now, before its copy runs
            torch.cuda._sleep(20_000_000)  # the copy waits behind this on the stream
            copied.append((x.cuda(non_blocking=True), expect))
            del x  # released while its copy is still queued
            if len(copied) == batches:
                break
    torch.cuda.synchronize()
    bad = sum(not torch.equal(d, ref[expect]) for d, expect in copied)
    return bad, len(copied)


def test_batches_pinned_in_place_are_not_refilled_before_the_device_read_them(cache_dir: Path) -> None:
    from dlstore.read import slots

    before = slots.stats["registered"]
    bad, n = copies_read_from_pinned_slots(cache_dir)
    assert slots.stats["registered"] > before  # the batches were pinned in place (no copy)
    assert bad == 0, f"{bad} of {n} device batches were overwritten before their copy"
