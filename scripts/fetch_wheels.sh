#!/usr/bin/env bash
# The wheel scripts/gpu_check_offline.sh installs on a machine without a network:
#
#   scripts/fetch_wheels.sh            # -> wheels/megatron_core-0.19.2-cp312-...-x86_64.whl
#
# Run where pip reaches PyPI. Fetches the pinned megatron-core for CPython 3.12 on x86-64
# Linux (the lent GPU machine's), whatever this machine is, without its dependencies (torch,
# numpy and packaging come with the GPU machine's python). wheels/ is gitignored.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$( [[ -x "$ROOT/.venv/bin/python" ]] && echo "$ROOT/.venv/bin/python" || echo python3 )}"
VERSION="$(PYTHONPATH="$ROOT" "$PYTHON" -c 'from megatron_domino.base.version import PINNED_MEGATRON_CORE; print(PINNED_MEGATRON_CORE)')"
mkdir -p "$ROOT/wheels"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$ROOT/wheels" "megatron-core==$VERSION"
ls -l "$ROOT"/wheels/megatron_core-"$VERSION"-*.whl
