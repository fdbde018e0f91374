#!/usr/bin/env bash
# (Re)create the virtual environment of one test leg: <repo>/.venvs/LEG.
#
#   tests/envs/build.sh LEG            build .venvs/LEG from tests/envs/LEG.txt (skipped when up to date)
#   tests/envs/build.sh LEG --force    rebuild even when up to date
#   tests/envs/build.sh LEG --repin    rebuild from the top-level choices in tests/envs/LEG.in and
#                                      rewrite tests/envs/LEG.txt with every installed version
#   tests/envs/build.sh --list         the legs and their interpreters
#
# Legs (interpreter, what it proves):
#   latest          3.11  newest numpy 2.x, torch 2.13, paddle 3.3, transformers + paddleformers
#                         --no-deps (numpy stays 2.x)
#   paddleformers   3.11  the ordinary paddle user's install: paddleformers with its dependencies,
#                         so numpy stays at 1.26.4 (fast_dataindex pins it); MindSpore 2.10; Ray
#                         (the project's ray extra: the sharded comparator)
#   oldest          3.10  the lowest versions twinstep claims (MindSpore 2.7)
#   newest-python   3.13  the newest Python that torch and paddle ship wheels for
#
# Every install runs with `-c LEG.txt` (pip constraints), so nothing can drift: a version
# changes only by editing LEG.in and running --repin.  .venvs/LEG/.twinstep-stamp holds the
# sha256 of LEG.txt, this leg's recipe and the interpreter version; a matching stamp means
# "up to date" and the build is skipped.
#
# Needs only an interpreter of the leg's Python version and a package index:
#   - $PYENV_ROOT/versions/X.Y.*/bin/python (newest patch), else pythonX.Y on PATH;
#     TWINSTEP_PYTHON overrides both.
#   - pip's own configuration (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_CACHE_DIR, ...).  torch
#     from PyPI is the CUDA build (~3 GB of nvidia-* wheels, which work on CPU too); to get
#     the CPU wheel, set TWINSTEP_TORCH_INDEX to an index that serves it, or put the
#     wheel in a PIP_FIND_LINKS folder.  LEG.txt pins torch==X.Y.Z without "+cpu", so both
#     builds satisfy it.
#   - TWINSTEP_VENVS: where the environments go (default <repo>/.venvs).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venvs=${TWINSTEP_VENVS:-$root/.venvs}

legs="latest paddleformers oldest newest-python"

python_of() {  # the Python minor version of a leg
    case $1 in
        latest|paddleformers) echo 3.11 ;;
        oldest) echo 3.10 ;;
        newest-python) echo 3.13 ;;
        *) return 1 ;;
    esac
}

project_extras() {  # the project's extras beyond the test extra, per leg
    case $leg in
        paddleformers) echo "[ray]" ;;  # the sharded comparator's tests run in this leg only
        *) echo "" ;;
    esac
}

recipe() {  # the leg's installs before the project itself; "$@" are pip's constraint options
    case $leg in
        latest)
            # the real-port test bed: paddleformers' modeling code needs only transformers and four
            # small modules; its full dependencies (~80 packages) would pin numpy to 1.26.4
            pip_install "$@" numpy torch paddlepaddle transformers colorlog aistudio-sdk ml_dtypes omegaconf
            pip_install "$@" --no-deps paddleformers ;;
        paddleformers)
            # what a paddle user types; its dependencies bring numpy 1.26.4 (and MindSpore, numpy 1.x only)
            pip_install "$@" torch paddlepaddle paddleformers transformers mindspore ;;
        oldest)
            pip_install "$@" numpy torch paddlepaddle mindspore grpcio protobuf zstandard numba pyyaml ;;
        newest-python)
            pip_install "$@" numpy torch paddlepaddle grpcio protobuf zstandard numba pyyaml ;;
    esac
}

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 1 ] || usage
if [ "$1" = --list ]; then
    for l in $legs; do echo "$l python$(python_of "$l")"; done
    exit 0
fi
leg=$1; mode=${2:-}
python_of "$leg" >/dev/null || { echo "unknown leg '$leg' (legs: $legs)" >&2; exit 2; }
case $mode in ""|--force|--repin) ;; *) usage ;; esac

pins=$here/$leg.txt
seed=$here/$leg.in
venv=$venvs/$leg
stamp=$venv/.twinstep-stamp

# --- the interpreter --------------------------------------------------------------------
want=$(python_of "$leg")
py=${TWINSTEP_PYTHON:-}
if [ -z "$py" ]; then
    pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
    best=$(ls -d "$pyenv_root/versions/$want".* 2>/dev/null | grep -E "/$want\.[0-9]+$" | sort -V | tail -n 1 || true)
    if [ -n "$best" ] && [ -x "$best/bin/python" ]; then
        py=$best/bin/python
    elif command -v "python$want" >/dev/null 2>&1; then
        py=$(command -v "python$want")
    else
        echo "no Python $want: install it (pyenv install $want) or set TWINSTEP_PYTHON" >&2; exit 1
    fi
