"""``validate`` beyond the slots: Lightning's Trainer arguments (``xfam.config.trainer_args``), deleted keys, the run
name, model.causal against the task, the metrics a run reports, wandb credentials, Triton tile sizes and the
``xfam generate`` length; each refused before anything is written, with the fix."""

from __future__ import annotations

import copy
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.helpers import ROOT, compose_cfg
from xfam.config import check_machine, check_trainer, lightning_trainer_args, trainer_args, validate
from xfam.core.errors import ConfigError
from xfam.eval.generate import generate
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

SMALL = ["model.dim=32", "model.layers=2", "model.heads=2", "model.max_len=64", "data.seq_len=32"]
SLOTS = {
    "attention": {"name": "vanilla"},
    "pos": {"name": "rope"},
    "memory": {"name": "none"},
    "exit": {"name": "none"},
}


@pytest.fixture(scope="module")
def base() -> dict:
    return compose_cfg(SMALL)


def problems(cfg: dict) -> list[str]:
    try:
        validate(cfg)
    except ConfigError as err:
        return err.problems
    return []


def with_trainer(base: dict, **values: Any) -> dict:
    return {**base["trainer"], **values}


# -- Lightning's Trainer arguments ---------------------------------------------------------------------

#: (values, texts of the one problem): what gave a traceback once the run folder existed, or trained silently
#: with another meaning (max_steps=1.5, a negative gradient_clip_val ...).
INVALID = [
    ({"max_steps": -5}, ["trainer.max_steps=-5: must be >= -1", "Fix:"]),
    ({"max_epochs": -5}, ["trainer.max_epochs=-5", "-1 (no epoch limit)"]),
    ({"limit_val_batches": -1}, ["trainer.limit_val_batches=-1: must be >= 0"]),
    ({"limit_val_batches": 1.5}, ["trainer.limit_val_batches=1.5", "[0.0, 1.0]"]),
    ({"devices": 0}, ["trainer.devices=0"]),
    ({"devices": -1}, ["trainer.devices=-1 with trainer.accelerator=cpu"]),
    ({"precision": "64-truee"}, ["trainer.precision: unknown value '64-truee'", "Did you mean '64-true'"]),
    ({"precision": 16.0}, ["trainer.precision: unknown value 16.0"]),
    ({"strategy": "nonsense"}, ["trainer.strategy: unknown value 'nonsense'", "ddp_spawn"]),
    ({"accelerator": "gpus"}, ["trainer.accelerator: unknown value 'gpus'", "Did you mean 'gpu'"]),
    ({"accumulate_grad_batches": 0}, ["trainer.accumulate_grad_batches=0: must be > 0"]),
    ({"max_steps": 1.5}, ["trainer.max_steps=1.5: must be an integer"]),
    ({"gradient_clip_val": -1}, ["trainer.gradient_clip_val=-1: must be >= 0"]),
    ({"log_every_n_steps": -3}, ["trainer.log_every_n_steps=-3: must be >= 0"]),
    ({"num_sanity_val_steps": -7}, ["trainer.num_sanity_val_steps=-7: must be >= -1"]),
    ({"val_check_interval": 0}, ["trainer.val_check_interval=0: must be > 0"]),
    ({"val_check_interval": 0.5}, ["is a share of an epoch", "check_val_every_n_epoch=1"]),
    ({"check_val_every_n_epoch": 0}, ["trainer.check_val_every_n_epoch=0: must be > 0"]),
    ({"num_nodes": 0}, ["trainer.num_nodes=0: must be > 0"]),
    ({"deterministic": "maybe"}, ["trainer.deterministic='maybe'"]),
    ({"max_steps": -1}, ["training has no step or epoch limit", "trainer.max_epochs=<epochs>"]),
    ({"max_steps": -1, "max_epochs": None, "max_time": "00:01:00:00"}, ["training has no step or epoch limit"]),
    ({"max_time": "1:00"}, ["trainer.max_time='1:00'", "DD:HH:MM:SS"]),
    ({"max_time": {"hour": 1}}, ["not hour"]),
    ({"barebones": True}, ["trainer.barebones=true disables logging and checkpoints"]),
    ({"fast_dev_run": -1}, ["trainer.fast_dev_run=-1"]),
    ({"profiler": "fancy"}, ["trainer.profiler='fancy': must be simple, advanced, pytorch, xla or null"]),
    ({"gradient_clip_algorithm": "l2"}, ["trainer.gradient_clip_algorithm='l2'"]),
    ({"reload_dataloaders_every_n_epochs": -1}, ["trainer.reload_dataloaders_every_n_epochs=-1"]),
    ({"overfit_batches": -2}, ["trainer.overfit_batches=-2"]),
    ({"min_steps": -1}, ["trainer.min_steps=-1: must be >= 0"]),
    ({"limit_train_batches": 2.5}, ["trainer.limit_train_batches=2.5"]),
    ({"inference_mode": "maybe"}, ["trainer.inference_mode='maybe': must be true or false"]),
    ({"devices": [0, 0], "accelerator": "gpu"}, ["distinct"]),
    ({"devices": "0", "accelerator": "gpu"}, ["trainer.devices='0'"]),
]


