"""The hardware JPEG lane's batch plumbing (dlstore.read.decode.hw_lane) without a GPU.

The decoder is a stand-in with nvImageCodec's Python surface (``Decoder.decode(sources, images=...)``,
``as_images``, Images over external buffers that a decode reuses, refused images as None), decoding
with Pillow; where nvImageCodec itself is installed its CPU backend runs the same checks. The pixels of
the real engines are compared on CUDA in tests/gpu/test_cuda_jpeg.py."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from dlstore.read.decode.hw_lane import HardwareJpeg


class _Image:
    """An nvImageCodec Image over host memory: its own, or an external buffer (``as_images``)."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.shape: tuple[int, ...] = buf.shape
        self.__array_interface__ = buf.__array_interface__

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.buf


def _pillow_chw(payload: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(payload)).convert("RGB")).transpose(2, 0, 1)


class _Decoder:
    decode_chw = staticmethod(_pillow_chw)

    def __init__(self, **kw: Any) -> None:
        self.calls: list[tuple[int, Any]] = []

    def decode(
        self, sources: list[Any], images: Any = None, params: Any = None, cuda_stream: int = 0
    ) -> list[Any]:
        assert all(isinstance(s, np.ndarray) for s in sources), (
            "payloads go in as arrays (no CodeStream per image)"
        )
        self.calls.append((len(sources), images))
        if images is not None and len(images) != len(sources):
            raise ValueError("Size mismatch")
        out: list[Any] = []
        for i, src in enumerate(sources):
            if src[:2].tolist() != [0xFF, 0xD8]:
                out.append(None)  # refused
                continue
            chw = np.ascontiguousarray(self.decode_chw(src.tobytes()))
            wrap = images[i] if images is not None else None
            if wrap is None:
                out.append(_Image(chw))
                continue
            if chw.nbytes > wrap.buf.nbytes:
                raise ValueError("Existing buffer is too small to fit new image")
            wrap.buf.reshape(-1)[: chw.nbytes] = chw.reshape(-1)
            out.append(wrap)
        return out


def fake_nvimgcodec(decode_chw: Any = _pillow_chw) -> Any:
    """A module with the parts of nvImageCodec's API the lane uses; ``decode_chw(bytes)`` decodes."""
    names = ("HW_GPU_ONLY", "GPU_ONLY", "CPU_ONLY")
    return SimpleNamespace(
        NVIMGCODEC_DEVICE_CPU_ONLY=-99999,
        Backend=lambda kind, load_hint=1.0: (kind, load_hint),
        BackendKind=SimpleNamespace(**{n: n for n in names}),
        Decoder=type("Decoder", (_Decoder,), {"decode_chw": staticmethod(decode_chw)}),
        SampleFormat=SimpleNamespace(P_RGB="P_RGB", P_Y="P_Y"),
        ColorSpec=SimpleNamespace(SRGB="SRGB", GRAY="GRAY"),
        DecodeParams=lambda **kw: kw,
        as_images=lambda sources, **kw: [_Image(s) for s in sources],
    )


def _jpegs(sizes: list[tuple[int, int]]) -> list[memoryview]:
    rng = np.random.default_rng(0)
    out = []
    for h, w in sizes:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG")
        out.append(memoryview(buf.getvalue()))
    return out


def _lanes() -> list[Any]:
    lanes = [HardwareJpeg(torch.device("cpu"), fake_nvimgcodec(), backends=(("CPU_ONLY", 1.0),))]
    try:  # nvImageCodec's own CPU backend, where the package is installed
        from nvidia import nvimgcodec

        lanes.append(
            HardwareJpeg(torch.device("cpu"), nvimgcodec, cpu_threads=1, backends=(("CPU_ONLY", 1.0),))
        )
    except Exception:
        pass
    return lanes


@pytest.mark.parametrize("lane", _lanes(), ids=lambda lane: type(lane.nv).__name__)
def test_slots_are_reused_and_hold_what_a_decode_of_its_own_gives(lane: HardwareJpeg) -> None:
    """``decode_into`` decodes every image into its slot of one buffer allocated once (the same slot
    Images every call), gives each image's address, and its pixels equal ``decode``'s; an image larger
    than a slot gets an allocation of its own, a refused one None; a larger batch gets more slots."""
    small = _jpegs([(16, 20), (19, 21), (22, 22)])
    refs = lane.decode(small)
    sizes = np.array([r.numel() for r in refs])
    first = lane.decode_into(small, sizes)
    assert lane.slots is not None and lane.slot_bytes >= 2 * sizes.max()
    slots, wraps = lane.slots, list(lane._wraps)
    base = slots.data_ptr()
    assert first == [base + i * lane.slot_bytes for i in range(3)]
    for address, ref in zip(first, refs):
        assert torch.equal(lane.view(address, tuple(ref.shape)), ref)
    # the next batch: the same buffer and slot Images; one image larger than a slot, one refused
    big = _jpegs([(64, 80)])[0]
    batch = [small[2], big, memoryview(b"not a jpeg"), small[0]]
    refs2 = [refs[2], lane.decode([big])[0], None, refs[0]]
    sizes2 = np.array([0 if r is None else r.numel() for r in refs2])
    sizes2[2] = 10
    assert sizes2[1] > lane.slot_bytes
    lane._ensure_slots(3, 1)  # enough slots already: nothing reallocated
    assert lane.slots is slots
    got = lane.decode_into(batch[:3], sizes2[:3])
    assert lane.slots is slots and lane._wraps[:3] == wraps
    assert got[0] == base and got[2] is None and got[1] not in (base + lane.slot_bytes, None)
    assert torch.equal(lane.view(got[0], tuple(refs2[0].shape)), refs2[0])
    assert torch.equal(lane.view(got[1], tuple(refs2[1].shape)), refs2[1])  # its own allocation
    more = lane.decode_into(
        batch[:2] + batch[3:] + small, np.array([sizes2[0], sizes2[1], sizes2[3], *sizes])
    )
    assert len(lane._wraps) == 6 and lane.slots is not slots  # a larger batch: more slots
    for address, ref in zip(more, [refs2[0], refs2[1], refs2[3], *refs]):
        assert torch.equal(lane.view(address, tuple(ref.shape)), ref)


