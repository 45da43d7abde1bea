"""Image Transformer 2D local attention (Parmar et al., 2018, "Image Transformer", arXiv:1802.05751, sec. 3.2,
"Local Self-Attention", fig. 2 right).

The sequence is an image of ``shape = [H, W]`` pixels, one position per pixel (``H * W`` positions). The image is
partitioned into rectangular query blocks of ``query_block = [q_h, q_w]`` pixels (``l_q = q_h q_w``); each query
block attends to its memory block, the query block extended by ``memory = [h_m, w_m]``: ``h_m`` rows above it and
``w_m`` columns to its left and to its right (clipped to the image; ``l_m = (q_h + h_m)(q_w + 2 w_m)``):

    query block (I, J):  rows [I q_h, (I + 1) q_h),        columns [J q_w, (J + 1) q_w)
    memory block (I, J): rows [I q_h - h_m, (I + 1) q_h),  columns [J q_w - w_m, (J + 1) q_w + w_m)
    query at pixel p may see key at pixel m  iff  m lies in the memory block of p's query block
                                                  (and, when causal, m precedes p in the generation order or is p)

Generation order (``order``): the paper's ``blocks`` -- query blocks in raster order, the pixels of a block in
raster order -- so a query block is a contiguous run of ``l_q`` positions; or plain ``raster`` order over the whole
image (the memory blocks are the same, only the order, hence the causal cut, differs). Position i of the sequence
is the i-th pixel of that order, so "not yet generated" is "later in the sequence" and causality is the ordinary
causal mask: masked are the memory block's pixels right of the query block in its own block rows (blocks not yet
generated), and, inside the query block, the pixels after the query. Bidirectional: the whole memory block.

An LM over images (``data=pixels``) feeds BOS then the pixels, so input i holds pixel i - 1 and predicts pixel i:
query i sits at pixel i's place in the image and sees the inputs at its memory block's places up to its own, i.e.
pixels before pixel i (the tensor2tensor implementation shifts the flattened blocked image right the same way).

Fast path: the sparse block engine (``xfam.attention._sparse``) with a tile of one query block (``blocks`` order)
or one row of a query block (``raster``: ``q_w`` positions, contiguous there); each tile gathers the tiles covering
its memory block (those entirely in its future skipped when causal) and applies the exact rule above inside them,
so scores are ``[B, H, N / b, b, K b]`` with ``K b`` about ``l_m``: cost O(N l_m), never ``N x N``. The layout is
derived from the memory blocks themselves (O(N l_m) once per sequence shape, cached), so any offset -- decoding
one pixel after another with the default key/value cache -- visits exactly the tiles it needs. ``dense`` is the
reference (explicit ``N x N`` scores masked by the rule), ``triton`` the flash kernel on the same layout (tiles
that are powers of two >= 16).

Refused before launch: ``H * W != model.max_len`` (the sequence is the image), query blocks that do not tile the
image, keys in front of the sequence that are not pixels (a memory slot's states, memory tokens, persistent keys:
their positions would shift the image), score modifiers (no full score matrix), and data whose images have another
shape, order or blocks (``data=pixels``: ``Selection.image``). Degenerate limit: one query block covering a
one-row image (``exact_params``) is dense attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from xfam.attention._base import ATTENTION
from xfam.attention._factorized import layout_from_blocks
from xfam.attention._sparse import SparseMechanism, SparsePattern
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.registry import NonNegative, Positive, Probability

Side = Annotated[int, Positive]


class Local2DPattern(SparsePattern):
    """The rule of the module docstring on sequence positions (key indices = pixel indices in ``order``)."""

    def __init__(self, shape: tuple[int, int], query_block: tuple[int, int], memory: tuple[int, int], order: str):
        (self.height, self.width), (self.qh, self.qw), (self.hm, self.wm) = shape, query_block, memory
        self.order, self.length = order, self.height * self.width
        self.block = self.qh * self.qw if order == "blocks" else self.qw  # engine tile: contiguous in ``order``

    def coords(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Row and column of the pixel at sequence position ``pos`` (inside ``[0, H W)``)."""
        if self.order == "raster":
            return pos // self.width, pos % self.width
        blk, within = pos // (self.qh * self.qw), pos % (self.qh * self.qw)
        per_row = self.width // self.qw  # query blocks per block row
        return (blk // per_row) * self.qh + within // self.qw, (blk % per_row) * self.qw + within % self.qw

    def position(self, row: Tensor, col: Tensor) -> Tensor:
        """Sequence position of pixel ``(row, col)``: the inverse of ``coords``."""
        if self.order == "raster":
            return row * self.width + col
        blk = (row // self.qh) * (self.width // self.qw) + col // self.qw
        return blk * (self.qh * self.qw) + (row % self.qh) * self.qw + col % self.qw

    def allowed(self, q_pos: Tensor, k_pos: Tensor, head: Tensor | None = None) -> Tensor:
        n = self.length
        inside = (q_pos >= 0) & (q_pos < n) & (k_pos >= 0) & (k_pos < n)
        (qr, qc), (kr, kc) = self.coords(q_pos.clamp(0, n - 1)), self.coords(k_pos.clamp(0, n - 1))
        top, left = qr - qr % self.qh, qc - qc % self.qw  # the query block's first row and column
        rows = (kr >= top - self.hm) & (kr < top + self.qh)
        cols = (kc >= left - self.wm) & (kc < left + self.qw + self.wm)
        return inside & rows & cols

    def memory_positions(self, device: torch.device) -> Tensor:
        """``[n_blocks, l_m]`` sequence positions of each query block's memory block (blocks in raster order of
        the block grid; -1 where the memory block leaves the image)."""
        rows = torch.arange(-self.hm, self.qh, device=device)  # [qh + hm] relative to the block's top row
        cols = torch.arange(-self.wm, self.qw + self.wm, device=device)  # [qw + 2 wm]
        top = torch.arange(0, self.height, self.qh, device=device)[:, None, None, None]  # [nbh, 1, 1, 1]
        left = torch.arange(0, self.width, self.qw, device=device)[None, :, None, None]  # [1, nbw, 1, 1]
        r, c = top + rows[:, None], left + cols[None, :]  # [nbh, nbw, qh + hm, qw + 2 wm]
        inside = (r >= 0) & (r < self.height) & (c >= 0) & (c < self.width)
        pos = self.position(r.clamp(0, self.height - 1), c.clamp(0, self.width - 1))
        return torch.where(inside, pos, -1).flatten(2).flatten(0, 1)  # [nbh * nbw, l_m]

    def layout(self, n_q: int, n_k: int, offset: int, causal: bool, device: torch.device) -> Tensor:
        b, n = self.block, self.length
        q_pos = offset + torch.arange(n_q * b, device=device).view(n_q, b)  # [nQ, b]
        real = (q_pos < n) & (q_pos < n_k * b)
        row, col = self.coords(q_pos.clamp(0, n - 1))
        blk = (row // self.qh) * (self.width // self.qw) + col // self.qw  # [nQ, b] query block of each query
        mem = self.memory_positions(device)[blk]  # [nQ, b, l_m]
        ok = real[..., None] & (mem >= 0) & (mem < n_k * b)
        if causal:
            ok &= mem <= q_pos[..., None]
        tiles = torch.where(ok, mem // b, n_k).flatten(1)  # [nQ, b * l_m], n_k: nothing
        touched = torch.zeros(n_q, n_k + 1, dtype=torch.bool, device=device).scatter_(1, tiles, True)
        return layout_from_blocks(touched[:, :n_k])  # [1, nQ, K]


@ATTENTION.register("local2d")
class Local2D(SparseMechanism):
    """Image Transformer 2D local attention: rectangular query blocks over an image attend to their memory blocks.

    Args:
        shape: ``[H, W]``, the image; the sequence is its ``H * W`` pixels (``model.max_len = H * W``).
        query_block: ``[q_h, q_w]``, the query blocks; they must tile the image.
        memory: ``[h_m, w_m]``, the memory block's extension: ``h_m`` rows above the query block, ``w_m`` columns
            to its left and to its right.
        order: generation order of the pixels, i.e. of the sequence: ``blocks`` (the paper: query blocks in raster
            order, raster order inside each) or ``raster`` (rows of the whole image).
        backend: ``auto`` (the flash kernel on CUDA where it applies, else the block engine), ``block``, ``dense``
            (the reference) or ``triton``.
        dropout: dropout on the attention probabilities.
    """

    paper = "Parmar et al., 2018, arXiv:1802.05751 (Image Transformer, 2D local)"
    accepts_memory = False
    pattern: Local2DPattern

    def __init__(
        self,
        *,
        shape: tuple[Side, Side] = (32, 32),
        query_block: tuple[Side, Side] = (8, 8),
        memory: tuple[Annotated[int, NonNegative], Annotated[int, NonNegative]] = (8, 8),
        order: Literal["blocks", "raster"] = "blocks",
        backend: Literal["auto", "block", "dense", "triton"] = "auto",
        dropout: Annotated[float, Probability] = 0.0,
    ):
        pattern = Local2DPattern(tuple(shape), tuple(query_block), tuple(memory), order)  # type: ignore[arg-type]
        super().__init__(pattern=pattern, backend=backend, dropout=dropout)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        n = self.pattern.length
        if mask.k_len - mask.persistent > n:  # (a rope model fed rows longer than model.max_len)
            raise ValueError(
                f"attention=local2d: {mask.k_len - mask.persistent} positions, more than the image's "
                f"{n} pixels (attention.shape); a sequence is one image. Fix: rows of at most {n} tokens."
            )
        return self.attend(self.pattern, q, k, v, mask, bias, modifier)

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Mapping[str, Any]) -> list[str]:
        (h, w), (qh, qw), max_len, out = params["shape"], params["query_block"], ctx.get("max_len"), []
        if max_len is not None and h * w != max_len:
            out.append(
                f"shape={list(params['shape'])} is {h * w} pixels, but model.max_len={max_len}: the sequence is the "
                f"image, one position per pixel. Fix: model.max_len={h * w}, or attention.shape=[H,W] with "
                f"H * W = {max_len}."
            )
        if h % qh or w % qw:
            fits = lambda n: [d for d in range(1, n + 1) if n % d == 0]  # noqa: E731
            out.append(
                f"query_block={list(params['query_block'])} does not tile the image {[h, w]}: the query blocks "
                f"partition it. Fix: q_h among {fits(h)} and q_w among {fits(w)}."
            )
        return out

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        out = super().refusals(params, selection)
        if n := selection.num_memory_tokens:
            out.append(
                f"attention=local2d with model.num_memory_tokens={n}: the tokens in front of every row would shift "
                f"each pixel off its place in the image. Fix: model.num_memory_tokens=0, or another attention."
            )
        image = getattr(selection, "image", None)  # the data's image geometry (data=pixels), or None
        if image is not None:
            out += [f"attention=local2d {why}" for why in image_mismatches(params, image)]
        return out

    @classmethod
    def exact_params(cls, seq_len: int) -> dict[str, Any]:
        return {"shape": [1, seq_len], "query_block": [1, seq_len], "memory": [0, 0]}


def image_mismatches(params: dict[str, Any], image: dict[str, Any]) -> list[str]:
    """How the attention's image (``shape``, ``order``, ``query_block``) disagrees with the data's (``image``:
    ``shape``, ``order`` and, in ``blocks`` order, ``block``), each with its fix."""
    out, data = [], f"data={image.get('source', 'pixels')}"
    if list(params["shape"]) != list(image["shape"]):
        h, w = image["shape"]
        out.append(
            f"shape={list(params['shape'])}, but {data} images are {[h, w]}. Fix: attention.shape=[{h},{w}] "
            f"and model.max_len={h * w}."
        )
    if params["order"] != image["order"]:
        out.append(
            f"order={params['order']}, but {data} lays the pixels out in {image['order']} order, so the "
            f"sequence would not be the attention's generation order. Fix: attention.order={image['order']} "
            f"(or data.order={params['order']})."
        )
    elif image["order"] == "blocks" and list(params["query_block"]) != list(image["block"]):
        qh, qw = image["block"]
        out.append(
            f"query_block={list(params['query_block'])}, but {data} orders the pixels by blocks of {[qh, qw]}; the "
            f"blocks order is the attention's only when they are its query blocks. Fix: attention.query_block="
            f"[{qh},{qw}] (or data.block={list(params['query_block'])})."
        )
    return out
