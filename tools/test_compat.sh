#!/usr/bin/env bash
# Installs a built wheel into a fresh virtual environment with a given torch,
# then runs the CPU tests that touch torch against that installation.
#
#   tools/test_compat.sh NAME WHEEL 'PIP REQUIREMENTS...' [PYTEST ARGS...]
#
# WHEEL may be `tree`: the environment then imports the package from this
# source tree (a .pth file; its extension is the one `make setup` built,
# which is abi3, so any torch's Python takes it) and the tests run in the
# tree itself. That is what CI's torch leg does: no second release build.
#
# COMPAT_REUSE=1 keeps an existing environment of that NAME and reinstalls
# only the wheel (for iterating on a fix); by default it is made afresh.
# COMPAT_SETUP_ONLY=1 stops once the environment is ready (no tests).
#
# The tests run from a staging copy holding the tests and the files they read
# (README, docs, examples, demo, tools, benches, the config source the variable-table
# test parses, the tool scripts), but no `tiacc_training/__init__.py`: the
# package imported is the one the wheel installed, never the source tree.
set -euo pipefail
name=$1 wheel=$2 requirements=$3
shift 3
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${COMPAT_DIR:-$repo/.compat}
venv=$root/$name
stage=$root/$name-stage
python=${COMPAT_PYTHON:-python3}

start=$SECONDS
rm -rf "$stage"
package=$wheel
[ "$wheel" = tree ] && package=
if [ "${COMPAT_REUSE:-0}" = 1 ] && [ -x "$venv/bin/python" ]; then
    # Iterating on a fix: keep the environment, replace only the wheel.
    [ -n "$package" ] && "$venv/bin/pip" install -q --force-reinstall --no-deps "$package"
else
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    # shellcheck disable=SC2086  # the requirements are one word each on purpose
    "$venv/bin/pip" install -q $requirements pillow tqdm pytest pytest-timeout $package
fi
echo "[$name] venv ready in $((SECONDS - start)) s"
[ "${COMPAT_SETUP_ONLY:-0}" = 1 ] && exit 0

if [ "$wheel" = tree ]; then
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$repo" >"$site/tiacc_training_tree.pth"
    cd "$repo"
    "$venv/bin/python" -c 'import sys, torch, tiacc_training
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"tiacc_training {tiacc_training.__version__} from {tiacc_training.__file__}")'
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
    echo "[$name] done in $((SECONDS - start)) s"
    exit 0
fi

mkdir -p "$stage/rust/tiacc-core/src/config" "$stage/tiacc_training/tools"
cd "$repo"
for path in tests README.md docs examples demo tools benches pyproject.toml; do
    [ -e "$path" ] && cp -r "$path" "$stage/"
done
cp rust/tiacc-core/src/config/mod.rs "$stage/rust/tiacc-core/src/config/"
find tiacc_training/tools -maxdepth 1 -name '*.py' ! -name '__init__.py' \
    -exec cp {} "$stage/tiacc_training/tools/" \;
find "$stage" -name __pycache__ -prune -exec rm -rf {} +

cd "$stage"
"$venv/bin/python" - <<'PY'
import sys

import tiacc_training
import torch
import torchvision

where = tiacc_training.__file__
assert "site-packages" in where, f"tiacc_training imported from {where}, not the wheel"
print(
    f"python {sys.version.split()[0]}, torch {torch.__version__}, "
    f"torchvision {torchvision.__version__}, tiacc_training {tiacc_training.__version__} "
    f"from {where}"
)
PY
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
echo "[$name] done in $((SECONDS - start)) s"
