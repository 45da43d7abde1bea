"""Reporting: medians, ratios, the markdown report and the chart (no torch)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from benchlib.common import (
    BATCH,
    BETAS,
    DIM,
    EPS,
    HEADS,
    LABELS,
    LAYERS,
    LR,
    MATMUL_N,
    SEQ,
    VOCAB,
    WEIGHT_DECAY,
    flops_per_step,
)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per (pos, system): median / min / max tokens/s over repeats, memory, params; per-round ratios."""
    runs, m = data["runs"], data["meta"]
    matmul = [r["gflops"] for r in runs if r["system"] == "matmul"]
    rate = statistics.median(matmul) * 1e9 if matmul else float("nan")
    fl = flops_per_step()
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for pos in m["pos"]:
        for s in m["systems"]:
            rs = [r for r in runs if r["system"] == s and r["pos"] == pos]
            if not rs:
                continue
            tps = [r["tokens_per_s"] for r in rs]
            med = statistics.median(tps)
            step = BATCH * SEQ / med
            table[pos, s] = {
                "tps": med,
                "min": min(tps),
                "max": max(tps),
                "all": tps,
                "step_ms": step * 1e3,
                "params": rs[0]["params"],
                "peak_mb": statistics.median(r["peak_rss_mb"] for r in rs),
                "delta_mb": statistics.median(r["peak_rss_mb"] - r["rss_before_mb"] for r in rs),
                "mfu": fl["total"] / step / rate,
                "inner_ms": statistics.median(r["inner_s"] for r in rs) * 1e3 if "inner_s" in rs[0] else None,
            }
    return {"table": table, "matmul": matmul, "rate": rate, "flops": fl}


RATIOS = (
    ("xfam", "xtransformers", "xfam / x-transformers default", 1.10),
    ("xfam", "xtransformers_flash", "xfam / x-transformers attn_flash", 1.00),
    ("xfam", "minimal", "xfam / minimal", 0.97),
    ("xfam_lightning", "xfam", "xfam Lightning / xfam plain loop", None),
)


def ratios(data: dict[str, Any], pos: str, a: str, b: str) -> tuple[float, float, float, float] | None:
    """Ratio of the medians, min and max of the per-round ratios (a and b measured in the same
    round), and the ratio of the best runs (max tokens/s) of each."""
    runs = data["runs"]
    get = lambda s: {r["repeat"]: r["tokens_per_s"] for r in runs if r["system"] == s and r["pos"] == pos}  # noqa: E731
    ra, rb = get(a), get(b)
    if not ra or not rb:
        return None
    per_round = [ra[k] / rb[k] for k in ra if k in rb]
    med = statistics.median(ra.values()) / statistics.median(rb.values())
    return med, min(per_round), max(per_round), max(ra.values()) / max(rb.values())


