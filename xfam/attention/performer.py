"""Performer: FAVOR+ attention (Choromanski et al., ICLR 2021, "Rethinking Attention with Performers").

Softmax attention softmax(q k^T / sqrt(Dh)) v is attention with the kernel exp(x . y), x = q / Dh^(1/4),
y = k / Dh^(1/4) (the data normalisation). FAVOR+ estimates it without bias with m positive random
features (Lemma 1):

    phi(x) = exp(w_r . x - |x|^2 / 2) / sqrt(m),  r = 1..m,   E[phi(x) . phi(y)] = exp(x . y)

with w_r ~ N(0, I_Dh), drawn as orthogonal random features (sec. 2.4: blocks of Dh orthogonal rows
rescaled by chi(Dh) lengths; lower variance, still unbiased). Attention is then linear attention
(``xfam.attention._linear``): bidirectional through the global sums, causal through chunked prefix
sums (memory linear in L), decoding through the running sums. Shapes: q ``[B, H, Sq, Dh]``, k/v
``[B, Hkv, Sk, Dh]``, features ``[B, H, S, m]``, state ``[B, H, m, Dh]``.

Numerical stabilisation, as in the authors' code (``softmax_kernel_transformation``): the max is
subtracted before exp -- per query row (a per-query constant, which cancels in o_i's ratio) and, for
the keys, one constant per (batch, head) (the running max in the causal case, which the causal engine
turns into an exact rescaling of its state, so no future key changes a past output). The
authors' additive kernel epsilon is dropped: it would bias the estimator. The features are a buffer,
redrawn every ``redraw_every`` training steps (never in eval), and travel in checkpoints.

``features=exact`` evaluates exp(x . y) itself (the m -> infinity limit) on the quadratic path: this
is dense softmax attention, the degenerate limit the contract tests use.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from torch import Tensor

from xfam.attention._base import ATTENTION
from xfam.attention._linear import KernelAttention
from xfam.core.registry import Positive


def favor_log_features(x: Tensor, w: Tensor) -> Tensor:
    """log phi(x) ``[..., m]`` for already normalised ``x [..., Dh]`` and ``w [..., m, Dh]``: phi = exp of this."""
    return x @ w.mT - (x * x).sum(-1, keepdim=True) / 2 - 0.5 * math.log(w.shape[-2])


@ATTENTION.register("performer")
class Performer(KernelAttention):
    """FAVOR+ attention with positive (orthogonal) random features.

    Args:
        num_features: m, the number of random features.
        features: ``orthogonal`` (the paper's ORF), ``iid`` Gaussian rows, or ``exact`` (the kernel
            itself, quadratic: the m -> infinity limit, for tests and as a reference).
        redraw_every: draw new features every this many training steps (null: never redraw).
        chunk: C, the chunk length of the causal prefix sums (speed only; the result does not depend on it).
        backend: ``auto`` (chunked linear attention, causal as the Triton kernel on CUDA; the quadratic
            path only for what it cannot do: a window mask, a bias that is not a causal decay),
            ``chunked``, ``quadratic`` (the reference: the same estimator with the L x L weights written
            out), or ``triton`` (the causal chunked path as the Triton kernel).
    """

    paper = "Choromanski et al., ICLR 2021, arXiv:2009.14794"

    def __init__(
        self,
        *,
        head_dim: int,
        num_features: Annotated[int, Positive] = 256,
        features: Literal["orthogonal", "iid", "exact"] = "orthogonal",
        redraw_every: Annotated[int, Positive] | None = 1000,
        chunk: Annotated[int, Positive] = 64,
        backend: Literal["auto", "chunked", "quadratic", "triton"] = "auto",
    ):
        super().__init__(
            rows=num_features,
            head_dim=head_dim,
            features=features,
            redraw_every=redraw_every,
            chunk=chunk,
            backend=backend,
        )

    def _scaled(self, x: Tensor) -> Tensor:
        return x * x.shape[-1] ** -0.25  # the data normalisation: exp(x . y) = exp(q . k / sqrt(Dh))

    def feature_maps(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        # log phi(x) = u - |x|^2 / 2 - log(m) / 2 with u = w . x; subtracting a row's max of u leaves
        # exp(u - max u) <= 1. For a query the rest is a per-query constant (it cancels in the ratio);
        # for a key it is kept as the key's log-scale ls, so phi(k) = fk * exp(ls) exactly.
        w = self.proj.to(q.dtype) * q.shape[-1] ** -0.25  # [m, Dh], the data normalisation folded in
        uq, uk = q @ w.T, k @ w.T  # [B, H, Sq, m], [B, Hkv, Sk, m]: u = w . x
        top = uk.detach().amax(-1, keepdim=True)
        fq = uq.sub_(uq.detach().amax(-1, keepdim=True)).exp_()  # in place: no extra [S, m] buffers
        ls = top[..., 0] - (k * k).sum(-1) * (0.5 / math.sqrt(k.shape[-1])) - 0.5 * math.log(w.shape[0])  # [B, Hkv, Sk]
        return fq, uk.sub_(top).exp_(), ls, None

    def exact_logits(self, q: Tensor, k: Tensor) -> Tensor:
        return self._scaled(q) @ self._scaled(k).transpose(-1, -2)  # [B, H, Sq, Sk]

    @classmethod
    def exact_params(cls, seq_len: int) -> dict:
        return {"features": "exact"}
