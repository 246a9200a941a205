#!/usr/bin/env bash
# The next device call for issues 37 and 38 (prepared 2026-12-06, not yet run). Here, first:
#   ../shared/tools/device-wheels && ../shared/tools/device-wheels simplejpeg==1.8.2
#   git archive 4e04c2e --prefix=.old37/ | tar x && echo /.old37/ >> .git/info/exclude
# then: run(command="bash benchmarks/results/gil_free_decode/next_call.sh", carry=[".whl", ".old37"]).
# At most 8 files come back from $OUT: everything is tarred into one.
set -u
R=/tmp/next; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -c "import simplejpeg, zarr; print('simplejpeg', simplejpeg.__version__, 'zarr', zarr.__version__)"
# issue 37: the npz random reads, the reader alone, both trees on one cache (16 threads)
W=/tmp/w37
timeout 90 python3 benchmarks/fastpaths.py --out $R/rrdata --work $W --sections data --images 8192 > $R/rrdata.log 2>&1
for i in 1 2 3; do
  timeout 30 python3 benchmarks/results/round37_h100/rr_probe.py $W/npz256 16 new >> $R/rr.log 2>&1
  (cd .old37 && timeout 30 python3 ../benchmarks/results/round37_h100/rr_probe.py $W/npz256 16 old) >> $R/rr.log 2>&1
done
cat $R/rr.log
# issue 38: the split's stamps, the tuner on and off, fixed splits (simplejpeg CPU decoders)
timeout 240 python3 benchmarks/results/gil_free_decode/probe_split.py $R /tmp/wp > $R/probe_split.log 2>&1
tail -20 $R/probe_split.log
tar czf "$OUT/next.tgz" -C /tmp next
