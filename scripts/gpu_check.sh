#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA device: the gpu-marked tests (allocated memory within
# the budget with another process on the device), then `bench swap` on a GPT-3-shaped model under
# a budget of 40% of what resident training needs, asserting its figures. Writes to $OUT when set.
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
timeout 240 $PY -m pytest -q -s -m gpu tests 2>&1 | tee "$OUT/gpu_tests.txt"
# 24 layers of a GPT-3 1.3B shape, 1024 tokens x 4 rows: the plan must offload or recompute.
timeout 300 $PY -m atomtrain.cli.main bench swap --json --preset gpt3-1.3b --n-layer 24 \
    --n-embd 2048 --n-head 32 --seq-len 1024 --rows 4 --rounds 2 --steps-per-round 2 \
    --device cuda --budget-fraction 0.4 > "$OUT/bench_swap.json"
cat "$OUT/bench_swap.json"
$PY - "$OUT/bench_swap.json" <<'PY' | tee "$OUT/assertions.txt"
import json, sys
r = json.load(open(sys.argv[1]))
checks = {
    "accounted peak within budget": r["peak_device_bytes"] <= r["budget_bytes"],
    "allocated peak within budget": r["cuda_max_allocated_bytes"] <= r["budget_bytes"],
    "budget at most 40% of the need": r["budget_bytes"] <= 0.4 * r["resident_need_bytes"] + 1,
    "offload or recompute in the plan": r["policies"]["offload"] + r["policies"]["recompute"] > 0,
    "gradients match resident": r["max_rel_grad_diff"] <= 1e-3,
}
for name, ok in checks.items():
    print(("PASS " if ok else "FAIL ") + name)
print("ratio", r["ratio"], "overlap_fraction", r["overlap_fraction"])
sys.exit(0 if all(checks.values()) else 1)
PY
