"""exit=calm (Schuster et al., 2022) and exit=depth_adaptive (Elbayad et al., 2020): early exit with copied states.

The reference for every early-exit pass is a plain model (``exit=none``) with the same weights whose blocks are
hooked so that, after a token's exit layer, each block's output at that token is replaced by its input: the
token's state is copied upwards while the later layers still run on the copy (``xfam.exit._early``).

One file over 400 lines: both policies are checked against one hooked reference model.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from doubles import build_model, decode_logits

from xfam.core.errors import ConfigError
from xfam.exit import EXIT
from xfam.exit.calm import CALM
from xfam.exit.depth_adaptive import DepthAdaptive
from xfam.model.stack import Stack

L, V, S = 4, 11, 10
MEASURES = ["softmax", "saturation", "classifier"]

# Thresholds that give mixed depths on these tiny models (each test that relies on it asserts it).
MIXED = {
    "softmax": ("calm", {"measure": "softmax", "threshold": 0.3}),
    "saturation": ("calm", {"measure": "saturation", "threshold": 0.85}),
    "classifier": ("calm", {"measure": "classifier", "threshold": 0.7}),
    "decay": ("calm", {"measure": "softmax", "threshold": 0.5, "threshold_decay": 20.0}),
    "geometric": ("depth_adaptive", {"classifier": "geometric", "threshold": 0.5}),
    "multinomial": ("depth_adaptive", {"classifier": "multinomial", "threshold": 0.0}),
}


def make(name: str | None, params: dict | None = None, **kw):
    """A tiny 4-layer model with large enough weights that confidences differ between tokens."""
    kw = {"layers": L, "vocab_size": V, "init_std": 0.3, **kw}
    model = build_model(exit=None if name is None else {"name": name, **(params or {})}, **kw)
    if name == "depth_adaptive" and (params or {}).get("classifier") == "multinomial":
        with torch.no_grad():  # favour the first and the last layer, so both occur
            model.exit.halting.bias.copy_(torch.tensor([0.5, -1.0, -1.0, 0.5]))
    return model


def mixed(case: str, **kw):
    name, params = MIXED[case]
    return make(name, params, **kw)


def twin(model, **kw):
    """A plain model (exit=none) with the early-exit model's weights; only ``exit.*`` is left over."""
    plain = build_model(exit=None, **{"layers": L, "vocab_size": V, "init_std": 0.3, **kw})
    res = plain.load_state_dict(model.state_dict(), strict=False)
    assert res.missing_keys == []
    assert res.unexpected_keys and all(k.startswith("exit.") for k in res.unexpected_keys)
    return plain


def tokens(b: int = 3, s: int = S, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


def hooked(model, x, **kw):
    """Run the model, and record each block's input and output ``[B, S, D]`` (blocks that ran only) in a second run
    whose exited tokens pass every later layer whole (``whole_layers``: the definition of state propagation, which
    the model's partial layers equal, tests/unit/test_exit_propagation.py); the first run's output."""
    out = model(x, **kw)
    ins, outs = {}, {}
    handles = []
    for i, blk in enumerate(model.blocks):
        handles.append(blk.register_forward_pre_hook(lambda m, a, i=i: ins.__setitem__(i, a[0].detach().clone())))
        handles.append(blk.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0].detach().clone())))
    try:
        with whole_layers():
            ref = model(x, **kw)
    finally:
        for h in handles:
            h.remove()
    assert (out.depth is None) == (ref.depth is None) and (out.depth is None or torch.equal(out.depth, ref.depth))
    return out, ins, outs


@contextlib.contextmanager
def whole_layers() -> Iterator[None]:
    """Within the context the layer stack has no ``run_layer_rows``: an exited token's copied state runs through
    every later layer in full."""
    saved = Stack.run_layer_rows
    del Stack.run_layer_rows
    try:
        yield
    finally:
        Stack.run_layer_rows = saved


def with_copied_states(plain, x, depth):
    """The plain model with each token's state copied above its exit layer ``depth [B, S]`` (1-based):
    block i (layer i + 1) returns its input at tokens with depth <= i, its output elsewhere.
    Returns the logits and the final states (each token's state at its exit)."""
    final = {}
    handles = [plain.norm.register_forward_pre_hook(lambda m, a: final.__setitem__("h", a[0]))]
    for i, blk in enumerate(plain.blocks):

        def hook(m, args, out, i=i):
            frozen = (depth <= i).unsqueeze(-1)
            return torch.where(frozen, args[0], out[0]), out[1]

        handles.append(blk.register_forward_hook(hook))
    try:
        return plain(x).logits, final["h"]
    finally:
        for h in handles:
            h.remove()


