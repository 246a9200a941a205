"""The nvJPEG lane's mechanism on a machine without a GPU: torchvision's CPU ``decode_jpeg`` stands in for
nvJPEG inside the same scripted call (as in tests/read), so only where the call runs differs between two
checkouts: ``ROOT`` before 8b0d296 calls it in the decode thread, after it the call is forked as each batch
is read. The loader alone and beside a busy pure-Python thread, 3 epochs after a warm one, batch 128.

    python cpu_stand_in.py ROOT CACHE      # prints {"alone": img/s, "beside_spin": img/s}
"""

import json
import sys
import threading
import time
from pathlib import Path

import torch

root, cache = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)  # this checkout's dlstore, before any other
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))
import harness  # noqa: E402

torch.set_num_threads(1)


def rate(spin: bool) -> float:
    loader = harness.make_loader(cache, 128, "decode", device="cpu", transform=lambda x: x, drop_last=False)
    loader._path.gpu = True  # the CPU decode stands in for nvJPEG
    for _ in loader:  # the warm epoch
        pass
    stop = threading.Event()

    def spinner() -> None:
        while not stop.is_set():
            pass

    busy = threading.Thread(target=spinner)
    if spin:
        busy.start()
    t0, count = time.perf_counter(), 0
    for _ in range(3):
        for x, _y in loader:
            count += len(x)
    seconds = time.perf_counter() - t0
    stop.set()
    if spin:
        busy.join()
    return count / seconds


print(json.dumps({"alone": rate(False), "beside_spin": rate(True)}))
