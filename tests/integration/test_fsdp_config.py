"""trainer=fsdp and trainer=fsdp_cpu: the configs compose and validate, become xfam's FSDP2 strategy
(``ShardedStrategy``, not Lightning's FSDP1 of the same name), and a machine without a GPU refuses
``trainer=fsdp`` in one clear message before anything is written, pointing to ``trainer=fsdp_cpu``. (Training
under them: tests/integration/test_fsdp.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, run_cli, text_data
from xfam.config import check_machine, validate
from xfam.core.errors import ConfigError
from xfam.training.lit.callbacks import MatmulPrecision
from xfam.training.lit.checkpoint import AtomicCheckpointIO
from xfam.training.lit.fsdp import ShardedStrategy
from xfam.training.lit.step_checkpoint import StepCheckpoint
from xfam.training.precheck import precheck

REFUSAL = "Fix: on CPU use trainer=fsdp_cpu (FSDP over 2 CPU processes)"


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """Pretend this machine has CUDA GPUs (``True``) or none (``False``)."""

    def pretend(available: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    return pretend


def test_fsdp_composes_and_validates() -> None:
    cfg = compose_cfg(["trainer=fsdp"])
    validate(cfg)  # the config alone: valid wherever it is composed
    trainer = cfg["trainer"]
    assert (trainer["strategy"], trainer["accelerator"], trainer["devices"]) == ("fsdp", "gpu", "auto")
    assert trainer["precision"] == "bf16-mixed"
    cpu = compose_cfg(["trainer=fsdp_cpu"])
    validate(cpu)
    assert (cpu["trainer"]["strategy"], cpu["trainer"]["accelerator"], cpu["trainer"]["devices"]) == (
        "fsdp_spawn",
        "cpu",
        2,
    )
    check_machine(cpu)  # runs here


def test_fsdp_trainer_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from xfam.training.lit import trainer as xfam_trainer

    seen: dict = {}
    monkeypatch.setattr(xfam_trainer.L, "Trainer", lambda **kw: seen.update(kw))  # Lightning itself needs a GPU
    xfam_trainer.make_trainer(compose_cfg(["trainer=fsdp"]), tmp_path)
    strategy = seen["strategy"]
    assert isinstance(strategy, ShardedStrategy) and not strategy.spawn and strategy.param_dtype == torch.bfloat16
    assert seen["accelerator"] == "gpu" and seen["precision"] == "bf16-mixed"
    (periodic,) = [c for c in seen["callbacks"] if isinstance(c, StepCheckpoint)]
    assert periodic.save_last == "link"  # last.ckpt links to the newest sharded folder
    xfam_trainer.make_trainer(compose_cfg(["trainer=fsdp_cpu"]), tmp_path)
    assert seen["strategy"].spawn and seen["strategy"].param_dtype is None
    assert "nonfinite" not in seen and "matmul_precision" not in seen  # xfam's own keys are not passed on
    assert [c.precision for c in seen["callbacks"] if isinstance(c, MatmulPrecision)] == ["highest"]
    assert any(isinstance(p, AtomicCheckpointIO) for p in seen["plugins"])


def test_the_machine_check(gpus) -> None:
    cfg = compose_cfg(["trainer=fsdp"])
    gpus(True)
    check_machine(cfg)
    precheck(["trainer=fsdp"])
    gpus(False)
    with pytest.raises(ConfigError) as err:
        check_machine(cfg)
    assert len(err.value.problems) == 1 and REFUSAL in str(err.value)
    with pytest.raises(ConfigError, match="trainer=fsdp_cpu"):
        precheck(["trainer=fsdp"])
    with pytest.raises(ConfigError, match="trainer.accelerator='gpu' .* needs a GPU.*Fix: on CPU use trainer=cpu"):
        precheck(["trainer=gpu"])
    check_machine(compose_cfg(["trainer=ddp_cpu"]))
    with pytest.MonkeyPatch.context() as mp:  # on a login node (srun there), the jobs run on the cluster's GPU nodes
        mp.setattr("xfam.training.precheck.shutil.which", lambda name: f"/usr/bin/{name}")
        precheck(["-m", "hydra/launcher=slurm", "trainer=fsdp"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine could run trainer=fsdp")
def test_fsdp_on_this_cpu_is_one_clear_error_and_writes_nothing(corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "fsdp"
    res = run_cli(["train.py", "trainer=fsdp", *TINY, *text_data(corpus), f"hydra.run.dir={run_dir}"])
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.count("xfam: error:") == 1 and REFUSAL in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "runs").exists()  # not even the run directory


def test_background_checkpoints_need_a_sharded_strategy() -> None:
    validate(compose_cfg(["trainer=fsdp_cpu", "callbacks.async_save=true"]))
    with pytest.raises(
        ConfigError, match="callbacks.async_save=true writes sharded checkpoints .* Fix: trainer=fsdp_cpu"
    ):
        validate(compose_cfg(["callbacks.async_save=true"]))


def test_fp16_with_fsdp_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="precision='16-mixed' with FSDP .* Fix: trainer.precision=bf16-mixed"):
        validate(compose_cfg(["trainer=fsdp", "trainer.precision=16-mixed"]))


def test_the_wrapping_plan_says_which_blocks_are_units_and_why_not() -> None:
    from doubles import build_model

    from xfam.training.lit.fsdp import sharding_plan, whole_stack_reason

    plain = build_model(layers=3, dim=16, heads=2)
    assert whole_stack_reason(plain) is None and "units: one unit per block (3)" in sharding_plan(plain, 2)
    for model, why in (
        (build_model(layers=3, dim=16, heads=2, share_layers=True), "a block runs at several depths"),
        (build_model(layers=3, dim=16, heads=2, reversible=True), "reversible layers"),
        (build_model(layers=3, dim=16, heads=2, exit={"name": "calm"}), "exit=calm skips blocks per rank"),
    ):
        assert whole_stack_reason(model) is not None
        assert f"none ({why}" in sharding_plan(model, 2) and "and the root (" in sharding_plan(model, 2)