def assert_mixed(depth: torch.Tensor) -> None:
    values = set(depth.flatten().tolist())
    assert len(values) > 1 and L in values, values


# -- 1. exits disabled ---------------------------------------------------------------------------

DISABLED = [("calm", {"measure": m}, {}) for m in MEASURES] + [
    ("depth_adaptive", {"classifier": "geometric"}, {}),
    ("depth_adaptive", {"classifier": "multinomial"}, {}),
    ("depth_adaptive", {"classifier": "geometric", "output_heads": "separate"}, {}),
    ("depth_adaptive", {"classifier": "sequence"}, {"task": "classify", "causal": False, "num_classes": 3}),
]


@pytest.mark.parametrize(("name", "params", "kw"), DISABLED)
def test_a_threshold_above_one_is_the_full_model_exactly(name, params, kw):
    model = make(name, {**params, "threshold": 1.01}, **kw)
    plain = twin(model, **kw)
    x = tokens()
    out = model(x)
    assert torch.equal(out.logits, plain(x).logits)
    assert torch.equal(out.depth, torch.full((3, S), L))


@pytest.mark.parametrize(("name", "params", "kw"), DISABLED)
def test_full_depth_context_runs_every_layer_whatever_the_threshold(name, params, kw):
    model = make(name, {**params, "threshold": 0.0}, **kw)
    plain = twin(model, **kw)
    x = tokens()
    assert (model(x).depth < L).any()  # the aggressive threshold does exit early
    with model.exit.full_depth():
        out = model(x)
    assert torch.equal(out.logits, plain(x).logits)
    assert torch.equal(out.depth, torch.full((3, S), L))
    assert (model(x).depth < L).any()  # restored on leaving the context


# -- 2. static exit ------------------------------------------------------------------------------

STATIC = [
    ("calm", {"measure": "softmax"}, {}),
    ("depth_adaptive", {"classifier": "geometric"}, {}),
    ("depth_adaptive", {"classifier": "sequence"}, {"task": "classify", "causal": False, "num_classes": 3}),
]


@pytest.mark.parametrize("k", range(1, L))
@pytest.mark.parametrize(("name", "params", "kw"), STATIC)
def test_exit_at_k_is_the_k_layer_model(name, params, kw, k):
    model = make(name, {**params, "exit_at": k}, **kw)
    short = build_model(exit=None, **{"vocab_size": V, "init_std": 0.3, **kw, "layers": k})
    state = {n: v for n, v in model.state_dict().items() if not n.startswith("exit.") and not n.startswith("blocks.")}
    state.update({n: v for n, v in model.state_dict().items() if n.startswith(tuple(f"blocks.{i}." for i in range(k)))})
    short.load_state_dict(state)  # strict: every parameter of the k-layer model
    x = tokens()
    out = model(x)
    assert torch.equal(out.logits, short(x).logits)
    assert torch.equal(out.depth, torch.full((3, S), k))
    if kw.get("task", "lm") == "lm":  # decoding runs every layer (for the cache) but keeps the exit
        assert torch.allclose(decode_logits(model, x, prompt=3), out.logits, atol=1e-5)


# -- 3. CALM's confidence measures and exit decisions --------------------------------------------


