"""``xfam generate``: sample from a language-model checkpoint with a KV cache."""

from __future__ import annotations

import argparse

import torch

from xfam.data.tokenize import tokenizer_from_state
from xfam.errors import ConfigError
from xfam.generate import generate
from xfam.lit.checkpoint import load_model


def sample(args: argparse.Namespace) -> None:
    model, meta = load_model(args.ckpt, args.device)
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
    limit = model.spec.max_len if model.pos.bounded else None
    if limit is not None and len(ids) + args.max_new_tokens > limit:
        raise ConfigError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({args.max_new_tokens}) exceeds the learned position "
            f"table ({limit}). Fix: max_new_tokens={max(0, limit - len(ids))} or less."
        )
    prompt = torch.tensor([ids] * args.num_samples, device=args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    tokens, logits = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=gen,
    )
    for row in tokens.tolist():
        print(tokenizer.decode(row))
        print("-" * 40)
    if args.check:
        with torch.no_grad():
            full = model(tokens[:, :-1]).logits[:, prompt.shape[1] - 1 :]  # recompute without a cache
        diff = (full - logits).abs().max().item()
        print(f"cached vs recomputed logits: max |diff| = {diff:.2e} ({'OK' if diff < 1e-5 else 'MISMATCH'})")
        if diff >= 1e-5:
            raise SystemExit(1)
