"""``xfam generate`` for an encoder-decoder checkpoint: the source (``source=`` text or ``source_file=``) is
encoded once, then the decoder generates with its cache (``xfam.eval.translate``): greedy, sampling or beam
search. ``check=true`` compares the logits of the best output with a recompute of the decoder over the whole
output in one call (teacher-forced)."""

from __future__ import annotations

from pathlib import Path

import torch

from xfam.cli.grammar import Args
from xfam.core.errors import ConfigError
from xfam.data.tokenize import tokenizer_from_state
from xfam.eval.translate import translate
from xfam.model.encoder_decoder import EncoderDecoder


def source_text(args: Args) -> str:
    """The source of ``args``: ``source=`` or the text of ``source_file=`` (exactly one of them)."""
    if (args.source is None) == (args.source_file is None):
        raise ConfigError(
            "an encoder-decoder generates from a source: pass exactly one of source=<text> and source_file=<path>. "
            "Fix: e.g. source='def add(a, b): return a + b'."
        )
    if args.source_file is None:
        return args.source
    path = Path(args.source_file)
    if not path.is_file():
        raise ConfigError(f"source_file={str(path)!r}: no such file. Fix: the path of a text file.")
    return path.read_text(encoding="utf-8", errors="replace")


def translate_checkpoint(model: EncoderDecoder, meta: dict, args: Args) -> None:
    """Print the outputs ``model`` generates for the source of ``args`` (one per sample; one with beam search)."""
    info = meta["data_info"]
    state = info.get("tokenizer")
    if state is None:
        raise ConfigError(
            f"{args.ckpt} was trained on data={info['name']}, which has no text tokenizer. Fix: evaluate it with "
            f"`xfam eval` (its validation reports BLEU, chrF and exact match), or train on text pairs "
            f"(data=docstrings, data=hf with source_column/target_column)."
        )
    if args.beam_size > 1 and args.num_samples > 1:
        raise ConfigError(f"beam_size={args.beam_size} returns one output; num_samples={args.num_samples}. Fix: one.")
    tokenizer = tokenizer_from_state(state)
    ids = tokenizer.encode(source_text(args))[: meta["config"]["data"].get("source_len") or None]
    if not ids:
        raise ConfigError("the source is empty. Fix: pass source=<text> or source_file=<a non-empty file>.")
    source = torch.tensor([ids] * args.num_samples, device=args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    temperature = 0.0 if args.beam_size > 1 else args.temperature
    out = translate(
        model,
        source,
        bos_id=info["bos_id"],
        eos_id=info["eos_id"],
        max_new_tokens=args.max_new_tokens,
        beam_size=args.beam_size,
        length_penalty=args.length_penalty,
        temperature=temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=gen,
    )
    for row in out.tokens.tolist():
        print(tokenizer.decode(row[: row.index(info["eos_id"])] if info["eos_id"] in row else row))
        print("-" * 40)
    if args.check:
        check_cached(model, source, out.tokens, info["bos_id"], info["eos_id"])


@torch.no_grad()
def check_cached(model: EncoderDecoder, source: torch.Tensor, tokens: torch.Tensor, bos: int, eos: int) -> None:
    """The logits of cached decoding along ``tokens`` equal one decoder call over the whole output."""
    first = tokens[0][: (tokens[0] == eos).nonzero()[0, 0] + 1 if (tokens[0] == eos).any() else None]  # [n]
    target = torch.cat((first.new_tensor([bos]), first))[None]  # [1, 1 + n]
    full = model(source[:1], decoder_input_ids=target[:, :-1]).logits  # [1, n, V]
    out, steps = None, []
    for t in range(target.shape[1] - 1):
        cache = model.empty_cache() if out is None else out.cache
        out = model(source[:1], decoder_input_ids=target[:, t : t + 1], cache=cache)
        steps.append(out.logits)
    cached = torch.cat(steps, dim=1)
    ok = torch.allclose(cached, full, rtol=1e-5, atol=1e-5)
    print(
        f"cached vs recomputed logits: max |diff| = {(cached - full).abs().max().item():.2e} "
        f"({'OK' if ok else 'MISMATCH'}: allclose rtol=atol=1e-5)"
    )
    if not ok:
        raise SystemExit(1)