def render_md(data: dict[str, Any], summary: dict[str, Any], png: Path | None, md_path: Path) -> str:
    m, tab, fl = data["meta"], summary["table"], summary["flops"]
    out = ["# Training throughput: xfam vs x-transformers vs a minimal PyTorch GPT", ""]
    out += [
        f"Measured by `scripts/bench_train.py` on {m['date']} (`{m['command']}`)"
        + (f"; rendered by `{data['rendered_by']}`." if data.get("rendered_by") else "."),
        "",
        "## Setup",
        "",
        f"* Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB RAM; {m['os']}.",
        f"* Versions: Python {m['python']}, torch {m['torch']}, lightning {m['lightning']}, "
        f"x-transformers {m['x_transformers']}, xfam at commit {m['xfam_commit']}.",
        f"* Threads: `torch.set_num_threads({m['threads']})` in every worker, and "
        f"`OMP_NUM_THREADS={m['threads']} MKL_NUM_THREADS={m['threads']}` in its environment.",
        f"* Model: vocab {VOCAB}, width {DIM}, {LAYERS} layers, {HEADS} heads (head dim {DIM // HEADS}), FFN 4x GELU, "
        f"pre-LayerNorm, causal LM; batch {BATCH} x {SEQ} tokens ({BATCH * SEQ} tokens per step), fp32, CPU.",
        f"* One step: `zero_grad`, forward, cross-entropy (mean over tokens), backward, AdamW step "
        f"(lr {LR}, betas {BETAS}, eps {EPS}). Weight decay as each system does it: minimal and "
        f"x-transformers `AdamW(model.parameters(), weight_decay={WEIGHT_DECAY})` (x-transformers has no "
        f"optimiser of its own; PyTorch's default AdamW kernel); xfam `xfam.training.lit.optim.make_optimizer` with "
        f"`OptimSpec()` defaults (decay {WEIGHT_DECAY} on weight matrices only, warmup + cosine `LambdaLR` "
        f"stepped every step, and the fused AdamW kernel, which xfam's Lightning module selects at full "
        f"precision).",
        "* Systems:",
        "  * **minimal**: the ~60-line plain-PyTorch GPT inside the script: fused q/k/v Linear (no bias), "
        "`F.scaled_dot_product_attention` (`is_causal=True`; ALiBi as one additive float mask "
        "`[1, H, S, S]` with the causal -inf folded in, built once per forward; RoPE as a rotate-half "
        "rotation of q and k with cos/sin built once per forward), GELU FFN (no bias), final LayerNorm, "
        "untied head. The yardstick.",
        "  * **x-transformers (default)**: `TransformerWrapper(num_tokens=256, max_seq_len=256, "
        "attn_layers=Decoder(dim=256, depth=4, heads=4, ...))`; learned = its default absolute "
        "embedding, rope = `rotary_pos_emb=True, use_abs_pos_emb=False`, alibi = `alibi_pos_bias=True, "
        "use_abs_pos_emb=False`. Default attention: explicit einsum scores. Note that its RoPE rotates "
        "only half of each head's channels by default (`rotary_emb_dim = dim_head // 2` = 32, partial "
        "rotary as in GPT-J), where xfam and minimal rotate all 64.",
        "  * **x-transformers (attn_flash)**: the same with `attn_flash=True` (SDPA).",
        "  * **xfam (plain loop)**: `XfamModel(ModelSpec(dim=256, layers=4, heads=4, max_len=256), task='lm', "
        "attention={name: vanilla, backend: auto}, pos={name: POS, defaults}, memory=none, exit=none)` "
        "with xfam's own optimiser setup, trained in the same plain loop as the others.",
        "  * **xfam (Lightning)**: `XfamLitModule(config, data_info)` under `lightning.Trainer(accelerator='cpu', "
        "devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, "
        "enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)` on an in-memory "
        "DataLoader (batch size 8, default collate) of random-token rows in xfam's batch format. A callback "
        "times a step from one `on_train_batch_start` to the next: the loop's whole cycle (data fetch, "
        "`training_step` with xfam's metrics, backward, optimizer and scheduler step, `self.log`).",
        "",
        "## Protocol",
        "",
        f"* Every measurement is a fresh process (`python scripts/bench_train.py --worker SYSTEM POS`, one "
        f"JSON line out). For each positional encoding the systems alternate (A B C D E A B C D E ...) "
        f"for {m['repeats']} rounds.",
        f"* In a process every step is timed with `time.perf_counter`; the first {m['warmup']} steps are "
        f"discarded and the median of the next {m['steps']} is that run's step time. The figure per "
        f"system is the median over rounds; the spread is the min-max over rounds.",
        "* Ratios are ratios of those medians; their spread is the min-max of the per-round ratios "
        "(two systems measured back to back in the same round).",
        "* Memory: peak RSS of the worker (`resource.getrusage(RUSAGE_SELF).ru_maxrss`), and its increase "
        "over the RSS measured just before the model was built (all libraries already imported, the "
        "batches already made): parameters, gradients, AdamW state, activations, allocator slack. The "
        "increase is only comparable between plain-loop workers: the Lightning worker imports more before "
        "its baseline and reuses heap memory those imports freed.",
        f"* Matmul rate: a {MATMUL_N}^3 fp32 `a @ b` with the same thread count, median of 10 after 3 "
        f"warm-up calls, in a fresh process at the start of every round: median "
        f"{summary['rate'] / 1e9:.1f} GFLOP/s (min {min(summary['matmul']):.1f}, max {max(summary['matmul']):.1f}).",
        f"* Model FLOPs per step (`flops_per_step()` in the script): dense 6 * N_matmul * tokens with "
        f"N_matmul = L * 12 D^2 + D * V = {fl['n_matmul']:,} (q/k/v, output, FFN, head; embeddings, "
        f"norms, softmax, optimiser not counted) -> {fl['dense'] / 1e9:.2f} GFLOP; attention scores and "
        f"values 2 * 2 * S * D per token and layer forward, full S x S (not halved for causality), "
        f"x3 for forward + backward = 12 * L * S * D * tokens -> {fl['attention'] / 1e9:.2f} GFLOP; "
        f"total {fl['total'] / 1e9:.2f} GFLOP per step. MFU = model FLOPs per step / step time / matmul rate.",
        f"* The machine was shared with other jobs (tests of other engineers). Two threads on two cores "
        f"are badly hurt by any other busy process (a step went from ~0.3 s to 1.5-2 s), so before each "
        f"measurement the parent waited (at most {m.get('max_wait', '?')} s) until other processes used "
        f"< {m.get('quiet', '?')} cores for 2 s, and each worker measured the cores used by other "
        f"processes during its timed steps (machine busy time from /proc/stat minus its own CPU time); a "
        f"measurement with > {m.get('noisy', '?')} such cores was rerun, at most {m.get('retries', '?')} "
        f"times. {len(data.get('rejected', []))} measurements were rerun; the raw results list the others' "
        f"load of every kept run.",
        "",
    ]
    # -- main table
    out += ["## Results", ""]
    if png is not None:
        out += [f"![throughput]({os.path.relpath(png, md_path.parent)})", ""]
    out += [
        "| pos | system | tokens/s (median) | min-max | vs minimal | step (ms) | params | peak RSS (MB) "
        "| RSS increase (MB) | MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for pos in m["pos"]:
        base = tab.get((pos, "minimal"))
        for s in m["systems"]:
            if (pos, s) not in tab:
                continue
            t = tab[pos, s]
            rel = f"{t['tps'] / base['tps']:.3f}" if base else "-"
            out.append(
                f"| {pos} | {LABELS[s]} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} | {rel} | "
                f"{t['step_ms']:.0f} | {t['params']:,} | {t['peak_mb']:.0f} | {t['delta_mb']:.0f} | {t['mfu']:.0%} |"
            )
    out.append("")
    # -- ratios and targets
    out += [
        "## Ratios and targets",
        "",
        "Targets: xfam >= 1.10x x-transformers default, >= 1.00x x-transformers attn_flash, and within 3% of "
        "the minimal model with the same pos (>= 0.97x). Each cell: ratio of the medians (the figure the "
        "targets are judged on), [min-max of the per-round ratios], and the ratio of the two systems' best "
        "runs (a second estimator, less sensitive to a slow process).",
        "",
        "| pos | " + " | ".join(label for _, _, label, _ in RATIOS) + " |",
        "|---|" + "---:|" * len(RATIOS),
    ]
    verdicts = []
    for pos in m["pos"]:
        cells = []
        for a, b, label, target in RATIOS:
            r = ratios(data, pos, a, b)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r[0]:.3f} [{r[1]:.3f}-{r[2]:.3f}], best {r[3]:.3f}"
            if target is not None:
                ok = r[0] >= target
                cell += "; met" if ok else "; **not met**"
                verdicts.append((pos, label, target, r, ok))
            cells.append(cell)
        out.append(f"| {pos} | " + " | ".join(cells) + " |")
    out.append("")
    if verdicts:
        n_ok = sum(v[-1] for v in verdicts)
        out.append(f"{n_ok} of {len(verdicts)} targets met:")
        out.append("")
        for pos, label, target, r, ok in verdicts:
            out.append(
                f"* pos={pos}, {label} = {r[0]:.3f} (per round {r[1]:.3f}-{r[2]:.3f}), target >= {target:.2f}: "
                + ("**met**" if ok else "**not met**")
            )
        out.append("")
    # -- noise
    spreads = sorted((t["max"] - t["min"]) / t["tps"] for t in tab.values())
    if spreads and m["repeats"] > 1:
        out += [
            f"Run-to-run noise: the min-max spread of one system over its {m['repeats']} rounds is "
            f"{statistics.median(spreads):.1%} of its median (median over all pos x system; largest "
            f"{spreads[-1]:.1%}), even with no other process busy: this virtual machine shows a fast and a "
            f"slow mode per process (~0.30 s and ~0.32 s per step for the same model). A difference of a few "
            f"percent between two systems is therefore not resolved by one such run; see the follow-up runs "
            f"and the profiles below.",
            "",
        ]
    out += render_followups(data)
    out += render_profiles(data)
    # -- parameters
    out += ["## Parameter counts", ""]
    out += ["| pos | " + " | ".join(LABELS[s] for s in m["systems"]) + " |", "|---|" + "---:|" * len(m["systems"])]
    for pos in m["pos"]:
        out.append(
            f"| {pos} | "
            + " | ".join(f"{tab[pos, s]['params']:,}" if (pos, s) in tab else "-" for s in m["systems"])
            + " |"
        )
    out += [
        "",
        "minimal and xfam have identical parameters (no Linear biases, LayerNorm gains without bias, untied "
        "head). x-transformers has the same matrices (its q, k, v are three separate Linears rather than one "
        "fused one; its LayerNorm is a bias-free norm times a learned gain) plus biases in its FFN Linears: "
        "4 layers * (1024 + 256) = 5,120 more. Its absolute position table (pos=learned) is 256 x 256 like "
        "the others' (65,536). RoPE and ALiBi have no parameters.",
        "",
    ]
    if any(t["inner_ms"] is not None for t in tab.values()):
        out += ["## Lightning step breakdown", ""]
        for pos in m["pos"]:
            t = tab.get((pos, "xfam_lightning"))
            if t and t["inner_ms"] is not None:
                out.append(
                    f"* pos={pos}: whole cycle {t['step_ms']:.1f} ms, of which `on_train_batch_start` -> "
                    f"`on_train_batch_end` {t['inner_ms']:.1f} ms."
                )
        out.append("")
    # -- raw
    out += [
        "## Raw results",
        "",
        "tokens/s of every kept run in round order (cores used by other processes during its timed steps):",
        "",
    ]
    for pos in m["pos"]:
        for s in ("matmul", *m["systems"]):
            rs = [r for r in data["runs"] if r["system"] == s and r["pos"] == pos]
            if not rs:
                continue
            key = "gflops" if s == "matmul" else "tokens_per_s"
            unit = " GFLOP/s" if s == "matmul" else ""
            vals = ", ".join(f"{r[key]:,.0f}{unit} ({r['foreign_cores']:.2f})" for r in rs)
            out.append(f"* {pos} / {s}: {vals}")
    out.append("")
    return "\n".join(out)


