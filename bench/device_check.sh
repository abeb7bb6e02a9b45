#!/usr/bin/env bash
# bench/device_check.sh OUTDIR [--dry-run] [--budget-s N] [--only STEPS]
#
# The GPU session's one prepared script (docs/gpu.md). On the bare device machine,
# from the repository root, every call runs the same command, each carrying the next
# payload folder that bench/device_wheels.sh prepared here:
#     call 1: carry .whl/call1   bash bench/device_check.sh $OUT    (stages, exit 3)
#     call 2: carry .whl/call2   bash bench/device_check.sh $OUT    (installs, measures, trains)
# --dry-run: the same steps on this machine's CPU in a tiny form (tests/test_device_check.py).
# Results: OUTDIR/device_check.json (summary), benchmarks.json, device_check.log,
# model.tar.part-NN. Exit 0: every step ok; 1: some step failed; 3: payload incomplete.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: bench/device_check.sh OUTDIR [--dry-run] [--budget-s N] [--only STEPS]" >&2
    exit 2
fi
py="${SPEL_DC_PYTHON:-python3}"
dry=0; given=""; prev=""
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && dry=1
    [ "$prev" = "--budget-s" ] && given="$arg"
    prev="$arg"
done
if [ $dry = 1 ]; then budget="${given:-${SPEL_DC_BUDGET_S:-240}}"; else budget="${given:-${SPEL_DC_BUDGET_S:-510}}"; fi
export PYTHONUNBUFFERED=1 SPEL_DC_PYTHON="$py"
# the whole check ends within its budget plus a minute, whatever hangs
exec timeout -k 10 "$((${budget%.*} + 60))" "$py" -m bench.device_check "$@"