fi
pyver=$("$py" -c 'import platform; print(platform.python_version())')
case $pyver in "$want".*) ;; *) echo "$py is Python $pyver, leg '$leg' needs $want" >&2; exit 1 ;; esac

# --- up to date? ------------------------------------------------------------------------
if [ "$mode" = --repin ]; then
    [ -f "$seed" ] || { echo "missing $seed" >&2; exit 1; }
else
    [ -f "$pins" ] || { echo "missing $pins (create it with: $0 $leg --repin)" >&2; exit 1; }
fi
hash_of() {  # the stamp: constraints, recipe, the project's declared dependencies, interpreter
    { cat "$1"; declare -f recipe; cat "$root/pyproject.toml"; echo "python $pyver"; } | sha256sum | cut -d' ' -f1
}
if [ -z "$mode" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(hash_of "$pins")" ]; then
    echo "$leg: $venv is up to date (python $pyver, $(basename "$pins"))"
    exit 0
fi

# --- build ------------------------------------------------------------------------------
start=$(date +%s)
rm -rf "$venv"
mkdir -p "$venvs"
free_disk() { df -h "$venvs" | awk 'NR == 2 { print $4 " free on " $6 }'; }
echo "$leg: building $venv with $py ($pyver); $(free_disk)"
"$py" -m venv "$venv"
vpy=$venv/bin/python

extra=()
[ -n "${TWINSTEP_TORCH_INDEX:-}" ] && extra=(--extra-index-url "$TWINSTEP_TORCH_INDEX")
# pip's wheel cache would hold a second copy of every download (torch's CUDA wheels alone are ~3 GB a
# leg) on the disk the environments need; the pins change rarely, so a rebuild downloads again.
# Set PIP_CACHE_DIR to keep a cache anyway.
[ -n "${PIP_CACHE_DIR:-}" ] || export PIP_NO_CACHE_DIR=1
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-10}  # a GB wheel cut off mid-way resumes (pip >= 25.1)
pip_install() {  # three tries: a dropped connection should not cost the leg
    local try
    for try in 1 2 3; do
        "$vpy" -m pip install --disable-pip-version-check ${extra[@]+"${extra[@]}"} "$@" && return 0
        echo "$leg: pip install failed (try $try of 3; $(free_disk))" >&2
        [ "$try" -lt 3 ] && sleep $((try * 15))
    done
    return 1
}

if [ "$mode" = --repin ]; then cons=$seed; else cons=$pins; fi
export PIP_CONSTRAINT=$cons  # the editable build's isolated environment obeys it too

pip_install -c "$cons" --upgrade pip setuptools
recipe -c "$cons"
# The project, editable, with its test extra minus the frameworks (the recipe chose those).
mapfile -t test_reqs < <("$vpy" - "$root/pyproject.toml" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
for spec in extras["test"]:
    if not spec.replace(" ", "").startswith("twinstep["):
        print(spec)
EOF
)
pip_install -c "$cons" -e "$root$(project_extras)" "${test_reqs[@]}"

frozen=$("$vpy" -m pip freeze --all --exclude-editable --disable-pip-version-check | sed 's/+[A-Za-z0-9.]*$//' | LC_ALL=C sort -f)
if [ "$mode" = --repin ]; then
    {
        echo "# Leg '$leg': every version installed in .venvs/$leg (Python $pyver)."
        echo "# Generated by: tests/envs/build.sh $leg --repin (from $leg.in). Edit $leg.in, not this file."
        echo "$frozen"
    } > "$pins"
    echo "$leg: wrote $pins"
fi

# Drift check: everything installed is pinned at the pinned version.
norm() { awk -F'==' 'NF == 2 { n = tolower($1); gsub(/[._]/, "-", n); print n "==" $2 }'; }
missing=$(comm -23 <(echo "$frozen" | norm | sort -u) \
                   <(grep -v '^#' "$pins" | sed 's/[[:space:]]*#.*//; /^$/d' | norm | sort -u) \
          | grep -v -E '^(nvidia-|triton==|cuda-)' || true)  # torch's CUDA wheel pins these itself
if [ -n "$missing" ]; then
    echo "$leg: WARNING: installed but not as pinned in $(basename "$pins"):" >&2
    echo "$missing" | sed 's/^/    /' >&2
fi
"$vpy" -m pip check --disable-pip-version-check || echo "$leg: (pip check complaints above; the latest leg installs paddleformers --no-deps on purpose)"

hash_of "$pins" > "$stamp"
elapsed=$(( $(date +%s) - start ))
size=$(du -sh "$venv" | cut -f1)
echo "$leg: built in ${elapsed}s, $size, python $pyver; $(free_disk)"
"$vpy" - <<'EOF'
from importlib.metadata import version, PackageNotFoundError
out = []
for name in ("numpy", "torch", "paddlepaddle", "mindspore", "grpcio", "protobuf", "zstandard", "numba", "pyyaml",
             "transformers", "paddleformers"):
    try:
        out.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
print("  " + " ".join(out))
EOF
