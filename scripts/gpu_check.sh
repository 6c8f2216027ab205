#!/usr/bin/env bash
# Everything that needs a GPU, in one command under 9 minutes: see scripts/gpu_check.py. Runs
# with the machine's own python3 (torch with CUDA, transformers; no Ray, no virtual environment
# needed); PY=... picks another interpreter, OUT=... the output folder (default out/gpu).
#   bash scripts/gpu_check.sh [--results-md bench/RESULTS.md]
#   bash scripts/gpu_check.sh --dry-run      # every section on the CPU, tiny sizes
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PY:-python3}" scripts/gpu_check.py --out "${OUT:-out/gpu}" "$@"
