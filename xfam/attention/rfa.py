"""Random Feature Attention (Peng et al., ICLR 2021, "Random Feature Attention").

Random Fourier features (Rahimi & Recht, 2007; RFA eq. 3), ``[..., 2m]``:

    phi(x) = sqrt(1/m) [sin(w_1 . x), ..., sin(w_m . x), cos(w_1 . x), ..., cos(w_m . x)]
    E[phi(x) . phi(y)] = exp(-|x - y|^2 / (2 sigma^2))          (w_r = eps_r / sigma, eps_r ~ N(0, I))

so exp(x . y / sigma^2) = exp(|x|^2 / 2sigma^2) exp(|y|^2 / 2sigma^2) E[phi(x) . phi(y)] (eq. 4): the
softmax kernel RFA approximates. With the paper's l2-normalised queries and keys the norm factors
are constants and cancel, and attention is linear attention with phi (eq. 5; ``xfam.attention._linear``:
global sums, chunked causal prefix sums, running sums when decoding). Shapes: q ``[B, H, Sq, Dh]``,
k/v ``[B, Hkv, Sk, Dh]``, features ``[B, H, S, 2m]``.

* sigma: the paper writes w ~ N(0, sigma^2 I) beside the kernel exp(-|x - y|^2 / 2 sigma^2); the two
  agree when the variance is sigma^-2, which is what is implemented (w = eps / sigma), so sigma is
  the kernel's width and exp(x . y / sigma^2) its softmax kernel. ``learn_sigma`` learns sigma per head
  dimension (shared by heads) through this reparameterisation, as the paper does, making the kernel
  exp(sum_d x_d y_d / sigma_d^2).
* RFA-Gate (sec. 3.2, causal only): S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T, z_t likewise, with
  g_t = sigmoid(w_g . x_t + b_g). A mechanism sees q, k, v, not the layer input x_t, so the gate reads
  k_t = W_k x_t (a linear function of x_t): g_t = sigmoid(w_g . k_t + b_g), w_g in R^Dh and b_g per
  key/value head (w_g = 0 and g = 0.9 at initialisation). The engine runs it as the log-decay log g_t
  and the key log-scale log(1 - g_t).
* ``normalize=False`` skips the l2 normalisation: x = q / Dh^(1/4) and the key factor
  exp(|y|^2 / 2 sigma^2) is kept (the trigonometric softmax-kernel estimator); with sigma = 1 the target
  is exactly softmax attention. ``features=exact`` evaluates the kernel exp(x . y / sigma^2) itself
  (quadratic, the m -> infinity limit): with ``normalize=False`` that is dense softmax attention, the
  degenerate limit the contract tests use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.attention._base import ATTENTION
from xfam.attention._linear import KernelAttention
from xfam.core.registry import Positive
from xfam.core.state import expand_kv


def rff_features(x: Tensor, w: Tensor) -> Tensor:
    """phi(x) ``[..., 2m]`` for ``x [..., Dh]`` (already divided by sigma) and ``w [..., m, Dh]``."""
    proj = x @ w.mT  # [..., m]
    return torch.cat((torch.sin(proj), torch.cos(proj)), -1) / math.sqrt(w.shape[-2])


class _SinCos(torch.autograd.Function):
    """[sin(x w^T), cos(x w^T)] ``[..., 2m]`` in one buffer; backward from the output alone:
    d/dp sin p = cos p, d/dp cos p = -sin p (no saved projection, no recomputed sin/cos)."""

    @staticmethod
    def forward(ctx, x, w):  # noqa: ANN001, ANN205
        proj = x @ w.mT  # [..., m]
        m = proj.shape[-1]
        if torch.compiler.is_compiling():  # (dynamo refuses out= into non-contiguous halves; inductor fuses the cat)
            out = torch.cat((torch.sin(proj), torch.cos(proj)), -1)
        else:  # eager: both halves written in place, no [.., 2m] copy
            out = proj.new_empty(*proj.shape[:-1], 2 * m)
            torch.sin(proj, out=out[..., :m])
            torch.cos(proj, out=out[..., m:])
        ctx.save_for_backward(out, x if ctx.needs_input_grad[1] else None, w)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        out, x, w = ctx.saved_tensors
        m = out.shape[-1] // 2
        d_proj = (grad[..., :m] * out[..., m:]).addcmul_(grad[..., m:], out[..., :m], value=-1.0)  # [..., m]
        d_w = (d_proj.mT @ x).sum_to_size(w.shape) if x is not None else None
        return d_proj @ w, d_w


@ATTENTION.register("rfa")
class RFA(KernelAttention):
    """Random feature attention with sin/cos features and optional gating.

    Args:
        num_features: m, the number of random vectors (phi has 2m entries).
        sigma: the kernel width (initial value when ``learn_sigma``).
        learn_sigma: learn sigma (per head dimension) through w = eps / sigma.
        normalize: l2-normalise queries and keys (the paper); false: scale by Dh^(-1/4) and keep the
            key norm factor.
        gate: RFA-Gate, a learned recency gate on the causal running sums (causal models only).
        features: ``iid`` Gaussian rows (the paper), ``orthogonal`` (blocks of orthogonal rows), or
            ``exact`` (the kernel itself, quadratic).
        redraw_every: draw new random vectors every this many training steps (null: never).
        chunk: chunk length of the causal prefix sums (speed only).
        backend: ``auto`` | ``chunked`` | ``quadratic`` | ``triton`` (see ``performer``).
    """

    decay_params = ("gate_w",)  # the gate's weights, not its bias (xfam.training.lit.optim)

    paper = "Peng et al., ICLR 2021, arXiv:2103.02143"
    log_sigma: Tensor  # a Parameter (learn_sigma) or a buffer

    def __init__(
        self,
        *,
        head_dim: int,
        kv_heads: int,
        num_features: Annotated[int, Positive] = 128,
        sigma: Annotated[float, Positive] = 1.0,
        learn_sigma: bool = True,
        normalize: bool = True,
        gate: bool = False,
        features: Literal["iid", "orthogonal", "exact"] = "iid",
        redraw_every: Annotated[int, Positive] | None = 1,
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
        self.normalize, self.gate = normalize, gate
        log_sigma = torch.full((head_dim,), math.log(sigma))
        if learn_sigma:
            self.log_sigma = nn.Parameter(log_sigma)
        else:
            self.register_buffer("log_sigma", log_sigma)
        if gate:
            self.gate_w = nn.Parameter(torch.zeros(kv_heads, head_dim))
            self.gate_b = nn.Parameter(torch.full((kv_heads,), math.log(9.0)))  # g = 0.9 at initialisation

    def _inputs(self, x: Tensor) -> Tensor:
        x = F.normalize(x, dim=-1) if self.normalize else x * x.shape[-1] ** -0.25
        return x * torch.exp(-self.log_sigma).to(x.dtype)  # x / sigma

    def _gate_terms(self, k: Tensor) -> tuple[Tensor, Tensor]:
        """log(1 - g_t) and log g_t, ``[B, Hkv, Sk]``."""
        pre = (k * self.gate_w[:, None].to(k.dtype)).sum(-1) + self.gate_b[:, None].to(k.dtype)
        return F.logsigmoid(-pre), F.logsigmoid(pre)

    def feature_maps(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        # phi = rff_features, its 1/sqrt(m) dropped from the queries (a per-query constant: it cancels in
        # the ratio) and moved into the keys' log-scale (no [S, 2m] pass)
        w = self.proj.to(q.dtype)
        xq, xk = self._inputs(q), self._inputs(k)
        ls, ld = (xk * xk).sum(-1) / 2 - 0.5 * math.log(w.shape[0]), None  # [B, Hkv, Sk]: key norm factor
        if self.gate:
            keep_scale, ld = self._gate_terms(k)
            ls = ls + keep_scale
        return _SinCos.apply(xq, w), _SinCos.apply(xk, w), ls, ld

    def _gate(self, k: Tensor, heads: int) -> tuple[Tensor | None, Tensor | None]:
        if not self.gate:
            return None, None
        ls, ld = self._gate_terms(k)
        return expand_kv(ls, heads), expand_kv(ld, heads)

    def exact_logits(self, q: Tensor, k: Tensor) -> Tensor:
        return self._inputs(q) @ self._inputs(k).transpose(-1, -2)  # x . y / sigma^2: [B, H, Sq, Sk]

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        out = []
        if params["gate"] and ctx.get("causal") is False:
            out.append(
                "gate=true is RFA's causal recency gate (a decay of the running sums), and this model is "
                "bidirectional. Fix: set attention.gate=false, or use a causal model."
            )
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict:
        return {"features": "exact", "normalize": False, "learn_sigma": False}
