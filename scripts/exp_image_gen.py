"""2D local attention against full attention on image generation, at equal model and budget: bits per pixel on the
test split, time per step, and samples drawn pixel by pixel.

    python scripts/exp_image_gen.py               # both arms; report + samples into docs/results.md (## image_gen)
    python scripts/exp_image_gen.py --quick       # smoke run: 8 x 8 images, a tiny model, a few steps; into <out>
    python scripts/exp_image_gen.py --dry-run     # compose and validate both runs, train nothing

The task is ``configs/experiment/image_gen.yaml``: scikit-learn's digits resized to 32 x 32 (``data=pixels``), a row
is BOS then the 1,024 pixels in the Image Transformer's 2D local order (8 x 8 blocks in raster order, raster inside
each block), a causal LM with learned absolute positions. The arms (Parmar et al., 2018, arXiv:1802.05751):

* ``local2d``: 2D local attention, query blocks 8 x 8, memory 8 rows above and 8 columns either side (a memory
  block of 16 x 24 pixels, of which a query sees the ones generated before it);
* ``vanilla``: full causal attention over every earlier pixel, the same rows in the same order.

Each run is exactly ``python train.py hydra.run.dir=<out>/<arm> experiment=image_gen <arm overrides>`` (commands in
the report), trained in this process one after another with ``--threads`` torch threads; both runs share seed,
data order, steps and model. Measured afterwards: test bits per pixel (``test/loss`` / ln 2, every test image), the
median wall time of one forward + backward pass on a training batch (``--timing-steps`` after two warm-up passes,
same thread count), and ``--samples`` images sampled pixel by pixel (temperature 1) from each trained model through
the decode cache, with the time per pixel. A run folder holding the finished run of the same config is reused.

Raw results: ``<out>/results.json``; the report goes between ``<!-- experiments:image_gen:start/end -->`` of
docs/results.md, the samples to docs/results_image_gen.png. ``--quick`` writes into ``<out>`` (default: a temporary
folder), never into docs/.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
SECTION = "image_gen"
sys.path.insert(0, str(ROOT / "scripts"))
from exp_finetune import compose, shown  # noqa: E402
from memory_experiments import pyplot, save  # noqa: E402
from run_experiments import comparable, fmt, one_line, run_folder, write_section  # noqa: E402


@dataclass(frozen=True)
class Budget:
    """Sizes of one invocation: the overrides on top of ``experiment=image_gen`` that every run shares."""

    steps: int
    overrides: tuple[str, ...]  # data and model sizes (empty: the experiment's own)
    local2d: tuple[str, ...]  # the local2d arm's attention settings (empty: the experiment's)
    samples: int  # images sampled from each trained model
    timing_steps: int  # timed forward + backward passes


REAL = Budget(steps=500, overrides=(), local2d=(), samples=8, timing_steps=8)
QUICK = Budget(
    steps=3,
    overrides=(
        "data.seq_len=64",
        "data.width=8",
        "data.block=[4,4]",
        "data.max_images=60",
        "data.batch_size=4",
        "model.dim=16",
        "model.layers=1",
        "model.heads=2",
        "model.max_len=64",
        "optim.warmup_steps=1",
        "trainer.limit_val_batches=2",
    ),
    local2d=("attention.shape=[8,8]", "attention.query_block=[4,4]", "attention.memory=[2,2]"),
    samples=2,
    timing_steps=2,
)


@dataclass(frozen=True)
class Arm:
    key: str
    overrides: tuple[str, ...]
    what: str


ARMS = (
    Arm("local2d", (), "2D local: memory block of each query block (Parmar et al. 2018)"),
    Arm("vanilla", ("attention=vanilla",), "full causal attention"),
)


@dataclass
class Run:
    """One arm's run and what became of it."""

    arm: str
    overrides: list[str]
    run_dir: Path
    status: str = "pending"  # ok | reused | refused | failed | planned
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    params: int | None = None
    step_ms: float | None = None  # median forward + backward of one training batch
    pixel_ms: float | None = None  # sampling, per pixel of a batch of ``samples`` images
    samples: list[list[int]] = field(default_factory=list)  # sampled pixel sequences (generation order)

    @property
    def done(self) -> bool:
        return self.status in ("ok", "reused")

    def command(self) -> str:
        return " ".join(["python train.py", f"hydra.run.dir={shown(self.run_dir)}", *map(shlex.quote, self.overrides)])


