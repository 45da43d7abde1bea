"""Triton kernels against PyTorch SDPA (its flash backend) and FlexAttention (``torch.compile``d), on CUDA.

    python scripts/bench_kernels.py                  # the full grid, bf16, within --budget-s (default 13 min)
    python scripts/bench_kernels.py --quick          # L in {4k, 1k}, head dim 64: a few minutes
    python scripts/bench_kernels.py --resume         # run only what --out's .jsonl lacks (the grid over several runs)
    python scripts/bench_kernels.py --interpret      # CPU, Triton's interpreter, tiny sizes: the script end to end

Cases (attention over L tokens, batch x L = 16k tokens, heads x head dim = 1024):

    causal    plain causal attention (SDPA: is_causal, its flash backend)
    alibi     causal + ALiBi slopes in-kernel (SDPA: an additive [1, H, L, L] bias)
    t5        causal + T5 bucketed bias table looked up in-kernel
    window    causal sliding window of 512
    bigbird   BigBird's block-sparse pattern (xfam's attention=bigbird geometry, window 3, random 3 blocks of
              64; its global rows and columns are left out of every implementation alike)
    linear    chunked causal linear attention (Performer features, m = 256) against xfam's PyTorch chunked path

TFLOP/s count the (query, key) pairs each case allows (a causal square is halved), 4 * Dh FLOPs per pair
forward and 2.5x that backward (FlashAttention's convention), the same count for every implementation.
``linear`` reports milliseconds. Times: median of ``--reps`` CUDA-event timings after ``--warmup`` calls
(the first call of each compiles; compile time is logged, not timed). Every configuration first checks the
Triton output against SDPA's (max abs error in the table). Results are written after every measurement (a
run cut off by its time budget still reports): JSON lines next to the table, and the markdown between the
``bench_kernels`` markers of ``--out`` (docs/benchmarks.md). Targets (H200): plain causal
forward+backward >= 0.9x SDPA; biased, windowed and sparse >= 1.1x FlexAttention.

One file over 400 lines: a GPU host runs it as one script (grid, budget, resume, report), which
scripts/gpu_checks.sh calls as is.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- bench_kernels:start -->", "<!-- bench_kernels:end -->"
CASES = ("causal", "alibi", "t5", "window", "bigbird", "linear")


@dataclasses.dataclass
class Config:
    case: str
    length: int
    head_dim: int
    batch: int
    heads: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="L in {4096, 1024}, head dim 64")
    p.add_argument("--interpret", action="store_true", help="CPU + TRITON_INTERPRET=1 at tiny sizes (a check)")
    p.add_argument("--lengths", type=int, nargs="*", help="default 4096 1024 16384 2048 8192 (in this order)")
    p.add_argument("--head-dims", type=int, nargs="*", help="default 64 128")
    p.add_argument("--cases", nargs="*", choices=CASES, default=list(CASES))
    p.add_argument("--tokens", type=int, default=16384, help="batch x length (default 16k)")
    p.add_argument("--width", type=int, default=1024, help="heads x head dim")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=780.0, help="start no configuration after this many seconds")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md", help="markdown file (markers)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take the most time)")
    p.add_argument("--resume", action="store_true", help="keep the measurements in --out's .jsonl, run the rest")
    args = p.parse_args(argv)
    if args.interpret:
        args.lengths, args.head_dims = args.lengths or [48, 80], args.head_dims or [32]
        args.tokens, args.width, args.warmup, args.reps = 80, 64, 1, 2
    elif args.quick:
        args.lengths, args.head_dims = args.lengths or [4096, 1024], args.head_dims or [64]  # 4k first: a cut run
    args.lengths = args.lengths or [4096, 1024, 16384, 2048, 8192]  # a run cut by its budget still spans L
    args.head_dims = args.head_dims or [64, 128]
    return args


# -- inputs and implementations ------------------------------------------------------------------------


def case_inputs(cfg: Config, device: Any, dtype: Any, block: int) -> dict[str, Any]:
    """The pieces every implementation of one case needs: kernel keyword arguments, FlexAttention's
    score_mod / mask_mod, SDPA's mask, and the number of allowed (query, key) pairs per head."""
    import torch

    from xfam.core.mask import AttnMask
    from xfam.pos.alibi import alibi_slopes
    from xfam.pos.t5 import t5_bucket

    n, h = cfg.length, cfg.heads
    qi, ki = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    out: dict[str, Any] = {"kernel": {"causal": True}, "score_mod": None, "mask_mod": _causal}
    allowed = qi >= ki  # [L, L]
    bias = None  # [H, L, L] for SDPA
    if cfg.case == "alibi":
        slopes = torch.tensor(alibi_slopes(h), device=device)
        out["kernel"]["alibi_slopes"] = slopes
        out["score_mod"] = lambda s, b, hh, q, k: s - slopes[hh] * (q - k).abs()
        bias = -slopes[:, None, None] * (qi - ki).abs()
    elif cfg.case == "t5":
        table = torch.randn(32, h, device=device) * 0.5
        dist = torch.arange(-(n - 1), n, device=device)
        buckets = t5_bucket(dist, True, 32, 128).to(torch.int32)  # [2L - 1]
        out["kernel"] |= {"bias_table": table, "bias_buckets": buckets}
        out["score_mod"] = lambda s, b, hh, q, k: s + table[buckets[q - k + n - 1], hh]
        bias = table[buckets[(qi - ki + n - 1).long()]].permute(2, 0, 1)  # [H, L, L]
    elif cfg.case == "window":
        w = min(512, n // 2)
        out["kernel"]["window"] = w
        out["mask_mod"] = lambda b, hh, q, k: (q >= k) & (q - k < w)
        allowed = allowed & (qi - ki < w)
    elif cfg.case == "bigbird":
        from xfam.attention._sparse.engine import geometry
        from xfam.attention.bigbird import BigBirdPattern

        pattern = BigBirdPattern(
            block=block, window=3, n_global=0, random=3, seed=0, layer=0, heads=h, causal=False, k_len=n
        )
        geo = geometry(pattern, AttnMask(q_len=n, k_len=n), device)
        kb = geo.idx.shape[-1] * block
        ok = geo.ok[..., :kb]  # [Hp, nQ, b, K*b]: the block part
        from xfam.kernels.flash_attention import prepare_layout

        out["kernel"] = {"layout": prepare_layout((geo.idx, ok), block, n, n, False, None), "block": block}
        dense = torch.zeros(ok.shape[0], n, n, dtype=torch.bool, device=device)  # [Hp, L, L]
        keys = (geo.idx[..., :, None] * block + torch.arange(block, device=device)).flatten(-2)  # [Hp, nQ, K*b]
        rows = torch.arange(n, device=device).view(-1, block)  # [nQ, b]
        for hp in range(ok.shape[0]):
            valid = ok[hp] & (keys[hp][:, None, :] < n)  # [nQ, b, K*b]
            qq = rows[:, :, None].expand_as(valid)[valid]
            dense[hp, qq, keys[hp][:, None, :].expand_as(valid)[valid]] = True
        out["mask_mod"] = lambda b, hh, q, k: dense[hh % dense.shape[0], q, k]
        allowed = dense
    if allowed.dim() == 2:
        allowed = allowed[None]
    out["pairs"] = int(allowed.sum()) * (h if allowed.shape[0] == 1 else 1)  # over all heads
    add = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    out["sdpa_mask"] = (add if bias is None else add + bias.to(dtype))[None]  # [1, H|1, L, L]
    out["sdpa_causal"] = cfg.case == "causal"
    return out


def _causal(b: Any, h: Any, q: Any, k: Any) -> Any:
    return q >= k


def implementations(cfg: Config, inp: dict[str, Any], flex: bool, block_mask_size: int) -> dict[str, Callable]:
    """name -> f(q, k, v) for the case."""
    import torch
    import torch.nn.functional as F

    from xfam.kernels.flash_attention import flash_attention

    impls: dict[str, Callable] = {"triton": lambda q, k, v: flash_attention(q, k, v, **inp["kernel"])}
    if inp["sdpa_causal"]:
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=inp["sdpa_mask"])
    if flex:  # compiled on CUDA; eager on CPU (a check of the score and mask functions, not a benchmark)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        cuda = inp["sdpa_mask"].is_cuda
        run = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
        bm = create_block_mask(
            inp["mask_mod"], None, cfg.heads, cfg.length, cfg.length, device=inp["sdpa_mask"].device,
            BLOCK_SIZE=block_mask_size,
        )  # fmt: skip
        impls["flex"] = lambda q, k, v: run(q, k, v, score_mod=inp["score_mod"], block_mask=bm)
    return impls


