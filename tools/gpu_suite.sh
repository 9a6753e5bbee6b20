#!/usr/bin/env bash
# The whole test suite on one GPU, in two parts that each fit one device call (on an H100 with 16
# cores, 2026-12-07: the DSA indexer files 180 s, the rest 460 s, with 12 workers):
#   bash tools/gpu_suite.sh indexer   # the tests/test_indexer*.py files
#   bash tools/gpu_suite.sh rest      # every other test file
#   bash tools/gpu_suite.sh           # both
# Each part's slowest tests and its failures are in its log. Run from the repository root; results
# go under $OUT (default ./gpu_suite_out): indexer.log, rest.log, summary.txt.
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(indexer rest)
source "$(dirname "$0")/gpu_steps.sh" suite
pytest=(env PYTHONSAFEPATH=1 python -m pytest -q -n 12 -p no:benchmark -p no:cacheprovider -rfE --tb=short
        --durations=10)
indexer_files=(tests/test_indexer_triton.py tests/test_indexer.py tests/test_indexer_cupy.py tests/test_indexer_random.py)
for part in "${parts[@]}"; do
    case $part in
    indexer) TAIL_LINES=3 run indexer 300 "${pytest[@]}" "${indexer_files[@]}" ;;
    rest) TAIL_LINES=3 run rest 580 "${pytest[@]}" tests "${indexer_files[@]/#/--ignore=}" ;;
    *) echo "unknown part $part (indexer, rest)" >&2; exit 2 ;;
    esac
done
cat "$OUT/summary.txt"
