"""Depth-Adaptive Transformer (Elbayad, Gu, Grave and Auli, ICLR 2020, arXiv:1910.10073).

An output classifier after every layer n = 1..N (``output_heads=shared``: the model's head; ``separate``:
one output layer W_n per layer below N after the shared final norm, the last is the model's head).

Training the classifiers (sec. 2.2):
    aligned  every layer's loss, uniform weights (eq. 4): the trainer's full-depth loss plus
             ``exit/layers`` = sum_{n<N} NLL_n (eq. 4 times N);
    mixed    M exit sequences drawn uniformly per token, states copied above each token's exit,
             ``exit/mixed`` = mean over the M paths of the NLL at each token's sampled exit (eq. 5);
             xfam also keeps the trainer's full-depth loss, so exits disabled stay a trained model.

Exit classifiers (sec. 3), trained by cross-entropy against an oracle (``exit/halting``, weight
alpha = ``exit_weight``; its gradient reaches the model, as in the paper):
    sequence     q(n | x) = softmax(W mean_t h^1_t + b): one exit for the whole input (eq. 8; the
                 paper averages the encoder's outputs, a single stack averages its first layer's);
    multinomial  q_t(n) = softmax(W h^1_t + b) per token (eq. 11);
    geometric    chi^n_t = sigmoid(w . h^n_t + b) for n < N, q_t(n) = chi^n_t prod_{n'<n} (1 - chi^n'_t),
                 q_t(N) = prod_{n'<N} (1 - chi^n'_t) (eq. 12-13).
Oracles (eq. 9-10, 14-17): n* = argmax_n score^n - lambda n with score = the log-likelihood
(``oracle=likelihood``) or the number correct (``correctness``) of layer n, per sequence for
``sequence``, and per token smoothed by the RBF kernel kappa(t, t') = exp(-(t - t')^2 / sigma) for
the token-specific ones (sigma = 0: no smoothing, the paper's best setting with lambda = 0.1).

Inference: ``geometric`` exits at the first layer with chi > ``threshold`` (the paper: 0.5, tuned
on validation data, e.g. by ``xfam calibrate --method grid``); ``sequence`` and ``multinomial``
exit at argmax q (the paper), xfam's ``threshold`` asking that q there reach it (0: plain argmax).
A threshold above 1 disables exits. States are copied above a token's exit (``xfam.exit._early``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.core.registry import Range
from xfam.core.stack import LayerStack
from xfam.exit._base import EXIT, EarlyExitPolicy, ExitOutput, layer_losses, target_nll
from xfam.exit._early import Decide, traverse_all, traverse_with_exits

Head = Callable[..., Tensor]


@EXIT.register("depth_adaptive")
class DepthAdaptive(EarlyExitPolicy):
    """Per-layer classifiers, a learned exit classifier and oracle supervision.

    Args:
        dim, num_layers, out_dim, causal: model width, depth, output size and direction (injected).
        classifier: the exit classifier: ``geometric``, ``multinomial`` (per token) or ``sequence``.
        output_heads: ``shared`` output classifier at every layer, or ``separate`` ones.
        training: ``aligned`` or ``mixed`` (sampled exits with copied states).
        samples: M, the exit sequences drawn per batch in mixed training.
        oracle: ``likelihood`` or ``correctness``.
        depth_penalty: lambda of the oracles' -lambda n term.
        sigma: width of the oracles' RBF smoothing over tokens (0: none).
        threshold: the inference threshold (see the module docstring); above 1 disables exits.
        exit_weight: alpha, the exit classifier loss weight.
        exit_at: every token exits after this layer (a static-depth model; 0: use the classifier).
    """

    paper = "Elbayad et al., ICLR 2020, arXiv:1910.10073 (Depth-Adaptive Transformer)"
    inference_options = ("threshold", "exit_at")

    def __init__(
        self,
        *,
        dim: int,
        num_layers: int,
        out_dim: int,
        causal: bool,
        classifier: Literal["geometric", "multinomial", "sequence"] = "geometric",
        output_heads: Literal["shared", "separate"] = "shared",
        training: Literal["aligned", "mixed"] = "aligned",
        samples: Annotated[int, Range(ge=1)] = 6,
        oracle: Literal["likelihood", "correctness"] = "likelihood",
        depth_penalty: Annotated[float, Range(ge=0.0)] = 0.1,
        sigma: Annotated[float, Range(ge=0.0)] = 0.0,
        threshold: Annotated[float, Range(ge=0.0)] = 0.5,
        exit_weight: Annotated[float, Range(ge=0.0)] = 1.0,
        exit_at: Annotated[int, Range(ge=0)] = 0,
    ):
        super().__init__()
        if exit_at >= num_layers:
            raise ConfigError(
                f"exit.exit_at={exit_at}: tokens can exit after layers 1..{num_layers - 1} of model.layers="
                f"{num_layers}. Fix: exit.exit_at={num_layers - 1} or less (0: use the exit classifier)."
            )
        self.kind, self.training_mode, self.samples, self.oracle = classifier, training, samples, oracle
        self.depth_penalty, self.sigma, self.threshold = depth_penalty, sigma, threshold
        self.exit_weight, self.exit_at = exit_weight, exit_at
        self.heads = (
            nn.ModuleList(nn.Linear(dim, out_dim, bias=False) for _ in range(num_layers - 1))
            if output_heads == "separate"
            else None
        )
        self.halting = nn.Linear(dim, 1 if classifier == "geometric" else num_layers)

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        kind, out = params.get("classifier", "geometric"), []
        if kind == "sequence" and selection.causal:
            out.append(
                "exit=depth_adaptive exit.classifier=sequence picks one depth from the mean over the whole input, "
                "which in a causal model would let every token see the future. Fix: exit.classifier=geometric or "
                "multinomial (per token), or a bidirectional model."
            )
        if kind != "sequence" and selection.task not in ("lm", "seq2seq"):
            out.append(
                f"exit=depth_adaptive exit.classifier={kind} exits per generated token of a causal decoder (a "
                f"language model, a seq2seq decoder); this is a {selection.task} task. Fix: exit.classifier=sequence."
            )
        if selection.has_memory:
            out.append("exit=depth_adaptive with memory is not implemented. Fix: memory=none.")
        return out

    # -- classifiers -----------------------------------------------------------------------------
    def layer_logits(self, n: int, h: Tensor, head: Head, num_layers: int) -> Tensor:
        """Output classifier of layer n (1-based) on states ``[B, S, D]``."""
        if self.heads is None or n == num_layers:
            return head(h)
        return head(h, proj=self.heads[n - 1])

    def planned_depth(self, h1: Tensor, key_padding: Tensor | None) -> tuple[Tensor, Tensor]:
        """``sequence`` / ``multinomial``: argmax exit ``[B, S]`` (1-based) and its probability, from the
        first layer's states ``[B, S, D]`` (the sequence classifier reads their mean over real tokens)."""
        if self.kind == "sequence":
            q = torch.softmax(self.halting(real_mean(h1, key_padding)).float(), -1)  # [B, N]
            q = q.unsqueeze(1).expand(-1, h1.shape[1], -1)
        else:
            q = torch.softmax(self.halting(h1).float(), -1)  # [B, S, N]
        prob, idx = q.max(-1)
        return idx + 1, prob

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: Tensor, stack: LayerStack) -> ExitOutput:
        num_layers, head, key_padding = stack.num_layers, stack.head, stack.key_padding
        if self.training and stack.targets is not None:
            return self._train(x, stack.run_layer, num_layers, head, stack.targets, key_padding)
        plan: dict[str, Tensor] = {}

        def decide(n: int, before: Tensor, after: Tensor) -> Tensor:
            if self.kind == "geometric":
                return torch.sigmoid(self.halting(after).squeeze(-1).float()) > self.threshold
            if n == 1:  # sequence / multinomial: decided once, from the first layer
                depth, prob = self.planned_depth(after, key_padding)
                plan["depth"] = torch.where(prob >= self.threshold, depth, num_layers)
            return plan["depth"] == n

        hidden, depth = self.traverse(x, stack, decide)
        return ExitOutput(hidden=hidden, depth=depth, logits=self._exit_logits(hidden, depth, head, num_layers))

    def _exit_logits(self, hidden: Tensor, depth: Tensor, head: Head, num_layers: int) -> Tensor | None:
        """Each token's logits from its exit layer's classifier (None with a shared head: the model's)."""
        if self.heads is None:
            return None
        out = None
        for n in range(1, num_layers + 1):
            logits = self.layer_logits(n, hidden, head, num_layers)  # [B, S, V], or [B, C] pooled
            sel = (depth[:, -logits.shape[1] :] if logits.dim() == 3 else depth[:, 0]) == n  # [B, S] or [B]
            sel = sel.unsqueeze(-1)
            out = logits if out is None else torch.where(sel, logits, out)
        return out

    # -- training --------------------------------------------------------------------------------
    def _train(
        self,
        x: Tensor,
        run_layer: Callable[[int, Tensor], Tensor],
        num_layers: int,
        head: Head,
        targets: Tensor,
        key_padding: Tensor | None,
    ) -> ExitOutput:
        hiddens = traverse_all(x, run_layer, num_layers)
        weights = [1.0 if self.training_mode == "aligned" else 0.0] * (num_layers - 1) + [0.0]
        logits_of = lambda n, h: self.layer_logits(n, h, head, num_layers)
        loss, nll, preds, keep = layer_losses(hiddens, logits_of, targets, weights)
        if self.training_mode == "aligned":
            aux = {"layers": loss}
        else:
            aux = {"mixed": self._mixed(x, run_layer, num_layers, head, targets)}
        if self.exit_weight and num_layers > 1:
            best = self.oracle_depth(nll.detach(), (preds == targets) & keep, keep)  # [B, S] or [B], 1-based
            aux["halting"] = self.exit_weight * self._halting_loss(hiddens, best, keep, key_padding, targets)
        return ExitOutput(hidden=hiddens[-1], aux=aux)

    def oracle_depth(self, nll: Tensor, correct: Tensor, keep: Tensor) -> Tensor:
        """n* = argmax_n score^n - lambda n (1-based; ties: the lowest layer), from per-layer NLL and
        correctness ``[N, B, S]`` (or ``[N, B]`` for a classifier); per sequence for ``sequence``."""
        score = -nll if self.oracle == "likelihood" else correct.float()  # [N, B, S]
        score = score * keep
        if score.dim() == 3 and self.kind == "sequence":
            score = score.sum(-1)  # [N, B]
        elif score.dim() == 3 and self.sigma > 0:
            t = torch.arange(score.shape[-1], device=score.device, dtype=score.dtype)
            kernel = torch.exp(-((t[:, None] - t[None, :]) ** 2) / self.sigma)  # [S, S] kappa(t, t')
            score = score @ kernel  # sum_t' kappa(t, t') score_t' (kernel is symmetric)
        n = torch.arange(1, score.shape[0] + 1, device=score.device, dtype=score.dtype)
        return (score - self.depth_penalty * n.view(-1, *[1] * (score.dim() - 1))).argmax(0) + 1

    def _halting_loss(
        self, hiddens: list[Tensor], best: Tensor, keep: Tensor, key_padding: Tensor | None, targets: Tensor
    ) -> Tensor:
        s = targets.shape[-1] if targets.dim() == 2 else None
        if self.kind == "geometric":  # log q(n) = sum_{n'<n} log(1 - chi^n') + log chi^n  (n < N)
            assert s is not None  # (per-token targets)
            logit = torch.stack([self.halting(h[:, -s:]).squeeze(-1).float() for h in hiddens[:-1]])  # [N-1, B, S]
            stay = torch.cumsum(F.logsigmoid(-logit), 0)  # sum_{n'<=n} log(1 - chi^n')
            log_q = torch.cat((F.logsigmoid(logit[:1]), stay[:-1] + F.logsigmoid(logit[1:]), stay[-1:]))  # [N, B, S]
            nll = -log_q.gather(0, (best - 1).unsqueeze(0)).squeeze(0)  # [B, S]
            return (nll * keep).sum() / keep.sum().clamp_min(1)
        if self.kind == "sequence":
            return F.cross_entropy(self.halting(real_mean(hiddens[0], key_padding)).float(), best - 1)
        assert s is not None  # (per-token targets)
        logits = self.halting(hiddens[0][:, -s:]).float()  # [B, S, N]
        nll, _ = target_nll(logits, torch.where(keep, best - 1, -100))
        return nll.sum() / keep.sum().clamp_min(1)

    def _mixed(self, x: Tensor, run_layer: Callable, num_layers: int, head: Head, targets: Tensor) -> Tensor:
        """Mean over M paths of the NLL at each token's exit drawn uniformly from 1..N (eq. 5; one exit per
        sequence for the ``sequence`` classifier), states copied above the exit."""
        total = x.new_zeros(()).float()
        for _ in range(self.samples):
            b, s = x.shape[:2]
            draw = torch.randint(1, num_layers + 1, (b, 1 if self.kind == "sequence" else s), device=x.device)
            exits = draw.expand(b, s)  # [B, S]
            hidden, depth = traverse_with_exits(x, run_layer, num_layers, _exits_at(exits), False)
            logits = self._exit_logits(hidden, depth, head, num_layers)
            nll, keep = target_nll(logits if logits is not None else head(hidden), targets)
            total = total + nll.sum() / keep.sum().clamp_min(1)
        return total / self.samples


def real_mean(h: Tensor, key_padding: Tensor | None) -> Tensor:
    """Mean over the real (unpadded) positions: ``[B, S, D]`` -> ``[B, D]``."""
    w = torch.ones_like(h[..., 0]) if key_padding is None else key_padding.to(h.dtype)  # [B, S]
    return (h * w.unsqueeze(-1)).sum(1) / w.sum(1, keepdim=True).clamp_min(1)


def _exits_at(exits: Tensor) -> Decide:
    """The exit rule of fixed exits ``[B, S]``: a token leaves after layer ``exits``."""
    return lambda n, _b, _a: exits == n
