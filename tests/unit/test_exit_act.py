"""exit=act: the Universal Transformer with Adaptive Computation Time (Dehghani et al., 2019; Graves, 2016)."""

from __future__ import annotations

import pytest
import torch
from doubles import ToyStack, build_model, decode_logits

from xfam.attention import ATTENTION
from xfam.core.sinusoid import TimestepSignal
from xfam.exit import EXIT
from xfam.exit.act import ACT
from xfam.memory import MEMORY
from xfam.model import compat
from xfam.pos import POS

V, D = 13, 8


def policy(**params) -> ACT:
    torch.manual_seed(0)
    act = EXIT.build({"name": "act", **params}, dim=D)
    with torch.no_grad():  # a halting unit whose p differs a lot between positions
        act.halt.weight.copy_(torch.linspace(-1.5, 1.5, D))
        act.halt.bias.fill_(-0.5)
    return act


def layer(step: int, h: torch.Tensor) -> torch.Tensor:
    """A stand-in for the shared block: position-wise, different at every step."""
    return torch.tanh(h * (1.0 + 0.1 * step) + 0.3)


def graves(x: torch.Tensor, act: ACT, steps: int, eps: float = 0.01, positions: bool = False):
    """ACT written out per position (Graves, 2016, eq. 6-14 with the UT's copied halted states)."""
    signal = TimestepSignal(D, positions=positions)
    out, n_all, r_all = torch.zeros_like(x), torch.zeros(x.shape[:2]), torch.zeros(x.shape[:2])
    for bi in range(x.shape[0]):
        for si in range(x.shape[1]):
            s, total = x[bi, si], 0.0
            for t in range(steps):
                state = s + signal.signal(torch.tensor([si]), t)[0]
                p = torch.sigmoid(act.halt(state)).item()
                new = layer(t, state)
                if total + p > 1 - eps or t == steps - 1:
                    r = 1 - total
                    out[bi, si] += r * new
                    n_all[bi, si], r_all[bi, si] = t + 1, r
                    break
                out[bi, si] += p * new
                total += p
                s = new
    return out, n_all, r_all


@pytest.mark.parametrize("position_signal", [False, True])
def test_equals_the_act_definition_per_position(position_signal):
    act = policy(position_signal=position_signal)
    x = torch.randn(2, 5, D)
    res = act(x, ToyStack(layer, 6))
    expected, n, r = graves(x, act, 6, positions=position_signal)
    assert torch.allclose(res.hidden, expected, atol=1e-6)
    assert torch.equal(res.depth, n) and torch.allclose(act.last["remainder"], r, atol=1e-6)
    assert len(set(n.flatten().tolist())) > 1  # positions halted at different steps


def test_halting_weights_sum_to_one_and_the_ponder_cost_is_n_plus_r():
    act = policy(tau=0.3)
    x = torch.randn(3, 7, D)
    pad = torch.ones(3, 7, dtype=torch.bool)
    pad[0, 5:] = False
    res = act(x, ToyStack(layer, 5, key_padding=pad))
    n, r, total = act.last["steps"], act.last["remainder"], act.last["halted_sum"]
    assert torch.allclose(total + r, torch.ones_like(r), atol=1e-6)  # sum_{t<N} p_t + R = 1
    assert ((r > 0) & (r <= 1)).all() and ((n >= 1) & (n <= 5)).all()
    assert torch.allclose(act.last["ponder"], n + r)
    assert torch.allclose(res.aux["ponder"], 0.3 * (n + r)[pad].mean())  # padding excluded


def test_a_halted_state_is_copied_unchanged_to_later_steps():
    act = policy()
    x = torch.randn(1, 6, D)
    seen = []

    def record(step, h):
        seen.append(h.clone())
        return layer(step, h)

    act(x, ToyStack(record, 6))
    n, signal = act.last["steps"][0].long(), TimestepSignal(D, positions=False)
    pos = torch.arange(6)
    for i in range(6):
        if n[i] < len(seen):  # halted before the last step taken: its state stays the one it halted with
            state = seen[n[i] - 1][0, i] - signal.signal(pos, int(n[i]) - 1)[i]
            halted = layer(int(n[i]) - 1, seen[n[i] - 1])[0, i]
            for t in range(int(n[i]), len(seen)):
                assert torch.allclose(seen[t][0, i] - signal.signal(pos, t)[i], halted, atol=1e-6)
            assert not torch.allclose(state, halted)


