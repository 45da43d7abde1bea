"""Compile every Triton kernel launch of the fused path for a CUDA GPU, on a machine without one.

    python scripts/compile_kernels.py                # sm_90 (H100, H200): every variant -> docs/kernels_sm90.md
    python scripts/compile_kernels.py --quick        # bf16, head dims 64 and 128, the attention kernels only
    python scripts/compile_kernels.py --arch 86      # RTX 30xx, A10 (99 KiB of shared memory) -> docs/kernels_sm86.md

The wrappers (``flash_attention``, ``causal_linear_attention``, ``rope``) run on CPU tensors and make the
launches they make on a GPU (the same tile sizes, warps, stages and argument specialisations), but every launch
is compiled for the target instead of run: ``JITFunction.warmup`` with a stand-in driver that names the target,
through Triton's own compiler and ptxas. ``cuobjdump --dump-resource-usage`` on each cubin then gives registers,
local memory (spills) and shared memory. A launch that asks for more shared memory than the target has raises
OutOfResources, as the driver does, and the flash wrapper tries smaller tiles (the table marks the refused ones
*over*). The script fails when a kernel does not compile or never fits; spills are reported, not failed. Outputs
are not computed, so this checks neither results nor speed: ``scripts/gpu_checks.sh`` does both, on a GPU.

Each kernel is compiled once per specialisation (repeats are counted, not recompiled); compile times are those of
an empty Triton cache (``--keep-cache`` reuses ~/.triton/cache). The table goes between the ``compile_kernels``
markers of ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- compile_kernels:start -->", "<!-- compile_kernels:end -->"
#: Largest dynamic shared memory of one block (bytes), by compute capability (CUDA programming guide, table 21).
SHARED_LIMIT = {70: 96 * 1024, 75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
ATTENTION = ("causal", "odd_length", "bidirectional_padding", "window", "documents", "gqa", "memory_prefix",
             "alibi", "t5", "span", "block_sparse", "block_sparse_128", "everything")  # fmt: skip
OTHERS = ("linear", "linear_decay_state", "rope")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100, H200)")
    p.add_argument("--variants", nargs="*", choices=ATTENTION + OTHERS, help="default: all")
    p.add_argument("--dtypes", nargs="*", choices=("bf16", "fp16", "fp32"), help="default: bf16 fp16 fp32")
    p.add_argument("--head-dims", type=int, nargs="*", help="default: 32 64 128")
    p.add_argument("--quick", action="store_true", help="bf16, head dims 64 and 128, attention variants only")
    p.add_argument("--keep-cache", action="store_true", help="use Triton's cache (compile times become cache hits)")
    p.add_argument("--out", type=Path, help="markdown file (markers); default docs/kernels_sm<arch>.md")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    if args.quick:
        args.variants = args.variants or list(ATTENTION)
        args.dtypes, args.head_dims = args.dtypes or ["bf16"], args.head_dims or [64, 128]
    args.variants = args.variants or list(ATTENTION + OTHERS)
    args.dtypes = args.dtypes or ["bf16", "fp16", "fp32"]
    args.head_dims = args.head_dims or [32, 64, 128]
    args.out = args.out or ROOT / "docs" / f"kernels_sm{args.arch}.md"
    return args


# -- compiling instead of launching ------------------------------------------------------------------------


class _TargetDriver:
    """What ``JITFunction.run(warmup=True)`` asks of the active driver: a device, a stream and the target."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


class _Compiler:
    """Stands in for a kernel: ``kernel[grid](*args, **kw)`` compiles (``warmup``) and records the result."""

    def __init__(self, fn: Any, name: str, log: list[dict[str, Any]], context: dict[str, Any], limit: int) -> None:
        self.fn, self.name, self.log, self.context, self.limit = fn, name, log, context, limit

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            n_cached = sum(len(c[0]) for c in self.fn.device_caches.values())
            t0 = time.perf_counter()
            try:
                kernel = self.fn.warmup(*args, grid=grid, **kwargs)
            except Exception as e:  # reported per kernel; the run goes on
                self.log.append({**self.context, "kernel": self.name, "error": f"{type(e).__name__}: {e}"})
                return
            fresh = sum(len(c[0]) for c in self.fn.device_caches.values()) > n_cached
            meta = {k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "C", "BM", "BDV", "BLOCK_S") if k in kwargs}
            meta |= {"warps": kernel.metadata.num_warps, "stages": kernel.metadata.num_stages}
            over = kernel.metadata.shared > self.limit
            self.log.append(
                {**self.context, "kernel": self.name, "fresh": fresh, "seconds": time.perf_counter() - t0,
                 "shared": kernel.metadata.shared, "tiles": meta, "over": over, **_resources(kernel)}
            )  # fmt: skip
            if over:  # what the driver does at launch: the wrapper then tries smaller tiles
                from triton.runtime import OutOfResources

                raise OutOfResources(kernel.metadata.shared, self.limit, "shared memory")

        return launch