def render_followups(data: dict[str, Any]) -> list[str]:
    """Targeted reruns (``--append-json``): more rounds of a few systems, same protocol."""
    out = []
    for f in data.get("followups", []):
        fm, ft = f["meta"], summarize(f)["table"]
        if not out:
            out += ["## Follow-up runs", ""]
        out += [
            f"`{fm['command']}` ({fm['date']}): {fm['repeats']} rounds of {', '.join(fm['systems'])}; "
            f"{fm['warmup']} warm-up + {fm['steps']} timed steps per process, same protocol.",
            "",
            "| pos | system | tokens/s (median) | min-max |",
            "|---|---|---:|---:|",
        ]
        for pos in fm["pos"]:
            for sy in fm["systems"]:
                if (pos, sy) in ft:
                    t = ft[pos, sy]
                    out.append(f"| {pos} | {LABELS[sy]} | {t['tps']:,.0f} | {t['min']:,.0f}-{t['max']:,.0f} |")
        out.append("")
        for pos in fm["pos"]:
            for a, b, label, target in RATIOS:
                r = ratios(f, pos, a, b)
                if r:
                    ok = "met" if target is not None and r[0] >= target else "not met"
                    verdict = "" if target is None else f" (target >= {target:.2f}: {ok})"
                    out.append(
                        f"* pos={pos}, {label} = {r[0]:.3f} (per round {r[1]:.3f}-{r[2]:.3f}, best runs "
                        f"{r[3]:.3f}){verdict}"
                    )
        out.append("")
    return out


