#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA device: the gpu-marked tests, then `bench swap` on a
# GPT-3 preset under a budget smaller than the model. About 5 minutes; writes to $OUT when set.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/atom-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if ! $PY -c "import atomtrain" 2>/dev/null; then
    $PY -m pip install --quiet --no-deps -e . || $PY -m pip install --quiet -e .
fi
$PY - <<'PY' | tee "$OUT/gpu.txt"
import torch
print("cuda:", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
timeout 180 $PY -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.txt"
# gpt3-1.3b: 1.3B parameters, 5.3 GB in fp32 (21 GB with gradients and AdamW state): an 4 GB
# budget holds a few blocks at a time.
timeout 240 $PY -m atomtrain.cli.main bench swap --json --preset gpt3-1.3b --n-layer 24 \
    --n-embd 2048 --n-head 32 --seq-len 1024 --rows 4 --rounds 3 --steps-per-round 2 \
    --device cuda --device-memory 4GB 2>&1 | tee "$OUT/bench_swap.json"
