#!/usr/bin/env bash
# Every GPU check of the Triton kernels in one run on a CUDA host
# (at most ~9 minutes; docs/kernels.md, "Running them on your CUDA host"): kernel parity on CUDA (bf16 included),
# the end-to-end training check, the inductor check of the kernels as custom operators, compiled decoding
# (default and CUDA graphs) against eager and ~3 minutes of the
# benchmark grid. Each step has its own time limit, so a slow step cannot starve the others; everything written
# so far is kept. It writes 7 files into $OUT
# (default runs/gpu_checks): gpu.txt, parity.txt, e2e.txt, kernel_e2e.json, bench.txt, benchmarks.md and its .jsonl.
#
#   python scripts/gpu_wheels.py               # only for a host without a package index: wheels into .whl/
#   OUT=/tmp/x bash scripts/gpu_checks.sh      # on the CUDA host (with .whl/ if made); then copy $OUT/benchmarks.md's kernel section
#                                              # and $OUT/benchmarks.kernels.jsonl into docs/ (the grid resumes there)
#   QUICK=1 ...                                # bench_kernels --quick instead of the next share of the full grid
#   CPU=1 OUT=/tmp/x bash scripts/gpu_checks.sh  # a rehearsal here: Triton's interpreter, tiny sizes
set -u
OUT=${OUT:-runs/gpu_checks}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # xfam from this checkout (whether or not it is pip-installed)
if ! $PY -c "import hydra, omegaconf, datasets" 2> /dev/null; then  # a host without an index: from .whl (gpu_wheels.py)
    ls .whl/*.whl > /dev/null 2>&1 || { echo "hydra/datasets missing and no .whl/: run scripts/gpu_wheels.py, carry .whl"; exit 1; }
    # The folder's name must contain "site-packages": dill (datasets' fingerprints) pickles any module outside
    # such a folder or sys.prefix by value, and fails on pyarrow's types.
    SITE=${SITE:-/tmp/xfam/site-packages}
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        > "$OUT/gpu.txt" 2>&1 || { echo "installing .whl failed"; cat "$OUT/gpu.txt"; exit 1; }
    export PYTHONPATH=$SITE:$PYTHONPATH
fi
{ if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
  $PY -c "import torch, triton, lightning, hydra, datasets; print('python', __import__('sys').version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'lightning', lightning.__version__, 'hydra',
hydra.__version__, 'datasets', datasets.__version__)" 2>&1; } >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
# Step limits sized for an H100/H200; the CPU rehearsal's interpreter is slower (the parity tests alone ~2 min).
if [ "${CPU:-0}" = "1" ]; then INTERPRET=--interpret SCALE=4; else INTERPRET= SCALE=1; fi
# Parallel test processes compile kernels side by side (pytest-xdist, where installed).
if $PY -c "import xdist" 2> /dev/null; then XDIST="-n 8"; else XDIST=; fi
[ -n "$INTERPRET" ] && XDIST=

echo "== kernel parity (fp32, fp16; bf16 on CUDA) =="
timeout $((120 * SCALE)) $PY -m pytest tests/kernels -q -p no:cacheprovider -m "not slow" $XDIST > "$OUT/parity.txt" 2>&1
echo "parity exit $?" | tee -a "$OUT/parity.txt"; tail -4 "$OUT/parity.txt"

echo "== end to end: 200 steps, attention=vanilla pos=alibi, kernel vs SDPA =="
timeout $((170 * SCALE)) $PY scripts/kernel_e2e.py $INTERPRET --out /tmp/xfam_e2e > "$OUT/e2e.txt" 2>&1
echo "e2e exit $?" | tee -a "$OUT/e2e.txt"; tail -5 "$OUT/e2e.txt"
cp /tmp/xfam_e2e/kernel_e2e.json "$OUT/" 2> /dev/null

echo "== inductor: a model on each kernel compiled (torch.compile, custom ops) vs eager (appended to e2e.txt) =="
# Without CUDA (the CPU rehearsal included) it says so and exits 0: inductor's Triton code needs a GPU.
timeout $((150 * SCALE)) $PY - >> "$OUT/e2e.txt" 2>&1 << 'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    print("inductor check skipped: no CUDA device"); sys.exit(0)
from xfam.model.build import build_model
from xfam.training.lit.compile import dynamo_settings
dynamo_settings()
cases = {  # each kernel at least once: flash attention, its T5 bias, the linear-attention kernel, fused RoPE
    "flash+rope": ({"name": "vanilla", "backend": "triton"}, {"name": "rope", "backend": "triton"}),
    "flash+t5": ({"name": "vanilla", "backend": "triton"}, {"name": "t5"}),
    "linear+alibi": ({"name": "performer", "backend": "triton", "redraw_every": None}, {"name": "alibi"}),
}
bad = 0
for name, (attn, pos) in cases.items():
    cfg = {"model": {"name": "g", "dim": 128, "layers": 2, "heads": 2, "max_len": 256}, "attention": attn,
           "pos": pos, "memory": {"name": "none"}, "exit": {"name": "none"}}
    torch.manual_seed(0)
    model = build_model(cfg, {"task": "lm", "vocab_size": 256}).cuda().train()
    ids = torch.randint(0, 256, (4, 256), device="cuda")
    def loss_grads(call):
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(call(ids).logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        return loss.detach(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids)
    eager_loss, eager_grads = loss_grads(model)
    compiled = torch.compile(model)
    loss_grads(compiled)  # compiles
    loss, grads = loss_grads(compiled)
    err = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(grads, eager_grads))
    ok = abs(loss.item() - eager_loss.item()) <= 1e-4 * abs(eager_loss.item()) and err <= 1e-3
    bad += not ok
    print(f"{name}: graphs {explained.graph_count} breaks {explained.graph_break_count}; loss eager "
          f"{eager_loss.item():.6f} compiled {loss.item():.6f}; max relative gradient error {err:.2e} "
          f"{'OK' if ok else 'MISMATCH'}")
sys.exit(1 if bad else 0)
PYEOF
echo "inductor exit $?" | tee -a "$OUT/e2e.txt"; tail -4 "$OUT/e2e.txt"

echo "== decoding: the compiled fixed-shape step (default and CUDA graphs) vs eager (appended to e2e.txt) =="
timeout $((120 * SCALE)) $PY - >> "$OUT/e2e.txt" 2>&1 << 'PYEOF'
import sys, time, torch
if not torch.cuda.is_available():
    print("decoding check skipped: no CUDA device"); sys.exit(0)
from xfam.eval.generate import generate
from xfam.model.build import build_model
cfg = {"model": {"name": "g", "dim": 256, "layers": 4, "heads": 4, "max_len": 4096, "dropout": 0.0},
       "attention": {"name": "vanilla"}, "pos": {"name": "rope"}, "memory": {"name": "none"}, "exit": {"name": "none"}}
torch.manual_seed(0)
model = build_model(cfg, {"task": "lm", "vocab_size": 256}).cuda().eval()
prompt = torch.randint(0, 256, (1, 256), device="cuda")
bad = 0
eager = generate(model, prompt, 256, temperature=0, decoder="eager")
for mode in ("default", "reduce-overhead"):
    kw = dict(temperature=0, decoder="compiled", compile_mode=None if mode == "default" else mode)
    generate(model, prompt, 256, **kw)  # compiles
    torch.cuda.synchronize(); start = time.perf_counter()
    got = generate(model, prompt, 256, **kw)
    torch.cuda.synchronize(); seconds = time.perf_counter() - start
    ok = torch.equal(got.tokens, eager.tokens) and torch.allclose(got.logits, eager.logits, atol=1e-4)
    bad += not ok
    print(f"decode {mode}: {256 / seconds:,.0f} new tokens/s at batch 1; greedy tokens and logits vs eager "
          f"{'OK' if ok else 'MISMATCH'}")
torch.cuda.synchronize(); start = time.perf_counter()
generate(model, prompt, 256, temperature=0, decoder="eager")
torch.cuda.synchronize(); print(f"decode eager: {256 / (time.perf_counter() - start):,.0f} new tokens/s at batch 1")
sys.exit(1 if bad else 0)
PYEOF
echo "decoding exit $?" | tee -a "$OUT/e2e.txt"; tail -4 "$OUT/e2e.txt"

echo "== benchmark =="
# --resume: the grid's measurements already in docs/ (docs/benchmarks.kernels.jsonl) are kept and only the rest
# runs, so successive runs fill the whole grid between them.
cp docs/benchmarks.md "$OUT/benchmarks.md"
[ -f docs/benchmarks.kernels.jsonl ] && cp docs/benchmarks.kernels.jsonl "$OUT/benchmarks.kernels.jsonl"
if [ -n "$INTERPRET" ]; then ARGS="--interpret --lengths 48"
elif [ "${QUICK:-0}" = "1" ]; then ARGS="--quick --budget-s 190"
else ARGS="--resume --budget-s 190"; fi
timeout $((240 * SCALE)) $PY scripts/bench_kernels.py $ARGS --out "$OUT/benchmarks.md" > "$OUT/bench.txt" 2>&1
echo "bench exit $?" | tee -a "$OUT/bench.txt"; tail -5 "$OUT/bench.txt"
