#!/usr/bin/env bash
# Everything that needs a GPU, in one go, for a lent GPU machine (never needed by CI): the
# `gpu`-marked tests, then the copy/compute overlap benchmark (prefetch on a side stream vs UVA
# zero-copy vs resident) and the host-to-device bandwidths, then batched generation on one GPU. Output goes to $OUT (default out/gpu)
# as text and JSON, to be copied into bench/RESULTS.md.
#   bash scripts/gpu_check.sh            # after `make .venv/.installed` (pip keeps a CUDA torch)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
status=0
timeout 300 "$PY" -m pytest -m gpu -v -rA tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.txt" || status=1
timeout 240 "$PY" bench/prefetch_overlap.py --json "$OUT/overlap.json" 2>&1 | tee "$OUT/overlap.txt" || status=1
# Continuous batching with real host-to-device copies: one GPU, N = 1, 8, 16 (the 2-stage and
# stall sections need more GPUs or time than a lent machine gives; last, so it cannot cost the
# runs above their time).
timeout 240 "$PY" bench/batching.py --stages 1 --batches 1,8,16 --repeats 2 --no-stall --json "$OUT/batching.json" \
    2>&1 | tee "$OUT/batching.txt" || status=1
# The throughput planner's prediction against what one GPU delivers, and the runtime overhead
# per stage step that would make it exact (the planner's default was calibrated on CPUs).
timeout 200 "$PY" bench/policy.py --stages 1 --batches 1,8,32 --repeats 1 --json "$OUT/policy.json" \
    2>&1 | tee "$OUT/policy.txt" || status=1
exit $status
