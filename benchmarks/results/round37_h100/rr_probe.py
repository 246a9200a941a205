"""npz random reads through ChunkSampler with this tree's dlstore (run from the tree's root), sorted by
storage position as the loaders read: img/s of three passes over 60 batches of 256.

    python3 rr_probe.py CACHE THREADS LABEL
"""

import json
import sys
import time

import numpy as np

sys.path.insert(0, ".")
from dlstore import open_cache  # noqa: E402

try:
    from dlstore.read import ChunkSampler
except ImportError:  # 4e04c2e
    from dlstore import ChunkSampler

cache = open_cache(sys.argv[1])
cache.reader.threads = int(sys.argv[2])
order = np.asarray(list(ChunkSampler(cache, seed=0)))
b, buf = 256, np.empty((256, *cache.spec.shape), np.uint8)
rates = []
for _ in range(3):
    t0, n = time.perf_counter(), 0
    for i in range(0, min(len(order), 60 * b) - b + 1, b):
        batch = order[i : i + b]
        cache.read(batch[np.argsort(cache.positions[batch], kind="stable")], out=buf)
        n += b
    rates.append(n / (time.perf_counter() - t0))
print(json.dumps({"tree": sys.argv[3], "threads": int(sys.argv[2]), "rates": [round(r) for r in rates]}))