@pytest.mark.parametrize(("values", "texts"), INVALID, ids=[str(v) for v, _ in INVALID])
def test_invalid_trainer_values_are_refused_with_the_fix(values: dict, texts: list[str], base: dict) -> None:
    found = check_trainer(with_trainer(base, **values))
    assert len(found) == 1, found
    for text in texts:
        assert text in found[0], f"{text!r} not in {found[0]!r}"
    assert "Fix:" in found[0]


#: Values Lightning accepts (its own semantics), which the table must accept too.
VALID = [
    {"limit_val_batches": 0.5},
    {"limit_val_batches": 5.0},
    {"limit_val_batches": 0},
    {"limit_test_batches": None},
    {"max_steps": -1, "max_epochs": 3},
    {"max_steps": -1, "max_epochs": None},  # Lightning's 1000 epochs
    {"max_epochs": None},
    {"max_time": "00:12:00:00"},
    {"max_time": {"hours": 2}},
    {"val_check_interval": 1.0, "check_val_every_n_epoch": 1},
    {"val_check_interval": "00:00:10:00"},
    {"devices": "auto"},
    {"devices": "2"},
    {"devices": "0,1", "accelerator": "gpu", "precision": "bf16-mixed"},
    {"devices": [0, 1], "accelerator": "cuda", "precision": 16},
    {"devices": -1, "accelerator": "gpu", "precision": "16-mixed"},
    {"precision": "bf16"},
    {"precision": 64},
    {"strategy": "DDP_spawn"},
    {"strategy": "ddp_spawn_find_unused_parameters_true"},  # from Lightning's registry
    {"gradient_clip_val": None},
    {"gradient_clip_algorithm": "Value"},
    {"deterministic": "warn"},
    {"fast_dev_run": True},
    {"fast_dev_run": 3},
    {"profiler": "simple"},
    {"num_sanity_val_steps": -1},
    {"log_every_n_steps": 0},
]


@pytest.mark.parametrize("values", VALID, ids=[str(v) for v in VALID])
def test_values_lightning_accepts_pass(values: dict, base: dict) -> None:
    assert check_trainer(with_trainer(base, **values)) == []


def test_every_trainer_config_and_sweep_default_passes(base: dict) -> None:
    for option in ("cpu", "ddp_cpu", "gpu", "ddp", "fsdp"):
        assert check_trainer(compose_cfg([f"trainer={option}"])["trainer"]) == [], option


#: Invalid values Lightning itself refuses when the Trainer is built (the others it accepts and fails on, or
#: misreads, later: max_steps=1.5, gradient_clip_val=-1, log_every_n_steps=-3 ...).
LIGHTNING_REFUSES = [
    {"max_steps": -5},
    {"max_epochs": -5},
    {"limit_val_batches": -1},
    {"limit_val_batches": 1.5},
    {"devices": 0},
    {"precision": "64-truee"},
    {"strategy": "nonsense"},
    {"accelerator": "gpus"},
    {"max_time": "1:00"},
    {"gradient_clip_algorithm": "l2"},
    {"profiler": "fancy"},
    {"fast_dev_run": -1},
    {"reload_dataloaders_every_n_epochs": -1},
    {"num_nodes": 0},
    {"overfit_batches": -2},
]


