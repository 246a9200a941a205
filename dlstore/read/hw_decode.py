"""The GPU's hardware JPEG engines (NVJPG on A100/H100/H200) as a decode lane, through nvImageCodec.

``HardwareJpeg.open(device)`` returns the lane, or None where it cannot run: no ``nvidia-nvimgcodec``
package (the ``nvimgcodec`` extra), no CUDA device, or a GPU without the engines (its hardware-only
decoder decodes nothing). Each call decodes a list of JPEG payloads in one batched call, planar
(C, H, W) uint8 on the device, on a stream of its own that it waits for (so the call's wall time is
the lane's busy time and the images are ready for any stream). An image the engines refuse (a
progressive JPEG, say) comes back None; ``decode_parts`` hands it to another lane.

    lane = HardwareJpeg.open(torch.device("cuda"))
    if lane is not None:
        images = lane.decode(payloads)          # list of (3, H, W) uint8 CUDA tensors (or None)
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
import torch

# nvImageCodec's CPU threads (JPEG header parsing for the engines). Its default is one per core, which
# would compete with the CPU decode processes for the same cores; at 128 px, batches of 256, the lane
# decoded 30.8k / 30.2k / 29.4k / 29.7k / 27.0k img/s with 1 / 2 / 4 / 8 / 16 (H200, jpeg_lanes.py).
CPU_THREADS = 2


class HardwareJpeg:
    """A batched hardware-only nvImageCodec decoder on one CUDA device; see the module."""

    def __init__(
        self, device: torch.device, nvimgcodec: Any, channels: int = 3, cpu_threads: int = CPU_THREADS
    ) -> None:
        self.device, self.channels = device, channels
        self.nv = nvimgcodec
        index = device.index if device.index is not None else torch.cuda.current_device()
        backend = nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)
        self.decoder = nvimgcodec.Decoder(
            device_id=index, max_num_cpu_threads=cpu_threads, backends=[backend]
        )
        fmt = nvimgcodec.SampleFormat.P_RGB if channels == 3 else nvimgcodec.SampleFormat.P_Y
        spec = nvimgcodec.ColorSpec.SRGB if channels == 3 else nvimgcodec.ColorSpec.GRAY
        self.params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False, color_spec=spec, sample_format=fmt
        )
        self.stream = torch.cuda.Stream(device)
        self._lock = threading.Lock()  # one batched call at a time on this decoder

    @classmethod
    def open(
        cls, device: torch.device, channels: int = 3, cpu_threads: int = CPU_THREADS
    ) -> HardwareJpeg | None:
        """The lane, or None where it cannot run here (see the module)."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        try:
            from nvidia import nvimgcodec
        except Exception:  # the optional package is absent (or its libraries do not load)
            return None
        try:
            lane = cls(device, nvimgcodec, channels, cpu_threads)
            probe = _probe_jpeg(channels)
            out = lane.decode([memoryview(probe)])
        except Exception:  # a GPU or driver the hardware backend does not support
            return None
        return lane if out and out[0] is not None and tuple(out[0].shape[1:]) == (16, 16) else None

    def decode(self, payloads: list[memoryview] | list[np.ndarray]) -> list[torch.Tensor | None]:
        """One batched hardware decode: (C, H, W) uint8 tensors on the device, None where refused."""
        if not payloads:
            return []
        streams = [self.nv.CodeStream(np.frombuffer(p, np.uint8)) for p in payloads]
        with self._lock:
            images = self.decoder.decode(streams, params=self.params, cuda_stream=self.stream.cuda_stream)
            self.stream.synchronize()  # done: usable on any stream, and the busy time is the call's
        return [None if img is None else self._tensor(img) for img in images]

    def _tensor(self, image: Any) -> torch.Tensor:
        """The decoded image as a tensor over its memory (it keeps the image alive)."""
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