def manual_confidence(model, measure: str, n: int, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    if measure == "softmax":
        p = torch.softmax(model.head_logits(after), -1).sort(-1, descending=True).values
        return p[..., 0] - p[..., 1]
    if measure == "saturation":
        if n == 1:
            return torch.zeros(after.shape[:2])
        return (before * after).sum(-1) / (before.norm(dim=-1) * after.norm(dim=-1))
    w, b = model.exit.classifier.weight[0], model.exit.classifier.bias[0]
    return torch.sigmoid(after @ w + b)


@pytest.mark.parametrize("measure", MEASURES)
def test_calm_confidence_definitions(measure):
    model = make("calm", {"measure": measure})
    x = tokens()
    with torch.no_grad(), model.exit.full_depth():
        _, ins, outs = hooked(model, x)
        head = lambda h, proj=None: model.head_logits(h, None, proj)
        stack = SimpleNamespace(head=head, scored_rows=model.scored_rows)  # what confidence reads of the stack
        for n in range(1, L + 1):
            got = model.exit.confidence(n, ins[n - 1], outs[n - 1], stack)
            want = manual_confidence(model, measure, n, ins[n - 1], outs[n - 1])
            assert got.shape == (3, S)
            assert torch.allclose(got, want, atol=1e-6)
            assert (got <= 1 + 1e-6).all()
            if measure == "saturation" and n == 1:
                assert torch.equal(got, torch.zeros(3, S))


@pytest.mark.parametrize("decay", [0.0, 20.0])
@pytest.mark.parametrize("min_layer", [1, 2])
@pytest.mark.parametrize("measure", MEASURES)
def test_calm_exits_at_the_first_confident_layer(measure, min_layer, decay):
    _, params = MIXED[measure]
    model = make("calm", {**params, "min_layer": min_layer, "threshold_decay": decay})
    x = tokens()
    with torch.no_grad():
        out, ins, outs = hooked(model, x)
    t, big_t = torch.arange(S, dtype=torch.float32), model.spec.max_len  # T of sec. 3.1: the model's max_len
    lam = params["threshold"]
    thr = (0.9 * lam + 0.1 * torch.exp(-decay * t / big_t)).clamp(0, 1) if decay else lam
    want = torch.full((3, S), L)
    running = torch.ones(3, S, dtype=torch.bool)
    for n in range(min_layer, L):
        if n - 1 not in outs:
            break
        c = manual_confidence(model, measure, n, ins[n - 1], outs[n - 1])
        exits = running & (c >= thr)
        want[exits] = n
        running &= ~exits
    assert torch.equal(out.depth, want)
    assert out.depth.min() >= min_layer
    assert_mixed(out.depth)
    # each token's logits are the head at its exit layer's output
    for b in range(3):
        for s in range(S):
            h = outs[int(want[b, s]) - 1][b : b + 1, s : s + 1]
            assert torch.allclose(out.logits[b, s], model.head_logits(h)[0, 0], atol=1e-6)


@pytest.mark.parametrize(
    ("name", "params", "unit", "c", "at"),
    [
        ("calm", {"measure": "classifier"}, "classifier", 0.5, 1),  # CALM sec. 3: exit when c >= threshold
        ("depth_adaptive", {"classifier": "geometric"}, "halting", 0.5, L),  # exit when chi > threshold
        ("depth_adaptive", {"classifier": "multinomial"}, "halting", 0.25, 1),  # exit when max q >= threshold
    ],
)
def test_the_inequality_at_the_threshold(name, params, unit, c, at):
    """With a zeroed exit unit every confidence is exactly ``c`` (sigmoid(0), or a uniform q over 4 layers,
    whose argmax is layer 1): ``at`` is the depth when the threshold equals it."""
    x = tokens()
    for threshold, want in ((c, at), (c - 1e-4, 1), (c + 1e-4, L)):
        model = make(name, {**params, "threshold": threshold})
        with torch.no_grad():
            getattr(model.exit, unit).weight.zero_()
            getattr(model.exit, unit).bias.zero_()
        assert torch.equal(model(x).depth, torch.full((3, S), want)), threshold


@pytest.mark.parametrize("threshold", [0.0, 0.4, 0.5])
@pytest.mark.parametrize("kind", ["geometric", "multinomial"])
def test_depth_adaptive_exit_decisions(kind, threshold):
    """geometric: the first layer with chi > threshold; multinomial: argmax q from the first layer's state,
    if q there reaches the threshold (else the last layer)."""
    model = make("depth_adaptive", {"classifier": kind, "threshold": threshold})
    x = tokens()
    with torch.no_grad():
        out, _, outs = hooked(model, x)
        if kind == "geometric":
            want = torch.full((3, S), L)
            for n in range(L - 1, 0, -1):  # the lowest layer wins
                if n - 1 in outs:
                    want[torch.sigmoid(model.exit.halting(outs[n - 1]))[..., 0] > threshold] = n
        else:
            q = torch.softmax(model.exit.halting(outs[0]), -1)  # [B, S, N]
            prob, idx = q.max(-1)
            want = torch.where(prob >= threshold, idx + 1, L)
    assert torch.equal(out.depth, want)
    if threshold > 0:
        assert len(set(want.flatten().tolist())) > 1


def test_threshold_decay_lowers_the_threshold_later_in_the_sequence():
    pol = EXIT.build({"name": "calm", "threshold": 0.8, "threshold_decay": 4.0}, dim=8, num_layers=3, max_len=16)
    pos = torch.arange(16)
    got = pol.threshold_at(pos, torch.zeros(1, 16, 8))
    assert torch.allclose(got, (0.72 + 0.1 * torch.exp(-4.0 * pos / 16)).clamp(0, 1))
    assert (got[1:] < got[:-1]).all()
    assert EXIT.build({"name": "calm", "threshold": 0.8}, dim=8, num_layers=3).threshold_at(pos, None) == 0.8


# -- 4. state propagation ------------------------------------------------------------------------

MIXED_LM = list(MIXED)


@pytest.mark.parametrize("case", MIXED_LM)
def test_exited_states_are_copied_to_every_later_layer(case):
    model = mixed(case)
    x = tokens()
    with torch.no_grad():
        out, ins, outs = hooked(model, x)
    depth = out.depth
    assert_mixed(depth)
    assert sorted(ins) == list(range(L))  # some token used every layer, so every block ran
    checked = 0
    for b in range(3):
        for s in range(S):
            d = int(depth[b, s])
            for i in range(d, L):  # layers i + 1 > d read the copy of the exit state
                assert torch.equal(ins[i][b, s], outs[d - 1][b, s])
                checked += 1
            if d < L:  # the later layers did run on the copy (they would change it)
                assert not torch.allclose(outs[d][b, s], outs[d - 1][b, s])
    assert checked > 0
    # an independent implementation of the copy (hooks on the plain model) gives the same logits
    with torch.no_grad():
        ref, _ = with_copied_states(twin(model), x, depth)
    assert torch.allclose(out.logits, ref, atol=1e-6)


@pytest.mark.parametrize("case", MIXED_LM)
def test_decoding_with_the_cache_equals_the_full_pass(case):
    model = mixed(case)
    x = tokens(s=11)
    with torch.no_grad():
        full, ins, _ = hooked(model, x)
        assert_mixed(full.depth)
        assert torch.allclose(decode_logits(model, x, prompt=3), full.logits, atol=1e-5)
        assert torch.allclose(decode_logits(model, x, prompt=1, step=2), full.logits, atol=1e-5)
        out = model(x[:, :3], cache=model.empty_cache())
        cache, depths = out.cache, [out.depth]
        for t in range(3, x.shape[1]):
            out = model(x[:, t : t + 1], cache=out.cache)
            cache = out.cache
            depths.append(out.depth)
    assert torch.equal(torch.cat(depths, 1), full.depth)
    # every layer's cache holds keys/values for every position, computed from the (copied) input state
    assert cache.length == x.shape[1] and len(cache.layers) == L
    for i, st in enumerate(cache.layers):
        blk = model.blocks[i]
        attn = blk.attn
        assert st["k"].shape == (3, attn.kv_heads, x.shape[1], attn.head_dim) == st["v"].shape
        with torch.no_grad():
            _, k, v = attn.qkv(blk.norm1(ins[i])).split((attn.q_width, attn.kv_width, attn.kv_width), -1)
        assert torch.allclose(st["k"], attn._heads(k, attn.kv_heads), atol=1e-5)
        assert torch.allclose(st["v"], attn._heads(v, attn.kv_heads), atol=1e-5)


# -- 5. causality and 6. batch independence ------------------------------------------------------


@pytest.mark.parametrize("case", MIXED_LM)
def test_no_causal_leak(case):
    model = mixed(case)
    x = tokens()
    with torch.no_grad():
        out = model(x)
        assert_mixed(out.depth)
        for j in (1, 4, 9):
            x2 = x.clone()
            x2[:, j] = (x2[:, j] + 1) % V
            out2 = model(x2)
            assert torch.allclose(out2.logits[:, :j], out.logits[:, :j], atol=1e-6)
            assert torch.equal(out2.depth[:, :j], out.depth[:, :j])


def sequence_model(x: torch.Tensor, key_padding: torch.Tensor | None = None):
    """A sequence-classifier model whose halting weights give the rows of ``x`` different depths (the
    first of a few seeded draws that does: depends on nothing but these seeds)."""
    kw = {"task": "classify", "causal": False, "num_classes": 3}
    model = make("depth_adaptive", {"classifier": "sequence", "threshold": 0.0}, **kw)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(50):
            model.exit.halting.weight.copy_(torch.randn(model.exit.halting.weight.shape, generator=gen) * 3.0)
            if len(set(model(x, key_padding=key_padding).depth[:, 0].tolist())) > 1:
                return model
    raise AssertionError("no draw of halting weights gave mixed depths")


@pytest.mark.parametrize("case", [*MIXED_LM, "sequence"])
def test_rows_of_a_batch_are_independent(case):
    x = tokens(seed=5)
    model = sequence_model(x) if case == "sequence" else mixed(case)
    with torch.no_grad():
        out = model(x)
        assert len(set(out.depth.flatten().tolist())) > 1
        for b in range(3):
            one = model(x[b : b + 1])
            assert torch.allclose(one.logits, out.logits[b : b + 1], atol=1e-6)
            assert torch.equal(one.depth, out.depth[b : b + 1])


def test_the_sequence_classifier_ignores_padding():
    x = tokens(b=8, seed=2)
    pad = torch.ones(8, S, dtype=torch.bool)
    pad[:, 4:] = False
    model = sequence_model(x, pad)
    with torch.no_grad():
        out = model(x, key_padding=pad)
        assert len(set(out.depth[:, 0].tolist())) > 1
        assert (out.depth == out.depth[:, :1]).all()  # one depth per sequence
        x2 = x.clone()
        x2[:, 4:] = (x2[:, 4:] + 3) % V  # other tokens in the padding
        out2 = model(x2, key_padding=pad)
        assert torch.equal(out2.depth, out.depth) and torch.allclose(out2.logits, out.logits, atol=1e-6)
        short = model(x[:, :4])  # the same rows without the padding
        assert torch.equal(short.depth, out.depth[:, :4]) and torch.allclose(short.logits, out.logits, atol=1e-5)


# -- 7. training losses --------------------------------------------------------------------------


def lm_targets(x: torch.Tensor) -> torch.Tensor:
    tgt = torch.roll(x, -1, 1)
    tgt[:, -1] = -100
    tgt[0, 2] = tgt[1, 5] = -100
    return tgt


def ce(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), tgt.flatten(), ignore_index=-100)


