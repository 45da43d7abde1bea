"""``init_from``: a checkpoint's weights start a model of a changed config (xfam.model.init_from): exact copies by
name and shape, fresh init kept for new tensors, shape changes refused or filled as asked (overlap, position
interpolation), the output head of another task left new; freezing and the optimiser's loaded/new groups; the
config check before launch."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.helpers import CONFIG_DIR, compose_cfg
from xfam.config import validate
from xfam.config.specs import OptimSpec
from xfam.core.errors import ConfigError
from xfam.core.registry import defaults_of
from xfam.model.build import build_model
from xfam.model.checkpoint_file import DIGEST_KEY, digest
from xfam.model.init_from import (
    FinetuneSpec,
    ParamSplit,
    finetune_problems,
    freeze,
    init_from,
    interpolate_rows,
    mark_split,
)
from xfam.training.lit.optim import lr_factor, make_optimizer, param_groups

SMALL = ["model.dim=32", "model.layers=2", "model.heads=2", "model.max_len=64", "data.seq_len=32"]
LM = {"task": "lm", "vocab_size": 257, "num_classes": None}
CLASSIFY = {"task": "classify", "vocab_size": 257, "num_classes": 10}


@functools.cache
def _cfg(overrides: tuple[str, ...]) -> dict:
    return compose_cfg([*SMALL, *overrides])


def model_of(*overrides: str, seed: int = 1, info: dict = LM) -> torch.nn.Module:
    """A tiny model of ``overrides`` (validated), initialised from ``seed``."""
    torch.manual_seed(seed)
    return build_model(validate(_cfg(overrides)), info)


def save(model: torch.nn.Module, path: Path, *overrides: str, info: dict = LM) -> Path:
    """``model`` as an xfam checkpoint (the Lightning module's ``model.`` prefix, metadata, digest)."""
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "global_step": 7,
        "xfam": {"config_version": 1, "config": _cfg(overrides), "data_info": info},
    }
    ckpt[DIGEST_KEY] = digest(ckpt)
    torch.save(ckpt, path)
    return path


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def names(entries) -> set[str]:
    return {e.name for e in entries}


def test_matching_tensors_copied_exactly_and_new_ones_keep_their_fresh_init(tmp_path: Path) -> None:
    base = model_of(seed=0)
    path = save(base, tmp_path / "plain.ckpt")
    model = model_of("memory=memorizing", seed=1)
    fresh = snapshot(model)
    report = init_from(model, path, FinetuneSpec())
    new = {f"memories.{i}.{p}" for i in (0, 1) for p in ("gate", "log_scale")}
    assert names(report.new) == new and not report.mismatched and not report.dropped
    assert names(report.loaded) == set(base.state_dict()) and report.loaded_params == set(base.state_dict())
    for name, value in model.state_dict().items():
        expected = fresh[name] if name in new else base.state_dict()[name]
        assert torch.equal(value, expected), name
    assert not torch.equal(fresh["embed.weight"], base.state_dict()["embed.weight"])  # (the copy is not vacuous)
    table = report.table()
    assert "15 loaded, 4 new, 0 mismatched, 0 dropped" in table and "(step 7)" in table
    assert "blocks.{0-1}.attn.qkv.weight" in table and "memories.{0-1}.gate" in table


def test_memory_removed_is_dropped_and_a_tied_head_loads_through_its_embedding(tmp_path: Path) -> None:
    memorizing = model_of("memory=memorizing", seed=0)
    report = init_from(model_of(), save(memorizing, tmp_path / "m.ckpt", "memory=memorizing"), FinetuneSpec())
    assert names(report.dropped) == {f"memories.{i}.{p}" for i in (0, 1) for p in ("gate", "log_scale")}
    untied = model_of(seed=0)
    tied = model_of("model.tie_embeddings=true")
    report = init_from(tied, save(untied, tmp_path / "u.ckpt"), FinetuneSpec())
    assert [(e.name, e.note) for e in report.dropped] == [("head.weight", "tied to embed.weight here")]
    assert torch.equal(tied.head.weight, untied.embed.weight) and tied.head.weight is tied.embed.weight
    report = init_from(model_of("model.tie_embeddings=true"), save(tied, tmp_path / "t.ckpt"), FinetuneSpec())
    assert not report.dropped and not report.new  # tied in both: nothing dropped


