"""Cross-attention: a decoder's queries over its encoder's outputs (Vaswani et al., 2017, sec. 3.2.3,
"encoder-decoder attention"), with any mechanism that declares ``cross_attention``.

    x [B, St, D] -> q [B, H, St, Dh];  encoder output [B, Ss, D] -> k, v [B, Hkv, Ss, Dh];  -> [B, St, D]

No positional encoding enters cross-attention (none of the survey's methods defines one): the
encoder's outputs carry their positions already. The keys and values depend on the encoder output
only, so a decoding loop projects them once (``CrossSource.kv``) and every new token reuses them.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor, nn

from xfam.attention._base import AttentionMechanism
from xfam.core.mask import AttnMask
from xfam.model.spec import ModelSpec


@dataclasses.dataclass
class CrossSource:
    """What a decoder's cross-attention reads in one call.

    Attributes:
        hidden: ``[B, Ss, D]`` the encoder's output (after its final norm, if it has one).
        key_padding: ``[B, Ss]`` True for real source tokens (None: nothing padded).
        kv: per decoder layer, its projected keys and values ``([B, Hkv, Ss, Dh], [B, Hkv, Ss, Dh])``, filled on
            first use; a decode cache keeps them, so later decoding steps never project the source again.
    """

    hidden: Tensor
    key_padding: Tensor | None = None
    kv: dict[int, tuple[Tensor, Tensor]] = dataclasses.field(default_factory=dict)

    def mask(self, q_len: int) -> AttnMask:
        """Every query sees every real source token."""
        return AttnMask(q_len, self.hidden.shape[1], key_padding=self.key_padding, cross=True)

    def index(self, rows: Tensor) -> CrossSource:
        """The source of the batch rows ``rows [N]`` (a beam search's reordering or expansion)."""
        pad = None if self.key_padding is None else self.key_padding[rows]
        kv = {i: (k[rows], v[rows]) for i, (k, v) in self.kv.items()}
        return CrossSource(self.hidden[rows], pad, kv)


class CrossAttention(nn.Module):
    """Projections around a cross-attention mechanism: ``x [B, St, D]``, source -> ``[B, St, D]``."""

    def __init__(self, spec: ModelSpec, mechanism: AttentionMechanism, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.n_kv_heads, spec.d_head
        self.layer = layer
        self.q = nn.Linear(spec.dim, self.heads * self.head_dim, bias=spec.bias)
        self.kv = nn.Linear(spec.dim, 2 * self.kv_heads * self.head_dim, bias=spec.bias)
        self.out = nn.Linear(self.heads * self.head_dim, spec.dim, bias=spec.bias)
        self.mechanism = mechanism

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)  # [B, S, n*Dh] -> [B, n, S, Dh]

    def keys_values(self, source: CrossSource) -> tuple[Tensor, Tensor]:
        """This layer's keys and values of the source ``2 x [B, Hkv, Ss, Dh]``, projected once per source."""
        if self.layer not in source.kv:
            k, v = self.kv(source.hidden).chunk(2, dim=-1)  # [B, Ss, Hkv*Dh] each
            source.kv[self.layer] = (self._heads(k, self.kv_heads), self._heads(v, self.kv_heads))
        return source.kv[self.layer]

    def forward(self, x: Tensor, source: CrossSource) -> Tensor:
        b, s, _ = x.shape
        q = self._heads(self.q(x), self.heads)  # [B, H, St, Dh]
        k, v = self.keys_values(source)
        o = self.mechanism(q, k, v, source.mask(s))  # [B, H, St, Dh]
        return self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