def test_the_table_agrees_with_lightning() -> None:
    """The static tables are Lightning's values, every table key is a Trainer argument, every key the trainer
    configs set is in the table (or xfam's own), and what Lightning refuses the table refuses."""
    import lightning
    from lightning.fabric.plugins.precision import precision as p
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    args = typing.get_args
    assert set(trainer_args.PRECISIONS) == set(
        args(p._PRECISION_INPUT_STR) + args(p._PRECISION_INPUT_STR_ALIAS) + args(p._PRECISION_INPUT_INT)
    )
    lightning_names = set(trainer_args.STRATEGIES) - {"auto"} - set(trainer_args.SHARDED_STRATEGIES)
    assert lightning_names <= set(StrategyRegistry.available_strategies())
    assert set(trainer_args.ACCELERATORS) - {"auto", "gpu"} <= set(AcceleratorRegistry.available_accelerators())
    assert set(trainer_args.ARGS) | {"precision", "strategy", "accelerator"} <= set(lightning_trainer_args())
    for option in ("cpu", "ddp_cpu", "gpu", "ddp", "fsdp"):
        keys = set(compose_cfg([f"trainer={option}"])["trainer"]) - {"nonfinite", "matmul_precision"}
        keys -= {"max_nonfinite_skips", "compile", "compile_mode"}  # (xfam's own, as the two above)
        assert keys <= set(trainer_args.ARGS) | {"precision", "strategy", "accelerator"}, option
    for values in LIGHTNING_REFUSES:
        assert trainer_args.problems({"max_steps": 10, **values}), values
        with pytest.raises((ValueError, TypeError, lightning.fabric.utilities.exceptions.MisconfigurationException)):
            lightning.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **values)


def test_refusing_a_trainer_value_does_not_import_lightning() -> None:
    """Importing Lightning takes seconds: a value in the static tables is judged without it."""
    code = (
        "import sys; from xfam.config import check_trainer; "
        "assert check_trainer({'max_steps': -5, 'precision': 'bf16-mixed', 'strategy': 'ddp', 'devices': 1}); "
        "assert not [m for m in sys.modules if m.startswith('lightning')], 'lightning imported'"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# -- deleted keys and sections ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "texts"),
    [
        (("model", "dim"), ["model.dim: missing", "~model.dim", "model.dim=256"]),
        (("trainer", "max_steps"), ["trainer.max_steps: missing", "~trainer.max_steps"]),
        (("optim", "betas"), ["optim.betas: missing", "optim.betas=[0.9,0.95]"]),
        (("callbacks", "monitor"), ["callbacks.monitor: missing"]),
        (("seed",), ["seed: missing", "seed=0"]),
        (("loader",), ["config section 'loader' is missing"]),
        (("attention",), ["config section 'attention' is missing", "attention=vanilla"]),
    ],
)
def test_a_deleted_key_is_named_with_how_to_restore_it(path: tuple[str, ...], texts: list[str], base: dict) -> None:
    cfg = copy.deepcopy(base)
    node = cfg
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    found = problems(cfg)
    assert len(found) == 1, found
    assert all(t in found[0] for t in texts) and "Fix:" in found[0], found


# -- the run name, seed and betas -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "", "   ", "a\\b", " x"])
def test_a_name_that_is_not_one_folder_is_refused(name: str, base: dict) -> None:
    found = problems({**base, "name": name})
    assert len(found) == 1 and found[0].startswith(f"name={name!r}") and "Fix: name=" in found[0], found


@pytest.mark.parametrize("name", ["default", "baseline-2", "my.run", "a_b"])
def test_a_plain_name_passes(name: str, base: dict) -> None:
    assert problems({**base, "name": name}) == []


