"""The advice ``dlstore bench`` and ``dlstore watch`` both give, in one place: the stage a loop is named by,
the sentence a report leads with, the ranked recommendations and the code each prints. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dlstore.write.sizes import count

WORTH_FRACTION = 1.05  # a change is advised when it is expected to gain at least 5%
MAX_RECOMMENDATIONS = 5
# A loop within 5% of the step alone runs as fast as its step: nothing around the step can be cut.
STEP_ALONE_FRACTION = 0.95
# The fast loader every snippet names: the one line to change when it is renamed.
FAST_LOADER = "dlstore.Loader"
plural = count  # "1 worker", "8 batches": the one helper reports use

STAGE_WORDS = {
    "read": "reading the files from storage",
    "transform": "preparing the images on the CPU (decode and transform)",
    "host": "the main thread's own work per step (the Python loop, the copy, kernel launches)",
    "h2d": "the copy to the GPU",
    "compute": "the training step",
    "cores": "a shortage of CPU cores (the workers and the main thread need more than there are)",
    "shared": "contention between the parts running together (shared cores, epoch starts)",
}


def fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:,.0f}"


def item(
    text: str, command: str | None, gain: float | None, expected: float | None = None, **extra: Any
) -> dict[str, Any]:
    """One recommendation: its text, the code or command that applies it, its gain over now, its rate."""
    return {"text": text, "command": command, "gain": gain, "expected_img_per_s": expected, **extra}


def rank(advice: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Most valuable first (the largest expected gain; advice without a number after), at most five."""
    return sorted(advice, key=lambda a: -(a.get("gain") or 0.0))[:MAX_RECOMMENDATIONS]


def recommendations(advice: Sequence[dict[str, Any]]) -> list[str]:
    """Each recommendation as one line of text: what to do, then how (``Apply:``), then whether it ran."""
    out = []
    for a in advice:
        line = a["text"] + (f" Apply: {a['command']}" if a.get("command") else "")
        if a.get("not_tried"):
            line += f" (Not tried: {a['not_tried']})"
        out.append(line)
    return out


def named_stage(model_stage: str, measured: float | None, alone: float | None, on_host: bool = False) -> str:
    """The stage a loop is named by: the step whenever the loop runs as fast as the step alone; on a GPU,
    a step-bound loop well below the step alone lost its time to the parts running together."""
    if measured and alone and measured >= STEP_ALONE_FRACTION * alone:
        return "compute"
    if model_stage == "compute" and not on_host and measured and alone and measured < 0.85 * alone:
        return "shared"
    return model_stage


def lead(
    stage: str,
    now: float | None,
    alone: float | None,
    wait_share: float | None,
    best: dict[str, Any] | None,
    stage_words: str | None = None,
) -> str:
    """The one sentence a report starts with: what binds, by how much, the best fix and its gain."""
    words = stage_words or STAGE_WORDS.get(stage, stage)
    if stage == "compute":
        text = f"The training step binds: the loop runs {fmt(now)} img/s"
        if alone and now and now >= STEP_ALONE_FRACTION * alone:  # else the parts took turns (0 workers)
            text += f", as fast as the step alone ({fmt(alone)} img/s), so the input pipeline needs no change"
        elif alone:
            text += f", where the step alone runs {fmt(alone)} img/s"
    else:
        text = f"{words[0].upper()}{words[1:]} binds: the loop runs {fmt(now)} img/s"
        if wait_share is not None:
            text += f" and waits for data {100 * wait_share:.0f}% of the time"
        if alone:
            text += f", where the step alone runs {fmt(alone)} img/s"
    if best is not None and best.get("expected_img_per_s") and best.get("what"):
        gain = f" ({best['gain']:.1f}× now)" if best.get("gain") else ""
        how = best.get("rate_word", "predicted")
        text += f"; best fix: {best['what']}, {how} {fmt(best['expected_img_per_s'])} img/s{gain}"
    elif stage == "compute":
        text += "; to go faster, speed up the step"
    else:
        text += "; no change measured here is predicted to gain 5% or more"
    return text + "."


def step_advice(stage: str, on_gpu: bool, rate: float | None, command: str | None = None) -> dict | None:
    """When the step itself binds: what to speed up, with no predicted number (the input is not it)."""
    if stage == "compute":
        where = "" if on_gpu else " (no GPU here: on a GPU the step is far faster and the input decides)"
        text = (
            f"The training step binds at {fmt(rate)} img/s{where}: speed up the step (bf16 autocast, "
            "channels_last, torch.compile, a larger batch) and measure again."
        )
    elif stage == "host":
        text = (
            "The main thread's own work per step binds: fewer, larger steps (a larger batch), fewer kernel "
            "launches (torch.compile, CUDA graphs), and no sync each step (loss.item(), .cpu(), printing a "
            "tensor: read such values every N steps)."
        )
    else:
        return None
    return item(text, command, None)


def loader_code(settings: dict[str, Any]) -> str:
    """The DataLoader call of an advice's ``settings`` (the structured field ``watch --apply`` sets)."""
    return f"DataLoader(..., {', '.join(f'{k}={v}' for k, v in settings.items())})"


