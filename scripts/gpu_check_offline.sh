#!/usr/bin/env bash
# The GPU check on a machine as it is: its own python3 and torch, no network, no venv.
#
#   scripts/gpu_check_offline.sh RESULTS_DIR [--quick] [flags of python -m lab.gpu_check]
#
#   scripts/gpu_check_offline.sh "$OUT/check" --quick    # under 4 minutes on one GPU
#   scripts/gpu_check_offline.sh "$OUT/check"            # the full check, under 8 minutes
#   scripts/gpu_check_offline.sh /tmp/c --device cpu --quick   # the CPU stand-in (tests this)
#
# RESULTS_DIR gets summary.md and results.json (it must not exist or be empty). Megatron-Core
# comes from the python's own site-packages if it imports there; otherwise from the wheel in
# $WHEELS (default: wheels/ in the checkout, made by scripts/fetch_wheels.sh on a machine with
# a network, ~2.4 MB, gitignored), installed with pip --target into $SITE (default:
# ${TMPDIR:-/tmp}/megatron-domino-site) with no index and no dependencies: torch, numpy and
# packaging must already be there. PYTHON defaults to python3. Exit status: the check's
# (0 passed, 1 failed, 2 no CUDA device, 3 incomplete), or 4 when Megatron-Core cannot be had.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 RESULTS_DIR [--quick] [gpu_check flags]: name the folder for summary.md and results.json first" >&2
    exit 4
fi
RESULTS_DIR="$1"
shift
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/wheels}"
SITE="${SITE:-${TMPDIR:-/tmp}/megatron-domino-site}"

if ! "$PYTHON" -c 'import megatron.core' >/dev/null 2>&1; then
    shopt -s nullglob
    wheels=("$WHEELS"/megatron_core-*.whl)
    shopt -u nullglob
    if [[ ${#wheels[@]} -ne 1 ]]; then
        echo "Megatron-Core does not import with $PYTHON and $WHEELS holds ${#wheels[@]} megatron_core wheels (need exactly one):" >&2
        echo "on a machine with a network run scripts/fetch_wheels.sh, then bring wheels/ along." >&2
        exit 4
    fi
    if [[ ! -f "$SITE/megatron/core/__init__.py" ]]; then  # a rerun reuses the install
        echo "installing ${wheels[0]##*/} into $SITE (pip --target, no index, no dependencies)"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${wheels[0]}"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m lab.gpu_check --run-dir "$RESULTS_DIR" "$@"
