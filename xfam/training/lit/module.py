"""The Lightning module: losses and metrics, auxiliary losses, memory across batches, exact resume.

It takes the ``RunConfig`` that ``xfam.config.validate`` returns (or a plain resolved config, as
``load_from_checkpoint`` passes it); its plain dict, never a Hydra or xfam object, is what checkpoints and
hyperparameters record, so a checkpoint loads anywhere. Metrics:

* lm: loss (mean NLL per target token), perplexity, bits per byte = summed NLL / (ln 2 * bytes
  the targets stand for), next-token accuracy;
* seq2seq: the same over the target tokens, plus BLEU, chrF and exact match of the outputs generated for
  the first ``task.eval_generate_rows`` rows of each evaluation (``xfam.eval.outputs``);
* mlm: loss, perplexity and accuracy on the masked tokens; tag: loss and accuracy per token;
* classify: loss, accuracy;
* regress: loss = mean squared error over every target value (mse), its root (rmse), the mean absolute error (mae);
* decision: the action loss (cross-entropy and accuracy for discrete actions, as regress for continuous ones),
  and the returns of rollouts in the environment (``xfam.eval.rollout``: return, return_std, score, per target).

Exact resume (docs/architecture.md): the checkpoint stores the number of batches consumed in the
current epoch and which epoch that is (the resumable sampler skips them there only), and every
rank's RNG states, restored just before the first training batch after the restart, when the
DataLoader iterator already exists.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import numpy as np
import torch
from torch import Tensor

from xfam.config.run import RunConfig
from xfam.config.specs import OptimSpec
from xfam.config.task import TaskSpec
from xfam.core.logs import log_in_spawned_rank, log_once, quiet_lightning
from xfam.eval.carry import Carry, carried_inputs, next_carry
from xfam.eval.forward import forward_batch
from xfam.eval.inference import compares_full_depth, full_depth_stats, summarize_full_depth
from xfam.eval.metrics import add_stats, batch_stats, summarize
from xfam.eval.outputs import GeneratedTexts
from xfam.eval.rollout import task_rollouts
from xfam.eval.text_metrics import text_metrics
from xfam.model.build import build_model
from xfam.model.checkpoint import digest, metadata
from xfam.model.transformer import ModelOutput
from xfam.training.lit.compile import CompiledTraining, compile_mode, strip_compiled_prefix
from xfam.training.lit.optim import make_optimizer

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig

quiet_lightning()  # also in ddp_spawn's worker processes, which import this module afresh

#: The batch key of each task's targets (``xfam.data.base``), where it is not ``labels``.
TARGET_KEYS = {"classify": "label", "regress": "targets"}


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, in types ``torch.load(weights_only=True)`` accepts."""
    # (the legacy tuple of MT19937, the default; numpy's stubs type the plain call as the dict form)
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, gauss = legacy
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class XfamLitModule(L.LightningModule):
    """Trains an ``XfamModel`` built from ``config`` (a ``RunConfig``, or a plain config dict) for data described
    by ``data_info``. ``self.config``: the plain dict, for checkpoints; ``self.run_config``: the RunConfig, if given."""

    token_bytes: Tensor  # a buffer: ``data_info["token_bytes"]`` (empty: none)

    def __init__(self, config: RunConfig | dict[str, Any], data_info: dict[str, Any]):
        super().__init__()
        self.run_config: RunConfig | None = None
        if not isinstance(config, Mapping):
            self.run_config = config
            # save_hyperparameters reads this frame's arguments as they are now: the plain dict goes into the
            # checkpoint's hyper_parameters, exactly as when a dict is passed (a checkpoint holds no xfam object).
            config = config.raw
        self.save_hyperparameters()
        self.config, self.data_info = config, data_info
        self.task = data_info["task"]
        self.model = build_model(config if self.run_config is None else self.run_config, data_info)
        self.uses_memory = self.model.uses_memory
        tb = data_info.get("token_bytes")
        self.register_buffer("token_bytes", torch.tensor(tb if tb else [], dtype=torch.float32), persistent=False)
        # Memory carried across batches ({"layers": per-layer states, "docs": next document ids}, see
        # _carried): the training one is saved in checkpoints; evaluation keeps its own.
        self._memory: Carry | None = None
        self._eval_memory: Carry | None = None
        self._resume: dict[str, Any] | None = None
        self._sums: dict[str, Any] = {}  # summed batch statistics (tensors) and the int count of batches
        self._texts: GeneratedTexts | None = None  # seq2seq: the generated outputs of this evaluation
        self._compile_mode = compile_mode(config)  # trainer.compile: the mode, or None (lit/compile.py)
        self._compiled: CompiledTraining | None = None  # made in on_fit_start, after sharding and device moves

    def setup(self, stage: str) -> None:
        """In a spawned rank (``trainer=ddp_cpu``, ``fsdp_cpu``), rank 0 logs into the run's ``train.log`` and
        stderr like the main process (``log_in_spawned_rank``); the other ranks keep quiet."""
        if self.global_rank == 0:
            log_in_spawned_rank(Path(self.trainer.default_root_dir) / "train.log")

    # -- steps -----------------------------------------------------------------------------------
    def forward(self, batch: dict[str, Tensor], memory: list[Any] | None = None, train: bool = False) -> ModelOutput:
        """``train``: pass the loss's targets, for exit policies that train per-layer classifiers, and run the
        compiled model under ``trainer.compile`` (evaluation stays eager: ``xfam.training.lit.compile``)."""
        targets = batch.get(TARGET_KEYS.get(self.task, "labels")) if train else None
        model = self._compiled.call if train and self._compiled is not None else self.model
        return forward_batch(model, batch, memory=memory, targets=targets)

    def on_fit_start(self) -> None:
        """``trainer.compile``: wrap the model once it is sharded (``configure_model``) and on its device."""
        if self._compile_mode is not None and self._compiled is None:
            self._compiled = CompiledTraining(self.model, self._compile_mode)

    def _stats(self, out: ModelOutput, batch: dict[str, Tensor], train: bool = False) -> dict[str, Tensor]:
        """The batch's sums; ``train``: the objective's float32 sum (``batch_stats``)."""
        return batch_stats(
            self.task, out.logits, batch, self.token_bytes, out.depth, self.model.num_layers, float64=not train
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.uses_memory:
            out, self._memory = self._carried(batch, self._memory, train=True)
        else:
            out = self(batch, train=True)
        stats = self._stats(out, batch, train=True)
        loss = stats["nll"] / stats["count"].clamp_min(1)
        self.log("train/loss", loss, prog_bar=True)
        total = loss
        for name, value in out.aux.items():
            self.log(f"train/{name}", value)
            total = total + value
        if out.depth is not None:
            self.log("train/depth", out.depth.float().mean())
        self.log("global_step", float(self.global_step), logger=False)  # ModelCheckpoint keeps the latest by it
        return total

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Steps done, as a callback metric: after ddp_spawn only those reach the main process.
        self.log("steps_done", float(self.global_step), logger=False)

    def on_train_epoch_start(self) -> None:
        self._memory = None  # a new epoch restarts the streams

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._accumulate(self._eval_forward(batch), batch)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._accumulate(self._eval_forward(batch), batch)

    def _eval_forward(self, batch: dict[str, Tensor]) -> ModelOutput:
        """Evaluation carries its own memory through the split's streams (cached evaluation: stored
        states are reused, never recomputed); the training memory is left untouched."""
        if not self.uses_memory:
            return self(batch)
        out, self._eval_memory = self._carried(batch, self._eval_memory)
        return out

    def _carried(self, batch: dict[str, Tensor], carry: Carry | None, train: bool = False) -> tuple[ModelOutput, Carry]:
        """One batch of contiguous streams with the memory carried from the previous one
        (``xfam.eval.carry``: per-layer states and each row's next document id)."""
        batch, layers, docs = carried_inputs(self.model, batch, carry, self.data_info.get("eos_id"))
        out = self(batch, memory=layers, train=train)
        return out, next_carry(out.memory, docs)

    def _accumulate(self, out: ModelOutput, batch: dict[str, Tensor]) -> None:
        add_stats(self._sums, self._stats(out, batch))
        if self._texts is not None:
            self._texts.add(self.model, batch)
        add_stats(self._sums, {f"aux/{k}": v for k, v in out.aux.items()})
        if compares_full_depth(self.model):  # early exit: the full-depth model's metrics and the agreement
            add_stats(self._sums, full_depth_stats(self.model, batch, self.task, self.token_bytes, out.logits))
        self._sums["batches"] = self._sums.get("batches", 0) + 1

    @functools.cached_property
    def task_spec(self) -> TaskSpec:
        """The ``task`` section (a checkpoint of a run before it had one: the defaults)."""
        return self.run_config.task_spec if self.run_config is not None else TaskSpec(**self.config.get("task", {}))

    def on_validation_epoch_start(self) -> None:
        self._sums = {}
        if self.task == "seq2seq":
            self._texts = GeneratedTexts(self.data_info, self.task_spec, self.config["data"].get("target_len"))
        self._eval_memory = None  # each evaluation starts its streams afresh

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def _log_epoch(self, prefix: str) -> None:
        if not self._sums:
            return
        sums = {
            k: self.trainer.strategy.reduce(torch.as_tensor(v, device=self.device), reduce_op="sum")
            for k, v in sorted(self._sums.items())
        }
        metrics = summarize(sums, self.task, prefix)  # (reads only its own keys, not full/...)
        if "agree" in sums:
            metrics |= summarize_full_depth(sums, self.task, prefix)
        metrics |= self._text_metrics(prefix)
        if not self.trainer.sanity_checking:  # a decision model's rollouts: the same seeded episodes on every rank
            rollouts = task_rollouts(self.model, self.data_info, self.task_spec, prefix, test=prefix == "test")
            metrics |= {k: torch.tensor(v, device=self.device) for k, v in rollouts.items()}
        self.log_dict({k: v.float() for k, v in metrics.items()}, prog_bar=prefix == "val", sync_dist=False)
        self._sums = {}

    def _text_metrics(self, prefix: str) -> dict[str, Tensor]:
        """BLEU, chrF and exact match of the generated outputs of every rank (``GeneratedTexts``)."""
        if self._texts is None:
            return {}
        texts, self._texts = self._texts.pairs, None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, texts)
            texts = [t for r in ranks for t in r]
        if not texts:
            return {}
        scores = text_metrics([h for h, _ in texts], [r for _, r in texts])
        return {f"{prefix}/{k}": torch.tensor(v, device=self.device) for k, v in scores.items()}

    # -- optimisation ----------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Shard the model under ``trainer=fsdp`` (``xfam.training.lit.fsdp``); nothing under other strategies."""
        shard = getattr(self.trainer.strategy, "shard", None)
        if shard is not None:
            shard(self)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        spec = self.run_config.optim if self.run_config is not None else OptimSpec(**self.config["optim"])
        full_precision = str(self.trainer.precision) in ("32-true", "64-true", "32", "64")
        if full_precision:
            log_once("optimizer: fused AdamW (full precision)")
        else:
            log_once(f"optimizer: AdamW without the fused kernel (precision {self.trainer.precision})")
        return make_optimizer(self.model, spec, int(self.trainer.estimated_stepping_batches), fused=full_precision)

    # -- exact resume ----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = strip_compiled_prefix(checkpoint["state_dict"])  # never torch.compile's names
        checkpoint["xfam"] = metadata(self.config, self.data_info)
        datamodule: Any = getattr(self.trainer, "datamodule", None)
        stream = datamodule.stream_state() if hasattr(datamodule, "stream_state") else None
        mine = {"rng": rng_state(), "memory": _to_cpu(self._memory), **({"stream": stream} if stream else {})}
        ranks: list[Any] = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, mine)
        loop = self.trainer.fit_loop
        sampler = getattr(datamodule, "train_sampler", None)
        # (Lightning types ``current`` as the base tracker; these progresses hold _Processed/_StartedTracker)
        checkpoint["xfam_resume"] = {
            "batches_in_epoch": loop.epoch_loop.batch_progress.current.processed,  # type: ignore[attr-defined]
            # The epoch those batches belong to: the last one started. (``current_epoch`` is already the next
            # one when a checkpoint is written after an epoch finished, e.g. at the end of training.)
            "epoch": loop.epoch_progress.current.started - 1,  # type: ignore[attr-defined]
            # Rows per step over all ranks: a resume on another number of processes maps the position by rows.
            "global_batch": sampler.batch_size * sampler.world_size if sampler is not None else None,
            "ranks": ranks,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "state_dict" in checkpoint:  # (called before the state dict is loaded)
            checkpoint["state_dict"] = strip_compiled_prefix(checkpoint["state_dict"])
        resume = checkpoint.get("xfam_resume")
        if resume is None or self._trainer is None:
            return
        world = self.trainer.world_size
        self._resume = {**rank_state(resume["ranks"], self.global_rank, world), "epoch": resume.get("epoch")}
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "resume_at"):
            stream = self._resume.get("stream")
            datamodule.resume_at(resume["batches_in_epoch"], resume.get("epoch"), resume.get("global_batch"), stream)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._resume is not None:
            set_rng_state(self._resume["rng"])
            memory = self._resume["memory"]
            # A checkpoint written at an epoch's last batch resumes in the next epoch, whose streams start
            # afresh (as ``on_train_epoch_start`` does in an uninterrupted run).
            same_epoch = self._resume["epoch"] in (None, self.current_epoch)
            self._memory = None if memory is None or not same_epoch else _to_device(memory, self.device)
            self._resume = None


