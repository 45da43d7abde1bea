"""The Decision Transformer's model side (Chen et al., 2021, arXiv:2106.01345): the (R, s, a) token layout, the
action head at the state tokens, no leak of a_t or the future into the prediction of a_t, behaviour cloning
without return tokens, the loss over real steps, and composition with the slots."""

from __future__ import annotations

import pytest
import torch

from xfam.core.trajectory import StepLayout
from xfam.eval.metrics import batch_stats, summarize
from xfam.model.inputs import DecisionEmbedding
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

DISCRETE = {"kind": "decision", "state_dim": 4, "num_actions": 3, "max_timestep": 50, "returns": True}
CONTINUOUS = {"kind": "decision", "state_dim": 3, "action_dim": 2, "max_timestep": 50, "returns": True}
NONE = {"name": "none"}


def model(inputs=DISCRETE, attention=None, pos="none", seed=0, exit=NONE, **spec) -> XfamModel:
    torch.manual_seed(seed)
    return XfamModel(
        ModelSpec(**{"dim": 32, "layers": 2, "heads": 4, "max_len": 60, **spec}),
        task="decision",
        vocab_size=0,
        attention=attention or {"name": "vanilla"},
        pos={"name": pos},
        memory=NONE,
        exit=exit,
        inputs=inputs,
    ).eval()


