"""CALM: Confident Adaptive Language Modeling (Schuster et al., NeurIPS 2022, arXiv:2207.07061).

Training (sec. 5): the shared head reads every layer, and the per-layer losses are averaged with
weights w_n = n / sum_j j, which favour deeper layers. xfam keeps the full model's loss (the
trainer's ``loss``) with weight 1 and adds ``exit/layers`` = sum_{n<N} (w_n / w_N) L_n = sum_{n<N}
(n / N) L_n: the same objective divided by w_N (Adam is insensitive to the scale), and the logged
training loss stays the full-depth loss. ``weighting=uniform`` gives every layer weight 1.

Inference (sec. 3): after layer n < N a token exits when its confidence c_n >= ``threshold``:

    softmax      c = p_(1) - p_(2), the gap between the top two probabilities of head(h^n)
    saturation   c = cos(h^(n-1), h^n)  (0 after layer 1, which has no previous layer: the CALM code)
    classifier   c = sigmoid(w . h^n + b), one linear classifier shared by the layers

With ``threshold_decay`` = tau > 0, the threshold at position t is clip(0.9 lambda + 0.1 exp(-tau t / T), 0, 1)
with T = ``model.max_len`` (sec. 3.1: exits get easier later in the sequence).

All three are <= 1, so a threshold above 1 disables exits and gives the full model exactly. The
classifier is trained on every run, whichever measure is chosen, so all three can be compared at
inference: a binary cross-entropy against the consistency oracle 1[argmax head(h^n) = argmax
head(h^N)] on detached states (``exit/classifier``), class-balanced as in the CALM code; CALM trains
it in a second step with the model frozen, xfam alongside the model but it never changes the model.
An exited
token's state is copied to the layers it skips and the later tokens' keys and values come from it
(``xfam.exit._early``). The threshold is calibrated with Learn-then-Test by ``xfam calibrate``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.core.registry import Range
from xfam.core.stack import LayerStack
from xfam.exit._base import EXIT, EarlyExitPolicy, ExitOutput, layer_losses
from xfam.exit._early import traverse_all

Measure = Literal["softmax", "saturation", "classifier"]


@EXIT.register("calm")
class CALM(EarlyExitPolicy):
    """Early exit per token with a confidence measure and a calibrated threshold.

    Args:
        dim, num_layers: model width and depth (injected).
        measure: the confidence measure used at inference (``softmax``, ``saturation``, ``classifier``).
        threshold: exit when the confidence reaches it; above 1 disables exits.
        min_layer: the first layer after which a token may exit.
        exit_at: every token exits after this layer (a static-depth model; 0: use the confidence).
        weighting: per-layer loss weights in training: ``linear`` (CALM: w_n proportional to n) or ``uniform``.
        classifier_weight: weight of the early-exit classifier's loss.
        threshold_decay: tau of the decaying threshold (0: a constant threshold).
    """

    paper = "Schuster et al., NeurIPS 2022, arXiv:2207.07061 (CALM)"
    inference_options = ("measure", "threshold", "min_layer", "exit_at", "threshold_decay")

    def __init__(
        self,
        *,
        dim: int,
        num_layers: int,
        measure: Measure = "softmax",
        threshold: Annotated[float, Range(ge=0.0)] = 0.9,
        min_layer: Annotated[int, Range(ge=1)] = 1,
        exit_at: Annotated[int, Range(ge=0)] = 0,
        weighting: Literal["linear", "uniform"] = "linear",
        classifier_weight: Annotated[float, Range(ge=0.0)] = 1.0,
        threshold_decay: Annotated[float, Range(ge=0.0)] = 0.0,
        max_len: int = 1024,
    ):
        super().__init__()
        for name, value in (("min_layer", min_layer), ("exit_at", exit_at)):
            if value >= num_layers:
                raise ConfigError(
                    f"exit.{name}={value}: tokens can exit after layers 1..{num_layers - 1} of model.layers="
                    f"{num_layers} (the last layer is the full model). Fix: exit.{name}={num_layers - 1} or less."
                )
        self.measure, self.threshold, self.min_layer, self.exit_at = measure, threshold, min_layer, exit_at
        self.weighting, self.classifier_weight = weighting, classifier_weight
        self.threshold_decay, self.max_len = threshold_decay, max_len
        self.classifier = nn.Linear(dim, 1)

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        out = []
        if selection.task not in ("lm", "seq2seq", "decision"):
            out.append(
                f"exit=calm exits per generated token of a causal decoder (a language model, a seq2seq decoder, a "
                f"Decision Transformer's actions); this is a {selection.task} task. Fix: exit=depth_adaptive "
                f"exit.classifier=sequence, or exit=none."
            )
        if selection.has_memory:
            out.append(
                "exit=calm with memory is not implemented (memory writes assume every layer ran). Fix: memory=none."
            )
        return out

    def confidence(self, n: int, before: Tensor, after: Tensor, stack: LayerStack) -> Tensor:
        """c_n ``[B, T]`` of the measure at the T rows the head scores, from the states before and after layer n
        ``[B, G + S, D]``."""
        if self.measure == "softmax":
            top = torch.softmax(stack.head(after).float(), dim=-1).topk(2, dim=-1).values  # [B, T, 2]
            return top[..., 0] - top[..., 1]
        before, after = stack.scored_rows(before), stack.scored_rows(after)  # [B, T, D]
        if self.measure == "saturation":
            sim = F.cosine_similarity(before.float(), after.float(), dim=-1)
            return sim if n > 1 else torch.zeros_like(sim)
        return torch.sigmoid(self.classifier(after).squeeze(-1).float())

    def threshold_at(self, positions: Tensor | None, after: Tensor) -> Tensor | float:
        """The threshold, or with ``threshold_decay`` the decaying threshold per position ``[S]``."""
        if not self.threshold_decay or self.threshold > 1:
            return self.threshold
        t = positions if positions is not None else torch.arange(after.shape[1], device=after.device)
        t = t.float()
        decay = torch.exp(-self.threshold_decay * t / self.max_len)
        return (0.9 * self.threshold + 0.1 * decay).clamp(0.0, 1.0)

    def forward(self, x: Tensor, stack: LayerStack) -> ExitOutput:
        if self.training and stack.targets is not None:
            return self._train(x, stack)

        def decide(n: int, before: Tensor, after: Tensor) -> Tensor:
            if n < self.min_layer:
                return torch.zeros(after.shape[:2], dtype=torch.bool, device=after.device)
            c = self.confidence(n, before, after, stack)  # [B, T]: the rows the head scores
            c = stack.spread_scores(c, after.shape[1], float("-inf"))  # unscored rows (ETC's globals ...) never exit
            return c >= self.threshold_at(stack.positions, after)

        hidden, depth = self.traverse(x, stack, decide)
        return ExitOutput(hidden=hidden, depth=depth)

    def _train(self, x: Tensor, stack: LayerStack) -> ExitOutput:
        head, targets = stack.head, stack.targets
        assert targets is not None  # (forward trains only with targets)
        hiddens = traverse_all(x, stack.run_layer, stack.num_layers)
        n_layers = len(hiddens)
        weights = [(n / n_layers if self.weighting == "linear" else 1.0) for n in range(1, n_layers)] + [0.0]
        # the last layer's weight is 0 here: it is the trainer's loss
        loss, _, preds, keep = layer_losses(hiddens, lambda n, h: head(h), targets, weights)
        aux = {"layers": loss}
        if self.classifier_weight and n_layers > 1:
            consistent = (preds[:-1] == preds[-1]).float()  # [N-1, B, S] oracle: agrees with the full model
            states = torch.stack([stack.scored_rows(h) for h in hiddens[:-1]]).detach()  # [N-1, B, T, D]
            logit = self.classifier(states).squeeze(-1).float()  # [N-1, B, T]
            share = (consistent * keep).sum() / (keep.sum() * (n_layers - 1)).clamp_min(1)  # positives' share
            balance = torch.where(consistent.bool(), 1 - share, share) * keep  # each class weighs half
            bce = F.binary_cross_entropy_with_logits(logit, consistent, reduction="none")
            aux["classifier"] = self.classifier_weight * (bce * balance).sum() / balance.sum().clamp_min(1e-9)
        return ExitOutput(hidden=hiddens[-1], aux=aux)
