"""A cache with fields through an object store (a moto S3 server) and through a Dask conversion
(LocalCluster): the masks, boxes and their labels read back from the URL, and from the Dask-built cache,
exactly as from the same conversion made locally by the process pool. The source is a parquet file whose
columns become the fields (``--field``), so the Dask workers get the source's field columns pickled."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from dlstore import CachedDataset, Loader, Remote, convert, verify
from dlstore.storage.stores import RemoteStore

BUCKET = "dlstore-fields"
FIELDS = ("mask=seg", "boxes=objects", "labels=object_labels:ragged", "tags")
N = 10


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(5)
    images, masks, boxes, labels = [], [], [], []
    for i in range(N):
        w, h = (int(v) for v in rng.integers(20, 40, 2))
        buf, png = io.BytesIO(), io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        ids = np.zeros((h, w), np.uint8)
        ids[2 : h // 2, 3 : w // 2] = 1 + i % 4
        Image.fromarray(ids).save(png, "PNG")
        images.append(buf.getvalue())
        masks.append(png.getvalue())
        boxes.append([[3.0, 2.0, w / 2, h / 2], [1.0, 1.0, w - 2.0, h - 1.5]][: 1 + i % 2])
        labels.append([1 + i % 4, 9][: len(boxes[-1])])
    table = pa.table(
        {
            "image": pa.array(images, pa.binary()),
            "seg": pa.array(masks, pa.binary()),
            "objects": pa.array(boxes, pa.list_(pa.list_(pa.float32()))),
            "object_labels": pa.array(labels, pa.list_(pa.int64())),
            "tags": pa.array([[i % 2, 1] for i in range(N)], pa.list_(pa.uint8())),
        }
    )
    path = tmp_path_factory.mktemp("src") / "data.parquet"
    pq.write_table(table, path, row_group_size=4)
    return path


def conv(src: Path, dest: str | Path, fmt: str, **kw: Any) -> Any:
    return convert(
        str(src), dest, format=fmt, size=12, fields=FIELDS, workers=1, storage_order="source", **kw
    )


def targets(path: str | Path) -> list[dict[str, Any]]:
    ds = CachedDataset(path)
    return [ds[i][1] for i in range(len(ds))]


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b) == N
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) == ["boxes", "labels", "mask", "tags"]
        for name in x:
            assert torch.equal(x[name].as_subclass(torch.Tensor), y[name].as_subclass(torch.Tensor)), name
        assert x["boxes"].canvas_size == y["boxes"].canvas_size == (12, 12)


@pytest.fixture(scope="module")
def local(parquet: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The targets of the same conversion made locally by the process pool (npz)."""
    dest = tmp_path_factory.mktemp("local") / "npz"
    conv(parquet, dest, "npz")
    out = targets(dest)
    assert any(len(t["boxes"]) for t in out) and any(int(t["mask"].max()) for t in out)
    return out


@pytest.fixture(scope="module")
def s3(server: Any) -> None:
    """conftest's moto server, with the bucket this module writes to."""
    RemoteStore(f"s3://{BUCKET}").fs.mkdir(BUCKET)


@pytest.mark.slow  # two conversions and a moto server: ~25 s on this shared 2-core VM, over the 5 s default
def test_fields_through_an_object_store(parquet: Path, local: list, s3: None, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/npz"
    conv(parquet, url, "npz")
    same(targets(url), local)
    assert verify(url).ok
    loader = Loader(
        url,
        batch_size=4,
        device="cpu",
        order="sequential",
        remote=Remote(cache_dir=tmp_path / "mirror"),
        via="pinned",
    )
    images, target = next(iter(loader))
    assert images.shape == (4, 3, 12, 12) and target["mask"].shape == (4, 12, 12)
    for j in range(4):
        assert torch.equal(target["mask"][j], local[j]["mask"].as_subclass(torch.Tensor))
        assert torch.equal(target["labels"][j], local[j]["labels"])


@pytest.mark.slow  # a LocalCluster of two worker processes starts in ~5-10 s here
def test_fields_through_a_dask_conversion(parquet: Path, local: list, s3: None, tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    conv(parquet, tmp_path / "pool-zarr", "zarr")
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster:
        conv(parquet, tmp_path / "zarr", "zarr", scheduler=cluster.scheduler_address)
        conv(parquet, f"s3://{BUCKET}/dask-npz", "npz", scheduler=cluster.scheduler_address)
    same(targets(tmp_path / "zarr"), targets(tmp_path / "pool-zarr"))
    same(targets(f"s3://{BUCKET}/dask-npz"), local)
