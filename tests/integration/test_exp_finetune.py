"""The fine-tuning recipes (scripts/exp_finetune.py, docs/finetuning.md): every run of the measured budget
composes and validates; each comparison changes only what it compares (the memory; the window, length and
learning rate of Longformer's stages as Beltagy et al. 2020 stage them; the interpolation factor); the commands
in the docs are the script's own; the verdict follows the numbers. The whole ``--quick`` run (every recipe
trained and evaluated at a tiny size, about a minute or two on 2 shared cores) is marked slow."""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import ROOT, compose_cfg
from xfam.config import resolve_streams, validate

sys.path.insert(0, str(ROOT / "scripts"))
import exp_finetune as ef  # noqa: E402

OUT = ROOT / "runs" / "exp_finetune"  # (the default folder: the docs show these paths)
FIXTURE = ROOT / "tests" / "fixtures" / "old_checkpoint" / "step-0000003.ckpt"  # an xfam checkpoint to name


def config(stage: ef.Stage) -> dict:
    """The stage's config, ``init_from`` pointing at a checkpoint that exists (validation reads its structure;
    the recipe's own checkpoint is written by the stage before)."""
    return copy.deepcopy(
        _composed(tuple(f"init_from={FIXTURE}" if o.startswith("init_from=") else o for o in stage.overrides))
    )


@functools.cache
def _composed(overrides: tuple[str, ...]) -> dict:
    return compose_cfg(list(overrides))


def all_stages(seeds: tuple[int, ...] = (0,)) -> list[ef.Stage]:
    """Every run of the measured budget, once (the pretraining is shared by recipes 1 and 3)."""
    b = ef.REAL
    mem = [s for arms in ef.memorizing_runs(b, OUT, list(seeds)) for s in arms.stages()]
    stages = [*mem, *ef.longformer_runs(b, OUT), *ef.interpolation_runs(b, OUT, 0).values()]
    return list({s.label: s for s in stages}.values())


def without(cfg: dict, *keys: str) -> dict:
    """``cfg`` without the dotted ``keys``."""
    out = copy.deepcopy(cfg)
    for key in keys:
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node[part]
        node.pop(leaf, None)
    return out


def test_every_run_of_the_budget_composes_and_validates() -> None:
    stages = all_stages()
    assert len(all_stages((0, 1, 2))) == 3 * 4 + 3 + 5  # per seed 4, 3 Longformer, 5 more of interpolation
    for stage in stages:
        cfg = config(stage)
        validate(cfg)
        assert resolve_streams(cfg)[0], stage.label  # the same stream layout for every run of a length
        assert cfg["model"]["dim"] == 64 and cfg["model"]["layers"] == 2, stage.label


def test_memorizing_arms_differ_only_in_their_memory() -> None:
    (arms,) = ef.memorizing_runs(ef.REAL, OUT, [2])
    a, b, c = config(arms.none), config(arms.knn), config(arms.closed)
    assert without(a, "memory") == without(b, "memory") == without(c, "memory")
    assert a["memory"]["name"] == "none"
    assert b["memory"]["name"] == "xl" and b["memory"]["mem_len"] == 0  # no memory in the other layer
    knn = {"name": "memorizing", "store_size": ef.REAL.store, "topk": 32}
    assert b["memory"]["per_layer"] == {-1: knn} and c["memory"]["per_layer"] == {-1: {**knn, "gate_bias": -3.0}}
    for stage in (arms.none, arms.knn, arms.closed):  # each from its own seed's pretraining
        assert f"init_from={ef.shown(arms.pre.ckpt)}" in stage.overrides
    assert str(arms.pre.ckpt).endswith("pretrain-s2/checkpoints/last.ckpt") and a["seed"] == 2
    assert a["trainer"]["max_steps"] == ef.REAL.finetune and a["data"] == config(arms.pre)["data"]


def test_longformer_stages_double_window_and_length_and_halve_the_rate() -> None:
    first, second, single = ef.longformer_runs(ef.REAL, OUT)
    c1, c2, c0 = config(first), config(second), config(single)
    assert c2["attention"]["window"] == 2 * c1["attention"]["window"]
    assert c2["data"]["seq_len"] == 2 * c1["data"]["seq_len"]
    assert c2["optim"]["lr"] == c1["optim"]["lr"] / 2
    assert c1["init_from"] is None and f"init_from={ef.shown(first.ckpt)}" in second.overrides
    tokens = [c["data"]["seq_len"] * c["data"]["batch_size"] for c in (c1, c2, c0)]
    assert tokens == [tokens[0]] * 3  # the same bytes per step in every stage
    # The control: stage 2's model and data from scratch, for the steps of both stages.
    assert c0["trainer"]["max_steps"] == sum(ef.REAL.stages)
    assert c0["init_from"] is None and c0["attention"] == c2["attention"] and c0["data"] == c2["data"]
    assert c1["attention"]["name"] == "longformer" and c1["attention"]["global_tokens"] == []


