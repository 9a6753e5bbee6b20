# Sourced by the tools/gpu_*.sh scripts: $OUT (default ./gpu_<name>_out, from $1), PYTHONPATH on
# this checkout, the machine's versions in $OUT/summary.txt, and `run`, one timed step.
set -u
OUT=${OUT:-gpu_${1}_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TAIL_LINES=${TAIL_LINES:-25}

run() {  # run NAME SECONDS COMMAND...: output to $OUT/NAME.log, a status line to the summary
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n "$TAIL_LINES" "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
python -c "import importlib, torch; print('torch', torch.__version__, *(f'{m} {importlib.import_module(m).__version__}' for m in ('triton', 'cupy') if importlib.util.find_spec(m)), 'gpus', torch.cuda.device_count())" | tee -a "$OUT/summary.txt"