def linear_implementations(features: int) -> tuple[Callable, dict[str, Callable]]:
    """``make(q, k, v) -> (fq, fk, v)`` and name -> f(fq, fk, v): Performer-style positive features."""
    import torch

    from xfam.attention._linear import causal_sums
    from xfam.kernels.linear_attention import causal_linear_attention

    def make(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
        w = torch.randn(q.shape[-1], features, device=q.device, dtype=q.dtype) / q.shape[-1] ** 0.5
        return torch.exp((q @ w).clamp(max=8)), torch.exp((k @ w).clamp(max=8)), v

    def torch_path(fq: Any, fk: Any, v: Any) -> Any:
        num, den, _ = causal_sums(fq, fk, v, torch.zeros(fk.shape[:-1], device=fk.device, dtype=fk.dtype))
        return num / den[..., None]

    def triton_path(fq: Any, fk: Any, v: Any) -> Any:
        v1 = torch.cat((v, v.new_ones(*v.shape[:-1], 1)), -1)  # the last column gives the denominators
        out, _ = causal_linear_attention(fq, fk, v1)
        return out[..., :-1] / out[..., -1:]

    return make, {"triton": triton_path, "pytorch_chunked": torch_path}


# -- timing ------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], warmup: int, reps: int, cuda: bool) -> tuple[float, float]:
    """(median seconds of ``fn`` after warm-up, seconds of the first call, which compiles)."""
    import torch

    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times), first


