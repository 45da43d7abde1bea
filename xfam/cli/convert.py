"""``xfam convert``: a sharded checkpoint (a folder written by ``trainer=fsdp`` / ``fsdp_cpu``) to a single
file, or a single file to a sharded folder (``xfam.model.sharded``).

Both ways keep everything a checkpoint holds: the weights, every optimizer's state (renumbered between
DCP's parameter names and ``torch.optim``'s indices), the learning-rate schedule, the loops' position,
xfam's metadata and the per-rank resume state, so the converted checkpoint evaluates, generates, exports
and resumes like the original: a model trained sharded continues in one process (``trainer=cpu
ckpt_path=<file>``), a one-process run continues sharded (``trainer=fsdp_cpu ckpt_path=<folder>``). The
source is verified first (its digests), and the result is written atomically with its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xfam.cli.grammar import Args
from xfam.core.errors import ConfigError
from xfam.model import sharded
from xfam.model.checkpoint import read, seal, write


def run(args: Args) -> Path:
    src, out = Path(args.ckpt), Path(args.out)
    if (out.exists() or out.is_symlink()) and not args.overwrite:
        raise ConfigError([f"out={str(out)!r} exists. Fix: another out=, or overwrite=true to replace it."])
    ckpt = read(src)  # digests checked (of every shard, for a folder)
    step = ckpt.get("global_step")
    if sharded.is_sharded(src):
        if out.is_dir() and not out.is_symlink():  # (a file can replace a file atomically, not a folder)
            sharded.remove(out)
        write(sharded.to_file(src, ckpt), out)
        print(f"{src} (sharded, step {step}) -> {out} (one file, {out.stat().st_size / 2**20:.1f} MB)")
        return out
    tmp = out.with_name(out.name + ".tmp")
    sharded.remove(tmp)
    tmp.mkdir(parents=True)
    sharded.to_folder(ckpt, tmp, optimizer_names(ckpt))
    meta = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    seal(tmp, out, meta)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{src} (one file, step {step}) -> {out} (sharded, {size / 2**20:.1f} MB)")
    return out


def optimizer_names(ckpt: dict[str, Any]) -> list[list[str]]:
    """For each optimizer state of a single-file checkpoint, the names of its parameters in the order its groups
    list them: the groups ``xfam.training.lit.optim.param_groups`` builds for the checkpoint's model (with the
    fine-tuning split and frozen parameters of a fine-tuning run), checked against the saved groups' sizes."""
    from xfam.config.specs import OptimSpec
    from xfam.model.build import build_model
    from xfam.model.init_from import FinetuneSpec, ParamSplit, freeze
    from xfam.training.lit.optim import param_groups
    from xfam.training.resume import FinetuneRecord

    states = ckpt.get("optimizer_states", [])
    if not states:
        return []
    meta = ckpt["xfam"]
    cfg = meta["config"]
    model = build_model(cfg, meta["data_info"])
    spec = FinetuneSpec(**cfg.get("finetune", {}))
    if spec.freeze:
        freeze(model, spec.freeze)
    record = ckpt.get("callbacks", {}).get(FinetuneRecord.__qualname__)
    loaded = None if record is None else frozenset(record["loaded"])
    split = None if loaded is None else ParamSplit(loaded=loaded, lr_loaded=spec.lr_loaded, lr_new=spec.lr_new)
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    groups = param_groups(model, OptimSpec(**cfg["optim"]), split)
    order = [names[id(p)] for g in groups for p in g["params"]]
    saved = [len(g["params"]) for g in states[0]["param_groups"]]
    if [len(g["params"]) for g in groups] != saved or len(states) != 1:
        raise ConfigError(
            [
                f"the optimizer state of this checkpoint does not match the parameter groups its config builds "
                f"(saved groups of {saved} parameters, built {[len(g['params']) for g in groups]}): it was written by "
                f"another version of xfam. Fix: convert it with the version that wrote it."
            ]
        )
    return [order]
