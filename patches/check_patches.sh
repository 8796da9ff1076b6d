#!/usr/bin/env bash
# Report whether the patches in this folder apply to Megatron-LM, and whether megatron-domino
# accepts the Megatron-Core release that comes with it. Changes nothing anywhere.
#
#   patches/check_patches.sh /path/to/Megatron-LM              # one checkout
#   patches/check_patches.sh --mirror GIT_DIR                  # every ref the patches list
#   patches/check_patches.sh --mirror GIT_DIR REF [REF...]     # these refs instead
#
# A checkout: `git apply --check` in it (and, when that fails, `git apply --check --reverse`
# to tell "already applied" from "does not apply"). Exit status: 0 when a patch applies (or is
# already applied) and megatron-domino accepts the checkout's Megatron-Core, 1 otherwise.
#
# --mirror: a git directory holding NVIDIA/Megatron-LM (a bare clone or mirror is enough).
# For each ref, the files a patch touches are read from that ref into a temporary folder and
# checked there. Without REFs, the refs are the ones each patch's header lists (lines
# "  REF  COMMIT  applies|does not apply  ..."); a result that differs from the recorded one,
# or a ref that moved off the recorded commit, is reported. Exit status: 0 when every listed
# ref gives its recorded result (with REFs: when each has a patch that applies and a release
# megatron-domino accepts), 1 otherwise.
#
# Exit status 2: a usage error. The tested range is read from megatron_domino.base.version (the
# installed megatron-domino, else this repository's); PYTHON (default python3, which needs
# `packaging`) reads it and the in-tree version (megatron/core/package_info.py).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage() {
    sed -n '5,7p' "${BASH_SOURCE[0]}" | sed 's/^# */usage: /' >&2
    exit 2
}

# "<version> <accepted: yes|no|unknown> <tested range>" for a package_info.py file.
# Run from this folder: a checkout's .python-version may pick another Python.
version_of() {
    (cd "$here" && NO_VCS_VERSION=1 "${PYTHON:-python3}" - "$1" "$here/.." 2>/dev/null <<'EOF'
import runpy, sys
found = runpy.run_path(sys.argv[1]).get("__version__", "?")
try:
    sys.path.append(sys.argv[2])
    from packaging.version import Version
    from megatron_domino.base.version import TESTED_MEGATRON_CORE
except Exception:
    print(found, "unknown", "?")
else:
    try:
        accepted = Version(Version(found).public) in TESTED_MEGATRON_CORE
    except Exception:
        accepted = False
    print(found, "yes" if accepted else "no", str(TESTED_MEGATRON_CORE).replace(" ", ""))
EOF
    ) || echo "? unknown ?"
}

accepts_text() {
    case $1 in
        yes) echo "megatron-domino accepts it ($2)" ;;
        no) echo "megatron-domino REFUSES it at run time ($2)" ;;
        *) echo "megatron-domino's tested range unreadable (pip install megatron-domino, packaging)" ;;
    esac
}

# Prints APPLIES / ALREADY APPLIED / DOES NOT APPLY (+ git's reason) for $2 in folder $1;
# returns 0 for the first two.
check_one() {
    local dir=$1 patch=$2 name
    name=$(basename "$patch")
    if (cd "$dir" && git apply --check "$patch" 2>/dev/null); then
        echo "  APPLIES          $name"
    elif (cd "$dir" && git apply --check --reverse "$patch" 2>/dev/null); then
        echo "  ALREADY APPLIED  $name"
    else
        echo "  DOES NOT APPLY   $name"
        (cd "$dir" && git apply --check "$patch" 2>&1 | sed 's/^/                   /')
        return 1
    fi
}

shopt -s nullglob
patches=("$here"/*.patch)
[[ ${#patches[@]} -gt 0 ]] || { echo "no *.patch in $here" >&2; exit 2; }

# ---------------------------------------------------------------- one checkout
if [[ ${1:-} != --mirror ]]; then
    [[ $# -eq 1 && -f "$1/pretrain_gpt.py" ]] || usage
    checkout=$(cd "$1" && pwd)
    commit=$(git -C "$checkout" rev-parse HEAD 2>/dev/null || echo "not a git checkout")
    read -r version accepted tested < <(version_of "$checkout/megatron/core/package_info.py")
    echo "Megatron-LM at $checkout"
    echo "  commit: $commit"
    echo "  megatron-core in the tree: $version; $(accepts_text "$accepted" "$tested")"
    applies=0
    for patch in "${patches[@]}"; do
        check_one "$checkout" "$patch" && applies=1
    done
    [[ $applies == 1 && $accepted == yes ]] && exit 0
    exit 1
fi

# ---------------------------------------------------------------- refs of a git directory
[[ $# -ge 2 ]] || usage
gitdir=$2
shift 2
git --git-dir="$gitdir" rev-parse --git-dir >/dev/null 2>&1 || {
    echo "$gitdir is not a git directory" >&2
    exit 2
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Checks one ref against the given patches; with an expectation (one patch), compares.
# Returns 1 on a mismatch, or without an expectation when no patch applies or the release
# is refused.
check_ref() {
    local ref=$1 recorded=$2 expected=$3 commit version accepted tested applies=0 got
    shift 3
    commit=$(git --git-dir="$gitdir" rev-parse --verify -q "$ref^{commit}") || {
        echo "$ref: not in $gitdir"
        return 1
    }
    rm -rf "$work/tree" && mkdir -p "$work/tree"
    git --git-dir="$gitdir" show "$commit:megatron/core/package_info.py" \
        >"$work/package_info.py" 2>/dev/null
    read -r version accepted tested < <(version_of "$work/package_info.py")
    echo "$ref  ${commit:0:12}  megatron-core $version; $(accepts_text "$accepted" "$tested")"
    if [[ $recorded != - && $recorded != "$commit" ]]; then
        echo "  NOTE: the patch header records commit ${recorded:0:12}; $ref has moved since"
    fi
    for patch in "$@"; do
        # the files the patch touches, as they are at this ref
        while read -r _ _ path; do
            mkdir -p "$work/tree/$(dirname "$path")"
            git --git-dir="$gitdir" show "$commit:$path" >"$work/tree/$path" 2>/dev/null \
                || rm -f "$work/tree/$path"
        done < <(cd "$work" && git apply --numstat "$patch") # not in a repo: all paths
        check_one "$work/tree" "$patch" && applies=1
    done
    if [[ $expected == - ]]; then
        [[ $applies == 1 && $accepted == yes ]]
        return
    fi
    got=$([[ $applies == 1 ]] && echo applies || echo "does not apply")
    if [[ $got != "$expected" ]]; then
        echo "  MISMATCH: the header of $(basename "$1") records '$expected' for $ref"
        return 1
    fi
}

status=0
if [[ $# -gt 0 ]]; then
    for ref in "$@"; do
        check_ref "$ref" - - "${patches[@]}" || status=1
    done
    exit $status
fi
for patch in "${patches[@]}"; do
    listed=$(sed -n -E 's/^  ([^ ]+) +([0-9a-f]{40}) +(applies|does not apply)( .*)?$/\1 \2 \3/p' \
        "$patch")
    [[ -n $listed ]] || { echo "$(basename "$patch") lists no refs" >&2; exit 2; }
    echo "== $(basename "$patch")"
    while read -r ref recorded expected; do
        check_ref "$ref" "$recorded" "$expected" "$patch" || status=1
    done <<<"$listed"
done
[[ $status == 0 ]] && echo "every listed ref gives the recorded result"
exit $status