@pytest.mark.parametrize("weighting", ["linear", "uniform"])
def test_calm_layer_loss_is_the_weighted_sum_of_per_layer_losses(weighting):
    model = make("calm", {"weighting": weighting}).train()
    x = tokens()
    tgt = lm_targets(x)
    out, _, outs = hooked(model, x, targets=tgt)
    with torch.no_grad():
        want = sum(
            ((n / L) if weighting == "linear" else 1.0) * ce(model.head_logits(outs[n - 1]), tgt) for n in range(1, L)
        )
        assert torch.allclose(out.aux["exit/layers"], want, rtol=1e-5)
        # the exit classifier: balanced BCE against consistency with the last layer's prediction
        keep = (tgt != -100).float()
        last = model.head_logits(outs[L - 1]).argmax(-1)
        labels = torch.stack([(model.head_logits(outs[n]).argmax(-1) == last).float() for n in range(L - 1)])
        logit = torch.stack([model.exit.classifier(outs[n]).squeeze(-1) for n in range(L - 1)])
        share = (labels * keep).sum() / (keep.sum() * (L - 1))
        w = torch.where(labels.bool(), 1 - share, share) * keep
        bce = F.binary_cross_entropy_with_logits(logit, labels, reduction="none")
        assert 0 < share < 1
        assert torch.allclose(out.aux["exit/classifier"], (bce * w).sum() / w.sum(), rtol=1e-5)
        assert torch.allclose((w * labels).sum(), (w * (1 - labels)).sum(), rtol=1e-5)  # each class weighs half