def test_width_change_refused_naming_each_shape_and_nothing_copied(tmp_path: Path) -> None:
    path = save(model_of(seed=0), tmp_path / "narrow.ckpt")
    wide = model_of("model.dim=64")
    fresh = snapshot(wide)
    with pytest.raises(ConfigError) as err:
        init_from(wide, path, FinetuneSpec())
    text = str(err.value)
    assert "embed.weight: [257, 32] in the checkpoint, [257, 64] here" in text
    assert "blocks.{0-1}.attn.qkv.weight: [96, 32] in the checkpoint, [192, 64] here" in text
    assert "model.dim 32 -> 64" in text and "Fix: finetune.allow_mismatch=true" in text
    assert all(torch.equal(v, fresh[k]) for k, v in wide.state_dict().items())  # refused before any copy


def test_allow_mismatch_copies_the_overlap_and_keeps_the_rest_fresh(tmp_path: Path) -> None:
    narrow = model_of(seed=0)
    wide = model_of("model.dim=64")
    fresh = snapshot(wide)
    report = init_from(wide, save(narrow, tmp_path / "n.ckpt"), FinetuneSpec(allow_mismatch=True))
    assert not report.loaded and len(report.mismatched) == 15 and report.loaded_params == frozenset()
    old, new = narrow.blocks[0].attn.qkv.weight, wide.blocks[0].attn.qkv.weight  # [96, 32] -> [192, 64]
    assert torch.equal(new[:96, :32], old)
    assert torch.equal(new[96:], fresh["blocks.0.attn.qkv.weight"][96:])
    assert torch.equal(new[:, 32:], fresh["blocks.0.attn.qkv.weight"][:, 32:])
    assert "overlap [96, 32] copied" in report.table()


def test_grown_position_table_interpolates_positions(tmp_path: Path) -> None:
    """Chen et al. (2023): position m of the longer context is position m L / L' of the trained one; doubling the
    table puts old row k at row 2k and midpoints between, the last row clamped to the old last row."""
    short = model_of("pos=learned", seed=0)
    path = save(short, tmp_path / "short.ckpt", "pos=learned")
    with pytest.raises(ConfigError, match=r"pos.table.weight: \[64, 32\] in the checkpoint, \[128, 32\] here"):
        init_from(model_of("pos=learned", "model.max_len=128"), path, FinetuneSpec())
    long = model_of("pos=learned", "model.max_len=128")
    report = init_from(long, path, FinetuneSpec(interpolate=["pos.table.weight"]))
    old, new = short.pos.table.weight, long.pos.table.weight
    assert torch.equal(new[0::2], old)
    torch.testing.assert_close(new[1:-1:2], (old[:-1] + old[1:]) / 2)
    assert torch.equal(new[-1], old[-1])
    assert [e.name for e in report.mismatched] == [
        "pos.table.weight"
    ] and "pos.table.weight" not in report.loaded_params
    overlap = model_of("pos=learned", "model.max_len=128")
    fresh = snapshot(overlap)
    init_from(overlap, path, FinetuneSpec(allow_mismatch=True))  # rows 0..63 copied, 64.. fresh
    assert torch.equal(overlap.pos.table.weight[:64], old)
    assert torch.equal(overlap.pos.table.weight[64:], fresh["pos.table.weight"][64:])
    torch.testing.assert_close(interpolate_rows(old, 32), old[0::2])  # (shrinking samples every other row)


