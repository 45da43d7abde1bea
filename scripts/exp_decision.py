"""The Decision Transformer's central claims at CPU scale (Chen et al., 2021, arXiv:2106.01345, sec. 4-5).

    python scripts/exp_decision.py                 # 2 envs x 4 methods x 3 seeds, into docs/results.md
    python scripts/exp_decision.py --quick         # smoke run: a few steps, 2 episodes; report into <out>
    python scripts/exp_decision.py --envs cartpole --seeds 0

Every run is ``python train.py experiment=decision data.env=<env> data.noise=<noise> seed=<s> <method>``, trained
in this process (``xfam.train``, ``--threads`` torch threads) on the same locally generated trajectories of each
environment (``data=gym``: a scripted expert, a noisy expert and a random policy, 100 episodes each; the data seed
is fixed, ``seed`` varies the model and the training order). Methods, one backbone:

* ``DT``: the Decision Transformer, K = 20;
* ``BC``: behaviour cloning, the same model without return tokens (``data.returns=false``);
* ``%BC``: behaviour cloning on the top 10% of training episodes by return (``data.top_fraction=0.1``);
* ``DT K=1``: the context-length ablation of the paper's sec. 5.3 (``data.context=1``).

Each final checkpoint then acts in its environment (``xfam.eval.rollout``) for ``--episodes`` episodes per target
return, reset with the test seeds (10000 + i) so no episode is one of validation's (discrete actions drawn from the
prediction, ``task.rollout_sample``, as the paper's Atari evaluation; continuous ones deterministic): the DT at a
grid of targets spanning the data's returns (claim 1: the return follows the target), the others at the expert's
return (they read no returns). Scores are normalised per environment: the data's random behaviour 0, its expert 100.
Reported (mean and spread over seeds): the score of each method at the expert target (claim 2: DT >= BC and ~ %BC),
the DT's return against each target, K = 1 vs 20; where a claim does not hold at this scale the report says so. Raw
results: ``<out>/results.json``; ``docs/results_decision.png``; the report goes between ``<!--
experiments:decision:start/end -->`` of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
PLOT = ROOT / "docs" / "results_decision.png"
SECTION = "decision"
sys.path.insert(0, str(ROOT / "scripts"))
from exp_finetune import compose, shown  # noqa: E402
from memory_experiments import pyplot, save  # noqa: E402
from run_experiments import run_folder, write_section  # noqa: E402

#: Per environment: the noisy expert's noise (a medium-quality tier between expert and random) and the target
#: returns the DT is conditioned on (from the random policy's level up to the expert's).
ENVS = {
    "cartpole": {"noise": 0.5, "targets": [25, 100, 200, 300, 400, 500]},
    "pendulum": {"noise": 0.9, "targets": [-1200, -900, -600, -400, -250, -150]},
}
METHODS = {
    "DT": [],
    "BC": ["data.returns=false", "model.max_len=40"],
    "%BC": ["data.returns=false", "data.top_fraction=0.1", "model.max_len=40"],
    "DT K=1": ["data.context=1", "model.max_len=3"],
}
QUICK = ["trainer.max_steps=20", "trainer.val_check_interval=10", "optim.warmup_steps=5", "data.episodes=6"]
TEST_SEED = 10_000


def overrides(env: str, method: str, seed: int, quick: bool) -> list[str]:
    # (rollouts run after training, below: none during validation)
    base = ["experiment=decision", f"data.env={env}", f"data.noise={ENVS[env]['noise']}", f"seed={seed}"]
    return [*base, *METHODS[method], "task.rollout_episodes=0", *(QUICK if quick else [])]


def run_one(env: str, method: str, seed: int, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Train one run (reused when its record holds the same config and episodes) and roll it out."""
    import xfam
    from xfam.eval.rollout import normalised, rollout
    from xfam.model.checkpoint import load_model

    words = overrides(env, method, seed, args.quick)
    cfg = compose(words)
    run_dir = out / env / method.replace(" ", "").replace("=", "").replace("%", "pct") / f"seed{seed}"
    record = run_dir / "record.json"
    if record.exists():
        old = json.loads(record.read_text())
        if old["config"] == cfg and old["episodes"] == args.episodes:
            return old
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    metrics = xfam.train(cfg, run_dir)
    seconds = time.perf_counter() - start
    model, meta = load_model(run_dir / "checkpoints" / "last.ckpt")
    decision = meta["data_info"]["decision"]
    reference = decision["reference_returns"]
    targets = ENVS[env]["targets"] if method.startswith("DT") else [reference["expert"]]
    if args.quick:
        targets = targets[-2:]
    rollouts = []
    for target in targets:
        res = rollout(
            model, decision, target, episodes=args.episodes, seed=TEST_SEED, sample=cfg["task"]["rollout_sample"]
        )
        rollouts.append(
            {"target": target, "mean": res.mean, "std": res.std, "score": normalised(res.mean, reference),
             "seconds": res.seconds, "steps": res.steps}
        )  # fmt: skip
        print(f"    {env} {method} seed {seed}: target {target:g} -> return {res.mean:.1f} ({res.seconds:.0f} s)")
    result = {
        "config": cfg,
        "command": "python train.py " + " ".join(w for w in words if w != "task.rollout_episodes=0"),
        "env": env,
        "method": method,
        "seed": seed,
        "episodes": args.episodes,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, int | float)},
        "reference": reference,
        "manifest": data_summary(cfg),
        "rollouts": rollouts,
        "seconds": seconds,
        "params": sum(p.numel() for p in model.parameters()),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(result, indent=1, default=str))
    return result


