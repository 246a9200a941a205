"""The GPU's hardware JPEG engines (NVJPG on A100/H100/H200) as a decode lane, through nvImageCodec.

``HardwareJpeg.open(device)`` returns the lane, or None where it cannot run (no ``nvidia-nvimgcodec``
package, no CUDA device, or a GPU without the engines). Each call decodes a list of JPEG payloads in
one batched call to planar (C, H, W) uint8 on the device, on a stream of its own that it waits for (so
the call's wall time is the lane's busy time). An image the engines refuse (a progressive JPEG, say)
comes back None, for another lane.

``decode_into`` is the loader's cheap path: no Python object per image. Every image is decoded into a
slot of one device buffer allocated once, through nvImageCodec Images over the slots made once and
reused (``images=``), and the caller gets each image's address, which the fused crop reads in place
(``dlstore.gpu.ragged.scattered_flat``). The next call overwrites the slots; an image larger than a
slot gets an allocation of its own.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
import torch

# nvImageCodec's CPU threads (header parsing): its default, one per core, competes with the CPU decode
# processes, and more threads did not decode faster.
CPU_THREADS = 2
# nvImageCodec backends of the lane, (BackendKind name, load hint), tried in order per image.
HW_ONLY = (("HW_GPU_ONLY", 1.0),)


class HardwareJpeg:
    """A batched nvImageCodec decoder (hardware-only by default) on one device; see the module."""

    def __init__(
        self,
        device: torch.device,
        nvimgcodec: Any,
        channels: int = 3,
        cpu_threads: int = CPU_THREADS,
        backends: tuple[tuple[str, float], ...] = HW_ONLY,
    ) -> None:
        self.device, self.channels, self.nv = device, channels, nvimgcodec
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.stream: Any = torch.cuda.Stream(device)
        else:  # nvImageCodec's CPU backend (tests, dry runs): host memory, no stream
            index, self.stream = nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, None
        kinds = [
            nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind), load_hint=hint)
            for kind, hint in backends
        ]
        self.decoder = nvimgcodec.Decoder(device_id=index, max_num_cpu_threads=cpu_threads, backends=kinds)
        fmt = nvimgcodec.SampleFormat.P_RGB if channels == 3 else nvimgcodec.SampleFormat.P_Y
        spec = nvimgcodec.ColorSpec.SRGB if channels == 3 else nvimgcodec.ColorSpec.GRAY
        self.params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False, color_spec=spec, sample_format=fmt
        )
        self._lock = threading.Lock()  # one batched call at a time on this decoder
        self.slots: torch.Tensor | None = None  # decode_into's buffer: slot i at slot_bytes * i
        self.slot_bytes = 0
        self._wraps: list[Any] = []  # an nvImageCodec Image over each slot (reused by every call)
        self._own: dict[int, Any] = {}  # address -> the Image of a larger image (until the next call)
        self.into = True  # decode_into works here (``open`` checks; else callers use ``decode``)

    @classmethod
    def open(cls, device: torch.device, channels: int = 3) -> HardwareJpeg | None:
        """The lane, or None where it cannot run here (see the module)."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        try:
            from nvidia import nvimgcodec
        except Exception:  # the optional package is absent (or its libraries do not load)
            return None
        try:
            lane = cls(device, nvimgcodec, channels)
            probe = _probe_jpeg(channels)
            out = lane.decode([memoryview(probe)])
        except Exception:  # a GPU or driver the hardware backend does not support
            return None
        if not out or out[0] is None or tuple(out[0].shape[1:]) != (16, 16):
            return None
        try:  # the slots path (external buffers reused by the decoder) where this version has it
            at = lane.decode_into([memoryview(probe)], np.array([out[0].numel()]))[0]
            lane.into = at is not None and torch.equal(lane.view(at, tuple(out[0].shape)), out[0])
        except Exception:
            lane.into = False
        lane.slots, lane._wraps, lane.slot_bytes = None, [], 0  # sized by the first real batch
        return lane

    def decode(self, payloads: list[memoryview] | list[np.ndarray]) -> list[torch.Tensor | None]:
        """One batched decode: (C, H, W) uint8 tensors of their own, None where refused."""
        if not payloads:
            return []
        images = self._call([np.frombuffer(p, np.uint8) for p in payloads], None)
        return [None if img is None else self._tensor(img) for img in images]

    def decode_into(
        self, payloads: list[memoryview] | list[np.ndarray], nbytes: np.ndarray
    ) -> list[int | None]:
        """One batched decode into the lane's slots (``nbytes``: each image's C * H * W): each image's
        address on the device (planar, back to back in its slot), None where refused. Valid until the
        next call; ``view`` makes one a tensor."""
        n = len(payloads)
        if n == 0:
            return []
        nbytes = np.asarray(nbytes, np.int64)
        self._ensure_slots(n, int(nbytes.max()))
        assert self.slots is not None
        fits = nbytes <= self.slot_bytes
        wraps = (
            self._wraps[:n] if fits.all() else [w if f else None for w, f in zip(self._wraps, fits.tolist())]
        )
        images = self._call([np.frombuffer(p, np.uint8) for p in payloads], wraps)
        base = self.slots.data_ptr()
        addresses: list[int | None] = list(range(base, base + n * self.slot_bytes, self.slot_bytes))
        self._own = {}
        for i, img in enumerate(images):
            if img is None:
                addresses[i] = None
            elif not fits[i]:  # decoded into an allocation of its own
                address = (
                    int(img.__cuda_array_interface__["data"][0])
                    if self.stream is not None
                    else int(img.__array_interface__["data"][0])
                )
                self._own[address] = img
                addresses[i] = address
        return addresses

    def view(self, address: int, shape: tuple[int, int, int]) -> torch.Tensor:
        """The (C, H, W) image ``decode_into`` put at ``address`` (a slot, or an allocation of its own)."""
        c, h, w = shape
        if address in self._own:
            return self._tensor(self._own[address])
        assert self.slots is not None
        start = address - self.slots.data_ptr()
        return self.slots[start : start + c * h * w].view(c, h, w)

    def _call(self, sources: list[np.ndarray], wraps: list[Any] | None) -> list[Any]:
        stream = self.stream.cuda_stream if self.stream is not None else 0
        with self._lock:
            images = self.decoder.decode(sources, images=wraps, params=self.params, cuda_stream=stream)
            if self.stream is not None:
                self.stream.synchronize()  # done: usable on any stream, and the busy time is the call's
        return images

    def _ensure_slots(self, n: int, largest: int) -> None:
        """At least ``n`` slots (doubling, so a split that moves does not reallocate every batch), each
        twice the first batch's largest image (a larger one later gets an allocation of its own)."""
        if len(self._wraps) >= n:
            return
        n = max(n, 2 * len(self._wraps))
        self.slot_bytes = max(self.slot_bytes, 2 * largest + 255 & ~255)  # 256-byte aligned slots
        self.slots = torch.empty(n * self.slot_bytes, dtype=torch.uint8, device=self.device)
        views = [self.slots[i * self.slot_bytes : (i + 1) * self.slot_bytes].view(1, -1) for i in range(n)]
        stream = self.stream.cuda_stream if self.stream is not None else None
        kw = {"cuda_stream": stream} if stream is not None else {}
        # over the host memory of a CPU tensor, nvImageCodec reads the NumPy array interface
        sources = views if self.stream is not None else [v.numpy() for v in views]
        self._wraps = list(self.nv.as_images(sources, **kw))

    def _tensor(self, image: Any) -> torch.Tensor:
        """The decoded image as a tensor over its memory (it keeps the image alive)."""
        if self.stream is None:  # host memory (the CPU backend): through the array interface
            t = torch.from_numpy(np.asarray(image))
        else:
            t = torch.as_tensor(image, device=self.device)
        return t.unsqueeze(0) if t.ndim == 2 else t


def _probe_jpeg(channels: int) -> bytes:
    """A small baseline JPEG (the engines decode those wherever they exist)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (16, 16, 3) if channels == 3 else (16, 16), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()