def test_interpolate_refuses_a_width_change_and_a_pattern_matching_nothing(tmp_path: Path) -> None:
    path = save(model_of("pos=learned", seed=0), tmp_path / "p.ckpt", "pos=learned")
    with pytest.raises(ConfigError, match=r"pos.table.weight: \[64, 32\] in the checkpoint, \[64, 64\] here"):
        init_from(model_of("pos=learned", "model.dim=64"), path, FinetuneSpec(interpolate=["*"]))
    with pytest.raises(ConfigError, match=r"pattern 'pos.tabel.\*' matches no tensor.*pos.table.weight"):
        init_from(model_of("pos=learned"), path, FinetuneSpec(interpolate=["pos.tabel.*"]))


def test_recipes_without_tensor_changes_load_everything(tmp_path: Path) -> None:
    """RoPE position interpolation (pos.interpolation) and a Longformer's grown window change no tensor."""
    for before, after in [
        (("pos=rope",), ("pos=rope", "pos.interpolation=2.0", "model.max_len=128")),
        (("attention=longformer", "attention.window=8"), ("attention=longformer", "attention.window=16")),
    ]:
        base = model_of(*before, seed=0)
        model = model_of(*after)
        report = init_from(model, save(base, tmp_path / "r.ckpt", *before), FinetuneSpec())
        assert not report.new and not report.mismatched and not report.dropped, after
        assert all(torch.equal(v, base.state_dict()[k]) for k, v in model.state_dict().items())


def test_another_task_gets_a_new_head_and_the_encoder_loads(tmp_path: Path) -> None:
    ov = ("model.max_len=256", "data.seq_len=256", "model.tie_embeddings=true")
    lm = model_of(*ov, seed=0)
    path = save(lm, tmp_path / "lm.ckpt", *ov)
    clf = model_of(*ov, "data=listops", info=CLASSIFY)
    fresh = snapshot(clf)
    report = init_from(clf, path, FinetuneSpec())
    assert names(report.new) == {"head.weight", "head.bias"} and not report.mismatched
    assert [e.note for e in report.new] == ["head of task lm"] * 2
    assert torch.equal(clf.head.weight, fresh["head.weight"]) and torch.equal(clf.embed.weight, lm.embed.weight)
    assert "task lm -> classify" in report.table()


def test_persistent_buffers_load_as_buffers(tmp_path: Path) -> None:
    """RFA's random features are persistent buffers: the loaded weights were trained with them."""
    base = model_of("attention=rfa", seed=0)
    model = model_of("attention=rfa")
    report = init_from(model, save(base, tmp_path / "rfa.ckpt", "attention=rfa"), FinetuneSpec())
    proj = "blocks.0.attn.mechanism.proj"
    assert torch.equal(model.state_dict()[proj], base.state_dict()[proj])
    assert proj in {e.name for e in report.loaded if e.buffer} and proj not in report.loaded_params


def test_freeze_keeps_frozen_parameters_through_an_optimizer_step() -> None:
    model = model_of()
    frozen = freeze(model, ["embed.*", "blocks.0.*"])
    assert set(frozen) == {"embed.weight"} | {n for n, _ in model.named_parameters() if n.startswith("blocks.0.")}
    before = snapshot(model)
    opt = make_optimizer(model, OptimSpec(warmup_steps=0, weight_decay=0.1), total_steps=10)["optimizer"]
    in_groups = {id(p) for g in opt.param_groups for p in g["params"]}
    model(torch.randint(0, 257, (2, 16))).logits.square().mean().backward()
    opt.step()
    for name, p in model.named_parameters():
        assert (id(p) in in_groups) == (name not in frozen), name
        assert torch.equal(p, before[name]) == (name in frozen), name
    with pytest.raises(ConfigError, match=r"finetune.freeze: pattern 'embd.\*' matches no tensor.*embed.weight"):
        freeze(model, ["embd.*"])


