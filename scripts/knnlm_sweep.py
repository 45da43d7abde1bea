"""kNN-LM sweep (Khandelwal et al., 2020): validation perplexity over lambda x k, from one datastore.

    python scripts/knnlm_sweep.py                                 # train experiment=knnlm (~10 min), then sweep
    python scripts/knnlm_sweep.py --ckpt runs/x/.../last.ckpt     # any trained xfam language model
    python scripts/knnlm_sweep.py --set trainer.max_steps=30 model.dim=32 model.layers=2 \\
        --store-limit 20 --limit 4 --results /tmp/r.md --png /tmp/r.png     # a one-minute smoke run

Without ``--ckpt`` it trains ``experiment=knnlm`` (plus ``--set`` overrides) into ``<out>/knnlm``
(reused when already trained: delete it, or use another ``--out``, to retrain). Then it builds the
datastore from the first ``--store-limit`` batches of the checkpoint's train split (``xfam knnlm
build``; reused when it matches), scores the first ``--limit`` batches of the validation split once
per batch with the largest k (smaller k are prefixes of the sorted neighbours) and every lambda,
prints the perplexity table, writes it between the ``<!-- experiments:knnlm:start/end -->`` markers
of ``--results`` (docs/results.md) and plots perplexity against lambda per k (``--png``,
docs/results_knnlm.png; infinite values left out); raw numbers go to ``<store>/sweep.json``.
Exact search costs ~2 x queries x entries x width flops per batch plus the top-k: with the defaults
(~512k entries of width 128, 20 batches of 2,048 queries) ~2-5 minutes on 2 CPU threads;
``--index faiss`` (``pip install 'xfam[faiss]'``) is about twice as fast.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from run_experiments import RESULTS, write_section  # noqa: E402

from xfam.core.errors import ConfigError  # noqa: E402
from xfam.eval.knnlm import build_datastore, default_store_dir, load_checked, score  # noqa: E402
from xfam.knnlm.datastore import read_manifest  # noqa: E402

LAMBDAS = [0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0]
KS = [8, 64, 256, 1024]


def train(out: Path, overrides: list[str]) -> Path:
    """``python train.py experiment=knnlm <overrides>`` into ``out`` (reused when finished); its last checkpoint."""
    found = glob.glob(str(out / "knnlm" / "*" / "checkpoints" / "last.ckpt"))
    if found:
        print(f"reusing {found[0]}", flush=True)
        return Path(found[0])
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=knnlm", *overrides]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "XFAM_RUNS": str(out)}, cwd=ROOT)
    return Path(glob.glob(str(out / "knnlm" / "*" / "checkpoints" / "last.ckpt"))[0])


def datastore(ckpt: Path, path: Path, limit: int | None) -> Path:
    """The train-split datastore of ``ckpt`` in ``path``: reused when it is this model's with this limit."""
    try:
        manifest = read_manifest(path)
        _, _, identity = load_checked(ckpt, "cpu")
        if (manifest["checkpoint"]["weights_sha256"], manifest["limit"], manifest["split"]) == (
            identity["weights_sha256"],
            limit,
            "train",
        ):
            print(f"reusing datastore {path} ({manifest['count']} entries)", flush=True)
            return path
    except ConfigError:  # none there yet
        pass
    print(f"building the datastore: {limit or 'all'} batches of the train split into {path}", flush=True)
    return build_datastore(ckpt, "train", path, limit=limit, overwrite=True)


def fmt(ppl: float, loss: float) -> str:
    return "inf" if math.isinf(loss) else f"{ppl:.2f}"