def test_payloads_go_in_without_a_code_stream_each() -> None:
    lane = HardwareJpeg(
        torch.device("cpu"), fake_nvimgcodec(), backends=(("HW_GPU_ONLY", 0.7), ("GPU_ONLY", 1.0))
    )
    payloads = _jpegs([(8, 8), (9, 9)])
    assert [tuple(t.shape) for t in lane.decode(payloads)] == [(3, 8, 8), (3, 9, 9)]  # type: ignore[union-attr]
    assert lane.decode([]) == [] and lane.decode_into([], np.array([], np.int64)) == []
    assert lane.decoder.calls[0] == (2, None)


@pytest.fixture(scope="module")
def jpeg_cache(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from decode_helpers import ragged_jpeg_cache

    return ragged_jpeg_cache(image_tree, tmp_path_factory.mktemp("hw-lane"))


def _torchvision_chw(payload: bytes) -> np.ndarray:
    import warnings

    import torchvision.io

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision >= 0.29 deprecates its decoders
        return torchvision.io.decode_jpeg(torch.frombuffer(bytearray(payload), dtype=torch.uint8)).numpy()


def test_the_crop_reads_each_lane_where_it_decoded_and_a_failed_lane_loses_nothing(
    jpeg_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU processes, the hardware lane (its slots; here over the stand-in decoder) and "nvJPEG" (the
    CPU decode_jpeg) split each batch; the crop gets it as one scattered FlatImages (no per-image tensor,
    no copy) and its crops equal the same-seeded crop of the list of each part's own decode. The
    hardware lane fails at its third call: its part goes to nvJPEG, counted, nothing lost or doubled."""
    from decode_helpers import cpu_split_loader, split_reference

    from dlstore import open_cache
    from dlstore.gpu.ragged import FlatImages, RaggedRandomResizedCrop
    from dlstore.read.decode import hw_lane as hw_decode
    from dlstore.read.loader import storage_sorted

    lane = HardwareJpeg(torch.device("cpu"), fake_nvimgcodec(_torchvision_chw), backends=(("CPU_ONLY", 1.0),))
    real, calls = lane.decode_into, [0]

    def flaky(payloads: Any, nbytes: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("NVJPG: engine error")
        return real(payloads, nbytes)

    lane.decode_into = flaky  # type: ignore[method-assign]
    monkeypatch.setattr(hw_decode.HardwareJpeg, "open", classmethod(lambda cls, device, channels=3: lane))
    crop = RaggedRandomResizedCrop(8, generator=torch.Generator().manual_seed(5))
    ref_crop = RaggedRandomResizedCrop(8, generator=torch.Generator().manual_seed(5))
    seen_kinds: list[bool] = []
    forward = crop.forward

    def spy(images: Any) -> Any:
        seen_kinds.append(isinstance(images, FlatImages) and images.gather is not None)
        return forward(images)

    crop.forward = spy  # type: ignore[method-assign]
    split = {"cpu": 0.25, "hw": 0.5, "nvjpeg": 0.25}
    loader = cpu_split_loader(jpeg_cache, None, split=split, lanes=list(split))
    loader._path.transform = crop
    cache = open_cache(jpeg_cache)
    seen = 0
    try:
        for x, labels in loader:
            torch.testing.assert_close(
                x, ref_crop(split_reference(cache, seen, len(x), 0.25)), rtol=0, atol=0
            )
            index = storage_sorted(cache, list(range(seen, seen + len(x))))
            assert labels.tolist() == cache.labels[index].tolist()
            seen += len(x)
        assert seen == len(cache) and seen_kinds and all(seen_kinds)
        assert calls[0] >= 3 and not loader._path.split.state["hw"].alive
        assert loader.stats.hw_images == 2 * 2 and loader.stats.rerouted >= 2
        assert loader.stats.cpu_images + loader.stats.gpu_images == len(cache)
    finally:
        loader.close()