def test_loaded_and_new_groups_carry_their_learning_rates(tmp_path: Path) -> None:
    model = model_of("memory=memorizing")
    report = init_from(model, save(model_of(seed=0), tmp_path / "p.ckpt"), FinetuneSpec())
    freeze(model, ["norm.weight"])
    mark_split(model, ParamSplit(loaded=report.loaded_params, lr_loaded=1e-4, lr_new=1e-2))
    spec = OptimSpec(lr=1e-3, warmup_steps=3, weight_decay=0.1)
    out = make_optimizer(model, spec, total_steps=20)
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    groups = {g["name"]: g for g in opt.param_groups}
    assert list(groups) == ["loaded", "loaded_no_decay", "new", "new_no_decay"]
    by_name = {id(p): n for n, p in model.named_parameters()}
    members = {k: {by_name[id(p)] for p in g["params"]} for k, g in groups.items()}
    assert members["loaded"] | members["loaded_no_decay"] == report.loaded_params - {"norm.weight"}
    assert members["new"] | members["new_no_decay"] == {n for n in by_name.values() if n.startswith("memories.")}
    plain = param_groups(model, spec)  # the decay split is kept inside each part
    assert members["loaded"] | members["new"] == {by_name[id(p)] for p in plain[0]["params"]}
    assert {k: g["weight_decay"] for k, g in groups.items()} == {
        "loaded": 0.1,
        "loaded_no_decay": 0.0,
        "new": 0.1,
        "new_no_decay": 0.0,
    }
    for step in range(5):  # the schedule multiplies each group's own base rate
        factor = lr_factor(step, spec, 20)
        for name, base in (("loaded", 1e-4), ("loaded_no_decay", 1e-4), ("new", 1e-2), ("new_no_decay", 1e-2)):
            assert groups[name]["lr"] == pytest.approx(base * factor), (step, name)
        opt.step()
        sched.step()
    spec_default = ParamSplit(loaded=report.loaded_params)  # null rates: optim.lr
    assert {g["lr"] for g in param_groups(model, spec, spec_default)} == {1e-3}


def test_config_check_before_launch(tmp_path: Path) -> None:
    good = save(model_of(seed=0), tmp_path / "good.ckpt")
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")

    def problems(**top) -> list[str]:
        cfg = dict(_cfg(()))
        cfg["finetune"] = {**cfg["finetune"], **top.pop("finetune", {})}
        return finetune_problems({**cfg, **top})

    assert problems(init_from=str(good)) == [] and problems(init_from=str(good), ckpt_path="auto") == []
    assert "no such file" in problems(init_from=str(tmp_path / "missing.ckpt"))[0]
    assert "cannot be read as a checkpoint" in problems(init_from=str(tmp_path / "text.ckpt"))[0]
    assert "not an xfam checkpoint" in problems(init_from=str(tmp_path / "foreign.ckpt"))[0]
    (both,) = problems(init_from=str(good), ckpt_path=str(good))
    assert "ckpt_path resumes that checkpoint exactly" in both and "ckpt_path=auto" in both
    (unused,) = problems(finetune={"lr_new": 0.01, "allow_mismatch": True})
    assert unused.startswith("finetune.allow_mismatch, finetune.lr_new set without init_from")
    assert problems(finetune={"freeze": ["embed.*"]}) == []  # freezing needs no checkpoint
    assert "empty pattern" in problems(init_from=str(good), finetune={"freeze": [" "]})[0]
    rc = validate(compose_cfg([*SMALL, f"init_from={good}", "finetune.lr_new=0.01", "finetune.freeze=[embed.*]"]))
    assert rc.finetune == FinetuneSpec(lr_new=0.01, freeze=["embed.*"]) and rc.run.init_from == str(good)
    with pytest.raises(ConfigError, match=r"finetune.freeze='embed.\*': must be a list"):
        validate(compose_cfg([*SMALL, "finetune.freeze=embed.*"]))
    with pytest.raises(ConfigError, match=r"finetune.lr_loaded=0: must be > 0"):
        validate(compose_cfg([*SMALL, f"init_from={good}", "finetune.lr_loaded=0"]))


def test_train_yaml_finetune_section_mirrors_the_spec() -> None:
    top = yaml.safe_load((CONFIG_DIR / "train.yaml").read_text())
    assert top["finetune"] == defaults_of(FinetuneSpec, skip=()) and top["init_from"] is None
