#!/usr/bin/env bash
# The suite under other torch and transformers releases than constraints/cpu.txt pins: how the
# floors in pyproject.toml were found (bench/RESULTS.md, "torch and transformers releases").
# Makes a virtual environment of its own, installs the project there with the two releases
# pinned, and runs the whole suite from this checkout; nothing of .venv is touched.
#   bash scripts/try_releases.sh TORCH TRANSFORMERS [DIR] [pytest arguments...]
#   bash scripts/try_releases.sh 2.11.0 5.21.0 /tmp/v-2.11-5.21
#   bash scripts/try_releases.sh 2.11.0 5.20.0 /tmp/v-2.11-5.20 tests/test_generation.py
# A torch from PyPI is its CUDA build (about 3 GB with its CUDA libraries); without a GPU it
# runs on the CPU, as the CPU build does. The installed package is an editable one of this
# checkout, so `offloadctl` is there for the tests that start it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
torch_version=$1 transformers_version=$2
dir=${3:-/tmp/offload-releases-$torch_version-$transformers_version}
shift $(($# < 3 ? $# : 3))
python=${PYTHON:-python3}
test -x "$dir/bin/python" || "$python" -m venv "$dir"
pip=("$dir/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$torch_version" -e '.[test]'
# on its own: a release below pyproject's floor is installed anyway (pip warns of the conflict)
"${pip[@]}" "transformers==$transformers_version"
"$dir/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
exec "$dir/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider \
  -q --basetemp="$dir/pytest" "$@"
