"""The JPEG cache on CUDA: nvJPEG batched decode and the ragged GPU crop (``pytest -m gpu``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from decode_helpers import ragged_jpeg_cache

from dlstore import Loader, convert, open_cache
from dlstore.formats import FORMATS
from dlstore.gpu.ragged import RaggedRandomResizedCrop, bilinear_gather, crop_coords, flat_batch
from dlstore.read.decode.lanes import decode_on_device
from dlstore.write.options import ConvertOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FORMAT = next(f.name for f in FORMATS.values() if f.ragged_ok)


@pytest.fixture(scope="module")
def jpeg_cache(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ragged_jpeg_cache(image_tree, tmp_path_factory.mktemp("cuda-jpeg"))


@pytest.fixture(scope="module")
def photo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JPEG cache of crops of a real photograph (matplotlib's public-domain ``grace_hopper.jpg``):
    nvJPEG and libjpeg upsample chroma differently: on tiny synthetic images with sharp colour edges they
    differ by 6-8 levels, on these photo crops at 128 px by 1.3-1.9 (H200, torchvision 0.26)."""
    from PIL import Image

    cbook = pytest.importorskip("matplotlib.cbook")
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        photo = img.convert("RGB")
    root = tmp_path_factory.mktemp("photo-src")
    for k in range(8):
        (root / f"c{k % 2}").mkdir(exist_ok=True)
        box = (20 * k, 25 * k, 20 * k + 300, 25 * k + 360)
        photo.crop(box).save(root / f"c{k % 2}" / f"{k}.jpg", quality=92)
    dest = tmp_path_factory.mktemp("cuda-photo") / "c"
    convert(root, dest, ConvertOptions(format=FORMAT, size=128, resize="shorter", codec="jpeg", workers=2))
    return dest


def test_nvjpeg_decode_is_close_to_pillow(photo_cache: Path) -> None:
    cache = open_cache(photo_cache)
    index = np.arange(len(cache))
    payloads, shapes = cache.read_payloads(index)
    out, fallbacks = decode_on_device(cache, payloads, shapes, cache.positions[index], torch.device("cuda"))
    assert fallbacks == 0 and all(t.is_cuda for t in out)
    diffs = [
        (gpu.permute(1, 2, 0).cpu().int() - torch.from_numpy(cpu).int()).abs().float().mean().item()
        for gpu, cpu in zip(out, cache.read_images(index))
    ]
    worst = int(np.argmax(diffs))
    assert diffs[worst] < 2.5, (worst, tuple(shapes[worst]), diffs)


def test_ragged_crop_on_cuda_equals_cpu(jpeg_cache: Path) -> None:
    images = [
        torch.from_numpy(a).permute(2, 0, 1).contiguous()
        for a in open_cache(jpeg_cache).read_images(range(8))
    ]
    boxes = [(0, 0, min(a.shape[1:]), min(a.shape[1:])) for a in images]
    top, left, h, w = (torch.tensor(v) for v in zip(*boxes))
    flip = torch.zeros(8, dtype=torch.bool)
    outs = []
    for dev in ("cpu", "cuda"):
        flat, starts, heights, widths = flat_batch([a.to(dev) for a in images])
        sx, sy = crop_coords(top.to(dev), left.to(dev), h.to(dev), w.to(dev), flip.to(dev), (16, 16))
        outs.append(bilinear_gather(flat, starts, heights, widths, 3, sx, sy).cpu())
    assert torch.allclose(outs[0], outs[1], atol=1e-3)


def test_decode_loader_on_cuda(jpeg_cache: Path) -> None:
    crop = RaggedRandomResizedCrop(16, out_dtype=torch.bfloat16, channels_last=True).cuda()
    loader = Loader(jpeg_cache, batch_size=4, transform=crop, device="cuda", via="decode")
    seen = 0
    for images, labels in loader:
        assert images.is_cuda and images.shape == (4, 3, 16, 16) and labels.is_cuda
        seen += len(images)
    assert seen == len(loader) * 4 and loader.stats.gpu_images == seen and loader.stats.cpu_fallbacks == 0


def test_decode_loader_pixels_survive_a_slow_consumer(image_tree: Path, tmp_path: Path) -> None:
    """nvJPEG writes on its own stream: while a slow crop of batch i is still queued, the decode of batch
    i+1 must not reuse (overwrite) batch i's freed images. Each batch must equal its own decode."""
    from dlstore.read.loader import storage_sorted

    convert(image_tree, tmp_path / "c", ConvertOptions(format=FORMAT, size=32, codec="jpeg", workers=2))
    cache = open_cache(tmp_path / "c")

    def slow_stack(images: list[torch.Tensor]) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time queued before the images are read
        return torch.stack(images)

    batch = 4
    loader = Loader(cache, batch, transform=slow_stack, order="sequential", lanes=["nvjpeg"], via="decode")
    got = [x.clone() for x, _y in loader]
    torch.cuda.synchronize()
    dev = torch.device("cuda")
    for k, x in enumerate(got):
        index = storage_sorted(cache, list(range(k * batch, (k + 1) * batch)))
        payloads, shapes = cache.read_payloads(index)
        ref, _ = decode_on_device(cache, payloads, shapes, cache.positions[index], dev)
        torch.testing.assert_close(x, torch.stack(ref), rtol=0, atol=0, msg=f"batch {k}")


