"""``xfam generate``: sample from a language-model checkpoint (``xfam.eval.generate``), optionally from
kNN-LM's interpolated distribution over a datastore (``knnlm_store=DIR``).

A model without memory decodes with its KV cache (or whatever state each mechanism keeps); a model with
memory (``memory=xl``, ``compressive``, ``memorizing``, ``spalm``) carries it as in training: segments of
the checkpoint's ``data.seq_len``, documents ending at its eos token when the run marked them
(``data.doc_mask``). ``check=true`` compares the logits each token was drawn from with a recompute of
the whole sequence (without memory: in one call; with memory: segment by segment)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from xfam.cli.grammar import Args
from xfam.cli.translate import translate_checkpoint
from xfam.core.errors import ConfigError
from xfam.data.tokenize import tokenizer_from_state
from xfam.eval.generate import generate, stream_logits
from xfam.eval.inference import agreement, compares_full_depth, full_depth_logits, set_exit_options
from xfam.model.checkpoint import load_model
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.transformer import XfamModel

if TYPE_CHECKING:
    from xfam.knnlm import KnnMixer


def sample(args: Args) -> None:
    model, meta = load_model(args.ckpt, args.device)
    assert isinstance(model, XfamModel | EncoderDecoder)  # (what build_model builds)
    set_exit_options(model, meta["config"], args.overrides)
    if isinstance(model, EncoderDecoder):
        return translate_checkpoint(model, meta, args)
    if args.source is not None or args.source_file is not None or args.beam_size > 1:
        raise ConfigError(
            "source, source_file and beam_size apply to an encoder-decoder checkpoint; this one is a "
            f"{model.task} model. Fix: prompt=<text> (and temperature/top_k/top_p)."
        )
    state = meta["data_info"].get("tokenizer")
    if state is None:
        raise ConfigError(
            f"{args.ckpt} was trained on data={meta['data_info']['name']}, which has no text tokenizer. "
            f"Fix: generate from a model trained on text (data=text or data=hf); evaluate this one with `xfam eval`."
        )
    tokenizer = tokenizer_from_state(state)  # from the checkpoint: no data needed
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ConfigError("the prompt is empty. Fix: pass prompt=<text>, e.g. prompt='def '.")
    # With memory, positions restart in every segment (of data.seq_len <= max_len): no limit on the stream.
    limit = model.spec.max_len if model.pos.bounded and not model.uses_memory else None
    if limit is not None and len(ids) + args.max_new_tokens > limit:
        raise ConfigError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({args.max_new_tokens}) exceeds the learned position "
            f"table ({limit}). Fix: max_new_tokens={max(0, limit - len(ids))} or less."
        )
    prompt = torch.tensor([ids] * args.num_samples, device=args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    knn = knn_mixer(model, meta, args) if args.knnlm_store else None
    segment_len, boundary = memory_segments(model, meta)
    tokens, logits, depth = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=gen,
        knn=knn,
        segment_len=segment_len,
        boundary=boundary,
        decoder=args.decoder,
        compile_mode=None if args.compile_mode == "default" else args.compile_mode,
    )
    for row in tokens.tolist():
        print(tokenizer.decode(row))
        print("-" * 40)
    if depth is not None:
        report_depth(model, tokens, logits, depth)
    if args.check:
        with torch.no_grad():
            if model.uses_memory:  # the stream segment by segment, memory carried: what generation must equal
                assert segment_len is not None  # (memory_segments: a memory model's)
                full = stream_logits(model, tokens[:, :-1], segment_len, boundary)[:, prompt.shape[1] - 1 :]
            else:
                full = model(tokens[:, :-1]).logits[:, prompt.shape[1] - 1 :]  # recompute without a cache
        # Equal within 1e-5 in torch.allclose's sense: |a - b| <= 1e-5 + 1e-5 |b|. The two paths
        # multiply in different shapes (one token vs the whole sequence), so they agree to float32
        # rounding relative to the logits' size, not to a fixed absolute number.
        ok = torch.allclose(logits, full, rtol=1e-5, atol=1e-5)
        diff = (full - logits).abs()
        rel = (diff / full.abs().clamp_min(1.0)).max().item()
        what = "generated" if model.uses_memory else "cached"
        print(
            f"{what} vs recomputed logits: max |diff| = {diff.max().item():.2e}, max relative {rel:.1e} "
            f"({'OK' if ok else 'MISMATCH'}: allclose rtol=atol=1e-5)"
        )
        if not ok:
            raise SystemExit(1)


def memory_segments(model: XfamModel, meta: dict) -> tuple[int | None, int | None]:
    """A memory model's training segment length (``data.seq_len``) and, when the run marked documents
    (``data.doc_mask``), the token that ends one (the data's eos); ``(None, None)`` without memory."""
    if not model.uses_memory:
        return None, None
    data = meta["config"]["data"]
    return data["seq_len"], meta["data_info"].get("eos_id") if data.get("doc_mask") else None


def knn_mixer(model: XfamModel, meta: dict, args: Args) -> KnnMixer:
    """kNN-LM over ``args.knnlm_store``, refused for another model's store (see ``xfam.knnlm``)."""
    from xfam.knnlm import Datastore, KnnMixer, check_supported, checkpoint_identity

    if args.check:
        raise ConfigError(
            "check=true compares the model's cached logits with a recompute; with knnlm_store tokens are drawn "
            "from kNN-LM's distribution instead. Fix: check=true without knnlm_store."
        )
    check_supported(model)
    identity = checkpoint_identity(args.ckpt, model, meta["config"])
    store = Datastore.open(args.knnlm_store, index=args.knnlm_index, device=args.device, checkpoint=identity)
    return KnnMixer(model, store, k=args.knnlm_k, lam=args.knnlm_lambda, temperature=args.knnlm_temperature)


def report_depth(model: XfamModel, tokens: torch.Tensor, logits: torch.Tensor, depth: torch.Tensor) -> None:
    """Layers used per generated token, the compute saved, and (early exit) how often the token's top-1
    prediction equals the full-depth model's given the same prefix."""
    mean = depth.float().mean().item()
    saved = 1 - mean / model.num_layers
    line = f"depth: {mean:.2f} of {model.num_layers} layers per generated token, compute saved {saved:.1%}"
    if compares_full_depth(model):
        n = logits.shape[1]
        full = full_depth_logits(model, {"input_ids": tokens[:, :-1]})[:, -n:]  # the full model on the same prefixes
        same, count = agreement(logits, full)
        line += f"; top-1 agreement with the full-depth model {float(same / count):.1%} of {int(count)} tokens"
    print(line)
