#!/usr/bin/env bash
# The one-command GPU check: scripts/gpu_check.sh [flags of python -m lab.gpu_check]
#
#   scripts/gpu_check.sh                     # the full check on CUDA (about 2-4 minutes, < 7 max)
#   scripts/gpu_check.sh --quick             # smaller models, one GEMM shape
#   scripts/gpu_check.sh --device cpu --quick   # the same code on the CPU (tests the script)
#
# Results go to $GPU_CHECK_OUT_DIR (default: gpu_check_results/ in the repository), one
# directory per run with results.json and summary.md; the path is printed at the end.
# PYTHON defaults to the repository's .venv if it exists, else python3. The repository is put
# on PYTHONPATH, so an uninstalled checkout works (megatron-core must be importable).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${GPU_CHECK_OUT_DIR:-$ROOT/gpu_check_results}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

before="$(readlink "$OUT_DIR/latest" 2>/dev/null || true)"
status=0
"$PYTHON" -m lab.gpu_check --out-dir "$OUT_DIR" "$@" || status=$?
after="$(readlink "$OUT_DIR/latest" 2>/dev/null || true)"
if [[ -n "$after" && "$after" != "$before" ]]; then
    echo "gpu_check results: $OUT_DIR/$after"
fi
exit "$status"
