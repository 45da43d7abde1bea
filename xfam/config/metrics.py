"""The metrics a run reports: ``final_metrics`` (what ``optimized_metric`` may name) and the check of
``optimized_metric`` and ``callbacks.monitor`` against them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from xfam.core.errors import did_you_mean
from xfam.model import compat

if TYPE_CHECKING:
    from xfam.data.base import DataSource

#: Aux-loss metrics are ``{split}/{slot}/{name}`` with names of the components' own (``val/attention/span``).
AUX_METRIC_SLOTS = ("attention", "memory", "exit")


def final_metrics(cfg: Mapping[str, Any], data_cls: type[DataSource] | None, sel: compat.Selection) -> list[str]:
    """The metric names a run of ``cfg`` returns when it ends (``runner.train``; what ``optimized_metric``
    may name): ``step``, ``train/tokens_per_s``, and for val (and test, with ``test=true``) the task's metrics
    (``xfam.eval.metrics.summarize``): loss and acc (regress, continuous decision: loss, mse, rmse, mae); lm,
    seq2seq, mlm: ppl, and (not mlm) bpb for byte-backed text; seq2seq: bleu, chrf, exact_match of generated
    outputs (``task.eval_generate_rows`` > 0); decision: the rollouts' return, return_std and score; an exit
    policy's depth and compute_saved; an early-exit policy's full-depth metrics and agreement. Aux losses
    (``val/attention/span`` ...) are named by the components and matched by prefix (``AUX_METRIC_SLOTS``)."""
    names = ["loss", "mse", "rmse", "mae"] if continuous_targets(sel.task, cfg, data_cls) else ["loss", "acc"]
    if sel.task in ("lm", "seq2seq", "mlm"):
        text = data_cls is not None and data_cls.byte_text and sel.task != "mlm"
        names += ["ppl"] + (["bpb"] if text else [])
    exit_cls = sel.exit[0]
    if exit_cls.registry_name != "none":
        names += ["depth", "compute_saved"]
    if exit_cls.early_exit:
        full = ["loss", "acc"] + (["ppl", "bpb"] if "bpb" in names else ["ppl"] if "ppl" in names else [])
        names += [f"full/{n}" for n in full] + ["agreement"]
    if sel.task == "decision" and cfg.get("task", {}).get("rollout_episodes", 10):
        names += ["return", "return_std", "score"]  # (score: where the data has reference returns)
    if sel.task == "seq2seq" and cfg.get("task", {}).get("eval_generate_rows", 64):
        names += ["bleu", "chrf", "exact_match"]
    splits = ["val", "test"] if cfg.get("test", True) else ["val"]
    return ["step", "train/tokens_per_s"] + [f"{s}/{n}" for s in splits for n in names]


def continuous_targets(task: str, cfg: Mapping[str, Any], data_cls: type[DataSource] | None) -> bool:
    """Whether the task's targets are vectors scored by squared error (regress, decision on continuous actions)."""
    if task == "decision" and data_cls is not None:
        return data_cls.inputs_for(cfg["data"]).get("action_dim") is not None
    return task == "regress"


def _metric_problems(cfg: Mapping[str, Any], data_cls: type[DataSource] | None, sel: compat.Selection) -> list[str]:
    """``optimized_metric`` (read when the run ends) and ``callbacks.monitor`` (read at each validation) must
    name metrics this run produces: found wrong only after training, otherwise."""
    out = []
    final = final_metrics(cfg, data_cls, sel)
    aux = lambda *splits: tuple(f"{s}/{slot}/" for s in splits for slot in AUX_METRIC_SLOTS)  # noqa: E731
    metric = cfg.get("optimized_metric")
    splits = ("val", "test") if cfg.get("test", True) else ("val",)
    if isinstance(metric, str) and metric not in final and not metric.startswith(aux(*splits)):
        hint = did_you_mean(metric, final)
        out.append(
            f"optimized_metric={metric!r} is not a metric this run reports when it ends (the sweeper would get "
            f"nothing after the whole training).{hint} Valid: {', '.join(final)}, or an auxiliary loss "
            f"val/<attention|memory|exit>/<name>. Fix: optimized_metric=val/loss (say)."
        )
    monitor, callbacks = cfg["callbacks"].get("monitor"), cfg["callbacks"]
    logged = [m for m in final if m.startswith("val/")] + ["train/loss", "global_step"]
    if "val/depth" in final:
        logged.append("train/depth")
    if (
        callbacks.get("save_best")
        and isinstance(monitor, str)
        and monitor not in logged
        and not monitor.startswith(aux("val", "train"))
    ):
        hint = did_you_mean(monitor, logged)
        out.append(
            f"callbacks.monitor={monitor!r} is not a metric logged at validation (best.ckpt keeps the lowest "
            f"one; Lightning stops at the first validation without it).{hint} Valid: {', '.join(logged)}. "
            f"Fix: callbacks.monitor=val/loss, or callbacks.save_best=false."
        )
    return out
