"""Score biases and modifiers: how a positional encoding reaches inside attention.

A ``ScoreBias`` is an additive term ``b[h, i, j]`` that depends only on head and positions (ALiBi,
T5, dynamic bias); a ``ScoreModifier`` is any other change to the scores or the output (Shaw,
Transformer-XL, DA-Transformer). Positional encodings make them, attention mechanisms consume them;
both import them from here. Positions are key indices over [memory | cache | segment] (``AttnMask``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core.mask import AttnMask


class ScoreBias(nn.Module):
    """An additive attention-score bias ``b[h, i, j]`` that depends only on head and positions.

    Subclasses implement ``pairs``; the other forms follow from it and may be overridden where a
    closed form is cheaper or more exact:

    (a) ``dense(mask)``: ``[1, H, Sq, Sk]`` for reference paths (memoised per forward);
    (b) ``pairs(q_pos, k_pos)``: values on gathered index pairs for sparse/bucketed paths;
    (c) ``kernel_params()``: a parametric description the fused kernel evaluates in-kernel
        (``xfam.attention._fused``): ``{"kind": "alibi", "slopes": [H]}`` or ``{"kind": "table",
        "table": [NB, H], "bucket": distances qpos - kpos -> bucket ids}``;
    (d) ``decay()``: per-head rates lambda_h with exp(b[h,i,j]) = lambda_h ** |i - j| on every pair,
        when the bias is a pure, symmetric distance decay (lets kernelised attention host it: causal,
        one decayed prefix sum; bidirectional, a forward plus a backward one).
    """

    heads: int

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bias at broadcast (query, key) positions: returns ``[H, *broadcast(q_pos, k_pos)]``."""
        raise NotImplementedError  # abstract

    def dense(self, mask: AttnMask, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[1, H, Sq, Sk]`` bias for every (query, key) pair described by ``mask``."""
        device = self._device()

        def make() -> Tensor:
            q_pos, k_pos = mask.positions(device)
            return self.pairs(q_pos[:, None], k_pos[None, :])[None].to(dtype)  # [1, H, Sq, Sk]

        return mask.memo(("bias", self, dtype), make)  # the object, not its id (see additive_mask)

    def kernel_params(self) -> dict[str, Any] | None:
        """Description for a fused kernel, or None if the kernel must read ``dense``."""
        return None

    def decay(self) -> Tensor | None:
        """Per-head decay ``[H]`` if the bias equals ``|i - j| * log(decay)`` on every pair, else None."""
        return None

    def select_heads(self, start: int, stop: int) -> ScoreBias:
        """The bias of heads ``start:stop`` only (for a per-head component schedule)."""
        return _HeadSlice(self, start, stop)

    def _device(self) -> torch.device:
        for t in self.buffers():
            return t.device
        for t in self.parameters():
            return t.device
        return torch.device("cpu")


class _HeadSlice(ScoreBias):
    def __init__(self, parent: ScoreBias, start: int, stop: int):
        super().__init__()
        self.parent, self.start, self.stop, self.heads = parent, start, stop, stop - start

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.parent.pairs(q_pos, k_pos)[self.start : self.stop]

    def dense(self, mask: AttnMask, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.parent.dense(mask, dtype)[:, self.start : self.stop]

    def decay(self) -> Tensor | None:
        d = self.parent.decay()
        return None if d is None else d[self.start : self.stop]

    def kernel_params(self) -> dict[str, Any] | None:
        params = self.parent.kernel_params()
        if params is None or params["kind"] not in ("alibi", "table"):
            return None
        if params["kind"] == "alibi":
            return {**params, "slopes": params["slopes"][self.start : self.stop]}
        return {**params, "table": params["table"][:, self.start : self.stop]}


class ScoreModifier(nn.Module):
    """A change to attention that is not an additive position-only bias.

    Hosted only by mechanisms that compute explicit scores (``hosts_modifiers``), and only by
    those named in the positional component's ``hosts`` when it is set. Hooks (identity by default):

    * ``logits(scores, q, k, mask)`` -- pre-softmax, on the scaled scores ``[B, H, Sq, Sk - P]`` of the keys
      with a position (Shaw on keys, Transformer-XL's position terms, DA-Transformer's reweighting);
    * ``output(probs, mask)`` -- a term ``[B, H, Sq, Dh]`` added to ``probs @ v`` (Shaw on values);

    and two on the whole matrix, persistent keys included, for modifiers that are not positional (the block's
    score options, ``xfam.model.attn_options``):

    * ``all_logits(scores, q, k, mask)`` -- pre-softmax, before the mask and the score bias are added
      (default: ``logits`` on the positional columns);
    * ``probs(probs, mask)`` -- the attention weights after the softmax, before they weigh the values.
    """

    def logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        return scores

    def output(self, probs: Tensor, mask: AttnMask) -> Tensor | None:
        return None

    def all_logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        p = mask.persistent  # the positional terms apply to the keys with a position: the last Sk - P
        if not p:
            return self.logits(scores, q, k, mask)
        modified = self.logits(scores[..., p:], q, k[:, :, p:], mask)  # [B, H, Sq, Sk - P]
        return torch.cat((scores[..., :p], modified), dim=-1)

    def probs(self, probs: Tensor, mask: AttnMask) -> Tensor:
        return probs


class ChainedModifier(ScoreModifier):
    """Two modifiers, ``first``'s hooks before ``second``'s (a positional encoding's, then the block's)."""

    def __init__(self, first: ScoreModifier, second: ScoreModifier):
        super().__init__()
        self.first, self.second = first, second

    def all_logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        return self.second.all_logits(self.first.all_logits(scores, q, k, mask), q, k, mask)

    def probs(self, probs: Tensor, mask: AttnMask) -> Tensor:
        return self.second.probs(self.first.probs(probs, mask), mask)

    def output(self, probs: Tensor, mask: AttnMask) -> Tensor | None:
        a, b = self.first.output(probs, mask), self.second.output(probs, mask)
        return b if a is None else a if b is None else a + b


def additive_mask(mask: AttnMask, bias: ScoreBias | None, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """Mask and bias as one additive ``[B|1, H|1, Sq, Sk]`` tensor (0 / -inf plus the bias).

    Memoised on the mask, so all layers of one forward share it.
    """

    def make() -> Tensor | None:
        allowed = mask.dense(device)  # [B|1, 1, Sq, Sk] or None
        out = None if bias is None else bias.dense(mask, dtype).to(device)  # [1, H, Sq, Sk - P]
        if out is not None and mask.persistent:  # persistent keys have no position: zero bias
            out = F.pad(out, (mask.persistent, 0))  # [1, H, Sq, Sk]
        if allowed is not None:
            neg = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            out = neg if out is None else out + neg
        return out

    # Keyed on the bias object itself, not its id: the key keeps it alive, so a short-lived bias (a
    # per-head slice) cannot hand its id, and with it this cached tensor, to the next one.
    return mask.memo(("additive", bias, dtype, device), make)