def make_runs(b: Budget, out: Path) -> list[Run]:
    shared = [
        "experiment=image_gen",
        *b.overrides,
        f"trainer.max_steps={b.steps}",
        f"trainer.val_check_interval={b.steps}",
        "callbacks.progress_bar=none",
    ]
    own = {"local2d": b.local2d}
    return [Run(arm.key, [*shared, *arm.overrides, *own.get(arm.key, ())], out / arm.key) for arm in ARMS]


def bits(loss: float | None) -> float | None:
    """Nats per pixel -> bits per pixel (every target of a row is one pixel)."""
    return None if loss is None else loss / math.log(2)


# ---------------------------------------------------------------------------------------------- runs


def train(run: Run, dry_run: bool) -> dict[str, Any] | None:
    """Compose, validate and train ``run`` (or reuse its folder); returns its config, None when refused."""
    import yaml

    import xfam

    print(f"[{run.arm}] {run.command()}", flush=True)
    try:
        cfg = compose(run.overrides)
        xfam.validate(cfg)
    except Exception as err:  # ConfigError, or Hydra's composition errors
        run.status, run.reason = "refused", f"{type(err).__name__}: {err}"
        print(f"    refused: {one_line(run.reason)}", flush=True)
        return None
    if dry_run:
        run.status = "planned"
        return cfg
    saved, record = run.run_dir / "config.yaml", run.run_dir / "driver.json"
    if saved.exists():
        if comparable(yaml.safe_load(saved.read_text())) != comparable(cfg):
            run.status = "refused"
            run.reason = f"{run.run_dir} holds a run of another config. Fix: --out <another folder>, or remove it."
            return None
        if record.exists():
            rec = json.loads(record.read_text())
            run.seconds, run.metrics, run.status = rec["seconds"], rec["metrics"], "reused"
            return cfg
        cfg["ckpt_path"] = "auto"
    start = time.perf_counter()
    try:
        run.metrics = xfam.train(cfg, run.run_dir)
    except Exception as err:  # recorded, not hidden: the other arm goes on
        run.status, run.reason = "failed", f"{type(err).__name__}: {err}"
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        return None
    run.status, run.seconds = "ok", time.perf_counter() - start
    record.write_text(json.dumps({"seconds": run.seconds, "metrics": run.metrics, "command": run.command()}))
    return cfg


def prepared_data(cfg: dict[str, Any]) -> Any:
    from xfam.model.build import build_data

    source = build_data({"data": cfg["data"]})
    source.prepare()
    return source


def time_steps(run: Run, cfg: dict[str, Any], source: Any, n: int) -> None:
    """Parameters and the median wall time of a forward + backward pass on the first training batch."""
    import torch
    import torch.nn.functional as F

    from xfam.model.build import build_model

    torch.manual_seed(0)
    model = build_model(cfg, {"task": "lm", "vocab_size": source.vocab_size, "num_classes": None}).train()
    run.params = sum(p.numel() for p in model.parameters())
    split = source.split("train")
    batch = source.collate([split[i] for i in range(source.batch_size)])
    times = []
    for _ in range(n + 2):
        start = time.perf_counter()
        logits = model(batch["input_ids"]).logits
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    run.step_ms = 1000 * statistics.median(times[2:])


