set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python -m pytest -q -rf --tb=short -p no:benchmark -n 4 tests/test_triton_gpu.py -k "raw or launcher or stream_handle" \
  tests/test_plans.py tests/test_raw_launch.py > $OUT/tests.txt 2>&1
tail -60 $OUT/tests.txt
timeout 90 python benchmarks/sync_gap.py --out $OUT/sync_gap.jsonl 2>&1 | tail -3
timeout 90 python -c "
import sys, runpy
sys.argv = ['sync_gap.py', '--out', '$OUT/sync_gap_raw.jsonl']
sys.path.insert(0, 'benchmarks')
from streamkl.backends.triton import common
common.RAW_LAUNCH = True
runpy.run_path('benchmarks/sync_gap.py', run_name='__main__')
" 2>&1 | tail -3
echo "== sync_gap off"; cat $OUT/sync_gap.jsonl | cut -c1-330
echo "== sync_gap raw"; cat $OUT/sync_gap_raw.jsonl | cut -c1-330
timeout 220 python benchmarks/ab_trees.py --flip backends.triton.common.RAW_LAUNCH=True --repeats 30 \
  --cases "fwd D=64 causal,fwd D=64,fwd 90%,student 90%" --out $OUT/ab_raw.jsonl 2>&1 | tail -20
