"""Every config option composes and validates; YAMLs and signatures stay one source of truth."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.integration.helpers import CONFIG_DIR, compose_cfg
from xfam.attention import ATTENTION
from xfam.config import SLOTS, lightning_trainer_args, validate
from xfam.config.specs import CallbacksSpec, LoggerSpec, OptimSpec, RunSpec
from xfam.core.errors import ConfigError
from xfam.core.registry import defaults_of
from xfam.model.spec import ModelSpec
from xfam.training.precheck import config_groups, precheck

GROUPS = config_groups()
OPTIONS = [(g, o) for g, opts in GROUPS.items() for o in opts if g not in ("hparams_search",)]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group: str, option: str) -> None:
    overrides = [f"{group}={option}"]
    if group == "attention" and not ATTENTION.get(option).causal:  # encoder-only: on a classification task
        overrides.append("data=listops")
    if group == "task":  # a task is the data's own (or masked LM over text): data that has it
        overrides += {
            "classify": ["data=listops"],
            "tag": ["data=pytokens"],
            "seq2seq": ["data=seq2seq_toy"],
            "regress": ["data=timeseries"],
            "decision": ["data=gym"],
        }.get(option, [])
    if (group, option) == ("experiment", "listops_mlm"):  # needs the corpus scripts/exp_seq2seq.py writes
        with pytest.raises(ConfigError, match="Fix: set data.paths"):
            validate(compose_cfg(overrides))
        return
    if (group, option) == ("memory", "spalm"):  # needs a datastore of a trained model: tests/integration/test_spalm.py
        with pytest.raises(ConfigError, match="memory=spalm needs memory.store=DIR"):
            validate(compose_cfg(overrides))
        return
    validate(compose_cfg(overrides))


def _xfam_classes(registry):
    return {n: c for n, c in registry.items() if c.__module__.startswith("xfam.")}


@pytest.mark.parametrize("slot", sorted(SLOTS))
def test_slot_yamls_and_registry_are_a_bijection_with_equal_defaults(slot: str) -> None:
    classes = _xfam_classes(SLOTS[slot])
    yamls = {p.stem: yaml.safe_load(p.read_text()) for p in (CONFIG_DIR / slot).glob("*.yaml")}
    assert set(yamls) == set(classes), "every YAML needs a registered class and every class a YAML"
    for name, cls in classes.items():
        expected = {"name": name, **{k: list(v) if isinstance(v, tuple) else v for k, v in defaults_of(cls).items()}}
        assert yamls[name] == expected, f"configs/{slot}/{name}.yaml must mirror {cls.__name__}'s signature"


def test_model_presets_name_every_field() -> None:
    fields = set(defaults_of(ModelSpec, skip=()))
    for path in (CONFIG_DIR / "model").glob("*.yaml"):
        preset = yaml.safe_load(path.read_text())
        assert set(preset) == fields, path.name
        assert preset["name"] == path.stem


@pytest.mark.parametrize(
    ("group", "spec", "varying"),
    [("optim", OptimSpec, set()), ("logger", LoggerSpec, {"name"}), ("callbacks", CallbacksSpec, set())],
)
def test_section_yamls_mirror_their_spec(group: str, spec: type, varying: set[str]) -> None:
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in defaults_of(spec, skip=()).items()}
    for path in (CONFIG_DIR / group).glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        assert {k: v for k, v in data.items() if k not in varying} == {
            k: v for k, v in defaults.items() if k not in varying
        }, path.name


def test_train_yaml_top_level_mirrors_run_spec() -> None:
    top = yaml.safe_load((CONFIG_DIR / "train.yaml").read_text())
    run = {k: v for k, v in top.items() if k in defaults_of(RunSpec, skip=())}
    assert run == defaults_of(RunSpec, skip=())


def test_optuna_search_and_slurm_launcher_compose(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=optuna"], return_hydra_config=True)
        assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
        assert cfg.optimized_metric == "val/loss"
        cfg = compose("train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
        assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
        assert cfg.hydra.launcher.tasks_per_node == cfg.hydra.launcher.gpus_per_node
    GlobalHydra.instance().clear()


def test_trainer_keys_are_read_from_lightnings_source() -> None:
    """(Importing Lightning takes seconds, so validation reads Trainer's arguments from its source.)"""
    assert lightning_trainer_args() == lightning_trainer_args(source=False)


def test_fsdp_and_gpu_trainers_compose_for_gpus() -> None:
    for option in ("gpu", "ddp", "fsdp"):
        cfg = compose_cfg([f"trainer={option}"])
        assert cfg["trainer"]["accelerator"] == "gpu" and cfg["trainer"]["precision"] == "bf16-mixed"
    assert compose_cfg(["trainer=fsdp"])["trainer"]["strategy"] == "fsdp"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["attention=vanila"], ["attention: unknown value 'vanila'", "Did you mean 'vanilla'", "Valid choices"]),
        (["pos=alibbi"], ["Did you mean 'alibi'", "rope", "Fix: pass pos="]),
        (["model.widht=3"], ["model: unknown key 'widht'", "Valid keys", "dim"]),
        (["trainer.max_step=3"], ["Did you mean 'max_steps'"]),
        (["model.heads=3"], ["model.heads=3 does not divide model.dim=128", "Fix: choose heads among"]),
        (["model.layers=-2"], ["model.layers=-2: must be > 0"]),
        (["model.norm=batchnorm"], ["model.norm='batchnorm': must be one of 'layernorm', 'rmsnorm'"]),
        (
            ["pos=learned", "model.max_len=64", "data.seq_len=128"],
            ["longer than the learned position table", "pos=rope"],
        ),
        (["data.paths=[/no/such/dir]"], ["does not exist"]),
        (["trainer.precision=16-mixed"], ["needs a GPU"]),
        (["attention.backend=flash"], ["attention.backend='flash': must be one of 'auto', 'sdpa', 'torch'"]),
        (["-m", "pos=rope,alibbi"], ["Did you mean 'alibi'"]),
        (["pos=alibi", "pos.num_heads=9"], ["num_heads=9 exceeds model.heads=4"]),
        (["pos.num_heads=2"], ["pos: unknown key 'num_heads'", "Valid keys: backend, base"]),
    ],
)
def test_precheck_names_the_problem_and_the_fix(args: list[str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        precheck(args)
    for text in expected:
        assert text in str(err.value), f"{text!r} not in:\n{err.value}"


def test_precheck_lists_every_problem_of_a_sweep_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        precheck(["-m", "model.heads=3,5", "optim.lr=-1"])
    msg = str(err.value)
    assert "model.heads=3" in msg and "model.heads=5" in msg and "optim.lr=-1" in msg
    assert msg.startswith(f"{len(err.value.problems)} configuration problems")


def test_precheck_lets_a_sweep_run_its_valid_jobs(capsys: pytest.CaptureFixture[str]) -> None:
    precheck(["-m", "model.heads=4,3"])  # heads=3 cannot divide dim 128: that job will be skipped
    err = capsys.readouterr().err
    assert "1 of 2 jobs of this sweep cannot run and will be recorded as skipped" in err
    assert "[model.heads=3] model.heads=3 does not divide model.dim=128" in err


def test_precheck_accepts_valid_command_lines() -> None:
    precheck([])
    precheck(["-m", "pos=none,sinusoidal,learned,rope,alibi"])
    precheck(["hparams_search=optuna"])