def measure(fn: Callable, args: tuple, warmup: int, reps: int, cuda: bool, backward: bool = True) -> dict[str, float]:
    """Forward and forward+backward seconds of ``fn(*args)`` (backward = the difference; NaN without one)."""
    import torch

    leaves = [a.detach().requires_grad_(True) for a in args]
    grad = None

    def fwd() -> Any:
        with torch.no_grad():
            return fn(*args)

    def fwd_bwd() -> None:
        nonlocal grad
        out = fn(*leaves)
        grad = torch.ones_like(out) if grad is None else grad
        out.backward(grad)
        for x in leaves:
            x.grad = None

    f, first_f = timed(fwd, warmup, reps, cuda)
    fb, first_fb = timed(fwd_bwd, warmup, reps, cuda) if backward else (math.nan, 0.0)
    return {"fwd_s": f, "fwd_bwd_s": fb, "bwd_s": max(fb - f, 0.0), "compile_s": first_f + first_fb}


# -- report ------------------------------------------------------------------------------------------


def header(device: Any, args: argparse.Namespace) -> str:
    import torch
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'x86'})"
    mode = (
        "Triton interpreter on CPU, fp32, tiny sizes: a check of the script, not a benchmark"
        if args.interpret
        else "bf16"
    )
    return (
        f"Hardware: {name}; torch {torch.__version__}, triton {triton.__version__}, CUDA "
        f"{torch.version.cuda}; {datetime.date.today().isoformat()}; {mode}. Command: "
        f"`python scripts/bench_kernels.py {' '.join(sys.argv[1:])}`. batch x L = {args.tokens} tokens, "
        f"heads x head dim = {args.width}; median of {args.reps} timings after {args.warmup} warm-up calls."
    )


def _ratio(rows: list[dict[str, Any]], r: dict[str, Any], other: str) -> str:
    """How many times faster ``r`` is than ``other`` on the same configuration (fwd + bwd)."""
    key = lambda x: (x["case"], x["length"], x["head_dim"])  # noqa: E731
    base = next((x for x in rows if key(x) == key(r) and x["impl"] == other), None)
    ratio = base["fwd_bwd_s"] / r["fwd_bwd_s"] if base else math.nan
    return "—" if math.isnan(ratio) else f"{ratio:.2f}x"


def _g(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.3g}"


