"""``trainer.compile``: a compiled run trains as the eager one does, and its checkpoints are the eager run's, key
for key, in both directions (resume with compile off or on, ``xfam eval`` / ``generate`` of a compiled run).

Tolerance of the loss comparisons: relative 1e-5. Inductor fuses the elementwise work and reorders fp32
reductions (layer norm, softmax, the residual adds), so a compiled step's loss differs from eager's in its last
bits (measured: at most 1 ulp, ~1e-7 relative, over 6 steps of the tiny model); AdamW's normalised updates carry
such differences on from step to step without amplifying them past 1e-6 in a few steps. A real fault (a wrong
mask, a dropped auxiliary loss, a stale parameter) moves the loss by 1e-3 or more.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, text_data
from xfam.config import validate
from xfam.core.errors import ConfigError
from xfam.model.checkpoint import load_model
from xfam.training.runner import train

RTOL = 1e-5  # see the module docstring
#: 6 steps, a checkpoint every 3 (so a resume from step 3 can be compared with steps 4-6 of the whole run).
STEPS = ["trainer.max_steps=6", "trainer.val_check_interval=6", "callbacks.every_n_steps=3", "callbacks.keep_last=-1"]


class Losses(L.Callback):
    """Every training step's loss, in order."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def run(corpus: Path, run_dir: Path, compile: bool, extra: tuple[str, ...] = ()) -> tuple[list[float], dict]:
    """Train the tiny model (``trainer.compile=compile``) into ``run_dir``: the step losses and the metrics."""
    torch._dynamo.reset()  # a fresh compile cache: earlier tests' graphs count towards the recompile limit
    cfg = compose_cfg([*TINY, *STEPS, *text_data(corpus), f"trainer.compile={str(compile).lower()}", *extra])
    losses = Losses()
    metrics = train(cfg, run_dir, callbacks=[losses])
    return losses.losses, metrics


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same 6 steps eagerly and compiled, with the compiled run's log records."""
    root = tmp_path_factory.mktemp("compile")
    eager = run(corpus, root / "eager", False)
    handler, xfam_log = Records(), logging.getLogger("xfam")
    xfam_log.addHandler(handler)
    level = xfam_log.level
    xfam_log.setLevel(logging.INFO)
    try:
        compiled = run(corpus, root / "compiled", True)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        xfam_log.removeHandler(handler)
        xfam_log.setLevel(level)
    return {"root": root, "eager": eager, "compiled": compiled, "log": handler.messages, "graphs": graphs}


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_compiled_losses_equal_eager(runs: dict[str, Any]) -> None:
    (eager, eager_metrics), (compiled, compiled_metrics) = runs["eager"], runs["compiled"]
    assert len(eager) == 6 and close(compiled, eager), (compiled, eager)
    assert eager[-1] < eager[0]  # it trains (the comparison is not between two constants)
    assert abs(compiled_metrics["val/loss"] - eager_metrics["val/loss"]) <= RTOL * eager_metrics["val/loss"]
    assert runs["graphs"] >= 1  # dynamo did compile (the compiled run is not the eager one again)
    said = [m for m in runs["log"] if m.startswith("trainer.compile:")]
    assert len(said) == 1 and "mode=default" in said[0] and "XfamModel" in said[0], runs["log"]


def test_a_compiled_runs_checkpoint_is_the_eager_runs(runs: dict[str, Any]) -> None:
    """No ``_orig_mod.`` in the file: the same keys as the eager run's, and ``load_model`` builds an eager model."""
    keys = {}
    for name in ("eager", "compiled"):
        ckpt = torch.load(runs["root"] / name / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
        keys[name] = list(ckpt["state_dict"])
    assert keys["compiled"] == keys["eager"] and not [k for k in keys["compiled"] if "_orig_mod" in k]
    model, _ = load_model(runs["root"] / "compiled" / "checkpoints" / "last.ckpt")
    assert not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert list(model.state_dict()) == [k.removeprefix("model.") for k in keys["eager"] if k.startswith("model.")]


def test_a_compiled_run_resumes_eagerly(runs: dict[str, Any], corpus: Path) -> None:
    """Steps 4-6 resumed from the compiled run's step-3 checkpoint with compile off equal the compiled run's."""
    root, compiled = runs["root"], runs["compiled"][0]
    ckpt = root / "compiled" / "checkpoints" / "step-0000003.ckpt"
    resumed, _ = run(corpus, root / "compiled_then_eager", False, (f"ckpt_path={ckpt}",))
    assert close(resumed, compiled[3:]), (resumed, compiled[3:])


def test_an_eager_run_resumes_compiled(runs: dict[str, Any], corpus: Path) -> None:
    root, eager = runs["root"], runs["eager"][0]
    ckpt = root / "eager" / "checkpoints" / "step-0000003.ckpt"
    resumed, _ = run(corpus, root / "eager_then_compiled", True, (f"ckpt_path={ckpt}",))
    assert close(resumed, eager[3:]), (resumed, eager[3:])


def test_eval_and_generate_read_a_compiled_runs_checkpoint(runs: dict[str, Any], capsys) -> None:
    from xfam.cli.main import main

    ckpt = runs["root"] / "compiled" / "checkpoints" / "last.ckpt"
    main(["eval", f"ckpt={ckpt}", "split=test"])
    out = capsys.readouterr().out
    assert "test/loss" in out
    main(["generate", f"ckpt={ckpt}", "prompt=the quick", "max_new_tokens=8", "temperature=0", "check=true"])
    out = capsys.readouterr().out
    assert "the quick" in out and "OK" in out


@pytest.mark.parametrize(
    ("values", "wanted"),
    [
        (["trainer.compile=yes"], "trainer.compile='yes': must be true or false"),
        (["trainer.compile_mode=fast"], "unknown value 'fast'"),
    ],
)
def test_bad_compile_settings_are_refused(values: list[str], wanted: str) -> None:
    with pytest.raises(ConfigError, match=wanted) as err:
        validate(compose_cfg([*TINY, *values]))
    assert "Fix: trainer." in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "component",
    [
        ["attention=vanilla"],
        ["attention=local", "attention.window=8"],
        ["attention=performer"],
        ["pos=rope"],
        ["pos=alibi"],
        ["pos=learned"],
        ["memory=xl", "memory.mem_len=16", "loader.streams=true"],
        ["exit=calm"],
    ],
    ids=lambda c: c[0],
)
def test_compiled_component_trains_as_eager(component: list[str], corpus: Path, tmp_path: Path) -> None:
    """Each slot's default (attention=vanilla, pos=rope, memory=none, exit=none: the fast test's model) and common
    components: the same losses compiled and eager (``RTOL``). ``fallback_random``: inductor draws random numbers
    from torch's generator as eager does (performer's feature redraws), else compiled draws differ by design."""
    import torch._inductor.config

    eager, _ = run(corpus, tmp_path / "eager", False, tuple(component))
    with torch._inductor.config.patch(fallback_random=True):
        compiled, _ = run(corpus, tmp_path / "compiled", True, tuple(component))
    assert close(compiled, eager), (compiled, eager)