def test_calm_classifier_loss_never_reaches_the_model():
    model = make("calm").train()
    x = tokens()
    model(x, targets=lm_targets(x)).aux["exit/classifier"].backward()
    for name, p in model.named_parameters():
        if not name.startswith("exit."):
            assert p.grad is None or not p.grad.any(), name
    assert model.exit.classifier.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("heads", ["shared", "separate"])
def test_depth_adaptive_aligned_layer_loss_is_the_sum_of_per_layer_losses(heads):
    model = make("depth_adaptive", {"output_heads": heads}).train()
    x = tokens()
    tgt = lm_targets(x)
    out, _, outs = hooked(model, x, targets=tgt)
    with torch.no_grad():
        proj = (lambda n: None) if heads == "shared" else (lambda n: model.exit.heads[n - 1])
        want = sum(ce(model.head_logits(outs[n - 1], None, proj(n)), tgt) for n in range(1, L))
        assert torch.allclose(out.aux["exit/layers"], want, rtol=1e-5)
    assert "exit/mixed" not in out.aux


@pytest.mark.parametrize("kind", ["geometric", "multinomial", "sequence"])
def test_depth_adaptive_halting_loss_trains_the_model_too(kind):
    kw = {"task": "classify", "causal": False, "num_classes": 3} if kind == "sequence" else {}
    model = make("depth_adaptive", {"classifier": kind}, **kw).train()
    x = tokens()
    tgt = torch.tensor([0, 2, 1]) if kind == "sequence" else lm_targets(x)
    aux = model(x, targets=tgt).aux
    assert torch.isfinite(aux["exit/halting"])
    aux["exit/halting"].backward()
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.exit.halting.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("depth_penalty", [0.0, 0.5])
def test_geometric_halting_loss_is_minus_log_q_at_the_likelihood_oracle(depth_penalty):
    model = make("depth_adaptive", {"classifier": "geometric", "depth_penalty": depth_penalty}).train()
    x = tokens()
    tgt = lm_targets(x)
    out, _, outs = hooked(model, x, targets=tgt)
    keep = tgt != -100
    with torch.no_grad():
        nll = torch.stack(
            [
                F.cross_entropy(model.head_logits(outs[n]).transpose(1, 2), tgt.clamp_min(0), reduction="none")
                for n in range(L)
            ]
        )  # [N, B, S]
        score = -nll * keep - depth_penalty * torch.arange(1, L + 1).view(-1, 1, 1)
        best = score.argmax(0)  # 0-based
        chi = torch.stack([torch.sigmoid(model.exit.halting(outs[n]).squeeze(-1)) for n in range(L - 1)])
        q = [chi[0]] + [chi[n] * torch.prod(1 - chi[:n], 0) for n in range(1, L - 1)] + [torch.prod(1 - chi, 0)]
        q = torch.stack(q)  # [N, B, S]
        assert torch.allclose(q.sum(0), torch.ones(3, S), atol=1e-6)
        want = (-torch.log(q.gather(0, best.unsqueeze(0)))[0] * keep).sum() / keep.sum()
    assert torch.allclose(out.aux["exit/halting"], want, rtol=1e-5)


