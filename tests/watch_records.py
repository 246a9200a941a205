"""Raw watch records of known cost, for the analysis tests (tests/bench/watch/)."""

from __future__ import annotations

from typing import Any


def raw(
    wait: float,
    host: float,
    workers: int = 0,
    steps: int = 40,
    rank: int = 0,
    cuda: bool = False,
    replay_period: float | None = None,
    getitem: float = 0.0,
    cores: int = 8,
) -> dict[str, Any]:
    """A record of ``steps`` steady steps of a constant wait and host time (then a replay, if given)."""
    t, t_call, t_ret, t_next, phase = 0.0, [], [], [], []
    for i in range(steps):
        t_call.append(t)
        t_ret.append(t + wait)
        t += wait + host
        t_next.append(t)
        phase.append("warmup" if i < 2 else "real")
    for _ in range(10 if replay_period else 0):
        t_call.append(t)
        t_ret.append(t + 1e-5)
        t += replay_period  # type: ignore[operator]
        t_next.append(t)
        phase.append("replay")
    n = len(t_call)
    return {
        "status": "completed",
        "exit_code": 0,
        "error": None,
        "rank": rank,
        "world_size": 1,
        "cuda": cuda,
        "device_label": "test",
        "cores": cores,
        "nvml": False,
        "main_cpu": [],
        "gpu_util": [],
        "config": {"replay_batches": 2},
        "profile_trace": None,
        "loaders": [
            {
                "index": 0,
                "images_per_batch": 32,
                "t_call": t_call,
                "t_ret": t_ret,
                "t_next": t_next,
                "phase": phase,
                "epoch": [0] * n,
                "device_s": None,
                "device_gap_s": None,
                "epochs": [{"epoch": 0, "first_step": 0}],
                "worker_samples": [],
                "settings": {
                    "num_workers": workers,
                    "batch_size": 32,
                    "pin_memory": False,
                    "prefetch_factor": None,
                    "persistent_workers": False,
                    "batches_per_epoch": steps,
                },
                "dataset": {
                    "type": "torchvision.datasets.folder.ImageFolder",
                    "len": 10_000,
                    "image_folder": True,
                    "torchvision": True,
                    "root": "/data/train",
                    "transforms": [
                        {"name": "RandomResizedCrop", "size": [224, 224], "random": True},
                        {"name": "ToTensor", "random": False},
                    ],
                },
                "parts": {
                    "getitem_s": getitem,
                    "transform_s": 0.8 * getitem,
                    "load_s": 0.2 * getitem,
                    "collate_s": 1e-4,
                }
                if getitem
                else {"skipped": "not measured"},
            }
        ],
    }


def recorded(name: str) -> dict[str, Any]:
    """A raw watch record kept from a real run (tests/records/watch_NAME.json)."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "records" / f"watch_{name}.json").read_text())
