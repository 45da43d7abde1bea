"""Decoding an encoder-decoder: greedy, sampling or beam search (``xfam.eval.beam``) over the decoder's
decode cache, which holds each layer's self-attention state and the encoder output with its per-layer
cross-attention keys and values, projected once for the whole decoding (``xfam.model.cross``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.eval.beam import BeamResult, beam_search, greedy_search, sample_search
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.plan import DecodeCache


def index_rows(x: Any, rows: Tensor) -> Any:
    """Every tensor in ``x`` (a decode cache, a mechanism's state: tensors batch-first) gathered to ``rows``."""
    if isinstance(x, Tensor):
        return x.index_select(0, rows.to(x.device)) if x.dim() else x
    if isinstance(x, DecodeCache):
        return DecodeCache(x.length, index_rows(x.layers, rows), index_rows(x.key_padding, rows), x.source.index(rows))
    if isinstance(x, dict):
        return {k: index_rows(v, rows) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(index_rows(v, rows) for v in x)
    return x


def reorder_beams(cache: DecodeCache, rows: Tensor) -> DecodeCache:
    """Beam search's ``reorder`` of the decode cache. Its first call expands B inputs to B*K beam rows; every later
    one keeps each row among its own input's K beams, whose source is the same, so the source and its projected
    cross-attention keys and values (the largest tensors of the cache) are gathered only in the first call."""
    if rows.numel() != cache.source.hidden.shape[0]:  # (the expansion)
        return index_rows(cache, rows)
    layers, pad = index_rows(cache.layers, rows), index_rows(cache.key_padding, rows)
    return DecodeCache(cache.length, layers, pad, cache.source)


@torch.no_grad()
def translate(
    model: EncoderDecoder,
    source: Tensor,
    key_padding: Tensor | None = None,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
    beam_size: int = 1,
    length_penalty: float = 1.0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    pad_id: int | None = None,
) -> BeamResult:
    """Outputs for ``source [B, Ss]`` (``key_padding [B, Ss]`` True on real tokens): ``tokens [B, T]`` without
    BOS, each ending at its EOS (later positions ``pad_id``, default EOS), and their scores. ``beam_size`` > 1:
    beam search with GNMT's ``length_penalty``; else ``temperature`` 0 is greedy and > 0 samples (top-k, top-p)."""
    if not isinstance(model, EncoderDecoder):
        raise ConfigError("translate needs an encoder-decoder (model.arch=encoder_decoder). Fix: use xfam.generate.")
    if beam_size > 1 and temperature > 0:
        raise ConfigError(
            f"beam_size={beam_size} with temperature={temperature}: beam search is deterministic, sampling is not. "
            f"Fix: beam_size=1 to sample, or temperature=0 for beam search."
        )
    model.eval()
    cache = model.empty_cache()
    cache.source = model.encode(source, key_padding)  # [B, Ss, D], once for the whole decoding

    def step(last: Tensor, state: DecodeCache) -> tuple[Tensor, DecodeCache]:
        out = model(None, decoder_input_ids=last[:, None], cache=state)
        return out.logits[:, -1], out.cache  # [N, V]

    kw: dict[str, Any] = dict(
        batch_size=source.shape[0], bos_id=bos_id, eos_id=eos_id, max_len=max_new_tokens, pad_id=pad_id
    )
    kw["device"] = source.device
    if beam_size > 1:
        return beam_search(step, cache, **kw, beam_size=beam_size, length_penalty=length_penalty, reorder=reorder_beams)
    if temperature > 0:
        return sample_search(step, cache, **kw, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    return greedy_search(step, cache, **kw)
