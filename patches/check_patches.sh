#!/usr/bin/env bash
# Report, for each patch in this folder, whether it applies to a Megatron-LM checkout.
#
#   patches/check_patches.sh /path/to/Megatron-LM
#
# Runs `git apply --check` (and, when that fails, `git apply --check --reverse` to tell
# "already applied" from "does not apply") in the checkout; it changes nothing there.
# A patch that applies is not enough: megatron-domino refuses, at run time, a Megatron-Core
# outside its tested range, so the script also compares the checkout's in-tree version with
# that range (read from megatron_domino.version: the installed package, else this repo).
# PYTHON (default python3) is the interpreter that reads the versions.
# Exit status: 0 when a patch applies (or is already applied) and the version is in range,
# 1 otherwise, 2 on a usage error.
set -uo pipefail

if [[ $# -ne 1 || ! -f "$1/pretrain_gpt.py" ]]; then
    echo "usage: $0 /path/to/Megatron-LM   (the folder holding pretrain_gpt.py)" >&2
    exit 2
fi
checkout=$(cd "$1" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

commit=$(git -C "$checkout" rev-parse HEAD 2>/dev/null || echo "not a git checkout")
# Prints "<in-tree version> <in range: yes|no|unknown> <tested range>".
# Run from this folder, not the checkout: a checkout's .python-version may pick another Python.
read -r version in_range tested < <(cd "$here" && "${PYTHON:-python3}" - "$checkout" "$here/.." 2>/dev/null <<'EOF'
import runpy, sys
found = runpy.run_path(f"{sys.argv[1]}/megatron/core/package_info.py").get("__version__", "?")
try:
    sys.path.append(sys.argv[2])
    from packaging.version import Version
    from megatron_domino.version import TESTED_MEGATRON_CORE
    low, high = TESTED_MEGATRON_CORE
except Exception:
    print(found, "unknown", "?")
else:
    ok = low <= Version(found) < high
    print(found, "yes" if ok else "no", f">={low},<{high}")
EOF
)
echo "Megatron-LM at $checkout"
echo "  commit: $commit"
echo "  megatron-core in the tree: ${version:-unknown} (megatron-domino runs on ${tested:-?})"

applies=0
shopt -s nullglob
for patch in "$here"/*.patch; do
    name=$(basename "$patch")
    if (cd "$checkout" && git apply --check "$patch" 2>/dev/null); then
        echo "APPLIES          $name"
        applies=1
    elif (cd "$checkout" && git apply --check --reverse "$patch" 2>/dev/null); then
        echo "ALREADY APPLIED  $name"
        applies=1
    else
        echo "DOES NOT APPLY   $name"
        (cd "$checkout" && git apply --check "$patch" 2>&1 | sed 's/^/                 /')
    fi
done

case "${in_range:-unknown}" in
    yes) [[ $applies == 1 ]] && exit 0 ;;
    no) echo "WARNING: megatron-domino refuses megatron-core $version at run time" \
             "(tested $tested), even where a patch applies." ;;
    *) echo "WARNING: could not read megatron-domino's tested Megatron-Core range" \
            "(pip install megatron-domino); the version was not checked." ;;
esac
exit 1