def render_profiles(data: dict[str, Any], top: int = 14) -> list[str]:
    """Self CPU time per op and step (``torch.profiler``), one process per system and pos."""
    profs = data.get("profiles", [])
    if not profs:
        return []
    out = [
        "## Where the time goes (torch.profiler)",
        "",
        f"One process per system and pos, {profs[0].get('steps', '?')} profiled steps after "
        f"{data['meta']['warmup']} warm-up steps; self CPU time per step in ms (calls per step). The "
        "profiler adds a little time to every op call.",
        "",
    ]
    for pos in dict.fromkeys(p["pos"] for p in profs):
        rows = [p for p in profs if p["pos"] == pos]
        names = sorted(
            {k for p in rows for k in p["ops"]}, key=lambda k: -max(p["ops"].get(k, [0, 0])[0] for p in rows)
        )
        out += [f"pos={pos}:", "", "| op | " + " | ".join(LABELS[p["system"]] for p in rows) + " |"]
        out.append("|---|" + "---:|" * len(rows))
        for k in names[:top]:
            cells = [f"{p['ops'][k][0]:.1f} ({p['ops'][k][1]:g})" if k in p["ops"] else "-" for p in rows]
            out.append(f"| `{k[:60]}` | " + " | ".join(cells) + " |")
        other = [sum(v[0] for kk, v in p["ops"].items() if kk not in names[:top]) for p in rows]
        out.append("| all other ops | " + " | ".join(f"{o:.1f}" for o in other) + " |")
        total = [sum(v[0] for v in p["ops"].values()) for p in rows]
        out.append("| **total self CPU** | " + " | ".join(f"**{t:.1f}**" for t in total) + " |")
        out.append(
            "| of which AdamW `step()` with all its ops | "
            + " | ".join(f"{p['optimizer_ms']:.1f}" if "optimizer_ms" in p else "-" for p in rows)
            + " |"
        )
        out.append("")
    return out


def render_png(data: dict[str, Any], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, tab = data["meta"], summary["table"]
    systems, poses = m["systems"], m["pos"]
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(10, 5))
    for j, s in enumerate(systems):
        xs, ys, lo, hi = [], [], [], []
        for i, pos in enumerate(poses):
            if (pos, s) in tab:
                t = tab[pos, s]
                xs.append(i + (j - (len(systems) - 1) / 2) * width)
                ys.append(t["tps"])
                lo.append(t["tps"] - t["min"])
                hi.append(t["max"] - t["tps"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=LABELS[s])
        ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7, rotation=90, padding=4)
    ax.set_xticks(range(len(poses)), [f"pos={p}" for p in poses])
    ax.set_ylabel("tokens / s (median; bars: min-max over rounds)")
    ax.set_title(
        f"Training throughput, width {DIM}, {LAYERS} layers, batch {BATCH}x{SEQ}, fp32, "
        f"{m['threads']} CPU threads ({m['repeats']} rounds)"
    )
    top = max(t["max"] for t in tab.values())
    ax.set_ylim(0, top * 1.25)
    ax.legend(loc="upper center", ncol=3, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
