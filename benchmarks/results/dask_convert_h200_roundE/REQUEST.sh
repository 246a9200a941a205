# budget: 118
# dask (issue 11 part 2): Dask local:16 vs the built-in pool on the same 98,304-image source (as round D),
# (1) cluster start included, (2) on local:16's own cluster started beforehand (its start timed apart),
# then cluster starts alone by layout (16x1, old LocalCluster 16x1, 1x16) if time is left.
set -u
export DLSTORE_COMMIT=7484375 COMMIT=7484375
python3 -c "import sys, dask, distributed; print('python', sys.version.split()[0], 'dask', dask.__version__, 'distributed', distributed.__version__)"
timeout 15 python3 -m dask spec --help > /dev/null 2>&1 && echo "dask spec: ok" || echo "dask spec: FAILED"
timeout 110 python3 benchmarks/dask_convert.py --out "$OUT" --images 4096 --copies 24 --format ram --size 256 \
  --dest-dir /dev/shm --workers 16 --repeats 1 --configs pool,local,running --budget-s 100 \
  --start-sweep 16x1,lc16x1,1x16
echo "benchmark rc=$?"
rm -rf /dev/shm/dask-convert-cache-* /tmp/dask-convert-* /tmp/dask-scratch-space