@pytest.mark.parametrize("gen_device", ["cuda", "cpu"])  # boxes drawn on the device / on the host
@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_crop_kernel_equals_the_pytorch_path(
    jpeg_cache: Path, channels_last: bool, gen_device: str
) -> None:
    from dlstore.gpu import fused_crop

    if fused_crop.triton is None:
        pytest.skip("Triton is not installed")
    assert not fused_crop._BROKEN, fused_crop._BROKEN  # an earlier launch in this process failed
    images = [
        torch.from_numpy(a).permute(2, 0, 1).cuda() for a in open_cache(jpeg_cache).read_images(range(12))
    ]
    outs = []
    for fused in (False, True):
        crop = RaggedRandomResizedCrop(
            20,
            mean=(0.5, 0.4, 0.3),
            std=(0.2, 0.3, 0.25),
            channels_last=channels_last,
            generator=torch.Generator(device=gen_device).manual_seed(3),
        ).cuda()
        assert crop.samples_on_host == (gen_device == "cpu")
        crop.fused = fused
        outs.append(crop(images))
    assert not fused_crop._BROKEN, fused_crop._BROKEN  # it ran, not the fallback
    assert outs[1].is_contiguous(memory_format=torch.channels_last) == channels_last
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-4)


def test_split_decode_on_cuda_equals_each_sides_own_decode(image_tree: Path, tmp_path: Path) -> None:
    """cpu_decoders: each batch's first half is decoded by CPU processes (pinned slots, one copy), the
    rest by nvJPEG; behind a slow consumer (slots reused while copies and crops are queued) every image
    must equal its own CPU or nvJPEG decode."""
    from dlstore.read.loader import storage_sorted

    convert(image_tree, tmp_path / "c", ConvertOptions(format=FORMAT, size=32, codec="jpeg", workers=2))
    cache = open_cache(tmp_path / "c")

    def slow_stack(images: list[torch.Tensor]) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)
        return torch.stack(images)

    batch = 4
    loader = Loader(
        cache,
        batch,
        transform=slow_stack,
        order="sequential",
        cpu_decoders=2,
        split={"cpu": 0.5},
        lanes=["cpu", "nvjpeg"],
        via="decode",
    )
    loader._path.read_ahead = 1
    try:
        got = [x.clone() for x, _y in loader]
        assert loader._path.cpu is not None and loader._path.cpu.pinned
    finally:
        loader.close()
    torch.cuda.synchronize()
    dev = torch.device("cuda")
    for k, x in enumerate(got):
        index = storage_sorted(cache, list(range(k * batch, (k + 1) * batch)))
        payloads, shapes = cache.read_payloads(index)
        gpu, _ = decode_on_device(cache, payloads[2:], shapes[2:], cache.positions[index[2:]], dev)
        cpu = [torch.from_numpy(a).permute(2, 0, 1).to(dev) for a in cache.read_images(index[:2])]
        torch.testing.assert_close(x, torch.stack(cpu + gpu), rtol=0, atol=0, msg=f"batch {k}")


def test_split_decode_into_the_fused_crop_equals_the_crop_of_the_list(
    image_tree: Path, tmp_path: Path
) -> None:
    """With a crop that takes FlatImages, the CPU share reaches the (fused) crop as one flat buffer:
    the crops equal the same-seeded crop of the CPU-decoded + nvJPEG-decoded list."""
    from dlstore.read.loader import storage_sorted

    convert(
        image_tree,
        tmp_path / "c",
        ConvertOptions(format=FORMAT, size=24, resize="shorter", codec="jpeg", workers=2),
    )
    cache = open_cache(tmp_path / "c")
    dev = torch.device("cuda")
    crop = RaggedRandomResizedCrop(16, generator=torch.Generator(dev).manual_seed(1)).cuda()
    ref_crop = RaggedRandomResizedCrop(16, generator=torch.Generator(dev).manual_seed(1)).cuda()
    loader = Loader(
        cache,
        4,
        transform=crop,
        order="sequential",
        cpu_decoders=2,
        split={"cpu": 0.5},
        lanes=["cpu", "nvjpeg"],
        via="decode",
    )
    try:
        got = [x.clone() for x, _y in loader]
    finally:
        loader.close()
    for k, x in enumerate(got):
        index = storage_sorted(cache, list(range(k * 4, (k + 1) * 4)))
        payloads, shapes = cache.read_payloads(index)
        gpu, _ = decode_on_device(cache, payloads[2:], shapes[2:], cache.positions[index[2:]], dev)
        cpu = [torch.from_numpy(a).permute(2, 0, 1).to(dev) for a in cache.read_images(index[:2])]
        torch.testing.assert_close(x, ref_crop(cpu + gpu), rtol=0, atol=1e-6, msg=f"batch {k}")