def render(rows: list[dict[str, Any]], head: str, note: str) -> str:
    order = {"triton": 0, "sdpa": 1, "flex": 2, "pytorch_chunked": 1}
    rows = sorted(rows, key=lambda r: (CASES.index(r["case"]), r["length"], r["head_dim"], order[r["impl"]]))
    att = [r for r in rows if r["case"] != "linear"]
    lines = [head, ""]
    if att:
        lines += [
            "| case | L | Dh | impl | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s | fwd+bwd vs SDPA | "
            "fwd+bwd vs Flex | max abs err vs SDPA |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in att:
            lines.append(
                f"| {r['case']} | {r['length']} | {r['head_dim']} | {r['impl']} | {_g(r['fwd_tflops'])} | "
                f"{_g(r['bwd_tflops'])} | {_g(r['fwd_bwd_tflops'])} | {_ratio(att, r, 'sdpa')} | "
                f"{_ratio(att, r, 'flex')} | {r['err']:.1e} |"
            )
    lin = [r for r in rows if r["case"] == "linear"]
    if lin:
        lines += [
            "",
            "| linear attention | L | Dh | impl | fwd ms | fwd+bwd ms | fwd+bwd vs PyTorch chunked | max abs err |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in lin:
            lines.append(
                f"| m={r['features']} | {r['length']} | {r['head_dim']} | {r['impl']} | {r['fwd_s'] * 1e3:.2f} | "
                f"{r['fwd_bwd_s'] * 1e3:.2f} | {_ratio(lin, r, 'pytorch_chunked')} | {r['err']:.1e} |"
            )
    if note:
        lines += ["", note]
    return "\n".join(lines)


# -- driver ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    import torch
    from benchlib.common import write_section

    cuda = torch.cuda.is_available() and not args.interpret
    if not cuda and not args.interpret:
        sys.exit("bench_kernels.py: no CUDA device. Fix: run on a GPU, or --interpret for the CPU check.")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    block = 64 if cuda else 16
    torch.manual_seed(0)
    jsonl = args.out.with_suffix(".kernels.jsonl")
    rows: list[dict[str, Any]] = []
    if args.resume and jsonl.exists():  # an earlier run's measurements, e.g. an earlier share of the grid
        rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    else:
        jsonl.unlink(missing_ok=True)
    done = {(r["case"], r["length"], r["head_dim"]) for r in rows}
    failed: list[str] = []
    head, start, cut = header(device, args), time.perf_counter(), ""
    if rows:
        head += f" Resumed: {len(rows)} measurements of earlier runs (--resume) are kept."
    configs = [(n, d, c) for n in args.lengths for d in args.head_dims for c in args.cases if (c, n, d) not in done]
    for i, (n, d, case) in enumerate(configs):
        if time.perf_counter() - start > args.budget_s:
            cut = (
                f"Cut at the {args.budget_s:.0f} s budget: {len(configs) - i} of {len(configs)} configurations not run."
            )
            break
        heads = max(args.width // d, 1)
        cfg = Config(case, n, d, max(args.tokens // n, 1), heads)
        q, k, v = (torch.randn(cfg.batch, heads, n, d, device=device, dtype=dtype) for _ in range(3))
        if case == "linear":
            features = 256 if cuda else 16
            make, impls = linear_implementations(features)
            args_ = make(q, k, v)
            flops = None
        else:
            inp = case_inputs(cfg, device, dtype, block)
            impls, args_ = implementations(cfg, inp, not args.no_flex, 128), (q, k, v)
            flops = 4 * d * inp["pairs"] * cfg.batch
        with torch.no_grad():
            ref_name = "pytorch_chunked" if case == "linear" else "sdpa"
            ref = impls[ref_name](*args_).float()
        for name, fn in impls.items():
            try:
                with torch.no_grad():
                    err = (fn(*args_).float() - ref).abs().max().item()
                r = {
                    "case": case,
                    "length": n,
                    "head_dim": d,
                    "impl": name,
                    "err": err,
                    # FlexAttention has no backward on CPU: there it checks the score and mask functions
                    **measure(fn, args_, args.warmup, args.reps, cuda, backward=cuda or name != "flex"),
                }
            except Exception as e:  # a failed implementation is reported (and fails the run at the end), not fatal
                failed.append(f"{case} L={n} Dh={d} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                print(failed[-1], flush=True)
                continue
            if case == "linear":
                r["features"] = features
            if flops is not None:
                r |= {
                    "fwd_tflops": flops / r["fwd_s"] / 1e12,
                    "bwd_tflops": 2.5 * flops / max(r["bwd_s"], 1e-12) / 1e12,
                }
                r["fwd_bwd_tflops"] = 3.5 * flops / r["fwd_bwd_s"] / 1e12
            rows.append(r)
            with jsonl.open("a") as fh:
                fh.write(json.dumps(r) + "\n")
            print(
                f"{case:8s} L={n:6d} Dh={d:4d} {name:16s} fwd {r['fwd_s'] * 1e3:8.3f} ms  "
                f"fwd+bwd {r['fwd_bwd_s'] * 1e3:8.3f} ms  err {err:.1e}  (first calls {r['compile_s']:.1f} s)",
                flush=True,
            )
            write_section(args.out, START, END, render(rows, head, _note(cut, failed)), new_heading="## Triton kernels")
        if cuda:
            torch.cuda.empty_cache()
    write_section(args.out, START, END, render(rows, head, _note(cut, failed)), new_heading="## Triton kernels")
    return rows, failed


def _note(cut: str, failed: list[str]) -> str:
    return "\n".join([cut] * bool(cut) + [f"- {f}" for f in failed])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is imported (and decorated)
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # xfam, benchlib
    import torch

    torch.set_num_threads(2 if args.interpret else torch.get_num_threads())
    rows, failed = run(args)
    tol = 2e-3 if args.interpret else 5e-2
    off = [f"{r['case']} L={r['length']} Dh={r['head_dim']} {r['impl']}: max abs error {r['err']:.1e} > {tol:g}"
           for r in rows if r["impl"] != "sdpa" and not r["err"] <= tol]  # fmt: skip
    for line in off:
        print("OFF", line)
    print(f"{len(rows)} measurements -> {args.out}; {len(off)} outputs off SDPA's, {len(failed)} failed calls")
    if off or failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
