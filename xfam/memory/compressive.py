"""Compressive Transformer memory (Rae et al., ICLR 2020, "Compressive Transformers for Long-Range
Sequence Modelling", Algorithm 1 and section 3.1).

Per layer, two FIFO queues: the memory of the last ``mem_len`` layer inputs (as Transformer-XL) and
the compressed memory of ``compressed_len`` slots. States pushed out of the memory are not discarded
but compressed, ``c`` consecutive states into one slot, by f_c:

    max / mean    pooling with kernel and stride c (no parameters)
    conv          1D convolution with kernel and stride c
    dilated_conv  1D convolution with kernel c, stride c and dilation 2: each slot also sees the c - 1
                  states before its group (zero-padded), a receptive field of 2c - 1. The paper names
                  dilated convolutions without giving the dilation; this is our reading.
    most_used     keep, of each group of c, the state that received the most attention while it was in
                  the memory (content attention of the segments' queries, summed over heads and queries)

Keys/values span [compressed memory | memory | segment], oldest first, positions counted per slot.
Evicted states are compressed in whole groups of c; a remainder (when the number of states evicted at a
step is not a multiple of c) waits, unseen, until its group is complete.

Training of f_c (learned functions only), never reaching the main network: states, queries and the
layer's attention weights all enter detached (the paper's stop-gradients), so only f_c (and g) learn:

    attention reconstruction  || attn(h, old_mem) - attn(h, f_c(old_mem)) ||^2   (content attention)
    auto-encoding             || old_mem - g(f_c(old_mem)) ||^2, g a transposed convolution

both as mean squared errors. Shapes: memory ``[B, M, D]``, compressed ``[B, Mc, D]``, hidden ``[B, S, D]``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.memory.base import MEMORY, LayerView, Memory, MemoryState, fifo
from xfam.registry import Range

Compression = Literal["max", "mean", "conv", "dilated_conv", "most_used"]
LEARNED = ("conv", "dilated_conv")


@MEMORY.register("compressive")
class CompressiveMemory(Memory):
    """Transformer-XL memory plus a compressed memory of evicted states (rate ``rate``)."""

    paper = "Rae et al., ICLR 2020, arXiv:1911.05507 (Compressive Transformer)"

    def __init__(
        self,
        *,
        dim: int,
        mem_len: Annotated[int, Range(ge=0)] = 128,
        compressed_len: Annotated[int, Range(ge=0)] = 128,
        rate: Annotated[int, Range(ge=1)] = 3,
        compression: Compression = "conv",
        loss: Literal["attention", "autoencoding", "none"] = "attention",
        loss_weight: Annotated[float, Range(ge=0.0)] = 1.0,
    ):
        """
        Args:
            mem_len: uncompressed states kept per layer (the paper's n_m).
            compressed_len: compressed slots kept per layer (n_cm); 0 is Transformer-XL.
            rate: compression rate c, states per compressed slot.
            compression: f_c (see the module docstring).
            loss: the compression network's training loss (learned f_c only): attention reconstruction
                (the paper's best), auto-encoding, or none.
            loss_weight: its weight in the total loss.
        """
        super().__init__()
        self.mem_len, self.compressed_len, self.rate = mem_len, compressed_len, rate
        self.compression, self.loss, self.loss_weight = compression, loss, loss_weight
        self.conv = self.decoder = None
        if compression in LEARNED:
            dilation = 2 if compression == "dilated_conv" else 1
            self.conv = nn.Conv1d(dim, dim, kernel_size=rate, stride=rate, dilation=dilation)
            if loss == "autoencoding":
                self.decoder = nn.ConvTranspose1d(dim, dim, kernel_size=rate, stride=rate)

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        if params.get("compression", "conv") not in LEARNED and params.get("loss", "attention") != "none":
            return [
                f"memory=compressive: compression={params.get('compression')} has no parameters, so its "
                f"loss={params.get('loss', 'attention')} would train nothing. Fix: memory.loss=none, or "
                f"memory.compression=conv / dilated_conv."
            ]
        return []

    # -- reading ---------------------------------------------------------------------------------
    def read(self, state: MemoryState) -> Tensor | None:
        if state is None:
            return None
        parts = [t for t in (state["ch"], state["h"]) if t is not None]
        return torch.cat(parts, dim=1) if parts else None  # [B, Mc + M, D]: oldest first

    def read_segments(self, state: MemoryState) -> Tensor | None:
        if state is None or state["docs"] is None:
            return None
        parts = [t for t in (state["cdocs"], state["docs"]) if t is not None]
        return torch.cat(parts, dim=1) if parts else None

    # -- writing ---------------------------------------------------------------------------------
    def write(self, state: MemoryState, hidden: Tensor, view: LayerView) -> tuple[MemoryState, dict[str, Tensor]]:
        st = state or dict.fromkeys(("h", "docs", "usage", "ch", "cdocs", "pending", "pdocs", "pusage"))
        h = hidden.detach()
        docs = view.segments
        usage = None
        if self.compression == "most_used" and st["h"] is not None:  # attention the memory gets from this segment
            usage = view.weights(h, st["h"]).sum(dim=(1, 2))  # [B, M]
            usage = usage if st["usage"] is None else st["usage"] + usage
        # [memory | segment]: the newest mem_len stay, the older ones are evicted towards compression
        both = _cat(st["h"], h)  # [B, M + S, D]
        n_out = max(0, both.shape[1] - self.mem_len)
        new = {
            "h": fifo(st["h"], h, self.mem_len),
            "docs": None if docs is None else fifo(st["docs"], docs, self.mem_len),
            "usage": None,
            "ch": st["ch"],
            "cdocs": st["cdocs"],
            "pending": None,
            "pdocs": None,
            "pusage": None,
        }
        if self.compression == "most_used" and new["h"] is not None:
            fresh = h.new_zeros(h.shape[0], h.shape[1])
            new["usage"] = _cat(usage, fresh)[:, -new["h"].shape[1] :]
        losses: dict[str, Tensor] = {}
        if self.compressed_len == 0 or n_out == 0:
            return new, losses
        # the evicted states (after any left waiting from earlier steps), compressed in whole groups of c
        evicted = _cat(st["pending"], both[:, :n_out])  # [B, P + E, D]
        ev_docs = None if docs is None else _cat(st["pdocs"], _cat(st["docs"], docs)[:, :n_out])
        ev_usage = None
        if self.compression == "most_used":
            ev_usage = _cat(st["pusage"], _cat(usage, torch.zeros_like(h[..., 0]))[:, :n_out])
        whole = evicted.shape[1] // self.rate * self.rate
        if whole < evicted.shape[1]:
            new["pending"], new["pdocs"] = evicted[:, whole:], None if ev_docs is None else ev_docs[:, whole:]
            new["pusage"] = None if ev_usage is None else ev_usage[:, whole:]
        if whole == 0:
            return new, losses
        old = evicted[:, :whole]  # [B, E', D]
        compressed = self.compress(old, None if ev_usage is None else ev_usage[:, :whole])  # [B, E'/c, D]
        if self.training and self.conv is not None and self.loss != "none":
            losses[f"{self.loss}_reconstruction"] = self.loss_weight * self.reconstruction(old, compressed, h, view)
        new["ch"] = fifo(st["ch"], compressed.detach(), self.compressed_len)
        if ev_docs is not None:
            slot_docs = ev_docs[:, :whole][:, self.rate - 1 :: self.rate]  # a slot: the document of its last state
            new["cdocs"] = fifo(st["cdocs"], slot_docs, self.compressed_len)
        return new, losses

    def compress(self, old: Tensor, usage: Tensor | None = None) -> Tensor:
        """f_c: ``[B, E, D] -> [B, E / c, D]`` (E a multiple of c)."""
        b, e, d = old.shape
        groups = old.view(b, e // self.rate, self.rate, d)  # [B, E/c, c, D]
        if self.compression == "max":
            return groups.amax(dim=2)
        if self.compression == "mean":
            return groups.mean(dim=2)
        if self.compression == "most_used":
            best = usage.view(b, e // self.rate, self.rate).argmax(dim=-1)  # [B, E/c]
            return groups.gather(2, best[..., None, None].expand(-1, -1, 1, d)).squeeze(2)
        x = old.transpose(1, 2)  # [B, D, E]
        pad = self.conv.dilation[0] * (self.rate - 1) - (self.rate - 1)  # dilated: the states before the group
        return self.conv(F.pad(x, (pad, 0))).transpose(1, 2)  # [B, E/c, D]

    def reconstruction(self, old: Tensor, compressed: Tensor, h: Tensor, view: LayerView) -> Tensor:
        """The compression network's loss; every input detached, the layer's weights detached (view)."""
        if self.loss == "autoencoding":
            rebuilt = self.decoder(compressed.transpose(1, 2)).transpose(1, 2)  # [B, E, D]
            return F.mse_loss(rebuilt, old)
        with torch.no_grad():
            target = view.attend(h, old)  # [B, S, H*Dh]
        return F.mse_loss(view.attend(h, compressed), target)


def _cat(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else torch.cat((a, b), dim=1)
