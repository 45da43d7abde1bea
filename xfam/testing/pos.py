"""The positional contract, in a full model: shapes, gradient flow, no causal leak through the whole LM, cached
decoding equal to recomputing the prefix (also left-padded), determinism given a seed, a working bidirectional
classifier in which order matters, the SDPA fast path of ``attention=vanilla`` equal to its einsum reference, and
``relative = True`` holding exactly: a shift of every position changes nothing."""

from __future__ import annotations

import pytest
import torch

from xfam.pos import POS
from xfam.testing._suite import each
from xfam.testing.doubles import build_model, decode_logits

V, S = 13, 12


def pos_cases(comps) -> list:
    return [pytest.param(n, dict(comps.params), id=n) for n in comps.names]


def encoding(pos: str, params: dict) -> dict:
    return {"name": pos, **params}


def tokens(b: int = 2, s: int = S) -> torch.Tensor:
    return torch.randint(0, V, (b, s))


@each(("pos", "params"), pos_cases)
def test_lm_shapes_and_gradient_flow(pos, params):
    model = build_model(pos=encoding(pos, params)).train()
    x = tokens()
    out = model(x)
    assert out.logits.shape == (2, S, V) and out.aux == {} and out.cache is None and out.memory is None
    torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), x.roll(-1, 1).flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches {name}"


@each(("pos", "params"), pos_cases)
def test_no_causal_leak_through_the_lm(pos, params):
    model = build_model(pos=encoding(pos, params), layers=3)
    x = tokens()
    base = model(x).logits
    for t in (0, 5, S - 1):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % V
        out = model(x2).logits
        assert torch.allclose(out[:, :t], base[:, :t], atol=1e-6), f"changing token {t} changed earlier logits"
        assert not torch.allclose(out[:, t:], base[:, t:], atol=1e-4)


@each(("pos", "params"), pos_cases)
@each(("prompt", "step"), [(5, 1), (1, 4)])
def test_cached_decode_equals_full_recompute(pos, params, prompt, step):
    model = build_model(pos=encoding(pos, params), kv_heads=2)
    x = tokens()
    assert torch.allclose(decode_logits(model, x, prompt, step), model(x).logits, atol=1e-5)


@each(("pos", "params"), pos_cases)
def test_cached_decode_with_left_padding_equals_full_recompute(pos, params):
    """Batched generation with left padding: cached pad keys stay masked in every later step."""
    model = build_model(pos=encoding(pos, params))
    x = tokens()
    pad = torch.tensor([[False] * 3 + [True] * (S - 3), [True] * S])
    full = model(x, key_padding=pad).logits
    real = pad[:, :, None].expand_as(full)
    for prompt, step in ((5, 1), (2, 3)):
        dec = decode_logits(model, x, prompt, step, key_padding=pad)
        assert torch.allclose(dec[real], full[real], atol=1e-5)


@each(("pos", "params"), pos_cases)
def test_deterministic_given_a_seed(pos, params):
    x = tokens()
    a, b = build_model(pos=encoding(pos, params), seed=3), build_model(pos=encoding(pos, params), seed=3)
    assert torch.equal(a(x).logits, b(x).logits)
    assert torch.equal(a(x).logits, a(x).logits)


@each(("pos", "params"), pos_cases)
def test_bidirectional_classifier(pos, params):
    """Forward works with padding; padded tokens change nothing; order matters unless pos has no order."""
    model = build_model(pos=encoding(pos, params), task="classify", num_classes=3)
    assert not model.causal
    x = tokens()
    pad = torch.tensor([[True] * S, [True] * 9 + [False] * 3])
    out = model(x, key_padding=pad).logits
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    x2 = x.clone()
    x2[1, 9:] = (x2[1, 9:] + 1) % V
    assert torch.allclose(model(x2, key_padding=pad).logits, out, atol=1e-6)
    # a future token is visible to every position in an encoder
    x3 = x.clone()
    x3[:, -1] = (x3[:, -1] + 1) % V
    assert not torch.allclose(model(x3).logits[0], model(x).logits[0], atol=1e-5)
    # Order: with weights of unit scale (at the N(0, 0.02) init, a multiplicative modifier such as DA's
    # rescales scores of ~1e-3 and moves the logits by less than any tolerance).
    model = build_model(pos=encoding(pos, params), task="classify", num_classes=3, init_std=0.5)
    perm = torch.randperm(S)
    permuted = model(x[:, perm]).logits
    if POS.get(pos).kind == "none":  # mean-pooled self-attention without positions is permutation invariant
        assert torch.allclose(permuted, model(x).logits, atol=1e-5)
    else:
        assert not torch.allclose(permuted, model(x).logits, atol=1e-5), "the order of the tokens does not matter"


@each(("pos", "params"), pos_cases)
@each("task", ["lm", "classify"])
def test_sdpa_path_equals_reference_path(pos, params, task):
    if POS.get(pos).kind == "modifier":
        pytest.skip("sdpa cannot host a score modifier (refused by xfam.model.compat)")
    x = tokens()
    pad = torch.tensor([[False] * 2 + [True] * (S - 2), [True] * (S - 3) + [False] * 3])
    seg = torch.tensor([[0] * 6 + [1] * 6, [0] * S])
    enc = encoding(pos, params)
    fast = build_model(pos=enc, task=task, kv_heads=2, attention={"name": "vanilla", "backend": "sdpa"})
    ref = build_model(pos=enc, task=task, kv_heads=2, attention={"name": "vanilla", "backend": "torch"})
    for kw in ({}, {"key_padding": pad}, {"segments": seg}):
        a, b = fast(x, **kw).logits, ref(x, **kw).logits
        assert torch.allclose(a, b, atol=1e-5), kw


@each(("pos", "params"), pos_cases)
@each("task", ["lm", "classify"])
def test_a_shift_of_every_position_changes_nothing_exactly_when_relative(pos, params, task):
    """Left padding moves the real tokens to positions c..c+S-1. A relative encoding (``relative = True``:
    ALiBi, RoPE, T5, Shaw, XL, DA, dynamic, none) gives the same outputs; an absolute one does not."""
    model = build_model(pos=encoding(pos, params), task=task, init_std=0.5)  # unit-scale scores: positions matter
    x = tokens()
    for c in (1, 7):
        shifted = torch.cat((torch.zeros(2, c, dtype=x.dtype), x), 1)
        pad = torch.cat((torch.zeros(2, c, dtype=torch.bool), torch.ones(2, S, dtype=torch.bool)), 1)
        base, moved = model(x).logits, model(shifted, key_padding=pad).logits
        moved = moved[:, c:] if task == "lm" else moved
        same = torch.allclose(moved, base, atol=1e-4)
        assert same == POS.get(pos).relative, f"pos={pos}: shift by {c} {'changed' if not same else 'kept'} outputs"
