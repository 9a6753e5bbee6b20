#!/usr/bin/env bash
# The CuPy backend, this checkout against a base copy of the package, on one GPU (under 300 s):
#  1. tests/test_cupy_gpu.py on this checkout (every SPEC feature against the float64 reference);
#  2. benchmarks/cupy_backward_h200.py (forward, student and all-four backward at N=16384 next to
#     FlashAttention-2, first-call compile time) once on the base and once on this checkout, per
#     head dim, in the order base, this, this, base (D=128, then D=64) so that drift over the run
#     weighs on both alike; each run compiles into an empty CuPy cache of its own;
#  3. the CuPy columns side by side, this / base, in $OUT/summary.txt.
# BASE: a directory holding the base `streamkl` package, e.g.
#   mkdir -p _gpu/base && git archive main streamkl | tar -x -C _gpu/base
#   BASE=_gpu/base bash tools/gpu_cupy_ab.sh
# BUDGET (default 295): seconds for the whole script; a benchmark run that would start with less
# than 20 s left is skipped (the last base run first).
# Run from the repository root; results go under $OUT (default ./gpu_cupy_ab_out): summary.txt,
# tests.log and one log per benchmark run.
BASE=$(cd "${BASE:?set BASE to a directory holding the base streamkl package}" && pwd)
[ -f "$BASE/streamkl/__init__.py" ] || { echo "no streamkl package under $BASE" >&2; exit 2; }
BUDGET=${BUDGET:-295}
source "$(dirname "$0")/gpu_steps.sh" cupy_ab
TREE=$PWD
CACHES=$(mktemp -d)

TAIL_LINES=6 run tests 100 python -m pytest -v -n 12 -p no:benchmark tests/test_cupy_gpu.py -rfE --tb=line

bench() {  # bench SIDE DIM: one benchmark run with PYTHONPATH on that side's package
    local side=$1 dim=$2 root=$TREE
    [ "$side" = base ] && root=$BASE
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "${side}_d$dim: skipped, $left s left" | tee -a "$OUT/summary.txt"
        return
    fi
    echo "${side}_d$dim: PYTHONPATH=$root" >>"$OUT/summary.txt"
    PYTHONPATH=$root CUPY_CACHE_DIR=$CACHES/${side}_d$dim TAIL_LINES=0 \
        run "${side}_d$dim" "$left" python benchmarks/cupy_backward_h200.py --dims "$dim"
}
bench base 128
bench tree 128
bench tree 64
bench base 64
rm -rf "$CACHES"

# this / base for the CuPy columns, from the JSON rows
python - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for log in sorted(out.glob("*_d*.log")):
    side = log.name.split("_")[0]
    for text in log.read_text().splitlines():
        if text.startswith("{"):
            r = json.loads(text)
            rows.setdefault((r["shape"], r["causal"]), {})[side] = r
print(f"{'case':28s} {'column':13s} {'base':>8s} {'this':>8s} {'this/base':>9s}")
for (shape, causal), sides in rows.items():
    if len(sides) < 2:
        continue
    for column in ("fa2_fwd", "fa2_bwd", "cupy_fwd", "cupy_student", "cupy_all4", "first_call_s"):
        base, this = sides["base"][column], sides["tree"][column]
        print(f"{shape + (' causal' if causal else ''):28s} {column:13s} {base:8.2f} {this:8.2f} {this / base:9.3f}")
EOF
grep -E "tests: |passed|failed" "$OUT/tests.log" | tail -n 3
echo "total $SECONDS s" | tee -a "$OUT/summary.txt"
