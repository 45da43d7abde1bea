"""Sampling: filters keep exactly the intended tokens; cached generation equals recomputation."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model

from xfam.core.errors import ConfigError
from xfam.eval.generate import filter_logits, generate


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, top_p=0.45)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.85)).tolist() == [[True, True, True, False]]
    shuffled = logits[:, [2, 0, 3, 1]]  # order must not matter
    assert torch.isfinite(filter_logits(shuffled, top_p=0.7)).tolist() == [[False, True, False, True]]


@pytest.mark.parametrize(
    "options", [{}, {"num_mem_kv": 3}, {"num_memory_tokens": 2}], ids=["plain", "mem_kv", "mem_tokens"]
)
@pytest.mark.parametrize("pos", ["none", "sinusoidal", "learned", "rope", "alibi"])
def test_cached_generation_logits_equal_a_full_recompute(pos: str, options: dict) -> None:
    model = build_model(pos=pos, vocab_size=13, **options)
    prompt = torch.randint(0, 13, (2, 5))
    tokens, logits, _ = generate(
        model, prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0)
    )
    assert tokens.shape == (2, 15) and torch.equal(tokens[:, :5], prompt)
    full = model(tokens[:, :-1]).logits[:, 4:]
    assert torch.allclose(full, logits, atol=1e-5)


def test_greedy_is_deterministic_and_stops_at_the_stop_token() -> None:
    model = build_model(pos="rope", vocab_size=13)
    prompt = torch.randint(0, 13, (1, 4))
    a, *_ = generate(model, prompt, 6, temperature=0)
    b, *_ = generate(model, prompt, 6, temperature=0)
    assert torch.equal(a, b)
    stop = int(a[0, 4])
    c, *_ = generate(model, prompt, 6, temperature=0, stop_token=stop)
    assert c.shape[1] == 5


def test_classifier_and_empty_prompt_are_refused() -> None:
    with pytest.raises(ConfigError, match="language model"):
        generate(build_model(task="classify", num_classes=3), torch.zeros(1, 3, dtype=torch.long), 2)
    with pytest.raises(ConfigError, match="at least one token"):
        generate(build_model(), torch.zeros(1, 0, dtype=torch.long), 2)


def test_sampling_settings_out_of_range_are_one_error() -> None:
    """top_p <= 0 kept no token at all (NaN probabilities, a failure inside torch.multinomial)."""
    model, prompt = build_model(), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"temperature=-1.*top_k=-2.*top_p=0 \(valid: 0 < top_p <= 1"):
        generate(model, prompt, 2, temperature=-1, top_k=-2, top_p=0)
    with pytest.raises(ConfigError, match=r"top_p=1.5"):
        generate(model, prompt, 2, top_p=1.5)
