"""The ``task`` group: what is trained on the data, and the model shape that serves it.

A data source has a task of its own (``DataSource.task_for``): ``lm`` (text), ``classify``, ``tag`` (a class
per token), ``seq2seq`` (source/target pairs) or ``regress`` (continuous vectors, each next one predicted
with a mean squared error: ``data=timeseries``, docs/inputs.md). ``task=auto`` takes it; ``task=mlm`` trains a
bidirectional encoder on any text source with BERT's masked-token objective instead (the only task that
changes the data's); naming the data's own task is allowed and changes nothing.

``model.arch=auto`` follows the task: seq2seq -> ``encoder_decoder``, lm and regress -> ``decoder``, the others
-> ``encoder``. A ``decoder`` on seq2seq pairs reads the source as a prefix of the target (a prefix LM with the
loss on the target only: the decoder-only baseline of an encoder-decoder).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Annotated, Literal, cast

from xfam.core.registry import NonNegative, Positive, Probability

#: What ``task.name`` may be.
TaskName = Literal["auto", "lm", "mlm", "classify", "tag", "seq2seq", "regress", "decision"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """The ``task`` section (``configs/task/<name>.yaml``; each file lists the keys its task reads).

    Attributes:
        name: ``auto`` (the data's task) or one of ``lm``, ``mlm``, ``classify``, ``tag``, ``seq2seq``, ``regress``,
            ``decision`` (the Decision Transformer on trajectories: ``data=gym``, docs/rl.md).
        rate / mask_frac / random_frac / span: masked LM (``xfam.data.masking``): the share of real tokens
            selected; of those, the share replaced by [MASK] and by a random token (the rest kept); SpanBERT's
            contiguous spans instead of single tokens.
        eval_generate_rows: seq2seq: rows whose outputs are generated and scored (BLEU, chrF, exact match) in
            each validation and test (0: none; loss and token accuracy are always computed on every row).
        beam_size / length_penalty: that decoding: greedy (1) or beam search with GNMT's length penalty alpha.
        max_new_tokens: the longest generated output (null: the data's ``target_len``).
        rollout_episodes: decision: episodes run in the environment per target return at each validation and
            test (``xfam.eval.rollout``; 0: none, the action loss only).
        target_returns: decision: the returns the rollouts condition on (null: the expert behaviour's mean return).
        rollout_seed: decision: validation's episode i is reset with seed ``rollout_seed + i``, test's with
            ``rollout_seed + 10000 + i``.
        rollout_max_steps: decision: the most steps of one rollout episode (null: the environment's time limit).
        rollout_sample: decision: draw discrete actions from the predicted distribution (the paper's Atari
            evaluation), else take the most likely one; continuous actions are always the prediction.
    """

    name: TaskName = "auto"
    rate: Annotated[float, Probability] = 0.15
    mask_frac: Annotated[float, Probability] = 0.8
    random_frac: Annotated[float, Probability] = 0.1
    span: bool = False
    eval_generate_rows: Annotated[int, NonNegative] = 64
    beam_size: Annotated[int, Positive] = 1
    length_penalty: Annotated[float, NonNegative] = 1.0
    max_new_tokens: Annotated[int, Positive] | None = None
    rollout_episodes: Annotated[int, NonNegative] = 10
    target_returns: list[float] | None = None
    rollout_seed: int = 0
    rollout_max_steps: Annotated[int, Positive] | None = None
    rollout_sample: bool = True


def known_task(name: object) -> TaskName:
    """``name`` if it is a task ``TaskSpec`` takes, else ``auto`` (to go on checking a section with other problems)."""
    return cast(TaskName, name) if name in typing.get_args(typing.get_type_hints(TaskSpec)["name"]) else "auto"


def resolve_task(spec: TaskSpec, data_task: str, data_name: str, sources: Mapping[str, str]) -> tuple[str, list[str]]:
    """The task trained (``spec.name``, or the data's for ``auto``) and the problems of the choice.
    ``sources``: every data source's own task by name, for the alternatives in a refusal."""
    if spec.name == "auto" or spec.name == data_task:
        return data_task, []
    if spec.name == "mlm":
        if data_task == "lm":
            return "mlm", []
        text = ", ".join(f"data={n}" for n, t in sources.items() if t == "lm")
        return "mlm", [
            f"task=mlm masks tokens of a text stream; data={data_name} is a {data_task} task. Fix: a text source "
            f"({text}), or task=auto."
        ]
    serving = ", ".join(f"data={n}" for n, t in sources.items() if t == spec.name) or "none"
    return data_task, [
        f"task={spec.name}, and data={data_name} is a {data_task} task: the task comes from the data (sources of "
        f"{spec.name}: {serving}). Fix: task=auto, or one of those sources."
    ]


def arch_problems(arch: str, task: str, causal: bool | None, data_name: str) -> list[str]:
    """Model shapes that cannot serve the task, and ``model.causal`` against the shape."""
    pairs = "data=seq2seq_toy, data=docstrings, or data=hf with source_column/target_column"
    if arch == "encoder_decoder" and task != "seq2seq":
        return [
            f"model.arch=encoder_decoder maps a source to a target; data={data_name} is a {task} task without pairs. "
            f"Fix: model.arch=auto, or a source of pairs ({pairs})."
        ]
    if arch == "encoder" and task in ("lm", "seq2seq", "regress", "decision"):
        item = {"regress": "vector", "decision": "action"}.get(task, "token")
        return [
            f"model.arch=encoder is bidirectional, and a {task} task predicts each next {item}: the encoder would "
            f"see it. Fix: model.arch=auto ({'encoder_decoder' if task == 'seq2seq' else 'decoder'})"
            + (", or task=mlm to pretrain an encoder on text." if task in ("lm", "seq2seq") else ".")
        ]
    if arch == "decoder" and task == "mlm":
        return [
            "task=mlm predicts masked tokens from both sides; model.arch=decoder sees only the left. "
            "Fix: model.arch=auto (encoder)."
        ]
    if causal is False and arch in ("decoder", "encoder_decoder") and task not in ("lm", "regress", "decision"):
        return [
            f"model.causal=false with model.arch={arch}: a decoder predicts each next token and must not see it. "
            f"Fix: model.causal=null."
        ]
    if causal and arch == "encoder" and task == "mlm":
        return ["model.causal=true with task=mlm: masked tokens are predicted from both sides. Fix: model.causal=null."]
    return []
