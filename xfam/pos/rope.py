"""Rotary position embedding, RoPE (Su et al., 2021, "RoFormer", arXiv:2104.09864).

Query and key at position i are rotated by R(i * theta_k) in each 2-D subspace k, with
theta_k = base^(-2k/d); then q_i . k_j depends on positions only through j - i. The paper pairs
channels (2k, 2k+1), as x-transformers does; xfam pairs channel k with k + d/2 ("rotate half", as
GPT-NeoX does), which is the same rotation after a fixed permutation of head channels that the
learned projections absorb, and is cheaper (two contiguous halves instead of strided pairs).

Options: ``rotary_dim`` rotates only the first r channels of each head (GPT-NeoX's partial rotary,
x-transformers' ``rotary_emb_dim``; theta_k = base^(-2k/r)), the other Dh - r channels carry no
position; ``interpolation`` divides positions by a factor s (position interpolation, Chen et al.,
2023, arXiv:2306.15595: a model trained at length L reads s L positions within its trained angles);
``xpos`` adds xPos (Sun et al., 2023, "A Length-Extrapolatable Transformer", arXiv:2212.10554): the
query at position n is also scaled by zeta^(n / gamma) and the key at m by zeta^(-m / gamma) per
channel pair k, zeta_k = (2k / r + 0.4) / 1.4, gamma = ``xpos_scale_base`` (512 in the paper), so the
score gains the factor zeta^((n - m) / gamma): still relative, decaying with distance for n >= m. It
grows for keys ahead of the query, so xPos is causal-only (as in the paper and x-transformers).
The scale is taken from position 0 (not re-centred per call) so cached keys keep their scale; a key's
scale zeta_0^(-p / gamma) grows with p, and the scaled key stays finite (entries up to 128) only up to
``xpos_max_position`` (about 66 gamma in fp32/bf16, 4.4 gamma in fp16), past which positions are
refused with that message.

``rotary_heads`` rotates only the first n query heads (and the key/value heads they read), the others carry
no position (x-transformers' ``rotate_num_heads``: heads that attend by content alone beside positional ones).

``backend``: ``torch`` (four elementwise passes), ``triton`` (one fused pass, ``kernels/rope.py``: reads x
once, writes once, backward = the transposed rotation), ``auto`` (the kernel on CUDA, PyTorch elsewhere).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

import xfam.kernels.runtime as runtime  # (a plain import: mypy cannot follow xfam.kernels, see pyproject)
from xfam.core.errors import ConfigError
from xfam.core.logs import log_once
from xfam.core.registry import Positive, Range
from xfam.pos._base import POS, PositionalEncoding

XPOS_HEADROOM = 256.0  # at xpos_max_position a rotated key entry x c + x' s (|x|, |x'| <= 128) times its scale fits


@POS.register("rope")
class Rope(PositionalEncoding):
    """Rotary embedding of q and k in every layer.

    Args:
        head_dim: per-head width Dh (injected); must be even.
        base: theta base (10000 in the paper).
        rotary_dim: channels rotated per head (even, <= Dh); null: all of them.
        interpolation: position interpolation factor s >= 1 (positions / s); 1: none.
        xpos: also scale q by zeta^(n/gamma) and k by zeta^(-m/gamma) (xPos; causal models only).
        xpos_scale_base: gamma, positions per unit of the xPos exponent (512 in the paper).
        rotary_heads: query heads rotated (the first n; with grouped-query attention a multiple of the
            query heads per key/value head); null: all.
        heads, kv_heads: H and Hkv (injected).
        backend: ``auto`` (the fused Triton rotation on CUDA), ``torch`` or ``triton``.
    """

    paper = "Su et al., 2021, RoFormer, arXiv:2104.09864"

    kind = "rotary"
    relative = True
    inv_freq: Tensor  # [r/2], buffers
    zeta: Tensor  # [r/2]

    def __init__(
        self,
        *,
        head_dim: int,
        base: Annotated[float, Positive] = 10000.0,
        rotary_dim: Annotated[int, Positive] | None = None,
        interpolation: Annotated[float, Range(ge=1.0)] = 1.0,
        xpos: bool = False,
        xpos_scale_base: Annotated[float, Positive] = 512.0,
        rotary_heads: Annotated[int, Positive] | None = None,
        heads: int = 1,
        kv_heads: int | None = None,
        backend: Literal["auto", "torch", "triton"] = "auto",
    ):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.rotary_heads = None if rotary_heads is None or rotary_heads >= heads else rotary_heads
        r = rotary_dim or head_dim
        k = torch.arange(0, r, 2, dtype=torch.float32)  # 2k, k = 0 .. r/2 - 1
        inv_freq = base ** (-k / r) / interpolation
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [r/2]
        self.rotary_dim, self.partial = r, r < head_dim
        self.xpos, self.xpos_scale_base, self.backend = xpos, xpos_scale_base, backend
        self.register_buffer("zeta", (k / r + 0.4) / 1.4, persistent=False)  # [r/2], in [0.29, 1)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        dh, r = ctx.get("head_dim", 0), params["rotary_dim"]
        if dh % 2:
            return [f"head_dim={dh} is odd; RoPE rotates channel pairs. Fix: use an even model.head_dim."]
        n, h = params.get("rotary_heads"), ctx.get("heads") or 0
        group = h // (ctx.get("kv_heads") or h) if h else 1
        if n is not None and h and (n > h or n % group):
            return [
                f"pos.rotary_heads={n} must be at most model.heads={h} and a multiple of the {group} query heads "
                f"that share a key/value head. Fix: pos.rotary_heads in {list(range(group, h + 1, group))}, or null."
            ]
        if r is not None and (r % 2 or (dh and r > dh)):
            return [f"rotary_dim={r} must be even and at most head_dim={dh}. Fix: pos.rotary_dim in 2, 4, ..., {dh}."]
        return []

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        if params.get("xpos") and not selection.causal:
            return [
                "pos.xpos=true scales a score by zeta^((n - m) / gamma), which grows without bound for keys after "
                "the query, so xPos is defined for causal models only, and this model is bidirectional. "
                "Fix: pos.xpos=false (plain RoPE), or a causal task."
            ]
        return []

    def xpos_max_position(self, dtype: torch.dtype) -> int:
        """Largest position p whose xPos key scale zeta_0^(-p / gamma) times ``XPOS_HEADROOM`` (256: a rotated
        pair of key entries up to 128) still fits ``dtype``. The table alone would fit up to 2^8 times larger
        scales (fp16: 9 gamma, where any key entry above 1 overflowed); the query scale, its inverse, then stays
        a normal number too."""
        top = math.log(torch.finfo(dtype).max / XPOS_HEADROOM)
        return int(top / -math.log(float(self.zeta[0])) * self.xpos_scale_base)

    def rotary_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
        """``cos [S, r]`` and the signed sine ``[-sin | sin]``, so that ``rotate`` is one fused
        multiply-add on the swapped halves (the sign of ``rotate_half`` is folded into the table).
        With xPos: the pair scaled by zeta^(p / gamma) for queries, then by its inverse for keys."""
        angles = positions.to(self.inv_freq)[:, None] * self.inv_freq[None, :]  # [S, r/2]
        cos, sin = angles.cos(), angles.sin()
        cos, ssin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [S, r]
        if not self.xpos:
            return cos.to(dtype), ssin.to(dtype)
        if positions.numel() and (last := int(positions[-1])) > (top := self.xpos_max_position(dtype)):
            raise ConfigError(
                f"pos.xpos=true: position {last} is past {top}, the last where keys scaled by xPos's "
                f"zeta^(-p / {self.xpos_scale_base:g}) stay within {dtype}. Fix: a larger pos.xpos_scale_base, "
                f"a wider dtype, or shorter sequences."
            )
        power = positions.to(self.zeta)[:, None] / self.xpos_scale_base  # [S, 1]
        scale = self.zeta[None, :] ** power  # [S, r/2]
        scale = torch.cat((scale, scale), dim=-1)  # [S, r]: channel k and k + r/2 share zeta_k
        return tuple(t.to(dtype) for t in (cos * scale, ssin * scale, cos / scale, ssin / scale))

    def rotate(self, x: Tensor, tables: tuple[Tensor, ...], key: bool = False) -> Tensor:
        if self.rotary_heads is not None:  # the first n heads (of queries; of keys, the ones they read)
            n = self.rotary_heads * x.shape[1] // self.heads
            return torch.cat((self._rotate_heads(x[:, :n], tables, key), x[:, n:]), dim=1)
        return self._rotate_heads(x, tables, key)

    def _rotate_heads(self, x: Tensor, tables: tuple[Tensor, ...], key: bool) -> Tensor:
        tables = tables[2:] if key and self.xpos else tables[:2]  # [S, r] each
        if self._fused(x):
            from xfam.kernels.rope import rope  # imported on first use (TRITON_INTERPRET)

            return rope(x, *tables)
        if self.partial:  # the first r channels rotate, the rest pass through
            r = self.rotary_dim
            return torch.cat((self._rotate(x[..., :r], tables), x[..., r:]), dim=-1)
        return self._rotate(x, tables)

    def _fused(self, x: Tensor) -> bool:
        """Whether this call takes the Triton kernel (``backend``; ``auto``: on CUDA)."""
        if self.backend != "auto":
            return self.backend == "triton"
        if x.device.type == "cuda" and runtime.why_not(x.device) is None:
            log_once("pos=rope backend=auto: fused Triton rotation (CUDA)")
            return True
        return False

    @staticmethod
    def _rotate(x: Tensor, tables: tuple[Tensor, ...]) -> Tensor:
        cos, signed_sin = tables  # [S, r], broadcast over [B, H, S, r]
        x1, x2 = x.chunk(2, dim=-1)
        # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = [x2 | x1] * [-sin | sin]
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)