def report(grid: dict[str, Any], ks: list[int], lambdas: list[float], about: dict[str, Any], cmd: str) -> str:
    base = grid["base"]
    lines = [
        f"Validation split, first {about['batches']} batches; datastore: {about['store_size']:,} entries from the "
        f"train split ({about['store_batches']} batches); {about['index']} search, temperature {about['temperature']}. "
        f"Base model: perplexity {base['ppl']:.2f}, {base['bpb']:.3f} bits per byte. Command: `{cmd}`.",
        "",
        "Perplexity of p = lambda p_kNN + (1 - lambda) p_LM (rows: lambda; columns: k neighbours):",
        "",
        "| lambda | " + " | ".join(f"k={k}" for k in ks) + " |",
        "|---|" + "---|" * len(ks),
    ]
    for lam in lambdas:
        cells = [fmt(grid[f"{k},{lam}"]["ppl"], grid[f"{k},{lam}"]["loss"]) for k in ks]
        lines.append(f"| {lam} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Share of targets among the k neighbours' values: "
        + ", ".join(f"k={k}: {grid[f'{k},{lambdas[0]}']['coverage']:.1%}" for k in ks)
        + ".",
    ]
    best = min(((k, lam) for k in ks for lam in lambdas), key=lambda kl: grid[f"{kl[0]},{kl[1]}"]["loss"])
    b = grid[f"{best[0]},{best[1]}"]
    lines.append(
        f"Best: k={best[0]}, lambda={best[1]}: perplexity {b['ppl']:.2f} ({b['bpb']:.3f} bits per byte) against "
        f"{base['ppl']:.2f}. lambda = 1 is p_kNN alone (inf: some target is carried by no neighbour). "
        "Plot: `docs/results_knnlm.png`."
    )
    return "\n".join(lines)


def plot(grid: dict[str, Any], ks: list[int], lambdas: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k in ks:
        pts = [(lam, grid[f"{k},{lam}"]["ppl"]) for lam in lambdas if math.isfinite(grid[f"{k},{lam}"]["loss"])]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=4, label=f"k = {k}")
    ax.axhline(grid["base"]["ppl"], color="k", ls="--", lw=1, label="base model")
    ax.set_xlabel("lambda (weight of p_kNN)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.set_title("kNN-LM: perplexity vs lambda")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default=None, help="a trained language model (default: train experiment=knnlm)")
    parser.add_argument("--set", nargs="*", default=[], help="extra train.py overrides when training")
    parser.add_argument("--out", default=str(ROOT / "runs" / "knnlm_sweep"), help="run directory root")
    parser.add_argument("--store", default=None, help="datastore directory (default: <run dir>/knnlm/<ckpt>_train)")
    parser.add_argument("--store-limit", type=int, default=250, help="train batches in the datastore (0: all)")
    parser.add_argument("--limit", type=int, default=20, help="validation batches scored")
    parser.add_argument("--index", default="exact", choices=["exact", "faiss"], help="search (both exact)")
    parser.add_argument("--ks", type=int, nargs="+", default=KS)
    parser.add_argument("--lambdas", type=float, nargs="+", default=LAMBDAS)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--results", default=str(RESULTS), help="markdown file the table goes into")
    parser.add_argument("--png", default=str(RESULTS.parent / "results_knnlm.png"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.ckpt) if args.ckpt else train(out, args.set)
    store_dir = Path(args.store) if args.store else default_store_dir(ckpt, "train")
    store_dir = datastore(ckpt, store_dir, args.store_limit or None)
    scorer, about = score(
        ckpt,
        store_dir,
        "validation",
        ks=args.ks,
        lambdas=args.lambdas,
        temperature=args.temperature,
        index=args.index,
        limit=args.limit,
        accuracy=False,
    )
    metrics = scorer.metrics("m")
    strip = lambda m: {key.split("/", 1)[1]: v for key, v in m.items()}  # "m/loss" -> "loss"
    grid = {"base": strip(metrics.pop("base"))}
    grid |= {f"{k},{lam}": strip(m) for (k, lam), m in metrics.items()}
    about |= {"temperature": args.temperature, "store_batches": read_manifest(store_dir)["batches"]}
    (store_dir / "sweep.json").write_text(json.dumps({"ckpt": str(ckpt), "about": about, "grid": grid}, indent=1))
    ks, lambdas = sorted(set(args.ks)), args.lambdas
    cmd = "python " + " ".join(["scripts/knnlm_sweep.py", *sys.argv[1:]])  # as run (the table says how it was made)
    table = report(grid, ks, lambdas, about, cmd)
    print(table)
    write_section(Path(args.results), "knnlm", table)
    plot(grid, ks, lambdas, Path(args.png))
    print(f"table -> {args.results}, plot -> {args.png}")


if __name__ == "__main__":
    main()