def _hardware_lane() -> object:
    from dlstore.read.decode.hw_lane import HardwareJpeg

    lane = HardwareJpeg.open(torch.device("cuda"))
    if lane is None:
        pytest.skip("no hardware JPEG lane here (nvidia-nvimgcodec absent, or a GPU without NVJPG)")
    return lane


def test_hardware_lane_decodes_like_the_cpu(photo_cache: Path) -> None:
    """The NVJPG lane's pixels on photo crops are within the bound nvJPEG's are held to (measured on
    the H200: mean 1.5e-6 levels, max 1, against Pillow)."""
    lane = _hardware_lane()
    cache = open_cache(photo_cache)
    index = np.arange(len(cache))
    payloads, _shapes = cache.read_payloads(index)
    out = lane.decode(payloads)  # type: ignore[attr-defined]
    for img, ref in zip(out, cache.read_images(index)):
        assert img is not None and img.is_cuda and img.dtype == torch.uint8
        diff = (img.permute(1, 2, 0).cpu().int() - torch.from_numpy(ref).int()).abs().float()
        assert diff.mean().item() <= 1.5


def test_hardware_and_nvjpeg_lanes_together_behind_a_slow_consumer(image_tree: Path, tmp_path: Path) -> None:
    """Half of each batch on the hardware engines, half on nvJPEG, at once, behind a slow consumer:
    every image equals its own lane's decode."""
    from dlstore.read.loader import storage_sorted

    lane = _hardware_lane()
    convert(image_tree, tmp_path / "c", ConvertOptions(format=FORMAT, size=32, codec="jpeg", workers=2))
    cache = open_cache(tmp_path / "c")

    def slow_stack(images: list[torch.Tensor]) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)
        return torch.stack(images)

    loader = Loader(
        cache,
        4,
        transform=slow_stack,
        order="sequential",
        lanes=["hw", "nvjpeg"],
        split={"hw": 0.5, "nvjpeg": 0.5},
        via="decode",
    )
    try:
        got = [x.clone() for x, _y in loader]
        assert loader.stats.hw_images == len(got) * 2 and loader.stats.rerouted == 0
    finally:
        loader.close()
    torch.cuda.synchronize()
    dev = torch.device("cuda")
    for k, x in enumerate(got):
        index = storage_sorted(cache, list(range(k * 4, (k + 1) * 4)))
        payloads, shapes = cache.read_payloads(index)
        hw = lane.decode(payloads[:2])  # type: ignore[attr-defined]
        gpu, _ = decode_on_device(cache, payloads[2:], shapes[2:], cache.positions[index[2:]], dev)
        torch.testing.assert_close(x, torch.stack(hw + gpu), rtol=0, atol=0, msg=f"batch {k}")


def test_hardware_lane_slots_hold_the_same_bytes_as_its_tensors(photo_cache: Path) -> None:
    """``decode_into`` (into the lane's reused slots, or an allocation of its own for an image larger
    than a slot) gives byte for byte what ``decode`` (a tensor per image) gives, call after call."""
    from dlstore.read.decode.hw_lane import HardwareJpeg

    lane = _hardware_lane()
    cache = open_cache(photo_cache)
    index = np.arange(len(cache))
    payloads, shapes = cache.read_payloads(index)
    nbytes = np.prod(shapes, axis=1)
    want = lane.decode(payloads)  # type: ignore[attr-defined]
    for _ in range(2):  # the second call reuses the slots
        got = lane.decode_into(payloads, nbytes)  # type: ignore[attr-defined]
        for address, ref in zip(got, want):
            assert torch.equal(lane.view(address, tuple(ref.shape)), ref)  # type: ignore[attr-defined]
    small = HardwareJpeg.open(torch.device("cuda"))
    assert small is not None
    small._ensure_slots(len(payloads), 1)  # slots far too small: each image gets its own allocation
    got = small.decode_into(payloads, nbytes)
    assert small.slots is not None and all(a is not None for a in got)
    for address, ref in zip(got, want):
        assert torch.equal(small.view(address, tuple(ref.shape)), ref)  # type: ignore[arg-type]


def test_scattered_images_through_the_fused_kernel_equal_the_list_crop() -> None:
    """Separate allocations read in place by the fused kernel (starts = address - base, some negative)."""
    from dlstore.gpu.ragged import scattered_flat

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    images = [
        torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8).to(dev)
        for h, w in [(40, 60), (70, 33), (25, 25)]
    ]
    hwc = np.array([[h, w, c] for c, h, w in (t.shape for t in images)])
    batch = scattered_flat(images[1], np.array([t.data_ptr() for t in images]), hwc, lambda: images)
    assert (batch.host[0] < 0).any() or (batch.host[0] > 0).any()  # type: ignore[index]
    a = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(3)).cuda()
    b = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(3)).cuda()
    torch.testing.assert_close(a(batch), b(images), rtol=0, atol=0)


class _SlowCrop(RaggedRandomResizedCrop):
    """The crop, queued behind 20 ms of GPU sleep: a decode that overwrote a buffer the crop still has
    to read would show in its pixels."""

    def forward(self, images, target=None):  # type: ignore[no-untyped-def]
        torch.cuda._sleep(20_000_000)
        return super().forward(images, target)
