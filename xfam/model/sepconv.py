"""The Universal Transformer's separable-convolution transition (``model.ffn=sepconv``; Dehghani et al., 2019,
"Universal Transformers", ICLR, arXiv:1807.03819, sec. 2.1: the transition function is "either a separable
convolution or a fully-connected neural network").

The form is the one of the authors' code (tensor2tensor's ``sepconv_relu_sepconv`` as the UT's ``sepconv``
transition): two depthwise-separable convolutions along the sequence with a ReLU between them,

    h = ReLU(P1 dw1(x) + b1)      dw1: kernel k1 = 3 over the D channels,  P1: D -> F    [B, S, F]
    y = P2 dw2(h) + b2            dw2: kernel k2 = 5 over the F channels,  P2: F -> D    [B, S, D]

where a depthwise convolution filters every channel along the sequence with its own kernel (no bias) and the
pointwise projection P (a 1x1 convolution, i.e. a linear layer) mixes the channels (Chollet, 2017). F is the
FFN's hidden width (``model.ffn_mult``), the biases follow ``model.bias`` (as the FFN's), ``model.ffn_dropout``
drops h (the code's ``relu_dropout``) and ``model.ffn_post_act_norm`` normalises it.

Padding of the sequence: ``LEFT`` (k - 1 rows in front: causal) in a causal model, ``SAME`` ((k - 1) / 2 on each
side) in a bidirectional one; both kernels are odd, as the code requires. Row i's output reads rows
``i - a`` for the taps ``a`` (0..k-1 causal, -(k-1)/2..(k-1)/2 bidirectional), and a tap reads zeros where its
row is padding or another document (the code zeroes padding rows before each convolution; xfam also keeps
packed documents apart), so a row's output never depends on padding or on another document.

Decoding: the layer keeps its last k1 - 1 input rows and k2 - 1 hidden rows (``forward``'s ``prev`` and the
rows it returns), so a decode step convolves exactly what the full pass would: decoding equals recomputation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core.mask import AttnMask
from xfam.model.layers import make_norm
from xfam.model.shift import moved, row_info, source_ok
from xfam.model.spec import ModelSpec


def taps(kernel: int, causal: bool) -> tuple[int, ...]:
    """How far back (negative: ahead) kernel column j reads: ``LEFT`` padding when causal, ``SAME`` otherwise."""
    last = kernel - 1 if causal else kernel // 2
    return tuple(last - j for j in range(kernel))


class DepthwiseConv(nn.Module):
    """One filter of ``kernel`` taps per channel along the sequence, no bias: ``[B, P + S, C] -> [B, S, C]``.

    Initialised as Keras' depthwise kernels (Glorot uniform, fan-in = fan-out = ``kernel``), the code's default.
    """

    def __init__(self, channels: int, kernel: int, causal: bool):
        super().__init__()
        self.taps = taps(kernel, causal)
        bound = math.sqrt(3.0 / kernel)
        self.weight = nn.Parameter(torch.empty(channels, kernel).uniform_(-bound, bound))  # [C, k]

    def forward(self, full: Tensor, rows: int, pad: Tensor | None, seg: Tensor | None) -> Tensor:
        """The outputs of the last ``rows`` rows of ``full [B, P + S, C]``; ``pad`` / ``seg``: ``[B, P + S]`` real
        rows and documents of ``full`` (None: all real / one document)."""
        p = full.shape[1] - rows
        out = None
        for j, a in enumerate(self.taps):
            term = moved(full, a)[:, p:] * self.weight[:, j].to(full.dtype)  # row i <- row i - a (zeros past the ends)
            ok = source_ok(pad, seg, a, p, full.dtype)  # [B, S, 1] or None
            term = term if ok is None else term * ok
            out = term if out is None else out + term
        assert out is not None  # (a kernel has taps)
        return out


class SepConvTransition(nn.Module):
    """``sepconv_relu_sepconv``: ``x [B, S, D] -> [B, S, D]`` (see the module docstring).

    ``up`` and ``down`` are the pointwise projections P1 and P2, named as the FFN's, so the model's init (the
    residual projection ``down`` scaled by 1/sqrt(2L)) and DeepNet's treat them alike.
    """

    mixes_rows = True  # the block passes the mask and the decode rows (``xfam.model.block``)

    def __init__(self, spec: ModelSpec, causal: bool):
        super().__init__()
        hidden = spec.ffn_hidden
        self.dw1 = DepthwiseConv(spec.dim, spec.sepconv_kernel1, causal)
        self.up = nn.Linear(spec.dim, hidden, bias=spec.bias)
        self.dw2 = DepthwiseConv(hidden, spec.sepconv_kernel2, causal)
        self.down = nn.Linear(hidden, spec.dim, bias=spec.bias)
        self.post_act_norm = make_norm(spec, hidden) if spec.ffn_post_act_norm else None
        self.drop = nn.Dropout(spec.ffn_dropout) if spec.ffn_dropout else None
        self.keep = (max(self.dw1.taps), max(self.dw2.taps))  # rows a decode step needs from before: k - 1, or 0

    def forward(
        self, x: Tensor, mask: AttnMask | None = None, prev: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``x [B, S, D]``; ``mask``: the layer's (padding and documents of its last rows); ``prev``: the input
        and hidden rows kept from the previous decode call. Returns the output ``[B, S, D]`` and the rows to keep
        for the next call (``[B, <= k1 - 1, D]``, ``[B, <= k2 - 1, F]``)."""
        s = x.shape[1]
        full_x = x if prev is None else torch.cat((prev[0], x), dim=1)  # [B, P1 + S, D]
        h = self.up(self.dw1(full_x, s, *_rows(mask, full_x.shape[1])))  # [B, S, F]
        h = F.relu(h)
        if self.post_act_norm is not None:
            h = self.post_act_norm(h)
        if self.drop is not None:
            h = self.drop(h)
        full_h = h if prev is None else torch.cat((prev[1], h), dim=1)  # [B, P2 + S, F]
        out = self.down(self.dw2(full_h, s, *_rows(mask, full_h.shape[1])))  # [B, S, D]
        kept = (
            full_x[:, max(0, full_x.shape[1] - self.keep[0]) :],
            full_h[:, max(0, full_h.shape[1] - self.keep[1]) :],
        )
        return out, kept


def _rows(mask: AttnMask | None, rows: int) -> tuple[Tensor | None, Tensor | None]:
    """Padding and documents ``[B, rows]`` of the last ``rows`` keys of ``mask`` (None: all real / one document)."""
    return (None, None) if mask is None else row_info(mask, rows)