@pytest.mark.parametrize(
    ("section", "key", "value", "text"),
    [
        (None, "seed", -1, "must be >= 0"),
        (None, "seed", 2**32, "must be <= 4294967295"),
        ("optim", "betas", [1.5, 0.9], "every item must be < 1"),
        ("optim", "betas", [0.9, -0.1], "every item must be >= 0"),
        ("optim", "betas", [0.9, 1.0], "every item must be < 1"),
    ],
)
def test_seed_and_betas_ranges(section: str | None, key: str, value: Any, text: str, base: dict) -> None:
    cfg = copy.deepcopy(base)
    (cfg[section] if section else cfg)[key] = value
    found = problems(cfg)
    assert len(found) == 1 and text in found[0], found


# -- model.causal against the task ------------------------------------------------------------------------


def test_a_bidirectional_language_model_sees_the_token_it_predicts() -> None:
    """Why model.causal=false is refused for language modelling: the logits at positions 0..9 (predicting
    tokens 1..10) change when token 10 changes, so the model can copy its targets; causal ones do not."""
    for causal, leaks in ((False, True), (True, False)):
        spec = ModelSpec(dim=32, layers=2, heads=2, max_len=32, causal=causal)
        model = XfamModel(spec, task="lm", vocab_size=50, **SLOTS)
        model.eval()
        ids = torch.randint(0, 50, (1, 16))
        other = ids.clone()
        other[0, 10] = (ids[0, 10] + 1) % 50
        with torch.no_grad():
            a, b = model(ids).logits[0, :10], model(other).logits[0, :10]
        assert bool((a - b).abs().max() > 1e-6) == leaks, causal


def test_model_causal_false_is_refused_for_language_modelling(base: dict) -> None:
    found = problems({**base, "model": {**base["model"], "causal": False}})
    assert len(found) == 1, found
    assert "model.causal=false with data=text" in found[0] and "sees that token" in found[0]
    assert "Fix: model.causal=null" in found[0] and "data=listops" in found[0]
    assert problems({**base, "model": {**base["model"], "causal": True}}) == []


def test_a_causal_classifier_must_not_pool_the_first_token() -> None:
    """Causal attention with pool=cls reads a first token that saw only itself (refused); with pool=mean every
    position's prefix is averaged, a valid classifier (accepted)."""
    listops = ["data=listops", "model.max_len=256", "data.seq_len=200", "model.dim=32", "model.heads=2"]
    found = problems(compose_cfg([*listops, "model.causal=true", "model.pool=cls"]))
    assert len(found) == 1 and "model.causal=true with model.pool=cls" in found[0] and "model.pool=mean" in found[0]
    assert problems(compose_cfg([*listops, "model.causal=true", "model.pool=mean"])) == []
    assert problems(compose_cfg([*listops, "model.pool=cls"])) == []  # bidirectional: the usual [CLS]
    spec = ModelSpec(dim=32, layers=2, heads=2, max_len=32, causal=True, pool="cls")
    model = XfamModel(spec, task="classify", vocab_size=20, num_classes=3, **SLOTS).eval()
    ids = torch.randint(1, 20, (2, 12))
    other = torch.cat([ids[:, :1], torch.randint(1, 20, (2, 11))], 1)  # the same first token, the rest redrawn
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, model(other).logits), "a causal [CLS] reads the first token only"


# -- metrics a run reports --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "metric", "ok"),
    [
        ([], "val/loss", True),
        ([], "val/bpb", True),
        ([], "test/ppl", True),
        ([], "step", True),
        ([], "val/los", False),
        ([], "train/loss", False),  # logged, but not among the final metrics
        (["test=false"], "test/loss", False),
        (["data=listops", "data.seq_len=200", "model.max_len=256"], "val/bpb", False),
        (["data=listops", "data.seq_len=200", "model.max_len=256"], "val/acc", True),
        (["exit=calm"], "val/agreement", True),
        (["exit=calm"], "val/full/loss", True),
        (["exit=act"], "val/depth", True),
        ([], "val/depth", False),
        (["attention=adaptive_span"], "val/attention/span", True),
    ],
)
def test_optimized_metric_must_be_a_final_metric(overrides: list[str], metric: str, ok: bool) -> None:
    found = problems(compose_cfg([*SMALL, *overrides, f"optimized_metric={metric}"]))
    assert (found == []) == ok, found
    if not ok:
        assert len(found) == 1 and f"optimized_metric={metric!r}" in found[0] and "Fix:" in found[0]


