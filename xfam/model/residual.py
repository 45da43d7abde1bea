"""How a sublayer's output joins the residual stream: one ``Link`` per sublayer (docs/blocks.md).

With ``f`` the sublayer (attention or FFN) and ``N`` the block's norm for it:

    pre        x + r(f(N(x)))                         (the default; r below)
    sandwich   x + r(N'(f(N(x))))                     (CogView, Ding et al., 2021, arXiv:2105.13290)
    post       N(x + r(f(x)))                         (Vaswani et al., 2017)
    deepnorm   N(alpha x + r(f(x)))                   (DeepNet, Wang et al., 2022, arXiv:2203.00555)
    resi_dual  N(x + r(f(x))), and d += r(f(x))       (ResiDual, Xie et al., 2023, arXiv:2304.14802: d starts
                                                       as the embedding, the output is x_L + N_d(d_L))

and ``r`` the residual's treatment of the branch, in order: a NormFormer post-norm N' of the attention
output (``attn_post_norm``), the half step of a macaron FFN, dropout, a gain (ReZero's scalar alpha, init 0,
Bachlechner et al., 2020, arXiv:2003.04887; LayerScale's per-channel lambda, CaiT, Touvron et al., 2021,
arXiv:2103.17239), and stochastic depth's per-sample drop (Huang et al., 2016, arXiv:1603.09382; as timm's
DropPath: per sample, the kept branches scaled by 1/survival in training, so evaluation uses the plain block,
where the paper draws per mini-batch and scales by the survival probability at test time, the same in
expectation). NormFormer's ResScale (Shleifer et al., 2021, arXiv:2110.09456) scales the stream of the FFN
sublayers instead: ``lambda x + r(...)``.
GTrXL (Parisotto et al., 2019, arXiv:1910.06764, eqs. in sec. 3.2) replaces the sum by a GRU-type gate
``g(x, ReLU(r(f(N(x)))))``.

A ``Link`` with the default options owns no parameters, so a default block's weights are what they were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from xfam.model.layers import make_norm
from xfam.model.spec import ModelSpec


def layerscale_init(spec: ModelSpec) -> float:
    """LayerScale's initial lambda: ``model.layerscale_init``, else CaiT's rule by depth (sec. 3.1)."""
    if spec.layerscale_init is not None:
        return spec.layerscale_init
    return 0.1 if spec.layers <= 18 else 1e-5 if spec.layers <= 24 else 1e-6


class GRUGate(nn.Module):
    """GTrXL's gating layer ``g(x, y)`` (Parisotto et al., 2019, sec. 3.2, the GRU-type gate):

        r = sigmoid(W_r y + U_r x)
        z = sigmoid(W_z y + U_z x - b_g)
        h = tanh(W_g y + U_g (r * x))
        g(x, y) = (1 - z) * x + z * h

    ``x``: the stream, ``y``: the sublayer's output. b_g is a learned per-channel bias, initialised at
    ``model.gtrxl_bias`` (the paper: 2): the update gate z then starts near sigmoid(-b_g), so the block starts
    near the identity."""

    def __init__(self, dim: int, bias_g: float):
        super().__init__()
        self.w = nn.Linear(dim, 3 * dim, bias=False)  # W_r, W_z, W_g
        self.u = nn.Linear(dim, 2 * dim, bias=False)  # U_r, U_z
        self.u_g = nn.Linear(dim, dim, bias=False)
        self.b_g = nn.Parameter(torch.full((dim,), float(bias_g)))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        wr, wz, wg = self.w(y).chunk(3, dim=-1)
        ur, uz = self.u(x).chunk(2, dim=-1)
        r = torch.sigmoid(wr + ur)
        z = torch.sigmoid(wz + uz - self.b_g)
        h = torch.tanh(wg + self.u_g(r * x))
        return (1 - z) * x + z * h


class Link(nn.Module):
    """One sublayer's residual connection (see the module docstring).

    Args:
        spec: the model's options.
        post_norm: a norm of the branch output (sandwich norm, or NormFormer's ``attn_post_norm``).
        half: a macaron FFN's half step.
        ffn: the link of an FFN sublayer (NormFormer's ResScale scales these only, as its reference code).
    """

    def __init__(self, spec: ModelSpec, post_norm: bool = False, half: bool = False, ffn: bool = False):
        super().__init__()
        self.position = spec.norm_position
        self.post_norm = make_norm(spec) if post_norm or spec.norm_position == "sandwich" else None
        self.scale = 0.5 if half else 1.0
        self.drop = nn.Dropout(spec.resid_drop) if spec.resid_drop else None
        self.gain = self.gate = self.stream_scale = None
        if spec.residual == "rezero":
            self.gain = nn.Parameter(torch.zeros(1))
        elif spec.residual == "layerscale":
            self.gain = nn.Parameter(torch.full((spec.dim,), layerscale_init(spec)))
        elif spec.residual == "gtrxl":
            self.gate = GRUGate(spec.dim, spec.gtrxl_bias)
        if spec.resid_scale and ffn:
            self.stream_scale = nn.Parameter(torch.ones(spec.dim))
        self.alpha = 1.0  # DeepNorm's residual scale, set by the model (``deepnorm_constants``)

    def branch(self, y: Tensor, keep: Tensor | None) -> Tensor:
        """The sublayer output ``y [B, S, D]`` as it joins the stream; ``keep [B, 1, 1]``: stochastic depth's
        per-sample survival mask, already divided by the survival probability."""
        if self.post_norm is not None:
            y = self.post_norm(y)
        if self.scale != 1.0:
            y = y * self.scale
        if self.drop is not None:
            y = self.drop(y)
        if self.gain is not None:
            y = y * self.gain
        return y if keep is None else y * keep

    def forward(
        self,
        x: Tensor,
        f: Callable[[Tensor], Tensor],
        norm: nn.Module,
        keep: Tensor | None = None,
        dual: list | None = None,
    ) -> Tensor:
        """``x [B, S, D]`` -> the stream after the sublayer ``f``; ``norm``: the block's norm for it; ``dual``:
        ResiDual's second stream, a one-element list updated in place."""
        if self.position in ("pre", "sandwich"):
            y = self.branch(f(norm(x)), keep)
            if self.gate is not None:
                out = self.gate(x, torch.relu(y))
            else:
                out = (x if self.stream_scale is None else x * self.stream_scale) + y
        else:
            y = self.branch(f(x), keep)
            if dual is not None:
                dual[0] = dual[0] + y
            stream = x if self.stream_scale is None else x * self.stream_scale
            out = norm(stream * self.alpha + y if self.alpha != 1.0 else stream + y)
        if keep is not None and (
            self.gate is not None or self.stream_scale is not None or self.position not in ("pre", "sandwich")
        ):
            out = torch.where(keep > 0, out, x)  # a dropped sample skips the sublayer: the stream passes unchanged
        return out


def deepnorm_constants(role: str, layers: int, partner: int = 0) -> tuple[float, float]:
    """DeepNet's alpha (residual scale) and beta (init gain) (Wang et al., 2022, Table 1 / sec. 4):

    * encoder-only (N layers): alpha = (2N)^(1/4), beta = (8N)^(-1/4);
    * decoder-only (M layers): alpha = (2M)^(1/4), beta = (8M)^(-1/4);
    * encoder-decoder (N encoder, M decoder layers): encoder alpha = 0.81 (N^4 M)^(1/16),
      beta = 0.87 (N^4 M)^(-1/16); decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4).

    ``role``: ``encoder`` / ``decoder`` (one stack) or ``encdec_encoder`` / ``encdec_decoder``; ``partner``:
    the other stack's depth in an encoder-decoder (0: unknown, an encoder built alone: encoder-only's rule)."""
    if role == "encdec_encoder" and partner:
        n, m = layers, partner
        return 0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)
    if role == "encdec_decoder":
        return (3 * layers) ** 0.25, (12 * layers) ** -0.25
    return (2 * layers) ** 0.25, (8 * layers) ** -0.25