def _resources(kernel: Any) -> dict[str, int]:
    """Registers and local memory (bytes per thread: spills and stack) from cuobjdump on the cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(kernel.asm["cubin"])
        fh.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
    num = lambda key: int(m.group(1)) if (m := re.search(rf"\b{key}:(\d+)", text)) else -1  # noqa: E731
    return {"regs": num("REG"), "local": num("LOCAL") + num("STACK")}


def install(arch: int, log: list[dict[str, Any]], context: dict[str, Any]) -> None:
    """Make the kernel modules compile for ``arch`` instead of launching: the stand-in driver, a ``_Compiler``
    for each launched kernel, and the device checks of the wrappers switched off (the tensors stay on CPU)."""
    import triton
    from triton.runtime.jit import JITFunction

    from xfam.kernels import flash_attention, linear_attention, rope, runtime

    triton.runtime.driver.set_active(_TargetDriver(arch))
    runtime.why_not = rope.why_not = lambda device, interpreted=None: None
    limit = SHARED_LIMIT.get(arch, 1 << 62)
    for module in (flash_attention, linear_attention, rope):
        for name, fn in list(vars(module).items()):
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):  # launched, not called from a kernel
                label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
                setattr(module, name, _Compiler(fn, label, log, context, limit))


# -- the launches -------------------------------------------------------------------------------------------


def attention_call(variant: str, dtype: Any, dh: int) -> None:
    """One forward and backward of ``flash_attention`` with the feature(s) of ``variant``."""
    import torch

    from xfam.kernels.flash_attention import flash_attention
    from xfam.pos.alibi import alibi_slopes
    from xfam.pos.t5 import t5_bucket

    b, h, s = 2, 4, 256
    s_q = 250 if variant in ("odd_length", "everything") else s
    s_k = s_q + (64 if variant in ("memory_prefix", "everything") else 0)
    h_kv = 2 if variant in ("gqa", "everything") else h
    q = torch.randn(b, h, s_q, dh, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s_k, dh, dtype=dtype, requires_grad=True) for _ in range(2))
    sparse = variant.startswith("block_sparse")
    kw: dict[str, Any] = {"causal": variant != "bidirectional_padding" and not sparse}
    if variant in ("bidirectional_padding", "everything"):
        kw["key_padding"] = torch.arange(s_k).expand(b, s_k) < s_k - 7
    if variant in ("window", "everything"):
        kw["window"] = 128
    if variant in ("documents", "everything"):
        kw["segments"] = torch.arange(s_k).expand(b, s_k) // 100
    if variant in ("alibi", "everything"):
        kw["alibi_slopes"] = torch.tensor(alibi_slopes(h))
    if variant in ("t5", "everything"):
        kw["bias_table"] = torch.randn(32, h, requires_grad=True)
        kw["bias_buckets"] = t5_bucket(torch.arange(-(s_k - 1), s_k), True, 32, 128)
    if variant in ("span", "everything"):
        kw["span"] = torch.full((h,), 40.0, requires_grad=True)
    if sparse:  # BigBird blocks of 64, or 128 (a tile the size of the block needs 112-160 KiB at Dh 128)
        from xfam.attention._sparse.engine import geometry
        from xfam.attention.bigbird import BigBirdPattern
        from xfam.core.mask import AttnMask

        block = 128 if variant == "block_sparse_128" else 64
        pattern = BigBirdPattern(block=block, window=3, n_global=0, random=2, seed=0, layer=0, heads=h, causal=False,
                                 k_len=s)  # fmt: skip
        geo = geometry(pattern, AttnMask(q_len=s, k_len=s), torch.device("cpu"))
        kw |= {"layout": (geo.idx, geo.ok[..., : geo.idx.shape[-1] * block]), "block": block}
    out = flash_attention(q, k, v, **kw)
    out.backward(torch.ones_like(out))


def other_call(variant: str, dtype: Any, dh: int) -> None:
    """Linear attention (xfam's Performer and RFA calls: features m, values with a ones column) or RoPE."""
    import torch

    b, h, t = 2, 4, 256
    if variant == "rope":
        from xfam.kernels.rope import rope

        x = torch.randn(b, h, t, dh, dtype=dtype, requires_grad=True)
        for r in (dh, dh // 2):  # full and partial rotation
            cos, sin = torch.randn(t, r), torch.randn(t, r)
            rope(x, cos, sin).sum().backward()
        return
    from xfam.kernels.linear_attention import causal_linear_attention

    for m in (128, 256):  # RFA's and Performer's default features
        fq, fk = (torch.rand(b, h, t, m, dtype=dtype, requires_grad=True) for _ in range(2))
        v1 = torch.randn(b, h, t, dh + 1, dtype=dtype, requires_grad=True)
        kw: dict[str, Any] = {}
        if variant == "linear_decay_state":
            kw = {"log_decay": -torch.rand(b, h, t), "key_logscale": torch.zeros(b, h, t),
                  "state": torch.randn(b, h, m, dh + 1)}  # fmt: skip
        out, last = causal_linear_attention(fq, fk, v1, **kw)
        (out.float().sum() + last.sum()).backward()


# -- report -------------------------------------------------------------------------------------------------


def render(rows: list[dict[str, Any]], args: argparse.Namespace, elapsed: float) -> str:
    import torch
    import triton

    limit = SHARED_LIMIT.get(args.arch)
    over = [r for r in rows if r.get("over") and r["fresh"]]
    ok = [r for r in rows if "error" not in r and r["fresh"] and not r["over"]]
    half = [r for r in ok if r["dtype"] != "fp32"]
    spill = lambda rs: f"{sum(r['local'] > 0 for r in rs)} of {len(rs)}"  # noqa: E731
    lines = [
        f"sm_{args.arch}, compiled on a CPU-only machine by `python scripts/compile_kernels.py "
        f"{' '.join(sys.argv[1:])}` ({datetime.date.today().isoformat()}; torch {torch.__version__}, triton "
        f"{triton.__version__}): {len(ok)} distinct kernels in {elapsed:.0f} s, "
        f"{sum('error' in r for r in rows)} errors.",
        "",
        f"* shared memory: at most {max((r['shared'] for r in ok), default=0) / 1024:.0f} KiB per block "
        f"(limit {'unknown' if limit is None else f'{limit // 1024} KiB'}); {len(over)} launches asked for more "
        f"and ran with smaller tiles (`_run`: the rows marked *over*, followed by the tiles that fit);",
        f"* kernels using local memory (register spills and stack): fp16/bf16 {spill(half)}, "
        f"fp32 {spill([r for r in ok if r['dtype'] == 'fp32'])}; "
        f"without the `everything` variant (all features at once) fp16/bf16 "
        f"{spill([r for r in half if r['variant'] != 'everything'])};",
        "* local = bytes per thread; compile s = Triton's compile and ptxas on this machine's CPU.",
        "",
        "| kernel | variant | dtype | Dh | tiles | regs | local B | shared KiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['variant']} | {r['dtype']} | {r['dh']} | **error** | "
                         f"{r['error'][:200].replace('|', '/')} | | | |")  # fmt: skip
        elif r["fresh"]:
            tiles = " ".join(f"{k}={v}" for k, v in r["tiles"].items())
            shared = f"{r['shared'] / 1024:.1f}" + (" *over*" if r["over"] else "")
            lines.append(
                f"| {r['kernel']} | {r['variant']} | {r['dtype']} | {r['dh']} | {tiles} | {r['regs']} | "
                f"{r['local']} | {shared} | {r['seconds']:.1f} |"
            )
    return "\n".join(lines)


def problems(rows: list[dict[str, Any]], arch: int) -> list[str]:
    """Compile errors, and kernels that would raise OutOfResources: beyond the target's shared memory, yet
    launched (a wrapper that tries smaller tiles marks its attempt ``over`` and goes on; one that cannot
    leaves an error)."""
    limit = SHARED_LIMIT.get(arch, 1 << 62)
    out = [f"{r['kernel']} ({r['variant']}, {r['dtype']}, Dh {r['dh']}): {r['error']}" for r in rows if "error" in r]
    out += [
        f"{r['kernel']} ({r['variant']}, {r['dtype']}, Dh {r['dh']}): {r['shared']} B of shared memory > {limit}"
        for r in rows
        if "error" not in r and not r.get("over") and r["shared"] > limit
    ]
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile_kernels.py compiles for a GPU: unset TRITON_INTERPRET (it makes the kernels interpreted).")
    if not args.keep_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="xfam_triton_cache_")
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # xfam, benchlib
    import torch

    rows: list[dict[str, Any]] = []
    context: dict[str, Any] = {}
    install(args.arch, rows, context)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    start = time.perf_counter()
    jobs = [(v, d, dh) for v in args.variants for d in args.dtypes for dh in args.head_dims]
    for i, (variant, dname, dh) in enumerate(jobs, 1):
        context.clear()
        context |= {"variant": variant, "dtype": dname, "dh": dh}
        before = len(rows)
        call = attention_call if variant in ATTENTION else other_call
        try:
            call(variant, dtypes[dname], dh)
        except Exception as e:  # a wrapper error (not a compile error): reported like one
            rows.append({**context, "kernel": call.__name__, "error": f"{type(e).__name__}: {e}"})
        new = rows[before:]
        worst = max((r.get("regs", 0) for r in new), default=0)
        compiled, errors = sum(r.get("fresh", False) for r in new), sum("error" in r for r in new)
        print(
            f"[{i}/{len(jobs)}] {variant} {dname} Dh={dh}: {len(new)} launches, {compiled} compiled, max regs "
            f"{worst}, {errors} errors  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    body = render(rows, args, time.perf_counter() - start)
    if args.no_write:
        print(body)
    else:
        from benchlib.common import write_section

        title = "# Triton kernels compiled for a GPU, without one\n\nWritten by `scripts/compile_kernels.py`.\n"
        write_section(args.out, START, END, body, new_file=title)
        print(f"table -> {args.out}")
    bad = problems(rows, args.arch)
    for line in bad:
        print("FAIL", line)
    spills = sum(1 for r in rows if r.get("fresh") and r.get("local", 0) > 0)
    print(f"{len(bad)} problems; {spills} kernels use local memory (spills)")
    if bad:
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
