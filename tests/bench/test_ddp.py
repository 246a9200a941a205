"""benchmarks/ddp.py under torchrun on CPU (gloo, 2 processes), and the samplers it relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlstore.read.cache import open_cache
from dlstore.read.loader import make_sampler
from dlstore.write.conversion import convert
from dlstore.write.options import ConvertOptions

ROOT = Path(__file__).resolve().parents[2]
N_IMAGES = 301  # not a multiple of 2 ranks x batch 16: exercises the padding


@pytest.fixture(scope="module")
def chunked_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Several chunks (64 px zarr: 86 images a chunk), so ranks read different units."""
    dest = tmp_path_factory.mktemp("ddp") / "cache"
    convert("demo", dest, ConvertOptions(format="zarr", size=64, demo_images=N_IMAGES, workers=1))
    return dest


def torchrun(cache: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "benchmarks" / "ddp.py"), str(cache), "--model", "smallcnn", "--size", "32"]
    cmd += ["--batch-size", "16", *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]


def epochs_of(record: Path) -> list[list[dict]]:
    """[rank][epoch] records."""
    return [json.loads((record / f"rank{r}.json").read_text())["epochs"] for r in range(2)]


def test_ddp_two_ranks_on_cpu(chunked_cache: Path, tmp_path: Path) -> None:
    torchrun(
        chunked_cache,
        "--epochs",
        "3",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--record",
        str(tmp_path / "a"),
    )
    ranks = epochs_of(tmp_path / "a")
    for epoch in range(3):
        mine = [set(ranks[r][epoch]["indices"]) for r in range(2)]
        counts = [len(ranks[r][epoch]["indices"]) for r in range(2)]
        assert counts == [151, 151]  # equal shares, padded by one repeated sample
        assert len(mine[0] & mine[1]) <= 1  # disjoint but for the padding
        assert mine[0] | mine[1] == set(range(N_IMAGES))  # together: the whole epoch
        assert [ranks[r][epoch]["batches"] for r in range(2)] == [151 // 16] * 2  # no rank waits for another
        assert all(ranks[r][epoch]["labels_match"] for r in range(2))  # the loader delivered those samples
    assert ranks[0][0]["indices"] != ranks[0][1]["indices"]  # set_epoch reshuffles
    # Resume at the boundary before epoch 2, in new processes: the same order as the run above.
    torchrun(
        chunked_cache,
        *("--epochs", "3", "--checkpoint", str(tmp_path / "ckpt"), "--resume", "2"),
        *("--record", str(tmp_path / "b")),
    )
    resumed = epochs_of(tmp_path / "b")
    for r in range(2):
        assert [e["epoch"] for e in resumed[r]] == [2]
        assert resumed[r][0]["indices"] == ranks[r][2]["indices"]


@pytest.mark.parametrize("order", ["chunk", "random"])
def test_sampler_shares_are_disjoint_equal_and_reshuffled(chunked_cache: Path, order: str) -> None:
    cache = open_cache(chunked_cache, check_source=False)
    samplers = [make_sampler(cache, order, seed=3, num_replicas=3, rank=r) for r in range(3)]
    orders = []
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        shares = [np.fromiter(iter(s), np.int64) for s in samplers]
        assert len({len(x) for x in shares}) == 1 and all(len(x) == len(s) for x, s in zip(shares, samplers))
        together = np.concatenate(shares)
        assert set(together.tolist()) == set(range(N_IMAGES))
        assert len(together) - len(set(together.tolist())) == len(together) - N_IMAGES  # only padding repeats
        orders.append(together)
    assert not np.array_equal(orders[0], orders[1])
