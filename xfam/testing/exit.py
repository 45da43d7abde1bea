"""The exit contract: the policy owns how depth is traversed (which layers run for which tokens), returns the
auxiliary losses it owns under ``exit/<name>`` and the depth it used, and keeps what the plain stack promises: no
causal leak, cached decoding equal to recomputing the prefix (layers a token skipped keep no decode state, yet
decoding equals the full pass), determinism. An early-exit policy (``early_exit``) under ``full_depth()`` is the
plain stack with the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xfam.exit import EXIT
from xfam.model.transformer import Task
from xfam.testing._compat import refusals
from xfam.testing._suite import each
from xfam.testing.doubles import build_model, decode_logits

V, B, S, L = 13, 2, 8, 3


def exit_cases(comps) -> list:
    return [pytest.param(n, dict(comps.params), id=n) for n in comps.names]


def early_cases(comps) -> list:
    return [pytest.param(n, dict(comps.params), id=n) for n in comps.names if EXIT.get(n).early_exit]


def model_with(name: str, params: dict, task: Task = "lm", **kw):
    """A tiny model with the policy, or a skip naming xfam's refusal of the policy for this task."""
    if problems := refusals(task, pos={"name": "rope"}, exit={"name": name, **params}, layers=L):
        pytest.skip(f"refused for task={task} (as validate would): {' '.join(problems)}")
    return build_model(exit={"name": name, **params}, layers=L, pos="rope", task=task, **kw)


@each(("name", "params"), exit_cases)
@each("task", ["lm", "classify"])
def test_training_outputs_depth_aux_losses_and_gradients(name, params, task):
    model = model_with(name, params, task=task).train()
    x = torch.randint(0, V, (B, S))
    targets = x.roll(-1, 1) if task == "lm" else torch.tensor([0, 2])
    out = model(x, targets=targets)
    assert out.logits.shape == ((B, S, V) if task == "lm" else (B, 3)) and torch.isfinite(out.logits).all()
    for key, value in out.aux.items():
        assert key.startswith("exit/") and value.dim() == 0 and torch.isfinite(value), key
    assert out.depth is None or (out.depth.shape == (B, S) and 1 <= out.depth.min() <= out.depth.max() <= L)
    loss = F.cross_entropy(out.logits.flatten(0, -2), targets.flatten()) + sum(out.aux.values())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{pname} has a non-finite gradient"
    ran = L if out.depth is None else int(out.depth.max())
    for i, block in enumerate(model.blocks[:ran]):  # the blocks the policy ran (one, shared, for ACT)
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters()), f"layer {i}"


@each(("name", "params"), exit_cases)
def test_no_causal_leak_through_the_lm(name, params):
    model = model_with(name, params)
    x = torch.randint(0, V, (B, S))
    base = model(x).logits
    for t in (0, 4, S - 1):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % V
        out = model(x2).logits
        assert torch.allclose(out[:, :t], base[:, :t], atol=1e-6), f"changing token {t} changed earlier logits"
        assert not torch.allclose(out[:, t:], base[:, t:], atol=1e-4)


@each(("name", "params"), exit_cases)
@each(("prompt", "step"), [(3, 1), (2, 3)])
def test_cached_decode_equals_full_recompute(name, params, prompt, step):
    model = model_with(name, params)
    x = torch.randint(0, V, (B, 9))
    assert torch.allclose(decode_logits(model, x, prompt, step), model(x).logits, atol=1e-5)


@each(("name", "params"), exit_cases)
def test_deterministic_given_a_seed(name, params):
    x = torch.randint(0, V, (B, S))
    a, b = model_with(name, params, seed=3), model_with(name, params, seed=3)
    out_a, out_b = a(x), b(x)
    assert torch.equal(out_a.logits, out_b.logits) and torch.equal(out_a.logits, a(x).logits)
    assert (out_a.depth is None) == (out_b.depth is None)
    assert out_a.depth is None or torch.equal(out_a.depth, out_b.depth)


@each(("name", "params"), early_cases)
def test_full_depth_is_the_plain_stack(name, params):
    """Under ``full_depth()`` every token runs every layer: the logits are those of ``exit=none`` with the same
    weights (what ``xfam eval`` compares an early-exit model against)."""
    model = model_with(name, params, init_std=0.3)
    plain = build_model(layers=L, pos="rope", init_std=0.3)
    result = plain.load_state_dict(model.state_dict(), strict=False)
    assert result.missing_keys == [] and all(k.startswith("exit.") for k in result.unexpected_keys)
    x = torch.randint(0, V, (B, S))
    with model.exit.full_depth():
        out = model(x)
    assert out.depth is None or bool((out.depth == L).all())
    assert torch.allclose(out.logits, plain(x).logits, atol=1e-5)