def test_interpolation_pairs_differ_only_in_how_positions_extend() -> None:
    runs = ef.interpolation_runs(ef.REAL, OUT, 0)
    pi, plain = config(runs["rope-pi"]), config(runs["rope-plain"])
    assert pi["pos"]["interpolation"] == 2.0 and plain["pos"]["interpolation"] == 1.0
    assert without(pi, "pos.interpolation") == without(plain, "pos.interpolation")
    assert pi["data"]["seq_len"] == 2 * ef.SEQ == 2 * config(runs["rope"])["data"]["seq_len"]
    grown, overlap = config(runs["learned-pi"]), config(runs["learned-overlap"])
    assert grown["finetune"]["interpolate"] == ["pos.table.weight"] and overlap["finetune"]["allow_mismatch"]
    assert without(grown, "finetune") == without(overlap, "finetune")
    assert grown["model"]["max_len"] == 2 * config(runs["learned"])["model"]["max_len"] == 2 * ef.SEQ


def test_a_command_is_exactly_its_run() -> None:
    for stage in all_stages((0, 1)):
        words = shlex.split(stage.command())
        assert words[:3] == ["python", "train.py", f"hydra.run.dir={ef.shown(stage.run_dir)}"]
        assert words[3:] == stage.overrides


def test_the_docs_show_the_scripts_commands() -> None:
    """docs/finetuning.md holds each recipe's tables between its markers, and every training command it shows
    for a recipe is one the script runs (so the docs cannot drift from the script)."""
    text = (ROOT / "docs" / "finetuning.md").read_text()
    commands = {s.command() for s in all_stages((0, 1, 2))}
    shown_any = False
    for recipe in ef.RECIPES:
        block = re.search(
            rf"<!-- experiments:finetune_{recipe}:start -->(.*?)<!-- experiments:finetune_{recipe}:end -->", text, re.S
        )
        assert block, recipe
        for line in re.findall(r"python train\.py [^\n`]*?(?= && \\|\n|`)", block.group(1)):
            assert line.strip() in commands, line
            shown_any = True
    assert shown_any


def test_verdict_follows_the_paired_differences() -> None:
    assert "**helped**" in ef.verdict([-0.05, -0.06, -0.055], "a")
    assert "**hurt**" in ef.verdict([0.05, 0.06, 0.055], "a")
    assert "no difference" in ef.verdict([-0.05, 0.04, -0.01], "a")  # signs disagree
    assert "no difference" in ef.verdict([-0.001, -0.2, -0.001], "a")  # all lower, but within 2 standard errors
    assert "no difference" in ef.verdict([-0.05], "a")  # one seed: no spread, no claim
    mean, sd = ef.mean_sd([1.0, 2.0, 4.0])
    assert mean == pytest.approx(7 / 3) and sd == pytest.approx(((16 / 9 + 1 / 9 + 25 / 9) / 2) ** 0.5)


@pytest.mark.slow
def test_quick_run_trains_every_recipe_and_writes_its_tables(tmp_path: Path) -> None:
    docs = tmp_path / "finetuning.md"
    docs.write_text("# Fine-tuning\n\nprose kept\n")
    results = ef.main(["all", "--quick", "--seeds", "0", "--out", str(tmp_path / "runs"), "--docs", str(docs)])
    saved = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert set(saved) >= {"memorizing", "longformer", "interpolation"}
    runs = [*(s for r in results["memorizing"]["rows"] for s in r["runs"]), *results["longformer"]["stages"]]
    assert len(runs) == 4 + 3
    runs += list(results["interpolation"]["runs"].values())
    assert all(r["status"] == "ok" for r in runs), [(r["label"], r["reason"]) for r in runs]
    text = docs.read_text()
    assert "prose kept" in text and all(f"experiments:finetune_{r}:end" in text for r in ef.RECIPES)
    out = tmp_path / "runs"
    knn_log = (out / "memorizing" / "knn-s0" / "train.log").read_text()
    assert "15 loaded, 2 new, 0 mismatched, 0 dropped" in knn_log and "memories.{1}.gate" in knn_log
    assert "interpolated over 64 -> 128 positions" in (out / "interpolation" / "learned-pi" / "train.log").read_text()
    evals = results["interpolation"]["evals"]
    assert isinstance(evals["learned"][2 * ef.SEQ], str) and evals["learned"][2 * ef.SEQ].startswith("refused")
    assert all(isinstance(evals[k][n], float) for k in ("rope", "rope+pi0", "rope-pi") for n in (64, 128, 256))
    assert evals["rope+pi0"] != evals["rope"]  # the interpolation factor reaches the evaluated model
