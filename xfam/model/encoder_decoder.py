"""The encoder-decoder Transformer (Vaswani et al., 2017, arXiv:1706.03762, sec. 3.1): a bidirectional
encoder stack over the source, and a decoder stack with causal self-attention and cross-attention to the
encoder's output in every block.

    source [B, Ss] -> encoder (task "encode") -> final norm -> E [B, Ss, D]
    target [B, St] -> decoder blocks: self-attention (causal) -> cross-attention over E -> FFN -> head [B, St, V]

Both stacks are ``XfamModel``s, so every slot applies to each: the encoder's attention and positions may
differ from the decoder's (``encoder.attention`` / ``encoder.pos``, e.g. a Longformer encoder with a dense
decoder as in LED), and the exit policy drives the decoder (CALM, the depth-adaptive Transformer: the
cross-attention keys and values of every layer are projected from the encoder output once, so a token that
skips layers leaves nothing of theirs to fill in). With ``model.tie_embeddings`` one matrix embeds the
source and the target tokens and is the output layer (T5, Raffel et al., 2020, arXiv:1910.10683: one
vocabulary shared by both sides).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xfam.core.typed import TypedModuleList
from xfam.model.block import Block
from xfam.model.cross import CrossSource
from xfam.model.plan import DecodeCache
from xfam.model.transformer import ModelOutput, XfamModel


class EncoderDecoder(nn.Module):
    """An encoder (``task="encode"``) and a decoder with cross-attention (``task="lm"``, built with ``cross``)."""

    task = "seq2seq"

    def __init__(self, encoder: XfamModel, decoder: XfamModel, tie_embeddings: bool = False):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        if tie_embeddings:  # one matrix: source embedding, target embedding, output layer
            decoder.embed = encoder.embed
            decoder.head.weight = encoder.embed.weight
        self.spec, self.causal, self.exit = decoder.spec, True, decoder.exit
        self.num_layers = decoder.num_layers
        self.uses_memory = False  # (compat refuses the memory slot for encoder-decoders)
        self.output_memory = None

    @property
    def head(self) -> nn.Linear | nn.Identity:
        """The decoder's output layer (what per-layer exit classifiers are sized by)."""
        return self.decoder.head

    @property
    def blocks(self) -> TypedModuleList[Block]:
        """The decoder's blocks (what exit policies and per-layer reports inspect)."""
        return self.decoder.blocks

    def new_step(self) -> None:
        self.encoder.new_step()
        self.decoder.new_step()

    def encode(self, source: Tensor, key_padding: Tensor | None = None) -> CrossSource:
        """``source [B, Ss]`` -> the encoder output every decoder layer attends to."""
        return self._encode(source, key_padding)[0]

    def _encode(self, source: Tensor, key_padding: Tensor | None) -> tuple[CrossSource, dict[str, Tensor]]:
        out = self.encoder(source, key_padding=key_padding)
        aux = {f"encoder/{k}": v for k, v in out.aux.items()}  # (e.g. an adaptive span's penalty in the encoder)
        return CrossSource(out.logits, key_padding), aux  # [B, Ss, D]: encode's output is the normed hidden states

    def forward(
        self,
        source: Tensor,
        *,
        decoder_input_ids: Tensor,
        key_padding: Tensor | None = None,
        cache: DecodeCache | None = None,
        encoded: CrossSource | None = None,
        targets: Tensor | None = None,
    ) -> ModelOutput:
        """Next-token logits ``[B, St, V]`` of the target given the source.

        Args:
            source: ``[B, Ss]`` source ids (ignored when ``encoded`` or a cache holding the source is given).
            decoder_input_ids: ``[B, St]`` target ids shifted right (BOS first); when decoding, the new tokens.
            key_padding: ``[B, Ss]`` True on real source tokens.
            cache: the decoder's decode state (``empty_cache()`` to start); it keeps the encoder output and its
                projected cross-attention keys and values after the first call.
            encoded: an encoder output computed before (``encode``), e.g. shared by several decodings.
            targets: ``[B, St]`` next-token ids (-100 = none), for exit policies with per-layer classifiers.
        """
        aux: dict[str, Tensor] = {}
        if encoded is None and (cache is None or cache.source is None):
            encoded, aux = self._encode(source, key_padding)
        out = self.decoder(decoder_input_ids, cache=cache, targets=targets, source=encoded)
        out.aux = {**aux, **out.aux}
        return out

    def empty_cache(self) -> DecodeCache:
        return self.decoder.empty_cache()

    def init_memory(self, batch_size: int, device: torch.device) -> list:
        return self.decoder.init_memory(batch_size, device)