@pytest.mark.parametrize("samples", [1, 2])
@pytest.mark.parametrize("heads", ["shared", "separate"])
def test_mixed_training_is_the_nll_at_uniformly_drawn_exits_with_copied_states(samples, heads):
    model = make("depth_adaptive", {"training": "mixed", "samples": samples, "output_heads": heads}).train()
    x = tokens()
    tgt = lm_targets(x)
    torch.manual_seed(7)
    aux = model(x, targets=tgt).aux
    assert "exit/layers" not in aux and torch.isfinite(aux["exit/mixed"])
    torch.manual_seed(7)
    draws = [torch.randint(1, L + 1, (3, S)) for _ in range(samples)]
    model.eval()
    plain = twin(model)
    want = 0.0
    with torch.no_grad():
        for draw in draws:
            assert len(set(draw.flatten().tolist())) > 1
            logits, final = with_copied_states(plain, x, draw)
            if heads == "separate":  # each token's copied state read by its exit layer's own output layer
                per_layer = [model.head_logits(final, None, model.exit.heads[n - 1]) for n in range(1, L)]
                per_layer = torch.stack([*per_layer, model.head_logits(final)])  # [N, B, S, V]
                logits = per_layer.gather(0, (draw - 1).view(1, 3, S, 1).expand(1, 3, S, V))[0]
            want = want + ce(logits, tgt)
    assert torch.allclose(aux["exit/mixed"], want / samples, rtol=1e-5)


# -- 8. depth_adaptive oracles -------------------------------------------------------------------


def da(**params) -> DepthAdaptive:
    return EXIT.build({"name": "depth_adaptive", **params}, dim=8, num_layers=3, out_dim=5, causal=True)


def test_likelihood_oracle_picks_the_best_layer_lowest_on_ties():
    nll = torch.tensor([[[1.0, 0.3, 2.0]], [[0.5, 0.3, 2.0]], [[0.7, 0.9, 2.0]]])  # [N=3, B=1, S=3]
    keep = torch.ones(1, 3, dtype=torch.bool)
    none = torch.zeros_like(nll, dtype=torch.bool)
    assert da(depth_penalty=0.0).oracle_depth(nll, none, keep).tolist() == [[2, 1, 1]]
    keep[0, 0] = False  # an ignored target: every layer scores 0, the lowest wins
    assert da(depth_penalty=0.0).oracle_depth(nll, none, keep).tolist() == [[1, 1, 1]]


