"""Compressive Transformer memory (Rae et al., ICLR 2020, "Compressive Transformers for Long-Range
Sequence Modelling", Algorithm 1 and section 3.1).

Per layer, two FIFO queues: the memory of the last ``mem_len`` layer inputs (as Transformer-XL) and
the compressed memory of ``compressed_len`` slots. States pushed out of the memory are not discarded
but compressed, ``c`` consecutive states into one slot, by f_c:

    max / mean    pooling with kernel and stride c (no parameters)
    conv          1D convolution with kernel and stride c
    dilated_conv  a dilated convolution (kernel 2, dilation c: each state with the one c before it, zero
                  before the first state evicted in the same step) and then ``conv``: a slot sees its
                  group and the group before it, a receptive field of 2c. The paper names dilated
                  convolutions without their shape; this is our reading, chosen so that every evicted
                  state reaches its own slot (kernel c, stride c and dilation 2 skipped every other one).
    most_used     keep, of each group of c, the state that received the most attention while it was in
                  the memory (content attention of the segments' queries, summed over heads and queries).
                  The paper sorts the memories by average attention and keeps the most used. Our
                  reading differs in three documented ways: the choice is per group of c (so the slots
                  stay in time order), usage is a sum over the segments a state stayed (states of one
                  group stay equally long when mem_len is a multiple of the segment length), and it is
                  a softmax over the uncompressed memory alone, without positions.

Documents (packed rows): a slot belongs to the document of its group's last state and is built from that
document's states only (the others in its group are left out, and so are dilated taps into another
document). The earlier document's states in such a group are lost, but no later query could see them:
documents are contiguous in a row, so that document has ended.

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

from typing import Annotated, Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core.registry import Range
from xfam.core.state import LayerView, MemoryState
from xfam.memory._base import MEMORY, Memory, fifo

Compression = Literal["max", "mean", "conv", "dilated_conv", "most_used"]
LEARNED = ("conv", "dilated_conv")


@MEMORY.register("compressive")
class CompressiveMemory(Memory):
    """Transformer-XL memory plus a compressed memory of evicted states (rate ``rate``)."""

    paper = "Rae et al., ICLR 2020, arXiv:1911.05507 (Compressive Transformer)"
    conv: nn.Conv1d | None  # the learned f_c (conv, dilated_conv)
    dilate: nn.Conv1d | None
    decoder: nn.ConvTranspose1d | None  # loss=autoencoding's

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
        self.conv = self.dilate = self.decoder = None
        if compression in LEARNED:
            self.conv = nn.Conv1d(dim, dim, kernel_size=rate, stride=rate)
            if compression == "dilated_conv":  # weight [D, D, 2]: tap 0 the state c before, tap 1 the state itself
                self.dilate = nn.Conv1d(dim, dim, kernel_size=2, dilation=rate)
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
        old_usage, old_docs = (None if t is None else t[:, :whole] for t in (ev_usage, ev_docs))
        compressed = self.compress(old, old_usage, old_docs)  # [B, E'/c, D]
        if self.training and self.conv is not None and self.loss != "none":
            losses[f"{self.loss}_reconstruction"] = self.loss_weight * self.reconstruction(old, compressed, h, view)
        new["ch"] = fifo(st["ch"], compressed.detach(), self.compressed_len)
        if old_docs is not None:
            slot_docs = old_docs[:, self.rate - 1 :: self.rate]  # a slot: the document of its last state
            new["cdocs"] = fifo(st["cdocs"], slot_docs, self.compressed_len)
        return new, losses

    def compress(self, old: Tensor, usage: Tensor | None = None, docs: Tensor | None = None) -> Tensor:
        """f_c: ``[B, E, D] -> [B, E / c, D]`` (E a multiple of c); ``docs [B, E]``: each slot takes only the
        states of its last state's document (the module docstring)."""
        b, e, d = old.shape
        c = self.rate
        if docs is None:
            docs = old.new_zeros(b, e, dtype=torch.long)
        keep = docs == docs[:, c - 1 :: c].repeat_interleave(c, dim=1)  # [B, E]: of the slot's document
        if self.compression == "most_used":
            assert usage is not None  # (write passes most_used its usage)
            best = usage.masked_fill(~keep, float("-inf")).view(b, e // c, c).argmax(dim=-1)  # [B, E/c]
            return old.view(b, e // c, c, d).gather(2, best[..., None, None].expand(-1, -1, 1, d)).squeeze(2)
        if self.dilate is not None:  # y_t = W0 x_{t-c} + W1 x_t + b, x_{t-c} only from the same document
            same = F.pad(docs, (c, 0), value=-1)[:, :e] == docs  # [B, E]; False for t < c
            before = F.pad(old, (0, 0, c, 0))[:, :e] * same[..., None]  # [B, E, D]
            w = self.dilate.weight  # [D, D, 2]
            old = F.linear(before, w[..., 0]) + F.linear(old, w[..., 1], self.dilate.bias)
        groups = old.view(b, e // c, c, d)  # [B, E/c, c, D]
        kept = keep.view(b, e // c, c, 1)
        if self.compression == "max":
            return groups.masked_fill(~kept, float("-inf")).amax(dim=2)
        if self.compression == "mean":
            return (groups * kept).sum(dim=2) / kept.sum(dim=2)  # a group keeps at least its last state
        assert self.conv is not None  # (the learned compressions)
        return self.conv((old * keep[..., None]).transpose(1, 2)).transpose(1, 2)  # [B, E/c, D]

    def reconstruction(self, old: Tensor, compressed: Tensor, h: Tensor, view: LayerView) -> Tensor:
        """The compression network's loss; every input detached, the layer's weights detached (view)."""
        if self.loss == "autoencoding":
            assert self.decoder is not None  # (built with loss=autoencoding)
            rebuilt = self.decoder(compressed.transpose(1, 2)).transpose(1, 2)  # [B, E, D]
            return F.mse_loss(rebuilt, old)
        with torch.no_grad():
            target = view.attend(h, old)  # [B, S, H*Dh]
        return F.mse_loss(view.attend(h, compressed), target)


@overload
def _cat(a: Tensor | None, b: Tensor) -> Tensor: ...
@overload
def _cat(a: Tensor | None, b: Tensor | None) -> Tensor | None: ...
def _cat(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else torch.cat((a, b), dim=1)
