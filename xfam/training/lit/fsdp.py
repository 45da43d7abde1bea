"""Sharded data parallel training (``trainer=fsdp`` on GPUs, ``trainer=fsdp_cpu`` on CPU processes): PyTorch's
FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``, with xfam's checkpoint guarantees.

What ``ShardedStrategy`` adds to Lightning's strategy:

* **Every process is a data-parallel rank.** Lightning's default data-parallel size is the number of
  nodes (the rest would be tensor parallel), so two processes on one host would hold the same rows and
  shard nothing; here the mesh is ``[world, 1]`` (data parallel x tensor parallel) and the data is sharded by
  global rank (``xfam.data.module``).
* **Per-block wrapping** (``shard_model``): each Transformer block is its own FSDP unit (all-gathered for its
  forward and backward, resharded after), the embeddings, head, norms, memories and exit classifiers form the
  root unit. On GPUs a bf16 run keeps fp32 sharded parameters and computes in bf16 with fp32 gradient
  reduction (``MixedPrecisionPolicy``), as torchtitan does.
* **Launch**: ``spawn=True`` (``trainer=fsdp_cpu``) starts the ranks as child processes of this one
  (Lightning's multiprocessing launcher, as ``ddp_spawn``), which also works inside ``train.py -m`` and in
  one Python session; ``spawn=False`` (``trainer=fsdp``) re-runs the command line per rank as Lightning's
  ``ddp`` does, or joins processes that torchrun or srun started.
* **Checkpoints** (``save_checkpoint``): a folder written with ``torch.distributed.checkpoint`` (each rank
  writes its shards) under ``<name>.tmp`` and renamed once complete, with the digests of its files in
  ``meta.pt`` (``xfam.model.sharded``); ``last.ckpt`` is a link to the newest ``step-N.ckpt`` folder. With
  ``callbacks.async_save`` the shards are staged (copied) at the step and written by a background thread while
  training goes on; the folder is sealed before the next write, at the end and before a preemption exit.
  Loading checks the digests first (rank 0, the verdict broadcast), then DCP reshards onto however many ranks
  resume.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from xfam.core.errors import ConfigError
from xfam.model.checkpoint import DIGEST_KEY, disk_errors, read, seal
from xfam.model.sharded import SHARDS_KEY, rank_digests, remove

if TYPE_CHECKING:
    from xfam.model.transformer import XfamModel


def stacks(model: nn.Module) -> dict[str, XfamModel]:
    """The layer stacks of ``model`` by name prefix: an ``XfamModel`` itself, or an encoder-decoder's two."""
    found = {"encoder.": model.encoder, "decoder.": model.decoder} if hasattr(model, "encoder") else {"": model}
    return cast("dict[str, XfamModel]", found)


def shard_model(model: nn.Module, mesh: Any, mp_policy: Any) -> list[str]:
    """Apply ``fully_shard`` to every Transformer block of ``model``'s stacks, then to ``model`` itself; returns the
    names of the per-block units. A stack's blocks stay in the root unit, gathered once per forward, where units of
    their own cannot work (``whole_stack_reason``)."""
    from torch.distributed.fsdp import fully_shard

    units = []
    for prefix, stack in stacks(model).items():
        if whole_stack_reason(stack) is not None:
            continue
        for i, block in enumerate(stack.blocks):
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
            units.append(f"{prefix}blocks.{i}")
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return units


def whole_stack_reason(stack: XfamModel) -> str | None:
    """Why the blocks of ``stack`` stay in the root unit (None: each is a unit of its own). A block that runs at
    several depths (``model.share_layers``, ACT's shared step); reversible layers (``model.reversible``: their
    backward calls the blocks' sublayers, not the blocks); an early-exit policy (``calm``, ``depth_adaptive``: when
    every token of a rank has left, that rank skips the remaining blocks, and its all-gathers would no longer pair
    with the other ranks'); a model-level objective (ETC's CPC: its extra passes through the stack depend on each
    rank's rows, none when fewer than two sentences are masked)."""
    from xfam.exit import EarlyExitPolicy

    if len(stack.blocks) != stack.num_layers:
        return "a block runs at several depths"
    if stack.spec.reversible:
        return "reversible layers call the blocks' sublayers in their backward"
    if isinstance(stack.exit, EarlyExitPolicy):
        return f"exit={stack.exit.registry_name} skips blocks per rank"
    if getattr(stack, "objective", None) is not None:
        return "the attention's model-level objective re-runs the stack per rank's rows"
    return None


def sharding_plan(model: nn.Module, processes: int | None) -> str:
    """The log line of how ``model`` is sharded (``shard_model``), for the run's log before launch."""
    reasons = {prefix.replace(".", " "): (whole_stack_reason(s), len(s.blocks)) for prefix, s in stacks(model).items()}
    parts = [f"{p}one unit per block ({n})" if why is None else f"{p}none ({why})" for p, (why, n) in reasons.items()]
    blocks_in_root = any(why is not None for why, _ in reasons.values())
    return (
        f"fsdp: parameters, gradients and AdamW state sharded over {processes or 'every'} process(es); units: "
        f"{', '.join(parts)}, and the root (embeddings, head, norms, memories, exit classifiers"
        f"{', blocks' if blocks_in_root else ''})"
    )


