"""A table of invalid command lines, each refused before anything is written, in one clear message.

Every ``python train.py ...`` case runs in-process through ``xfam.training.hydra_app.main`` (what train.py runs:
the pre-launch check, then Hydra) with ``sys.argv`` set, and every ``xfam ...`` case through
``xfam.cli.main.main``; a few run as real subprocesses for the wiring. Each must exit with status 2,
print exactly one ``xfam: error:`` naming the problem (the case's texts) and the fix, show no traceback,
and leave the runs folder (``XFAM_RUNS``) untouched. Cases cover every config group, the xfam commands
and Hydra's override grammar; ``test_fuzz_config`` generates its cases from the registries instead.

One file over 400 lines: it is one table of cases, read as a whole.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.helpers import compose_cfg, run_cli
from xfam.cli import main as xfam_main
from xfam.model.build import build_model
from xfam.model.checkpoint import metadata
from xfam.training import hydra_app
from xfam.training.precheck import config_groups

CLEAN_EXIT = 2
#: Words that introduce the fix in a message (compat's refusals list "Alternatives:").
FIX_WORDS = ("Fix:", "Alternatives:")
#: Small model settings every train.py case starts from (the refusals do not depend on them), and a small
#: corpus for data=text (discovering the default one takes most of a check's time).
BASE = ["model.dim=32", "model.layers=2", "model.heads=2", "model.max_len=64", "data.seq_len=32"]
TEXT = ["data.paths=[{corpus}]", "data.extensions=[.txt]"]

#: (id, train.py arguments after BASE, texts the one error contains[, environment])
TRAIN: list[tuple[Any, ...]] = [
    # -- model
    ("model-unknown-option", ["model=tyni"], ["model: unknown value 'tyni'", "Did you mean 'tiny'"]),
    ("model-dim-zero", ["model.dim=0"], ["model.dim=0: must be > 0"]),
    ("model-heads-not-dividing", ["model.heads=3"], ["model.heads=3 does not divide model.dim=32"]),
    ("model-deleted-dim", ["~model.dim"], ["model.dim: missing", "~model.dim"]),
    ("model-deleted-section", ["~model"], ["config section 'model' is missing", "model=tiny"]),
    ("model-reversible-post", ["model.reversible=true", "model.norm_position=post"], ["norm_position=pre"]),
    ("model-ffn-chunks", ["model.ffn_chunks=2"], ["model.ffn_chunks applies to reversible layers"]),
    ("model-bidirectional-lm", ["model.causal=false"], ["model.causal=false", "sees that token", "causal=null"]),
    (
        "model-causal-cls-classifier",
        ["data=listops", "data.seq_len=200", "model.max_len=256", "model.causal=true", "model.pool=cls"],
        ["model.causal=true with model.pool=cls", "model.pool=mean"],
    ),
    ("model-pool", ["data=listops", "model.pool=max"], ["model.pool='max'"]),
    # -- task and model shape
    ("task-unknown", ["task=translate"], ["task: unknown value 'translate'"]),
    ("task-mlm-on-classes", ["task=mlm", "data=listops"], ["task=mlm masks tokens of a text stream", "data=text"]),
    ("task-pairs-without-pairs", ["model.arch=encoder_decoder"], ["maps a source to a target", "data=docstrings"]),
    ("task-mlm-decoder", ["task=mlm", "model.arch=decoder"], ["sees only the left", "model.arch=auto"]),
    ("task-beam-zero", ["task=seq2seq", "task.beam_size=0"], ["task.beam_size=0", "task comes from the data"]),
    # -- attention (several components)
    ("attention-unknown", ["attention=vanila"], ["attention: unknown value 'vanila'", "Did you mean 'vanilla'"]),
    ("attention-backend", ["attention.backend=flash"], ["attention.backend='flash'"]),
    ("local-unknown-key", ["attention=local", "attention.windw=8"], ["unknown key 'windw'", "'window'"]),
    ("local-window-too-long", ["attention=local", "attention.window=5000"], ["window=5000", "model.max_len=64"]),
    (
        "performer-triton-chunk",
        ["attention=performer", "attention.backend=triton", "attention.chunk=8"],
        ["chunk=8", "powers of two >= 16", "attention.backend=auto"],
    ),
    ("rfa-triton-chunk", ["attention=rfa", "attention.backend=triton", "attention.chunk=24"], ["chunk=24"]),
    ("rfa-gate-bidirectional", ["attention=rfa", "attention.gate=true", "data=listops"], ["gate=true"]),
    (
        "bigbird-triton-block",
        ["attention=bigbird", "attention.block=8", "attention.backend=triton"],
        ["attention=bigbird backend=triton", "block 8", "attention.backend=block"],
    ),
    ("bigbird-window-blocks", ["attention=bigbird", "attention.window_blocks=2"], ["window_blocks=2"]),
    (
        "longformer-triton-block",
        ["attention=longformer", "attention.window=8", "attention.block=24", "attention.backend=triton"],
        ["block 24"],
    ),
    (
        "strided-triton-block",
        ["attention=strided", "attention.stride=16", "attention.block=12", "attention.backend=triton"],
        ["block 12", "attention.backend=factorized"],
    ),
    (
        "adaptive-span-triton-dynamic",
        ["attention=adaptive_span", "attention.dynamic=true", "attention.backend=triton"],
        ["per-query (dynamic) spans"],
    ),
    (
        "local-triton-dropout",
        ["attention=local", "attention.window=8", "attention.dropout=0.1", "attention.backend=triton"],
        ["attention dropout"],
    ),
    (
        "vanilla-triton-persistent",
        ["attention.backend=triton", "model.num_mem_kv=2"],
        ["persistent keys (model.num_mem_kv)"],
    ),
    ("vanilla-triton-dropout", ["attention.backend=triton", "attention.dropout=0.1"], ["no attention dropout"]),
    ("blockwise-causal", ["attention=blockwise"], ["attention=blockwise cannot be causal"]),
    ("lsh-triton", ["attention=lsh", "attention.backend=triton"], ["attention.backend='triton'"]),
    ("etc-triton", ["attention=etc", "attention.backend=triton"], ["attention.backend='triton'"]),
    ("performer-shaw", ["attention=performer", "pos=shaw"], ["pos=shaw runs only inside attention"]),
    # -- pos
    ("pos-unknown", ["pos=alibbi"], ["pos: unknown value 'alibbi'", "Did you mean 'alibi'"]),
    ("pos-learned-short", ["pos=learned", "data.seq_len=128"], ["longer than the learned position table"]),
    ("pos-alibi-heads", ["pos=alibi", "pos.num_heads=9"], ["num_heads=9 exceeds"]),
    ("pos-da-host", ["pos=da", "attention=local", "attention.window=8"], ["pos=da runs only inside attention"]),
    # -- memory
    ("memory-unknown", ["memory=xll"], ["memory: unknown value 'xll'", "Did you mean 'xl'"]),
    ("memory-absolute-pos", ["memory=xl", "pos=learned"], ["needs relative positions"]),
    ("memory-no-streams", ["memory=xl", "loader.streams=false"], ["needs contiguous streams"]),
    ("memory-attention", ["memory=xl", "attention=sinkhorn", "attention.block=16"], ["cannot attend to memory keys"]),
    ("memory-reversible", ["memory=xl", "model.reversible=true"], ["cannot carry memory"]),
    ("memory-memorizing-topk", ["memory=memorizing", "memory.topk=0"], ["memory.topk=0"]),
    # -- exit
    ("exit-unknown", ["exit=calmm"], ["exit: unknown value 'calmm'", "Did you mean 'calm'"]),
    ("exit-reversible", ["exit=calm", "model.reversible=true"], ["traverses depth itself"]),
    ("exit-memory-tokens", ["exit=calm", "model.num_memory_tokens=2"], ["num_memory_tokens=2"]),
    ("exit-act-mode", ["exit=act", "exit.mode=halt"], ["exit.mode='halt'"]),
    # -- data (several)
    ("data-unknown", ["data=txt"], ["data: unknown value 'txt'", "Did you mean 'text'"]),
    ("data-missing-path", ["data.paths=[/definitely/not/here]"], ["'/definitely/not/here' does not exist"]),
    ("data-tokenizer", ["data.tokenizer=sentencepiece"], ["data.tokenizer='sentencepiece'"]),
    ("listops-seq-len", ["data=listops", "data.seq_len=10"], ["seq_len=10"]),
    ("listops-streams", ["data=listops", "loader.streams=true"], ["contiguous streams need a contiguous source"]),
    ("parity-unknown-key", ["data=parity", "data.length=3"], ["data: unknown key 'length'"]),
    ("assoc-recall-pairs", ["data=assoc_recall", "data.num_pairs=0"], ["data.num_pairs=0"]),
    ("far-recall-key", ["data=far_recall", "data.x=1"], ["data: unknown key 'x'"]),
    ("hf-fraction", ["data=hf", "data.test_fraction=-0.1"], ["data.test_fraction=-0.1"]),
    ("data-deleted", ["~data"], ["config section 'data' is missing"]),
    # -- optim
    ("optim-unknown", ["optim=sgd"], ["optim: unknown value 'sgd'"]),
    ("optim-lr-negative", ["optim.lr=-1"], ["optim.lr=-1: must be > 0"]),
    ("optim-betas-range", ["optim.betas=[1.5,0.9]"], ["optim.betas=[1.5, 0.9]", "must be < 1"]),
    ("optim-betas-negative", ["optim.betas=[0.9,-0.1]"], ["must be >= 0"]),
    ("optim-warmup-negative", ["optim.warmup_steps=-1"], ["optim.warmup_steps=-1: must be >= 0"]),
    ("optim-min-lr", ["optim.min_lr_ratio=2"], ["optim.min_lr_ratio=2: must be <= 1"]),
    ("optim-deleted-lr", ["~optim.lr"], ["optim.lr: missing"]),
    # -- trainer (Lightning's arguments)
    ("trainer-max-steps-negative", ["trainer.max_steps=-5"], ["trainer.max_steps=-5: must be >= -1"]),
    ("trainer-max-steps-float", ["trainer.max_steps=1.5"], ["trainer.max_steps=1.5: must be an integer"]),
    ("trainer-max-epochs", ["trainer.max_epochs=-5"], ["trainer.max_epochs=-5"]),
    ("trainer-no-end", ["trainer.max_steps=-1"], ["training has no step or epoch limit"]),
    ("trainer-limit-val-negative", ["trainer.limit_val_batches=-1"], ["trainer.limit_val_batches=-1"]),
    ("trainer-limit-val-share", ["trainer.limit_val_batches=1.5"], ["trainer.limit_val_batches=1.5", "[0.0, 1.0]"]),
    ("trainer-devices-zero", ["trainer.devices=0"], ["trainer.devices=0"]),
    ("trainer-devices-cpu-all", ["trainer.devices=-1"], ["trainer.devices=-1 with trainer.accelerator=cpu"]),
    ("trainer-devices-list", ["trainer.devices=[0,0]"], ["distinct"]),
    ("trainer-precision", ["trainer.precision=64-truee"], ["trainer.precision: unknown value '64-truee'", "64-true"]),
    ("trainer-precision-cpu", ["trainer.precision=16-mixed"], ["needs a GPU"]),
    ("trainer-strategy", ["trainer.strategy=nonsense"], ["trainer.strategy: unknown value 'nonsense'", "ddp"]),
    ("trainer-accelerator", ["trainer.accelerator=gpus"], ["trainer.accelerator: unknown value 'gpus'"]),
    ("trainer-accumulate", ["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches=0"]),
    ("trainer-clip", ["trainer.gradient_clip_val=-1"], ["trainer.gradient_clip_val=-1: must be >= 0"]),
    ("trainer-log-every", ["trainer.log_every_n_steps=-3"], ["trainer.log_every_n_steps=-3: must be >= 0"]),
    ("trainer-sanity", ["trainer.num_sanity_val_steps=-7"], ["trainer.num_sanity_val_steps=-7"]),
    ("trainer-val-interval-zero", ["trainer.val_check_interval=0"], ["trainer.val_check_interval=0: must be > 0"]),
    ("trainer-val-interval-share", ["trainer.val_check_interval=0.5"], ["check_val_every_n_epoch=null"]),
    ("trainer-num-nodes", ["trainer.num_nodes=0"], ["trainer.num_nodes=0: must be > 0"]),
    ("trainer-deleted-max-steps", ["~trainer.max_steps"], ["trainer.max_steps: missing"]),
    ("trainer-max-time", ["+trainer.max_time=1:00"], ["trainer.max_time='1:00'", "DD:HH:MM:SS"]),
    ("trainer-barebones", ["+trainer.barebones=true"], ["trainer.barebones=true"]),
    ("trainer-fast-dev-run", ["+trainer.fast_dev_run=-1"], ["trainer.fast_dev_run=-1"]),
    ("trainer-profiler", ["+trainer.profiler=fancy"], ["trainer.profiler='fancy'"]),
    ("trainer-clip-algorithm", ["+trainer.gradient_clip_algorithm=l2"], ["must be norm, value or null"]),
    ("trainer-reload", ["+trainer.reload_dataloaders_every_n_epochs=-1"], ["reload_dataloaders_every_n_epochs=-1"]),
    ("trainer-unknown-key", ["trainer.max_step=10"], ["trainer: unknown key 'max_step'", "'max_steps'"]),
    ("trainer-owned-key", ["+trainer.logger=false"], ["trainer.logger: set by xfam"]),
    ("trainer-nonfinite", ["trainer.nonfinite=ignore"], ["trainer.nonfinite: unknown value 'ignore'"]),
    # -- logger
    ("logger-mode", ["logger=wandb", "logger.mode=loud"], ["logger.mode='loud'"]),
    ("logger-tags", ["logger=wandb", "logger.tags=abc"], ["logger.tags='abc': must be a list"]),
    ("logger-deleted-mode", ["~logger.mode"], ["logger.mode: missing"]),
    ("wandb-online-no-key", ["logger=wandb", "logger.mode=online"], ["logger.mode=online", "wandb login"]),
    (
        "wandb-env-online-no-key",
        ["logger=wandb"],
        ["WANDB_MODE=online", "logger.mode=offline"],
        {"WANDB_MODE": "online"},
    ),
    # -- callbacks
    ("callbacks-signal", ["callbacks.requeue_signal=KILL"], ["callbacks.requeue_signal='KILL'"]),
    ("callbacks-same-signal", ["callbacks.requeue_signal=TERM"], ["are both TERM"]),
    ("callbacks-monitor", ["callbacks.monitor=val/los"], ["callbacks.monitor='val/los'", "Did you mean 'val/loss'"]),
    ("callbacks-unknown", ["callbacks=minimal"], ["callbacks: unknown value 'minimal'"]),
    ("callbacks-deleted", ["~callbacks.monitor"], ["callbacks.monitor: missing"]),
    # -- loader
    ("loader-workers", ["loader.num_workers=-1"], ["loader.num_workers=-1: must be >= 0"]),
    ("loader-deleted", ["~loader"], ["config section 'loader' is missing"]),
    # -- experiment and hparams_search
    ("experiment-unknown", ["experiment=lsh_cop"], ["experiment: unknown value 'lsh_cop'", "lsh_copy"]),
    ("experiment-listops-causal", ["experiment=listops", "model.causal=true"], ["model.pool=cls"]),
    ("experiment-with-bad-value", ["experiment=memory_copy", "optim.lr=-1"], ["optim.lr=-1"]),
    (
        "hparams-metric",
        ["hparams_search=optuna", "optimized_metric=val/los"],
        ["optimized_metric='val/los'", "Did you mean 'val/loss'"],
    ),
    # -- top-level keys
    ("name-escapes", ["name=../../x"], ["name='../../x'", "outside the runs folder"]),
    ("name-nested", ["name=a/b"], ["name='a/b' contains '/'"]),
    ("name-empty", ["name="], ["name='' is empty"]),
    ("name-blank", ["name='   '"], ["is empty"]),
    ("seed-negative", ["seed=-1"], ["seed=-1: must be >= 0"]),
    ("seed-too-large", ["seed=4294967296"], ["seed=4294967296: must be <= 4294967295"]),
    ("ckpt-path-missing", ["ckpt_path=/no/such.ckpt"], ["ckpt_path='/no/such.ckpt': no such file"]),
    ("metric-typo", ["optimized_metric=val/los"], ["optimized_metric='val/los'", "val/loss"]),
    ("metric-bpb-classifier", ["data=listops", "optimized_metric=val/bpb"], ["optimized_metric='val/bpb'"]),
    ("metric-test-without-test", ["test=false", "optimized_metric=test/loss"], ["optimized_metric='test/loss'"]),
    ("deleted-seed", ["~seed"], ["seed: missing", "seed=0"]),
    ("unknown-top-key", ["foo=1"], ["unknown key 'foo'"]),
    ("added-top-key", ["+foo=1"], ["config: unknown key 'foo'"]),
    # -- sweeps
    ("sweep-unknown-value", ["-m", "pos=rope,alibbi"], ["Did you mean 'alibi'"]),
    ("sweep-all-jobs-invalid", ["-m", "model.heads=3,5"], ["model.heads=3", "model.heads=5"]),
    ("sweep-trainer", ["-m", "trainer.max_steps=-5,-6"], ["trainer.max_steps=-5", "trainer.max_steps=-6"]),
    ("sweep-names", ["-m", "name=a/b,c/d"], ["name='a/b'"]),
    # -- the override grammar (xfam.training.precheck)
    ("grammar-open-list", ["pos=["], ["pos=["]),
    ("grammar-bare-word", ["foo"], ["foo"]),
    ("grammar-open-value", ["model.dim=["], ["model.dim"]),
    ("grammar-unknown-group", ["optimizer=adam"], ["optimizer"]),
    ("grammar-per-layer-quoted", ["+attention.per_layer={0: {window: 8}}"], ["attention (layer 0): unknown key"]),
    ("grammar-config-dir", ["--config-dir=/definitely/not/here"], ["/definitely/not/here: no such folder"]),
    ("grammar-interpolation", ["model.dim=${oops}"], ["oops"]),
    ("grammar-append-existing", ["+model.dim=3"], ["model.dim"]),
]


def _flat(cases: list[Any]) -> list[Any]:
    """Each case as a pytest.param(argv, texts, env) with its id (and its marks)."""
    out = []
    for case in cases:
        marks: Any = ()
        if hasattr(case, "values"):  # a pytest.param already
            case, marks = case.values, case.marks
        ident, argv, texts, *env = case
        out.append(pytest.param(argv, texts, env[0] if env else {}, id=ident, marks=marks))
    return out


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty, not yet existing runs folder, no wandb credentials, no debug switch."""
    root = tmp_path / "runs"
    monkeypatch.setenv("XFAM_RUNS", str(root))
    monkeypatch.delenv("XFAM_DEBUG", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    return root


def refused(capsys: pytest.CaptureFixture[str], call: Any, texts: list[str], root: Path) -> str:
    """Run ``call`` (a command's main), check the one clean refusal; returns stderr."""
    try:
        call()
    except SystemExit as stop:
        code = stop.code
    else:
        code = 0
    out, err = capsys.readouterr()
    assert code == CLEAN_EXIT, f"exit {code}:\n{err}\n{out}"
    assert err.count("xfam: error:") == 1, err
    assert "Traceback" not in err + out, err
    for text in texts:
        assert text in err, f"{text!r} not in:\n{err}"
    assert any(word in err for word in FIX_WORDS), f"no fix in:\n{err}"
    assert not root.exists() or not any(root.rglob("*")), f"written under the runs folder: {list(root.rglob('*'))}"
    return err


class Launched(Exception):
    """The command line passed the pre-launch check (a training job would start)."""


def _never_train() -> None:
    raise Launched


@pytest.mark.parametrize(("argv", "texts", "env"), _flat(TRAIN))
def test_train_command_line_is_refused_before_anything_is_written(
    argv: list[str],
    texts: list[str],
    env: dict[str, str],
    corpus: Path,
    runs: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    flags = [a for a in argv if a.startswith("-")]  # Hydra's (-m, --config-dir=DIR): overrides never start so
    text = [] if any(a.lstrip("~").startswith(("data", "experiment=")) for a in argv) else TEXT
    base = [*BASE, *[a.format(corpus=corpus) for a in text]]
    monkeypatch.setattr(sys, "argv", ["train.py", *flags, *base, *[a for a in argv if a not in flags]])
    refused(capsys, lambda: hydra_app.main(_never_train), texts, runs)


# -- the xfam command --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Checkpoints written without training (the refusals come before any weights matter): a byte-level LM
    with a learned position table of 64, and a ListOps classifier."""
    root = tmp_path_factory.mktemp("ckpts")
    small = ["model.dim=32", "model.layers=1", "model.heads=2", "model.max_len=64"]
    infos = {
        "lm": (["pos=learned", "data.seq_len=32"], {"name": "text", "task": "lm", "vocab_size": 257}),
        "classify": (["data=listops", "data.seq_len=48"], {"name": "listops", "task": "classify", "vocab_size": 17}),
    }
    out = {}
    for kind, (overrides, info) in infos.items():
        cfg = compose_cfg([*small, *overrides])
        info = {
            "num_classes": 10 if kind == "classify" else None,
            "token_bytes": None,
            "pad_id": 0 if kind == "classify" else None,
            "eos_id": None if kind == "classify" else 256,
            "fingerprint": "none",
            "tokenizer": {"kind": "byte"} if kind == "lm" else None,
            **info,
        }
        model = build_model(cfg, info)
        path = root / f"{kind}.ckpt"
        state = {f"model.{k}": v for k, v in model.state_dict().items()}
        torch.save({"xfam": metadata(cfg, info), "state_dict": state}, path)
        out[kind] = str(path)
    return out


LM, CLS = "ckpt={lm}", "ckpt={classify}"
#: (id, xfam arguments ({lm} / {classify}: the fixture's checkpoints), texts the one error contains)
XFAM: list[tuple[Any, ...]] = [
    ("no-command", [], ["name a command"]),
    ("unknown-command", ["evl"], ["invalid choice: 'evl'"]),
    ("list-unknown-flag", ["list", "--bogus"], ["unrecognized arguments: --bogus"]),
    ("list-switch-value", ["list", "markdown=maybe"], ["markdown is a switch"]),
    ("eval-no-ckpt", ["eval"], ["required: --ckpt", "ckpt="]),
    ("eval-missing-ckpt", ["eval", "ckpt=/no/such.ckpt"], ["ckpt='/no/such.ckpt' does not exist"]),
    ("eval-ckpt-folder", ["eval", "ckpt=/tmp"], ["ckpt='/tmp' is a folder"]),
    ("eval-split", ["eval", LM, "split=dev"], ["invalid choice: 'dev'"]),
    ("eval-batch-size", ["eval", LM, "batch_size=0"], ["batch_size=0: must be an integer >= 1"]),
    ("eval-limit", ["eval", LM, "limit=-1"], ["limit=-1: must be an integer >= 1"]),
    ("eval-batch-size-text", ["eval", LM, "batch_size=abc"], ["invalid int value: 'abc'"]),
    ("eval-device", ["eval", LM, "device=gpu"], ["device='gpu' is not a device name"]),
    ("eval-unknown-option", ["eval", LM, "spilt=test"], ["'spilt=test' is neither an option", "'split'"]),
    ("generate-negative", ["generate", LM, "prompt=ab", "max_new_tokens=-5"], ["max_new_tokens=-5"]),
    ("generate-zero", ["generate", LM, "prompt=ab", "max_new_tokens=0"], ["max_new_tokens=0"]),
    (
        "generate-past-position-table",
        ["generate", LM, "prompt=ab", "max_new_tokens=100"],
        ["exceeds the learned position table (64)", "max_new_tokens=62"],
    ),
    ("generate-default-length", ["generate", LM, "prompt=ab"], ["max_new_tokens (200)"]),
    ("generate-temperature", ["generate", LM, "temperature=-1"], ["temperature=-1.0: must be a number >= 0"]),
    ("generate-temperature-nan", ["generate", LM, "temperature=nan"], ["temperature=nan"]),
    ("generate-top-p-zero", ["generate", LM, "top_p=0"], ["top_p=0.0: must be a number in (0, 1]"]),
    ("generate-top-p-large", ["generate", LM, "top_p=1.5"], ["top_p=1.5"]),
    ("generate-top-k", ["generate", LM, "top_k=-3"], ["top_k=-3"]),
    ("generate-samples", ["generate", LM, "num_samples=0"], ["num_samples=0"]),
    ("generate-knn-lambda", ["generate", LM, "knnlm_lambda=2"], ["knnlm_lambda=2.0"]),
    ("generate-knn-k", ["generate", LM, "knnlm_k=0"], ["knnlm_k=0"]),
    ("generate-knn-temperature", ["generate", LM, "knnlm_temperature=0"], ["knnlm_temperature=0.0"]),
    ("generate-knn-index", ["generate", LM, "knnlm_index=annoy"], ["invalid choice: 'annoy'"]),
    ("generate-switch", ["generate", LM, "check=maybe"], ["check is a switch"]),
    ("generate-empty-prompt", ["generate", LM, "max_new_tokens=5"], ["the prompt is empty"]),
    ("generate-classifier", ["generate", CLS, "prompt=ab"], ["no text tokenizer"]),
    ("generate-typo", ["generate", LM, "max_new_token=3"], ["Did you mean 'max_new_tokens'"]),
    ("generate-device", ["generate", LM, "device=cuda:x"], ["device='cuda:x'"]),
    ("calibrate-delta-zero", ["calibrate", LM, "delta=0"], ["delta=0.0: must be a number in (0, 1)"]),
    ("calibrate-delta-large", ["calibrate", LM, "delta=1.5"], ["delta=1.5"]),
    ("calibrate-epsilon", ["calibrate", LM, "epsilon=0"], ["epsilon=0.0"]),
    ("calibrate-tolerance", ["calibrate", LM, "tolerance=-1"], ["tolerance=-1.0"]),
    ("calibrate-thresholds", ["calibrate", LM, "thresholds=a,b"], ["thresholds='a,b'"]),
    ("calibrate-method", ["calibrate", LM, "method=bayes"], ["invalid choice: 'bayes'"]),
    ("calibrate-no-exit", ["calibrate", LM], ["has no exit threshold", "exit=calm"]),
    ("calibrate-limit", ["calibrate", LM, "limit=0"], ["limit=0"]),
    ("knnlm-no-step", ["knnlm"], ["name a step"]),
    ("knnlm-unknown-step", ["knnlm", "search"], ["invalid choice: 'search'"]),
    ("knnlm-build-no-ckpt", ["knnlm", "build"], ["required: --ckpt"]),
    ("knnlm-build-limit", ["knnlm", "build", LM, "limit=0"], ["limit=0"]),
    ("knnlm-build-dtype", ["knnlm", "build", LM, "dtype=int8"], ["invalid choice: 'int8'"]),
    ("knnlm-eval-no-store", ["knnlm", "eval", LM], ["required: --store"]),
    ("knnlm-eval-k", ["knnlm", "eval", LM, "store=/tmp", "k=0"], ["k=0: the number of neighbours must be >= 1"]),
    ("knnlm-eval-lambda", ["knnlm", "eval", LM, "store=/tmp", "lambda=2"], ["lambda=2.0: the interpolation weight"]),
    ("knnlm-eval-temperature", ["knnlm", "eval", LM, "store=/tmp", "temperature=0"], ["temperature=0.0: must be > 0"]),
    ("knnlm-eval-index", ["knnlm", "eval", LM, "store=/tmp", "index=annoy"], ["invalid choice: 'annoy'"]),
]


@pytest.mark.parametrize(("argv", "texts", "env"), _flat(XFAM))
def test_xfam_command_line_is_refused_before_anything_is_written(
    argv: list[str],
    texts: list[str],
    env: dict[str, str],
    ckpts: dict[str, str],
    runs: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [a.format(**ckpts) for a in argv]
    refused(capsys, lambda: xfam_main.main(argv), texts, runs)


def test_the_table_covers_every_config_group() -> None:
    """At least one case selects or sets each group (and 150 cases in all)."""
    words = " ".join(a for case in _flat(TRAIN) for a in case.values[0])
    missing = [g for g in config_groups() if f"{g}=" not in words and f"{g}." not in words]
    assert not missing, f"no case for {missing}"
    assert len(TRAIN) + len(XFAM) >= 150


# -- a few real processes: the same refusals through the entry points ---------------------------------

SUBPROCESS = [
    ("train-name", ["train.py", "name=../../x"], ["outside the runs folder"]),
    ("xfam-generate", ["-m", "xfam.cli", "generate", "ckpt={lm}", "max_new_tokens=-5"], ["max_new_tokens=-5"]),
]


@pytest.mark.parametrize(("args", "texts"), [pytest.param(a, t, id=i) for i, a, t in SUBPROCESS])
def test_entry_points_refuse_in_one_message(
    args: list[str], texts: list[str], ckpts: dict[str, str], tmp_path: Path
) -> None:
    root = tmp_path / "runs"
    res = run_cli([a.format(**ckpts) for a in args], env={"XFAM_RUNS": str(root)})
    assert res.returncode == CLEAN_EXIT, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.count("xfam: error:") == 1 and "Traceback" not in res.stdout + res.stderr, res.stderr
    assert all(t in res.stderr for t in texts) and "Fix:" in res.stderr, res.stderr
    assert not root.exists()