def rank_state(ranks: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
    """This rank's resume state (RNG states, memory) from the ``ranks`` a checkpoint saved, when ``world``
    processes resume it. The same number of processes: its own. Another number (a sharded checkpoint resumed on
    more or fewer processes): the RNG states, which are the same on every rank of a data-parallel run (every
    rank seeds alike and draws alike), and the memory streams regrouped: the saved ranks' streams laid end to
    end are cut into ``world`` equal groups, which is where ``ResumableBatchSampler`` puts them when the global
    batch is unchanged (``xfam.training.resume.check_processes`` refuses a changed one before launch)."""
    if len(ranks) == world:
        return ranks[rank]
    if len({digest(r["rng"]) for r in ranks}) > 1:
        log_once(f"resume on {world} processes from {len(ranks)}: the ranks' random states differ; rank 0's is used")
    memory = ranks[0]["memory"]
    if memory is not None:
        memory = _regroup([r["memory"] for r in ranks], rank, world)
    return {"rng": ranks[0]["rng"], "memory": memory}


def _regroup(states: list[Any], rank: int, world: int) -> Any:
    """Concatenate the per-rank ``states`` (one structure, tensors with the rank's streams first) along the streams
    and take group ``rank`` of ``world``."""
    first = states[0]
    if isinstance(first, Tensor):
        return torch.cat(states).chunk(world)[rank].clone()
    if isinstance(first, (list, tuple)):
        return type(first)(_regroup([s[i] for s in states], rank, world) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _regroup([s[k] for s in states], rank, world) for k in first}
    return first


def _to_cpu(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x