class ShardedStrategy(ModelParallelStrategy):
    """FSDP2 over every process as a data-parallel rank, with atomic, verified sharded checkpoints (module
    docstring). ``spawn``: start the ranks as child processes (CPU tests, sweeps); ``param_dtype``: the
    compute dtype of a mixed-precision run (None: the parameters' own); ``async_save``: write checkpoints in a
    background thread (``callbacks.async_save``)."""

    def __init__(self, spawn: bool = False, param_dtype: torch.dtype | None = None, async_save: bool = False):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True)
        self.spawn, self.param_dtype, self.async_save = spawn, param_dtype, async_save
        self._pending: tuple[Any, Path, Path, dict[str, Any]] | None = None  # (future, tmp, path, meta)
        self._removals: list[Path] = []  # older checkpoints to remove once the pending one is sealed
        self._save_group: Any = None  # the process group of background writes (not the training's)

    # -- processes ---------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        if self.spawn:
            self._launcher = _ShardedSpawnLauncher(self, start_method="spawn")
        else:
            super()._configure_launcher()

    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1  # every rank reads its own rows

    def shard(self, module: L.LightningModule) -> None:
        """``configure_model``: shard ``module.model`` over the data-parallel mesh (once per process)."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

        if isinstance(module.model, FSDPModule):
            return
        reduce_dtype = torch.float32 if self.param_dtype is not None else None
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=reduce_dtype)
        model = module.model
        assert isinstance(model, nn.Module)  # (an XfamLitModule's model)
        shard_model(model, self.device_mesh["data_parallel"], mp)  # (the runner logged the plan)

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Each rank writes its shards into ``<path>.tmp``; rank 0 adds ``meta.pt`` with the digests and renames
        the folder to ``<path>``, so ``<path>`` is a whole checkpoint or absent. With ``async_save`` the shards are
        copied (staged) now and written by a background thread; the folder is sealed by ``finish_pending``."""
        import torch.distributed.checkpoint as dcp

        self.finish_pending()  # one write at a time: the previous one is sealed before this one starts
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(path.name + ".tmp")
        if self.is_global_zero:
            remove(tmp)  # a write that died before
            tmp.mkdir(parents=True)
        self.barrier()
        state = {"state_dict": checkpoint.pop("state_dict")}
        state |= {f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}
        if self.async_save:
            if self._save_group is None:  # background collectives must not interleave with training's
                self._save_group = torch.distributed.new_group(backend="gloo")
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._save_group)
            self._pending = (future, tmp, path, checkpoint)
            return
        with disk_errors(path):
            dcp.save(state, checkpoint_id=str(tmp))  # every rank's shards; returns once DCP's .metadata is written
            self._seal(tmp, path, checkpoint)
        self.barrier()

    def _seal(self, tmp: Path, path: Path, meta: dict[str, Any]) -> None:
        """Every rank hashes the shards it wrote; rank 0 gathers the digests and seals the folder."""
        digests: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(digests, rank_digests(tmp, self.global_rank))
        if self.is_global_zero:
            seal(tmp, path, meta, {name: d for rank in digests for name, d in rank.items()})

    def finish_pending(self) -> None:
        """Wait for the background write (``async_save``) and seal its folder; then remove the checkpoints pruned
        meanwhile (never before: until the new one is sealed, they are the ones a restart resumes from)."""
        if self._pending is None:
            return
        future, tmp, path, meta = self._pending
        self._pending = None
        with disk_errors(path):
            future.result()  # this rank's shards written (on rank 0, DCP's coordinator: .metadata too)
            self._seal(tmp, path, meta)
            if self.is_global_zero:
                for old in self._removals:
                    remove(old)
        self._removals = []
        self.barrier()

    def teardown(self) -> None:
        self.finish_pending()
        super().teardown()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        problem = None
        if self.is_global_zero:
            try:
                read(path)  # digests of meta.pt and of every shard (or a single file's digest)
            except ConfigError as err:
                problem = str(err)
        if (problem := self.broadcast(problem)) is not None:
            raise ConfigError(problem)
        if not path.is_dir():
            raise ConfigError(
                f"checkpoint {path} is a single file; trainer=fsdp resumes from sharded checkpoints (folders). Fix: "
                f"xfam convert ckpt={path} out=<folder> to make a sharded copy, then ckpt_path=<folder>."
            )
        checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        checkpoint.pop(DIGEST_KEY, None)
        checkpoint.pop(SHARDS_KEY, None)
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        if self._pending is not None:
            self._removals.append(Path(filepath))
        elif self.is_global_zero:
            remove(Path(filepath))


class _ShardedSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, returning the *full* trained weights to the main process: its own sends
    ``state_dict()``, which under FSDP holds each rank's shards (``DTensor``), not the model."""

    def _collect_rank_zero_results(self, trainer: L.Trainer, results: Any) -> _WorkerOutput | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        fitting = trainer.state.fn == TrainerFn.FITTING  # (after a test or validation nothing goes back)
        if fitting:  # a collective, every rank; the barrier lets no rank exit while its part is in flight
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state_dict = get_model_state_dict(trainer.lightning_module, options=options)
            torch.distributed.barrier()
        if self._strategy.local_rank != 0 or self._strategy.global_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        if fitting:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            torch.save(state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: L.Trainer) -> None:
        if worker_output.weights_path is not None:  # a plain torch.save of tensors (no digest): read it here
            state = torch.load(worker_output.weights_path, map_location="cpu", weights_only=True)
            trainer.lightning_module.load_state_dict(state, strict=False)
            shutil.rmtree(os.path.dirname(worker_output.weights_path), ignore_errors=True)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)