def window(layout: StepLayout, b: int = 2, k: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(b, k, layout.state_dim, generator=g)
    if layout.discrete_actions:
        actions = torch.randint(0, layout.num_actions, (b, k), generator=g)
    else:
        actions = torch.rand(b, k, layout.action_dim, generator=g) * 2 - 1
    returns = torch.randn(b, k, generator=g)
    steps = torch.arange(3, 3 + k).expand(b, -1)
    return {"returns": returns, "states": states, "actions": actions, "timesteps": steps}


def test_pack_and_unpack_round_trip_and_the_token_order():
    layout = StepLayout.of(DISCRETE)
    w = window(layout)
    x = layout.pack(**w)  # [B, K, F]
    assert x.shape == (2, 5, 1 + 4 + 1 + 1)
    r, s, a, t = layout.unpack(x)
    assert torch.equal(r[..., 0], w["returns"]) and torch.equal(s, w["states"])
    assert torch.equal(a, w["actions"]) and torch.equal(t, w["timesteps"])
    emb = DecisionEmbedding(layout, 8)
    e = emb(x)  # [B, 3K, 8]
    time = emb.timesteps(w["timesteps"])
    assert torch.allclose(e[:, 0::3], emb.returns(w["returns"][..., None]) + time)  # R_t, s_t, a_t per step
    assert torch.allclose(e[:, 1::3], emb.states(w["states"]) + time)
    assert torch.allclose(e[:, 2::3], emb.actions(w["actions"]) + time)
    assert torch.equal(layout.state_rows(torch.arange(15)[None, :, None])[0, :, 0], torch.arange(1, 15, 3))
    mask = torch.tensor([[False, True, True, True, True]])
    assert layout.per_token(mask).tolist() == [[False] * 3 + [True] * 12]


def test_behaviour_cloning_has_no_return_tokens():
    layout = StepLayout.of({**DISCRETE, "returns": False})
    e = DecisionEmbedding(layout, 8)(layout.pack(**window(layout)))
    assert e.shape == (2, 10, 8) and layout.tokens == 2
    assert torch.equal(layout.state_rows(torch.arange(10)[None, :, None])[0, :, 0], torch.arange(0, 10, 2))
    m = model({**DISCRETE, "returns": False})
    assert m(layout.pack(**window(layout))).logits.shape == (2, 5, 3)


@pytest.mark.parametrize("inputs", [DISCRETE, CONTINUOUS], ids=["discrete", "continuous"])
@pytest.mark.parametrize("attention", ["vanilla", "local", "performer"])
def test_the_action_prediction_sees_its_return_and_state_and_the_past_only(inputs, attention):
    """a_t is predicted at s_t: changing a_t, or anything of a later step, never changes it; changing R_t or
    s_t does (the causal leak test of the (R, s, a) layout)."""
    attn = {"name": attention, **({"window": 4} if attention == "local" else {})}
    m = model(inputs, attn, pos="rope")
    layout = m.embed.layout
    w = window(layout)
    base = m(layout.pack(**w)).logits  # [B, K, A]
    t = 2
    for key in ("actions", "returns", "states", "timesteps"):
        for first in (t + 1, t) if key != "actions" else (t,):
            v = {k: x.clone() for k, x in w.items()}
            if key == "actions" and layout.discrete_actions:
                v[key][:, first:] = (v[key][:, first:] + 1) % layout.num_actions
            elif key == "timesteps":
                v[key][:, first:] += 7
            else:
                v[key][:, first:] += 0.5
            out = m(layout.pack(**v)).logits
            assert torch.allclose(out[:, :first], base[:, :first], atol=1e-6), (key, first)
            if first == t and key != "actions":
                assert not torch.allclose(out[:, t], base[:, t], atol=1e-6), key  # R_t, s_t, t: seen by a_t


def test_continuous_actions_are_bounded_and_discrete_ones_are_logits():
    layout = StepLayout.of(CONTINUOUS)
    m = model(CONTINUOUS)
    with torch.no_grad():
        m.head.weight.mul_(1e3)
    out = m(layout.pack(**window(layout))).logits
    assert out.shape == (2, 5, 2) and out.abs().max() <= 1.0
    assert model(DISCRETE).head.out_features == 3


def test_the_loss_counts_real_steps_only():
    layout = StepLayout.of(CONTINUOUS)
    pred = torch.zeros(1, 3, 2)
    targets = torch.tensor([[[9.0, 9.0], [1.0, 0.0], [0.0, 1.0]]])
    step_mask = torch.tensor([[False, True, True]])  # the first step is padding
    stats = batch_stats("decision", pred, {"targets": targets, "step_mask": step_mask}, None)
    metrics = summarize(stats, "decision", "val")
    assert stats["count"] == 4 and metrics["val/mse"] == pytest.approx(0.5)
    labels = torch.tensor([[-100, 2, 0]])
    logits = torch.tensor([[[0.0, 0.0, 9.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]]])
    metrics = summarize(batch_stats("decision", logits, {"labels": labels}, None), "decision", "val")
    assert metrics["val/acc"] == 1.0 and layout.width == 1 + 3 + 2 + 1


def test_left_padding_leaves_the_real_steps_predictions_unchanged():
    """Rollouts and training windows pad the start of an episode on the left: padded steps never reach a real
    step's prediction."""
    m = model(DISCRETE, pos="rope")
    layout = m.embed.layout
    w = window(layout, b=1, k=5)
    full = m(layout.pack(**w)).logits[:, 2:]
    junk = {k: v.clone() for k, v in w.items()}
    junk["states"][:, :2] = 100.0
    mask = torch.tensor([[False, False, True, True, True]])
    padded = m(layout.pack(**junk), key_padding=layout.per_token(mask)).logits[:, 2:]
    short = m(layout.pack(**{k: v[:, 2:] for k, v in w.items()})).logits
    assert torch.allclose(padded, short, atol=1e-5) and not torch.allclose(full, short, atol=1e-5)


def test_calm_exits_per_action_and_trains_per_layer_heads_at_the_state_tokens():
    """exit=calm on a decision model: the per-layer losses and the exit classifier read the state rows only; at
    threshold 0 every action is read after layer 1 (its state row frozen there), at a threshold above 1 the
    full model; the prediction of a_t still never sees a_t."""
    calm = {"name": "calm", "threshold": 0.0, "min_layer": 1}
    m = model(DISCRETE, exit=calm, pos="rope", layers=3)
    layout = m.embed.layout
    w = window(layout)
    x = layout.pack(**w)
    m.train()
    out = m(x, targets=w["actions"])
    assert {"exit/layers", "exit/classifier"} <= set(out.aux) and out.logits.shape == (2, 5, 3)
    out.aux["exit/layers"].backward()  # the per-layer losses reach the first layer through its state rows
    assert m.blocks[0].attn.qkv.weight.grad.abs().sum() > 0 and torch.isfinite(out.aux["exit/classifier"])
    m.eval()
    first = []
    hook = m.blocks[0].register_forward_hook(lambda mod, args, y: first.append(y[0] if isinstance(y, tuple) else y))
    out = m(x)
    hook.remove()
    assert torch.equal(out.depth, torch.ones(2, 5, dtype=torch.long))  # [B, K]: one depth per action
    assert torch.allclose(out.logits, m.head_logits(first[0]), atol=1e-6)
    m.exit.threshold = 2.0
    with torch.no_grad():
        full = m(x)
    assert torch.equal(full.depth, torch.full((2, 5), 3)) and not torch.allclose(full.logits, out.logits)
    m.exit.threshold = 0.5
    base = m(x).logits
    v = {k: t.clone() for k, t in w.items()}
    v["actions"][:, 2:] = (v["actions"][:, 2:] + 1) % 3
    assert torch.allclose(m(layout.pack(**v)).logits[:, :3], base[:, :3], atol=1e-6)