def test_the_depth_penalty_prefers_a_lower_layer_unless_the_gain_exceeds_lambda():
    # gains over layer 1: token 0 at layer 2: 0.05 < lambda; token 1 at 2: 0.5 > lambda; token 2 at 3: 0.4 > 2 lambda
    nll = torch.tensor([[[1.0, 1.0, 1.0]], [[0.95, 0.5, 0.9]], [[0.93, 0.5, 0.6]]])
    keep = torch.ones(1, 3, dtype=torch.bool)
    none = torch.zeros_like(nll, dtype=torch.bool)
    assert da(depth_penalty=0.0).oracle_depth(nll, none, keep).tolist() == [[3, 2, 3]]
    assert da(depth_penalty=0.1).oracle_depth(nll, none, keep).tolist() == [[1, 2, 3]]


def test_correctness_oracle_counts_correct_predictions():
    correct = torch.tensor([[[0, 1, 0]], [[1, 1, 0]], [[1, 1, 1]]], dtype=torch.bool)
    keep = torch.ones(1, 3, dtype=torch.bool)
    nll = torch.rand(3, 1, 3)
    assert da(oracle="correctness", depth_penalty=0.0).oracle_depth(nll, correct, keep).tolist() == [[2, 1, 3]]
    seq = da(oracle="correctness", depth_penalty=0.1, classifier="sequence")
    assert seq.oracle_depth(nll, correct, keep).tolist() == [3]  # totals 1, 2, 3 minus 0.1 n


def test_rbf_smoothing_of_the_token_scores():
    torch.manual_seed(3)
    nll = torch.rand(3, 2, 6) * 3
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 4:] = False
    none = torch.zeros_like(nll, dtype=torch.bool)
    sigma, lam = 2.0, 0.1
    got = da(sigma=sigma, depth_penalty=lam).oracle_depth(nll, none, keep)
    score = -nll * keep
    want = torch.empty(2, 6, dtype=torch.long)
    for b in range(2):
        for t in range(6):
            sm = [
                sum(float(torch.exp(torch.tensor(-((t - u) ** 2) / sigma))) * score[n, b, u] for u in range(6))
                for n in range(3)
            ]
            want[b, t] = max(range(3), key=lambda n: (float(sm[n] - lam * (n + 1)), -n)) + 1
    assert torch.equal(got, want)
    # smoothing changes the answer: a token alone prefers layer 2, its neighbours strongly prefer layer 1
    nll = torch.tensor([[[0.0, 1.0, 0.0]], [[3.0, 0.8, 3.0]], [[3.0, 3.0, 3.0]]])
    keep = torch.ones(1, 3, dtype=torch.bool)
    none = torch.zeros_like(nll, dtype=torch.bool)
    assert da(sigma=0.0, depth_penalty=0.0).oracle_depth(nll, none, keep).tolist() == [[1, 2, 1]]
    assert da(sigma=1.0, depth_penalty=0.0).oracle_depth(nll, none, keep).tolist() == [[1, 1, 1]]


def test_sequence_oracle_sums_over_tokens():
    nll = torch.tensor([[[0.0, 2.0], [1.0, 1.0]], [[1.5, 0.0], [0.0, 0.0]], [[1.0, 1.0], [3.0, 3.0]]])  # [3, 2, 2]
    keep = torch.ones(2, 2, dtype=torch.bool)
    none = torch.zeros_like(nll, dtype=torch.bool)
    seq = da(classifier="sequence", depth_penalty=0.0)
    # sums: row 0: 2.0, 1.5, 2.0 -> layer 2; row 1: 2.0, 0.0, 6.0 -> layer 2
    assert seq.oracle_depth(nll, none, keep).tolist() == [2, 2]
    # per token (no sum) row 0 would pick layer 1 for token 0
    assert da(depth_penalty=0.0).oracle_depth(nll, none, keep)[0].tolist() == [1, 2]