def test_the_checkpoint_monitor_must_be_logged(base: dict) -> None:
    found = problems({**base, "callbacks": {**base["callbacks"], "monitor": "val/los"}})
    assert len(found) == 1 and "Did you mean 'val/loss'" in found[0], found
    assert problems({**base, "callbacks": {**base["callbacks"], "monitor": "val/los", "save_best": False}}) == []
    assert problems({**base, "callbacks": {**base["callbacks"], "monitor": "train/loss"}}) == []


# -- wandb credentials --------------------------------------------------------------------------------------


def test_wandb_online_needs_credentials_here(base: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from xfam.config.specs import LoggerSpec
    from xfam.training.lit.trainer import wandb_mode

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    online = {**base, "logger": {**compose_cfg(["logger=wandb"])["logger"], "mode": "online"}}
    validate(online)  # the config is valid; the machine lacks the key
    with pytest.raises(ConfigError, match="logger.mode=online: wandb has no credentials") as err:
        check_machine(online)
    assert "wandb login" in str(err.value) and "logger.mode=offline" in str(err.value)
    with pytest.raises(ConfigError, match="no credentials"):
        wandb_mode(LoggerSpec(name="wandb", mode="online"))  # (programmatic runs: before any logger exists)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match="WANDB_MODE=online"):
        check_machine({**online, "logger": {**online["logger"], "mode": "auto"}})
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    check_machine(online)
    assert wandb_mode(LoggerSpec(name="wandb", mode="online")) == ("online", "set by logger.mode")
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_machine(online)


# -- Triton tiles -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        (["attention=performer", "attention.chunk=8"], "chunk=8, and the Triton kernel takes chunks"),
        (["attention=rfa", "attention.chunk=24"], "chunk=24"),
        (["attention=bigbird", "attention.block=8"], "block 8 (the kernel tiles powers of two >= 16)"),
        (["attention=local", "attention.window=8", "attention.block=12"], "block 12"),
        (["attention=fixed", "attention.stride=16", "attention.summary=4", "attention.block=8"], "block 8"),
        (["attention=adaptive_span", "attention.dynamic=true"], "per-query (dynamic) spans"),
        (["attention=local", "attention.window=8", "attention.dropout=0.1"], "attention dropout"),
        (["model.num_mem_kv=2"], "persistent keys"),
    ],
)
def test_triton_tiles_the_kernels_cannot_take_are_refused_by_validate(overrides: list[str], text: str) -> None:
    """(Found in the first training step otherwise; ``check_machine`` judges only the device.)"""
    found = problems(compose_cfg([*SMALL, *overrides, "attention.backend=triton"]))
    assert len(found) == 1 and text in found[0] and "attention.backend=auto" in found[0], found
    assert problems(compose_cfg([*SMALL, *overrides, "attention.backend=auto"])) == []


def test_triton_tiles_the_kernels_take_pass() -> None:
    for overrides in (["attention=performer", "attention.chunk=16"], ["attention=bigbird", "attention.block=16"]):
        assert problems(compose_cfg([*SMALL, *overrides, "attention.backend=triton"])) == [], overrides


# -- generate -------------------------------------------------------------------------------------------------


def test_generate_refuses_no_new_tokens() -> None:
    spec = ModelSpec(dim=32, layers=1, heads=2, max_len=32)
    model = XfamModel(spec, task="lm", vocab_size=20, **SLOTS)
    for n in (0, -5):
        with pytest.raises(ConfigError, match=f"max_new_tokens={n}"):
            generate(model, torch.zeros(1, 3, dtype=torch.long), n)
    assert generate(model, torch.zeros(1, 3, dtype=torch.long), 2).tokens.shape == (1, 5)