def data_summary(cfg: dict[str, Any]) -> dict[str, Any]:
    """The behaviour policies' returns and the training split's range (the data manifest)."""
    from xfam.model.build import build_data

    source = build_data(cfg)
    source.prepare()
    m = source.manifest
    return {"policies": m["policies_returns"], "train_returns": m["splits"]["train"]["returns"]}


def at_expert(r: dict[str, Any]) -> dict[str, Any]:
    """The rollout conditioned on the expert's return (the DT's highest target; BC's only one)."""
    return r["rollouts"][-1]


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.1f} ± {sd:.1f}"


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    envs = list(dict.fromkeys(r["env"] for r in results))
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]
    seeds = sorted({r["seed"] for r in results})
    first = results[0]
    m, d = first["config"]["model"], first["config"]["data"]
    quick = " --quick" if args.quick else ""
    command = first["command"].replace(f"seed={first['seed']}", "seed=<s>")
    lines = [
        f"Command: `OMP_NUM_THREADS={args.threads} python scripts/exp_decision.py{quick} --envs {','.join(envs)} "
        f"--seeds {','.join(map(str, seeds))} --episodes {args.episodes}` (torch threads: {args.threads}; the "
        f"shared 2-core CPU). Each run: `{command}` plus the "
        f"method's overrides (scripts/exp_decision.py). Model: {m['layers']} layers x {m['dim']} wide, {m['heads']} "
        f"head, pos={first['config']['pos']['name']} (timestep embedding), {first['config']['trainer']['max_steps']} "
        f"steps of {d['batch_size']} windows; rollouts: {args.episodes} test-seeded episodes per target, scores "
        f"normalised per environment (random behaviour 0, expert 100); ± is the standard deviation over "
        f"{len(seeds)} training seeds.",
        "",
        "Data (generated once per environment, 100 episodes per behaviour policy, 80/10/10 % split by episode):",
        "",
        "| env | expert return | noisy expert (noise) | random | training episodes' returns |",
        "|---|---|---|---|---|",
    ]
    for env in envs:
        s = next(r for r in results if r["env"] == env)["manifest"]
        p, tr = s["policies"], s["train_returns"]
        lines.append(
            f"| {env} | {p['expert']['mean']:.1f} | {p['noisy']['mean']:.1f} ({ENVS[env]['noise']}) | "
            f"{p['random']['mean']:.1f} | {tr['min']:.1f} .. {tr['max']:.1f} |"
        )
    lines += ["", "**Claim 2: the DT matches or beats behaviour cloning.** Score at the expert's return:", ""]
    lines += ["| method | " + " | ".join(envs) + " |", "|---|" + "---|" * len(envs)]
    scores: dict[tuple[str, str], list[float]] = {}
    for method in methods:
        cells = []
        for env in envs:
            runs = [r for r in results if r["env"] == env and r["method"] == method]
            scores[env, method] = [at_expert(r)["score"] for r in runs]
            cells.append(spread(scores[env, method]) if runs else "-")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "**Claim 1: the return follows the conditioning target.** DT (K = 20) return per target:", ""]
    for env in envs:
        runs = [r for r in results if r["env"] == env and r["method"] == "DT"]
        if not runs:
            continue
        targets = [x["target"] for x in runs[0]["rollouts"]]
        lines += [f"| {env}: target | " + " | ".join(f"{t:g}" for t in targets) + " |", "|---|" + "---|" * len(targets)]
        lines.append(
            "| return | "
            + " | ".join(spread([r["rollouts"][i]["mean"] for r in runs]) for i in range(len(targets)))
            + " |"
        )
        lines.append("")
    lines += verdicts(results, scores, envs)
    if args.plot:
        lines += ["", f"![DT return against the target return; BC, %BC and the behaviour policies]({PLOT.name})"]
    return "\n".join(lines)