def sample(run: Run, length: int, n: int) -> None:
    """``n`` images from the run's last checkpoint, pixel by pixel through the decode cache (temperature 1,
    intensities only: BOS is never drawn), and the time per pixel."""
    import torch

    import xfam
    from xfam.data.images import BOS, LEVELS

    model, _ = xfam.load_model(run.run_dir / "checkpoints" / "last.ckpt")
    model.eval()
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model(torch.full((n, 1), BOS), cache=model.empty_cache())
        pixels = []
        for i in range(length):
            probs = torch.softmax(out.logits[:, -1, :LEVELS].double(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=g)  # [n, 1]
            pixels.append(nxt)
            if i + 1 < length:
                out = model(nxt, cache=out.cache)
    run.pixel_ms = 1000 * (time.perf_counter() - start) / length
    run.samples = torch.cat(pixels, dim=1).tolist()


# ---------------------------------------------------------------------------------------------- report


def report(runs: list[Run], b: Budget, args: argparse.Namespace, cfg: dict[str, Any], source: Any, png: str | None):
    data, att, model = cfg["data"], cfg["attention"], cfg["model"]
    h, w = data["seq_len"] // data["width"], data["width"]
    (qh, qw), (hm, wm) = att.get("query_block", ("?", "?")), att.get("memory", ("?", "?"))  # (local2d's)
    base = source.manifest["baselines_test_bits_per_pixel"]
    images = source.manifest["images"]
    quick = " --quick" if args.quick else ""
    lines = [
        f"Command: `OMP_NUM_THREADS={args.threads} python scripts/exp_image_gen.py{quick}` (torch threads: "
        f"{args.threads}; the shared 2-core CPU, other jobs running). The runs, exactly:",
        "",
        "```bash",
        *(run.command() for run in runs),
        "```",
        "",
        "Data: `data=pixels`, scikit-learn's digits "
        f"resized to {h} x {w} ({images['train']} training, {images['validation']} validation, {images['test']} test "
        f"images), each a row of BOS + {h * w} pixels in the 2D local order (blocks of {data['block'][0]} x "
        f"{data['block'][1]} in raster order, raster inside each). Model: layers {model['layers']}, width "
        f"{model['dim']}, {model['heads']} heads, learned absolute positions; {b.steps} steps of batch "
        f"{data['batch_size']}, AdamW at lr {cfg['optim']['lr']:g} (the same seed, data order and budget for both). "
        f"local2d: query blocks {qh} x {qw}, memory {hm} rows above and {wm} columns either side, a memory block "
        f"of ({qh} + {hm}) x ({qw} + 2 x {wm}) of the {h * w} pixels.",
        "",
        "| arm | what | params | test bits/pixel | val bits/pixel | training (s) | forward + backward (ms/step) "
        "| sampling (ms/pixel) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run, arm in zip(runs, ARMS):
        if not run.done:
            lines.append(f"| {run.arm} | {arm.what} | - | **{run.status}** | - | - | - | - |")
            continue
        lines.append(
            f"| {run.arm} | {arm.what} | {run.params or 0:,} | {fmt(bits(run.metrics.get('test/loss')), 3)} | "
            f"{fmt(bits(run.metrics.get('val/loss')), 3)} | {fmt(run.seconds, 0)} | {fmt(run.step_ms, 0)} | "
            f"{fmt(run.pixel_ms, 1)} |"
        )
    lines += [
        "",
        f"Context-free baselines on the test split: a uniform guess, {base['uniform']:.0f} bits per pixel; the "
        f"training split's intensity histogram, {base['train_histogram']:.3f}. Training (s): the wall time of "
        "`xfam.train` (training, validation, test on the prepared data; the first run also pays one-time start-up "
        "costs). Bits per pixel = test loss / ln 2 over "
        f"every pixel of every test image. Forward + backward: median of {b.timing_steps} passes on one training "
        f"batch after two warm-up passes, same threads, untrained weights. Sampling: {b.samples} images at once, "
        "one pixel per decode call. One seed per arm: differences of a few hundredths of a bit are within what a "
        "second seed could move.",
    ]
    bad = [r for r in runs if not r.done]
    lines += [f"* `{r.arm}`: **{r.status}**: {one_line(r.reason)}" for r in bad]
    if png:
        lines += ["", f"![image_gen samples]({png})", "", "Top row: test images; then samples of each arm."]
    return "\n".join(lines)


def plot(runs: list[Run], source: Any, cfg: dict[str, Any], n: int, path: Path) -> None:
    """Test images on the first row, each arm's samples below."""
    import numpy as np

    from xfam.data.images import to_images

    data = cfg["data"]
    shape, order, block = (data["seq_len"] // data["width"], data["width"]), data["order"], tuple(data["block"])
    real = source.split("test")[:n]["tokens"][:, 1:].numpy()
    rows = [("test images", real)] + [(r.arm, np.array(r.samples)) for r in runs if r.samples]
    plt = pyplot()
    fig, axes = plt.subplots(len(rows), n, figsize=(1.3 * n, 1.45 * len(rows)), squeeze=False)
    for i, (label, seqs) in enumerate(rows):
        for j, img in enumerate(to_images(seqs, shape, order, block)):
            ax = axes[i][j]
            ax.imshow(img, cmap="gray", vmin=0, vmax=255)
            ax.set_xticks([]), ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
    save(fig, path)


# ---------------------------------------------------------------------------------------------- driver


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 x 8 images, a tiny model, a few steps")
    parser.add_argument("--out", default=None, help="run folders (default runs/exp_image_gen; --quick: a temp folder)")
    parser.add_argument(
        "--results", default=None, help=f"report into this file (default {shown(RESULTS)}; --quick: <out>/results.md)"
    )
    parser.add_argument("--no-results", action="store_true", help="write no report file and no image")
    parser.add_argument("--steps", type=int, default=None, help="training steps of each run (default: the budget's)")
    parser.add_argument("--samples", type=int, default=None, help="images sampled per arm (default: the budget's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="compose and validate both runs; train nothing")
    args = parser.parse_args(argv)
    args.out = str(run_folder(args.out, "exp_image_gen", args.quick))
    if args.results is None:
        args.results = str(Path(args.out) / "results.md") if args.quick else str(RESULTS)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    logging.getLogger("xfam").setLevel(logging.INFO)
    budget = QUICK if args.quick else REAL
    budget = replace(budget, steps=args.steps or budget.steps, samples=args.samples or budget.samples)
    out = Path(args.out)
    runs = make_runs(budget, out)
    started = time.perf_counter()
    if not args.dry_run:  # the data cache first, so that neither run's time includes preparing it
        prepared_data(compose(runs[0].overrides))
    cfgs = [train(run, args.dry_run) for run in runs]
    results: dict[str, Any] = {"budget": asdict(budget)}
    if args.dry_run:
        print(f"dry run: {sum(r.status == 'planned' for r in runs)} of {len(runs)} runs compose and validate")
        return results
    cfg = next((c for c in cfgs if c is not None), None)  # (the local2d run's, when it was not refused)
    if cfg is None:
        print("no run could start; nothing to report", flush=True)
        return results
    source = prepared_data(cfg)
    for run, run_cfg in zip(runs, cfgs):
        if run.done and run_cfg is not None:
            print(f"[{run.arm}] timing and sampling", flush=True)
            time_steps(run, run_cfg, source, budget.timing_steps)
            sample(run, source.seq_len, budget.samples)
            print(f"    test bits/pixel {fmt(bits(run.metrics.get('test/loss')), 3)}", flush=True)
    results["runs"] = [{**asdict(r), "run_dir": str(r.run_dir), "command": r.command()} for r in runs]
    results["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    path = Path(args.results)
    png = path.with_name("results_image_gen.png")
    body = report(runs, budget, args, cfg, source, None if args.no_results else png.name)
    results["report"] = body
    print(body, flush=True)
    if not args.no_results:
        plot(runs, source, cfg, budget.samples, png)
        write_section(path, SECTION, body)
        print(f"wrote {path} ({SECTION}) and {png}", flush=True)
    print(f"results: {out / 'results.json'}; total {results['seconds'] / 60:.1f} min", flush=True)
    return results


if __name__ == "__main__":
    main()
