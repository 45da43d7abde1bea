#!/usr/bin/env bash
# Every GPU check of the Triton kernels in one run, for a CUDA machine with a short time budget
# (~12 minutes in all): kernel parity on CUDA (bf16 included), the end-to-end training check, and the
# quick benchmark. Results go to $OUT (default runs/gpu_checks); each step has its own time limit, so
# a slow step cannot starve the others, and everything written so far is kept.
#
#   bash scripts/gpu_checks.sh                 # then: copy $OUT/benchmarks.md's kernel section into docs/benchmarks.md
#   OUT=/tmp/x QUICK=0 bash scripts/gpu_checks.sh   # the full benchmark grid instead of --quick
set -u
OUT=${OUT:-runs/gpu_checks}
PY=${PY:-python}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" >> "$OUT/gpu.txt"

echo "== kernel parity on CUDA (fp32, fp16, bf16) =="
timeout 240 $PY -m pytest tests/kernels -q -p no:cacheprovider -x > "$OUT/parity.txt" 2>&1
echo "parity exit $?" | tee -a "$OUT/parity.txt"; tail -3 "$OUT/parity.txt"

echo "== end to end: 200 steps, attention=vanilla pos=alibi, kernel vs SDPA =="
timeout 240 $PY scripts/kernel_e2e.py --out "$OUT/e2e" > "$OUT/e2e.txt" 2>&1
echo "e2e exit $?" | tee -a "$OUT/e2e.txt"; tail -5 "$OUT/e2e.txt"

echo "== benchmark =="
cp docs/benchmarks.md "$OUT/benchmarks.md"
if [ "${QUICK:-1}" = "1" ]; then ARGS="--quick --budget-s 200"; else ARGS="--budget-s 600"; fi
timeout 330 $PY scripts/bench_kernels.py $ARGS --out "$OUT/benchmarks.md" > "$OUT/bench.txt" 2>&1
echo "bench exit $?" | tee -a "$OUT/bench.txt"; tail -5 "$OUT/bench.txt"