def test_halting_losses_by_hand():
    torch.manual_seed(0)
    pol = da(classifier="geometric")
    hiddens = [torch.randn(2, 4, 8) for _ in range(3)]
    best = torch.tensor([[1, 2, 3, 2], [3, 3, 1, 1]])
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[1, 3] = False
    tgt = torch.zeros(2, 4, dtype=torch.long)
    chi = [torch.sigmoid(pol.halting(h).squeeze(-1)) for h in hiddens[:2]]
    q = torch.stack([chi[0], (1 - chi[0]) * chi[1], (1 - chi[0]) * (1 - chi[1])])
    want = -torch.log(q.gather(0, (best - 1).unsqueeze(0))[0])
    got = pol._halting_loss(hiddens, best, keep, None, tgt)
    assert torch.allclose(got, want[keep].mean(), rtol=1e-5)
    multi = da(classifier="multinomial")
    logq = torch.log_softmax(multi.halting(hiddens[0]), -1)  # [B, S, N]
    want = -logq.gather(-1, (best - 1).unsqueeze(-1))[..., 0]
    assert torch.allclose(multi._halting_loss(hiddens, best, keep, None, tgt), want[keep].mean(), rtol=1e-5)
    seq = da(classifier="sequence")
    pad = torch.tensor([[True] * 4, [True, True, False, False]])
    mean = torch.stack([hiddens[0][0].mean(0), hiddens[0][1, :2].mean(0)])
    want = F.cross_entropy(seq.halting(mean), torch.tensor([2, 0]))
    got = seq._halting_loss(hiddens, torch.tensor([3, 1]), torch.ones(2, dtype=torch.bool), pad, torch.tensor([0, 1]))
    assert torch.allclose(got, want, rtol=1e-5)


# -- 9. refusals ---------------------------------------------------------------------------------


def sel(task="lm", causal=True, has_memory=False):
    return types.SimpleNamespace(task=task, causal=causal, has_memory=has_memory)


def test_calm_refusals():
    assert CALM.refusals({}, sel()) == []
    (msg,) = CALM.refusals({}, sel(task="classify", causal=False))
    assert "exit=calm" in msg and "Fix:" in msg
    (msg,) = CALM.refusals({}, sel(has_memory=True))
    assert "Fix: memory=none" in msg


def test_depth_adaptive_refusals():
    for kind in ("geometric", "multinomial"):
        assert DepthAdaptive.refusals({"classifier": kind}, sel()) == []
        (msg,) = DepthAdaptive.refusals({"classifier": kind}, sel(task="classify", causal=False))
        assert f"exit.classifier={kind}" in msg and "Fix: exit.classifier=sequence" in msg
    assert DepthAdaptive.refusals({}, sel()) == []  # default geometric
    assert DepthAdaptive.refusals({"classifier": "sequence"}, sel(task="classify", causal=False)) == []
    (msg,) = DepthAdaptive.refusals({"classifier": "sequence"}, sel(task="lm", causal=True))
    assert "classifier=sequence" in msg and "Fix:" in msg
    (msg,) = DepthAdaptive.refusals({}, sel(has_memory=True))
    assert "Fix: memory=none" in msg


@pytest.mark.parametrize(("name", "param"), [("calm", "exit_at"), ("calm", "min_layer"), ("depth_adaptive", "exit_at")])
@pytest.mark.parametrize("value", [L, L + 2])
def test_exits_at_or_past_the_last_layer_are_config_errors(name, param, value):
    with pytest.raises(ConfigError, match=rf"exit\.{param}={value}.*Fix: exit\.{param}={L - 1} or less"):
        build_model(exit={"name": name, param: value}, layers=L, vocab_size=V)
    build_model(exit={"name": name, param: L - 1}, layers=L, vocab_size=V)  # the last valid value


# -- 10. separate output heads -------------------------------------------------------------------


def test_separate_heads_give_each_token_its_exit_layers_classifier():
    model = make("depth_adaptive", {"classifier": "geometric", "threshold": 0.5, "output_heads": "separate"})
    assert len(model.exit.heads) == L - 1
    x = tokens()
    with torch.no_grad():
        out, _, outs = hooked(model, x)
        depth = out.depth
        assert (depth == 1).any() and (depth == L).any()
        for b in range(3):
            for s in range(S):
                d = int(depth[b, s])
                h = outs[d - 1][b : b + 1, s : s + 1]
                proj = model.exit.heads[d - 1] if d < L else None
                assert torch.allclose(out.logits[b, s], model.head_logits(h, None, proj)[0, 0], atol=1e-6)
                if d < L:  # not the shared head
                    assert not torch.allclose(out.logits[b, s], model.head_logits(h)[0, 0], atol=1e-3)
        assert torch.allclose(decode_logits(model, x, prompt=3), out.logits, atol=1e-5)