@pytest.mark.parametrize("signal", [False, True])
@pytest.mark.parametrize("task", ["lm", "classify"])
def test_fixed_mode_is_a_weight_tied_stack(signal, task):
    act = build_model(exit={"name": "act", "mode": "fixed", "signal": signal}, layers=4, task=task, pos="rope")
    assert len(act.blocks) == 1
    tied = build_model(layers=4, task=task, pos="rope")
    state = {k: v for k, v in act.state_dict().items() if not k.startswith("exit.")}
    for i in range(4):  # every layer of the plain stack gets the one shared block
        state.update({k.replace("blocks.0.", f"blocks.{i}."): v for k, v in state.items() if k.startswith("blocks.0.")})
    tied.load_state_dict(state)
    x = torch.randint(0, V, (2, 9))
    same = torch.allclose(act(x).logits, tied(x).logits, atol=1e-5)
    assert same != signal  # exactly the tied stack without the step signal, not with it


def test_no_causal_leak_and_decoding_equals_the_full_pass():
    model = build_model(exit={"name": "act", "halting_bias": 0.0}, layers=5, pos="alibi", init_std=0.3)
    with torch.no_grad():
        model.exit.halt.weight.normal_(0, 1.0)
    x = torch.randint(0, V, (2, 10))
    out = model(x)
    assert len(set(out.depth.flatten().tolist())) > 1
    for t in (0, 4, 9):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % V
        assert torch.allclose(model(x2).logits[:, :t], out.logits[:, :t], atol=1e-6)
    assert torch.allclose(decode_logits(model, x, prompt=3), out.logits, atol=1e-5)
    assert torch.allclose(decode_logits(model, x, prompt=1, step=2), out.logits, atol=1e-5)


def test_limits_one_step_and_all_steps():
    """p -> 1: every position halts at step 1 (N = 1, R = 1); p -> 0: every position runs T steps and the
    output is the fixed T-step model's."""
    x = torch.randint(0, V, (2, 7))
    eager = build_model(exit={"name": "act", "halting_bias": 40.0}, layers=4)
    one = build_model(exit={"name": "act", "mode": "fixed"}, layers=1)
    one.load_state_dict({k: v for k, v in eager.state_dict().items() if not k.startswith("exit.")}, strict=False)
    out = eager(x)
    assert torch.equal(out.depth, torch.ones(2, 7)) and torch.allclose(out.logits, one(x).logits, atol=1e-6)
    lazy = build_model(exit={"name": "act", "halting_bias": -40.0}, layers=4)
    fixed = build_model(exit={"name": "act", "mode": "fixed"}, layers=4)
    fixed.load_state_dict({k: v for k, v in lazy.state_dict().items() if not k.startswith("exit.")}, strict=False)
    out = lazy(x)
    assert torch.equal(out.depth, torch.full((2, 7), 4.0)) and torch.allclose(out.logits, fixed(x).logits, atol=1e-6)


def test_the_ponder_cost_trains_the_halting_unit():
    model = build_model(exit={"name": "act", "tau": 1.0}, layers=3).train()
    out = model(torch.randint(0, V, (2, 6)))
    out.aux["exit/ponder"].backward()
    assert model.exit.halt.weight.grad.abs().sum() > 0 and model.exit.halt.bias.grad.abs() > 0
    assert model.exit.halt.bias.detach().item() == 1.0  # the model's init kept the halting bias


def test_memory_is_refused_with_the_reason():
    sel = compat.Selection(
        attention=[(ATTENTION.get("vanilla"), {}, False)],
        pos=(POS.get("rope"), {}),
        memory=[(MEMORY.get("toy_memory"), {})],
        exit=(EXIT.get("act"), {}),
        causal=True,
        streams=True,
    )
    (msg,) = compat.check(sel)
    assert "exit=act" in msg and "Fix: memory=none" in msg


def test_evaluation_reports_the_depth_used_and_the_compute_saved():
    """The exit slot's inference report: mean layers per scored token and 1 - depth / layers, summed exactly."""
    from xfam.eval.metrics import batch_stats, summarize

    logits = torch.zeros(2, 3, V)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])  # 3 scored tokens
    depth = torch.tensor([[1.0, 3.0, 8.0], [2.0, 8.0, 8.0]])  # unscored tokens do not count
    sums = {k: v.double() for k, v in batch_stats("lm", logits, {"labels": labels}, None, depth, 4).items()}
    sums["batches"] = torch.tensor(1.0)
    out = summarize(sums, "lm", "test")
    assert float(out["test/depth"]) == pytest.approx(2.0) and float(out["test/compute_saved"]) == pytest.approx(0.5)
    assert "depth" not in batch_stats("lm", logits, {"labels": labels}, None)  # a full-depth model: no report
    model = build_model(exit={"name": "act", "halting_bias": 40.0}, layers=4, task="classify")
    pad = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    x = torch.randint(0, V, (2, 5))
    out = model(x, key_padding=pad)
    stats = batch_stats("classify", out.logits, {"label": torch.tensor([0, 1]), "key_padding": pad}, None, out.depth, 4)
    assert float(stats["depth"]) == 8.0 and float(stats["layers"]) == 32.0  # 8 real tokens, 1 step each of 4