def workers_code(n: int, pin: bool | None = None) -> str:
    pinned = "" if pin is None else f", pin_memory={pin}"
    return f"DataLoader(..., num_workers={n}, persistent_workers={n > 0}{pinned})"


def decode_lanes(n: int) -> list[str]:
    """The fast loader's decode lanes with ``n`` CPU decoders (a lane the machine lacks is skipped)."""
    return ["cpu", "hw", "nvjpeg"] if n else ["hw", "nvjpeg"]


def decoder_code(n: int, batch_size: int) -> str:
    return f"{FAST_LOADER}(cache, {batch_size}, transform=crop, cpu_decoders={n}, lanes={decode_lanes(n)})"


# -- caches -----------------------------------------------------------------------------------------------


def convert_command(
    source: str,
    size: int,
    extra: str = "",
    channels: int = 3,
    needed: int | None = None,
    avail: int | None = None,
) -> tuple[str, bool]:
    """(``dlstore convert`` command, whether it is a JPEG cache): a raw RAM cache when ``needed`` bytes fit
    in the ``avail`` memory (or either is unknown), else JPEGs kept at the shorter side, decoded on the GPU."""
    from dlstore.formats import compressed_gpu_format, in_memory_format

    base = f"dlstore convert {source} DEST --size {size}{extra}" + (" --channels 1" if channels == 1 else "")
    jpeg = compressed_gpu_format()
    if needed is not None and avail is not None and needed > avail and jpeg is not None:
        return (
            f"{base} --format {jpeg[0]} --codec {jpeg[1]} --resize shorter   # a raw cache needs "
            f"{needed / 1e9:.1f} GB, {avail / 1e9:.1f} GB is free: read it with {FAST_LOADER}",
            True,
        )
    return f"{base} --format {in_memory_format()}", False


def ragged_format() -> str:
    """A format that stores images at their own aspect ratio (``--resize shorter``)."""
    from dlstore.formats import FORMATS

    return next(f.name for f in FORMATS.values() if f.ragged_ok)


# Transforms that only turn a PIL image into a tensor, and crops that take the whole image.
TENSOR_STEPS = ("ToTensor", "PILToTensor", "ToImage", "ConvertImageDtype", "ToDtype", "MaybeToTensor")
WHOLE_IMAGE_CROPS = ("RandomResizedCrop", "RandomResizedCropAndInterpolation")


def gpu_augment(transforms: Sequence[dict[str, Any]], size: int) -> tuple[dict[str, Any], list[str]]:
    """GpuAugment's arguments reproducing the user's transform at ``size``, and the steps it cannot."""
    kw: dict[str, Any] = {"size": size, "scale": (1.0, 1.0), "ratio": (1.0, 1.0), "hflip_p": 0.0}
    missing = []
    for t in transforms:
        name = t["name"]
        if name in WHOLE_IMAGE_CROPS:
            kw.update(size=min(t["size"]), scale=tuple(t.get("scale", (0.08, 1.0))))
            kw["ratio"] = tuple(round(r, 4) for r in t.get("ratio", (3 / 4, 4 / 3)))
        elif name == "RandomHorizontalFlip":
            kw["hflip_p"] = t.get("p", 0.5)
        elif name == "RandomRotation":
            kw["degrees"] = t.get("degrees", 0.0)
        elif name == "Normalize" and "mean" in t and "std" in t:
            kw.update(mean=tuple(t["mean"]), std=tuple(t["std"]))
        elif name in ("ConvertImageDtype", "ToDtype") and "float" in str(t.get("dtype", "")):
            kw["out_dtype"] = t["dtype"]
        elif name in ("Resize", "CenterCrop") and min(t.get("size") or [0]) == size:
            continue  # the cache's own resize and centre crop
        elif name not in TENSOR_STEPS:
            missing.append(name)
    return kw, missing


def not_reproduced(missing: Sequence[str]) -> str:
    if not missing:
        return ""
    them = "it" if len(missing) == 1 else "them"
    return f" GpuAugment does not do {', '.join(missing)}: keep {them} on the CPU or drop {them} knowingly."


def augment_code(kw: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v}" for k, v in kw.items() if k != "size")
    return f"dlstore.gpu.GpuAugment({kw['size']}, {args}).to('cuda')"


def crops_whole_image(transforms: Sequence[dict[str, Any]]) -> bool:
    return any(t["name"] in WHOLE_IMAGE_CROPS for t in transforms)


def border_note(source: str, size: int, extra: str) -> str:
    """What a centre-cropped cache changes for a crop drawn over the whole image, and the cache that does not."""
    return (
        f" The cache keeps each image's centre {size}×{size} square, so RandomResizedCrop no longer sees the "
        f"image's borders; to keep them: dlstore convert {source} DEST --size {size}{extra} --resize shorter "
        f"--format {ragged_format()} and dlstore.CachedDataset(DEST, transform=your_transform, pil=True)."
    )
