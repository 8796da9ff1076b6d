#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter, or explain how to get one and exit 1.
#
# megatron-core 0.17 and newer need Python >= 3.12. Looked for, in order: $PYTHON if set,
# `python3.12` on PATH (pyenv's shim counts only if it runs: a shim for a version that is not
# selected exits 127), then pyenv's versions folder (${PYENV_ROOT:-~/.pyenv}/versions/3.12.*),
# which CI and other non-interactive shells reach without pyenv being initialised.
set -uo pipefail

works() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }

if [[ -n "${PYTHON:-}" ]]; then
    if works "$PYTHON"; then echo "$PYTHON"; exit 0; fi
    echo "PYTHON=$PYTHON is not a working Python 3.12 (megatron-core 0.19 needs 3.12)." >&2
    exit 1
fi
if command -v python3.12 >/dev/null && works python3.12; then
    command -v python3.12
    exit 0
fi
for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12; do
    if [[ -x "$candidate" ]] && works "$candidate"; then echo "$candidate"; exit 0; fi
done
cat >&2 <<'MSG'
No Python 3.12 found: megatron-core 0.19 (what megatron-domino is tested with) needs it.
Install one and run make again, e.g.
    pyenv install 3.12        (found in ~/.pyenv/versions without activating it)
    apt-get install python3.12 python3.12-venv
or point make at one: make test PYTHON=/path/to/python3.12
MSG
exit 1