def verdicts(results: list[dict[str, Any]], scores: dict, envs: list[str]) -> list[str]:
    """What the numbers say about each claim, per environment, in words (computed, never asserted)."""
    out = ["Verdicts (computed from the tables above):", ""]
    for env in envs:
        mean = {k[1]: statistics.mean(v) for k, v in scores.items() if k[0] == env and v}
        sd = {k[1]: (statistics.stdev(v) if len(v) > 1 else 0.0) for k, v in scores.items() if k[0] == env and v}
        for other, held, missed in (
            ("BC", "reproduced (DT >= BC within one seed spread).", "NOT reproduced at this scale."),
            ("%BC", "DT matches or beats %BC.", "%BC is better here (the paper: comparable on D4RL)."),
        ):
            if "DT" in mean and other in mean:
                margin = mean["DT"] - mean[other]
                holds = margin >= -max(sd["DT"], sd[other])
                out.append(f"* {env}: DT vs {other} {margin:+.1f} points: " + (held if holds else missed))
        runs = [r for r in results if r["env"] == env and r["method"] == "DT"]
        if runs:
            targets = [x["target"] for x in runs[0]["rollouts"]]
            means = [statistics.mean(r["rollouts"][i]["mean"] for r in runs) for i in range(len(targets))]
            rho = spearman(targets, means)
            out.append(
                f"* {env}: DT return vs target, Spearman rank correlation {rho:+.2f} over {len(targets)} targets: "
                + ("the return rises with the target." if rho >= 0.8 else "the return does NOT track the target well.")
            )
        if "DT K=1" in mean and "DT" in mean:
            gain = mean["DT"] - mean["DT K=1"]
            helps = gain > max(sd["DT"], sd["DT K=1"])
            out.append(
                f"* {env}: context K = 20 vs K = 1: {gain:+.1f} points "
                + ("(the longer context helps, as in the paper)." if helps else "(no gain beyond the seed spread).")
            )
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (tied values share their mean rank; 0 when either side is constant)."""

    def ranks(v: list[float]) -> list[float]:
        return [statistics.mean(j for j, w in enumerate(sorted(v)) if w == u) for u in v]

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    envs = list(dict.fromkeys(r["env"] for r in results))
    fig, axes = plt.subplots(1, len(envs), figsize=(5.5 * len(envs), 4), squeeze=False)
    for ax, env in zip(axes[0], envs, strict=True):
        ref = next(r for r in results if r["env"] == env)["reference"]
        for method, style in (("DT", "o-"), ("DT K=1", "s--")):
            runs = [r for r in results if r["env"] == env and r["method"] == method]
            if not runs:
                continue
            targets = [x["target"] for x in runs[0]["rollouts"]]
            means = [statistics.mean(r["rollouts"][i]["mean"] for r in runs) for i in range(len(targets))]
            ax.plot(targets, means, style, label=method)
        lo, hi = ref["random"], ref["expert"]
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, linestyle=":", label="return = target")
        for method, color in (("BC", "tab:red"), ("%BC", "tab:green")):
            runs = [r for r in results if r["env"] == env and r["method"] == method]
            if runs:
                ax.axhline(statistics.mean(at_expert(r)["mean"] for r in runs), color=color, label=method)
        ax.axhline(hi, color="gray", linestyle="--", linewidth=0.8, label="expert behaviour")
        ax.axhline(lo, color="gray", linestyle="-.", linewidth=0.8, label="random behaviour")
        ax.set_title(env)
        ax.set_xlabel("target return")
        ax.set_ylabel("achieved return (mean over seeds)")
        ax.legend(fontsize=7, loc="lower right")
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: a few steps, report into <out>")
    parser.add_argument("--envs", default=",".join(ENVS), help=f"comma-separated environments of {list(ENVS)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated methods of {list(METHODS)}")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default 0,1,2)")
    parser.add_argument("--episodes", type=int, default=10, help="rollout episodes per target (default 10)")
    parser.add_argument("--out", default=None, help="run folders (default: runs/exp_decision; --quick: a tmp dir)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="no PNG")
    args = parser.parse_args()
    envs, methods = args.envs.split(","), args.methods.split(",")
    if bad := [e for e in envs if e not in ENVS] + [m for m in methods if m not in METHODS]:
        parser.error(f"unknown {bad}; environments: {list(ENVS)}, methods: {list(METHODS)}")
    if args.quick:
        args.episodes = min(args.episodes, 2)
    import torch

    torch.set_num_threads(args.threads)
    out = run_folder(args.out, "exp_decision", args.quick)
    results = [
        run_one(env, method, int(seed), out, args)
        for env in envs
        for method in methods
        for seed in args.seeds.split(",")
    ]
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results_md, png = (out / "results.md", out / PLOT.name) if args.quick else (RESULTS, PLOT)
    if args.plot:
        plot(results, png)
    write_section(results_md, SECTION, report(results, args))
    print(f"report: {shown(results_md)}")


if __name__ == "__main__":
    main()
