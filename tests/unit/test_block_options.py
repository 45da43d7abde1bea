"""The block options (docs/blocks.md, ``xfam.model.block_compat.OPTIONS``): a contract every option keeps (gradients,
causality, cached decoding, bidirectional use), the attention options' equations, the sublayer layouts, token
shift, layer sharing, the forgetful mask, embeddings and dropouts, and that the default model is what it was.
The residual, norm and FFN options: tests/unit/test_block_residual.py.

One file over 400 lines: the contract runs over one table of every option, read as a whole.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from doubles import decode_logits

from tests.unit.test_block_residual import record
from xfam.attention._base import ATTENTION
from xfam.attention.vanilla import reference_attention
from xfam.core.mask import AttnMask
from xfam.exit._base import EXIT
from xfam.memory._base import MEMORY
from xfam.model import block_compat
from xfam.model.attn_options import Carry, ScoreOptions
from xfam.model.block import SelfAttention
from xfam.model.compat import Selection
from xfam.model.layers import FeedForward
from xfam.model.layout import block_layouts, sublayer_order
from xfam.model.residual import Link
from xfam.model.shift import shift_tokens
from xfam.model.spec import ModelSpec
from xfam.model.stack import forgetful_keys
from xfam.model.transformer import XfamModel
from xfam.pos._base import POS

V = 50  # vocabulary of the tiny models


def tiny(task: str = "lm", pos: str = "rope", seed: int = 0, **opts) -> XfamModel:
    """A seeded dim-32, 2-layer, 4-head model with the block options ``opts``, in eval mode."""
    torch.manual_seed(seed)
    spec = ModelSpec(**{"dim": 32, "layers": 2, "heads": 4, "max_len": 64, **opts})
    model = XfamModel(
        spec,
        task=task,
        vocab_size=V,
        num_classes=3 if task == "classify" else None,
        attention={"name": "vanilla"},
        pos={"name": pos},
        memory={"name": "none"},
        exit={"name": "none"},
    )
    return model.eval()


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, n, -1).transpose(1, 2)  # [B, S, n*Dh] -> [B, n, S, Dh]


def raw_qkv(attn: SelfAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's projections of its input ``x [B, S, D]``, per head, before any block option."""
    q, k, v = attn.qkv(x).split((attn.q_width, attn.kv_width, attn.kv_width), dim=-1)
    return heads(q, attn.heads), heads(k, attn.kv_heads), heads(v, attn.kv_heads)


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    s = scores.shape[-1]
    return scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)


# -- the contract of every option ----------------------------------------------------------------------


OPTIONS = list(block_compat.OPTIONS)


def option_spec(name: str) -> ModelSpec:
    """The option's override on a 4-layer tiny model (the depth ``compat.block_matrix`` checks the overrides at:
    ``layer_order=aaffaaff`` has four a's), which must be a valid spec."""
    spec = ModelSpec(dim=32, layers=4, heads=4, max_len=64, **block_compat.OPTIONS[name].override)
    assert spec.problems() == []
    return spec


def option_model(name: str, task: str = "lm") -> XfamModel:
    return tiny(task, layers=4, **block_compat.OPTIONS[name].override)


@pytest.mark.parametrize("name", OPTIONS)
def test_training_step_gives_finite_gradients(name: str) -> None:
    """Every parameter gets a finite gradient; every one but the branch weights behind ReZero's zero gain a
    non-zero one (those are multiplied by alpha = 0 at init, as the paper intends)."""
    option_spec(name)
    model = option_model(name).train()
    model(torch.randint(0, V, (2, 10))).logits.pow(2).mean().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        behind_zero_gain = name == "residual=rezero" and n.startswith("blocks.") and ".link" not in n
        assert behind_zero_gain or p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("name", OPTIONS)
def test_no_causal_leak(name: str) -> None:
    """Changing token 6 changes no earlier output (evaluation, and training with the same random draws: layer
    drop and the forgetful mask draw per call), and does change the later ones."""
    model = option_model(name)
    x = torch.randint(0, V, (2, 10))
    y = x.clone()
    y[:, 6] = (y[:, 6] + 1) % V
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
        assert torch.equal(a[:, :6], b[:, :6])
        assert not torch.allclose(a[:, 6:], b[:, 6:], atol=1e-6)
        model.train()
        torch.manual_seed(3)
        a = model(x).logits
        torch.manual_seed(3)
        b = model(y).logits
        assert torch.equal(a[:, :6], b[:, :6])


@pytest.mark.parametrize("name", OPTIONS)
def test_cached_decoding_equals_full_pass(name: str) -> None:
    """A prompt and the rest in two calls, and token by token, give the full pass's logits."""
    model = option_model(name)
    x = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        full = model(x).logits
        first = model(x[:, :6], cache=model.empty_cache())
        second = model(x[:, 6:], cache=first.cache)
        assert torch.allclose(torch.cat((first.logits, second.logits), dim=1), full, atol=1e-5)
        assert torch.allclose(decode_logits(model, x, prompt=3, step=1), full, atol=1e-5)


def selection(causal: bool) -> Selection:
    """The slots of ``tiny`` (vanilla attention, rope, no memory, no exit) for ``block_compat.reasons``."""
    return Selection(
        attention=[(ATTENTION.get("vanilla"), {"name": "vanilla"}, False)],
        pos=(POS.get("rope"), {"name": "rope"}),
        memory=[(MEMORY.get("none"), {"name": "none"})],
        exit=(EXIT.get("none"), {"name": "none"}),
        causal=causal,
        task="lm" if causal else "classify",
    )


@pytest.mark.parametrize("name", OPTIONS)
def test_bidirectional_classifier(name: str) -> None:
    """Every option but the forgetful *causal* mask runs in a bidirectional classifier (with padding); that one is
    refused, with its reason, for a bidirectional model (and allowed for a causal one)."""
    spec = option_spec(name)
    refused = block_compat.reasons(spec, selection(causal=False))
    assert block_compat.reasons(spec, selection(causal=True)) == []
    if name == "forgetful_mask":
        assert len(refused) == 1 and "bidirectional" in refused[0] and "Fix" in refused[0]
        return
    assert refused == []
    model = option_model(name, task="classify")
    x, pad = torch.randint(0, V, (2, 10)), torch.ones(2, 10, dtype=torch.bool)
    pad[0, 7:] = False
    with torch.no_grad():
        logits = model(x, key_padding=pad).logits
        assert logits.shape == (2, 3) and torch.isfinite(logits).all()
        y = x.clone()
        y[0, 8] = (y[0, 8] + 1) % V  # a padded token: nothing changes
        assert torch.allclose(model(y, key_padding=pad).logits, logits, atol=1e-6)


# -- attention options ---------------------------------------------------------------------------------


def test_qk_norm_l2_scores_are_temperature_times_cosine() -> None:
    """Henry et al. (2020, arXiv:2010.04245): the scores are g cos(q, k), so |score| <= g; g is learned and starts
    at log2(L^2 - L) with L = max_len."""
    model = tiny(pos="none", attn_qk_norm="l2")
    attn = model.blocks[0].attn
    g = attn.qk_norm.scale
    assert isinstance(g, torch.nn.Parameter) and g.item() == pytest.approx(math.log2(64**2 - 64))
    with torch.no_grad(), record(attn, attn.mechanism) as calls:
        model(torch.randint(0, V, (2, 10)))
    (_, (q, k, *_), _), (_, (x, *_), _) = calls  # the mechanism's q and k (it returns first), the attention's input
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # what the mechanism computes
    q0, k0, _ = raw_qkv(attn, x)
    cos = F.normalize(q0, dim=-1) @ F.normalize(k0, dim=-1).transpose(-1, -2)
    assert torch.allclose(scores, g * cos, atol=1e-5)
    assert scores.abs().max() <= g + 1e-5


def test_qk_norm_fixed_scale_is_a_buffer() -> None:
    attn = tiny(attn_qk_norm="l2", attn_qk_scale=10.0).blocks[0].attn
    assert "scale" not in dict(attn.qk_norm.named_parameters())
    assert dict(attn.qk_norm.named_buffers())["scale"].item() == 10.0


def test_qk_norm_rms_gives_unit_rms_per_head_times_gain() -> None:
    model = tiny(pos="none", attn_qk_norm="rms")
    attn = model.blocks[0].attn
    with torch.no_grad():
        for norm in (attn.qk_norm.q_norm, attn.qk_norm.k_norm):
            norm.weight.uniform_(0.5, 2.0)  # [Dh]
    with torch.no_grad(), record(attn, attn.mechanism) as calls:
        model(torch.randint(0, V, (2, 10)))
    (_, (q, k, *_), _), (_, (x, *_), _) = calls
    q0, k0, _ = raw_qkv(attn, x)
    for got, raw, gain in ((q, q0, attn.qk_norm.q_norm.weight), (k, k0, attn.qk_norm.k_norm.weight)):
        unit = got / gain
        assert torch.allclose(unit.pow(2).mean(-1), torch.ones(()), atol=1e-3)  # (eps 1e-6)
        assert torch.allclose(unit, raw / raw.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), atol=1e-5)


def test_talking_heads_identity_at_init() -> None:
    """With P_l = P_w = I the model is the plain model with the same other weights."""
    th, plain = tiny(attn_talking_heads=True), tiny()
    missing, unexpected = plain.load_state_dict(th.state_dict(), strict=False)
    assert missing == [] and sorted(unexpected) == sorted(
        f"blocks.{i}.attn.score_options.{m}" for i in range(2) for m in ("pre_mix", "post_mix")
    )
    x = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        assert torch.allclose(th(x).logits, plain(x).logits, atol=1e-5)


def test_talking_heads_mix_logits_then_mask_then_weights() -> None:
    """Shazeer et al. (2020, arXiv:2003.02436): L = J P_l across heads before the softmax (the causal mask applied
    after the mixing), W = softmax(L), U = W P_w after it, O = U V."""
    so = ScoreOptions(ModelSpec(dim=32, heads=4, attn_talking_heads=True))
    with torch.no_grad():
        so.pre_mix.copy_(torch.randn(4, 4))
        so.post_mix.copy_(torch.randn(4, 4))
    q, k, v = torch.randn(3, 2, 4, 7, 8).unbind(0)  # [B, H, S, Dh]
    got = reference_attention(q, k, v, AttnMask(7, 7, causal=True), modifier=so)
    j = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(8)
    logits = torch.einsum("bhqk,hg->bgqk", j, so.pre_mix)
    w = causal_softmax(logits)
    u = torch.einsum("bhqk,hg->bgqk", w, so.post_mix)
    assert torch.allclose(got, u @ v, atol=1e-5)


def test_realformer_scores_accumulate_through_the_carry() -> None:
    """He et al. (2020, arXiv:2012.11747): layer n's pre-softmax scores are its own plus the previous layer's
    (accumulated) scores, which it passes on; the first layer has none to add."""
    spec = ModelSpec(dim=32, heads=4, residual_attn=True)
    first, second = ScoreOptions(spec), ScoreOptions(spec)
    a, b = torch.randn(2, 2, 4, 5, 5).unbind(0)
    carry = Carry()
    first.carry = second.carry = carry
    mask = AttnMask(5, 5, causal=True)
    assert torch.equal(first.all_logits(a, None, None, mask), a) and torch.equal(carry.scores, a)
    assert torch.equal(second.all_logits(b, None, None, mask), a + b) and torch.equal(carry.scores, a + b)


def test_realformer_in_the_model() -> None:
    """Layer n attends with softmax(its raw scores + the sum of all earlier layers'); every call starts afresh."""
    model = tiny(pos="none", layers=3, residual_attn=True)
    x = torch.randint(0, V, (2, 10))
    mechanisms = [b.attn.mechanism for b in model.blocks]
    with torch.no_grad(), record(*mechanisms) as calls:
        first = model(x).logits
        assert torch.equal(model(x).logits, first)  # (the carry is per call: a second call adds nothing old)
    raw = [q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) for _, (q, k, *_), _ in calls[:3]]
    for n, (_, (_, _, v, *_), o) in enumerate(calls[:3]):
        assert torch.allclose(o, causal_softmax(sum(raw[: n + 1])) @ v, atol=1e-6), n
    assert not torch.allclose(calls[2][2], causal_softmax(raw[2] + raw[1]) @ calls[2][1][2], atol=1e-4)


def test_resformer_value_residual() -> None:
    """Zhou et al. (2024, arXiv:2410.17897): layer n > 1 attends over (V_n + V_1) / 2, layer 1 over V_1."""
    model = tiny(pos="none", value_residual=True)
    attns = [b.attn for b in model.blocks]
    with torch.no_grad(), record(*attns, *(a.mechanism for a in attns)) as calls:
        model(torch.randint(0, V, (2, 10)))
    inputs = {mod: args[0] for mod, args, _ in calls if isinstance(mod, SelfAttention)}
    values = [args[2] for mod, args, _ in calls if not isinstance(mod, SelfAttention)]
    v1 = raw_qkv(attns[0], inputs[attns[0]])[2]
    v2 = raw_qkv(attns[1], inputs[attns[1]])[2]
    assert torch.allclose(values[0], v1, atol=1e-7)
    assert torch.allclose(values[1], (v2 + v1) / 2, atol=1e-7)


def test_attention_gate_starts_at_sigmoid_one() -> None:
    """AlphaFold2's gate sigmoid(W_g x + b_g) with W_g = 0, b_g = 1 at init: each head output times sigmoid(1)."""
    gated, plain = tiny(attn_gate=True), tiny()
    gate = gated.blocks[0].attn.gate
    assert torch.equal(gate.weight, torch.zeros_like(gate.weight)) and torch.equal(
        gate.bias, torch.ones_like(gate.bias)
    )
    plain.load_state_dict(gated.state_dict(), strict=False)
    x = torch.randint(0, V, (2, 10))
    with torch.no_grad(), record(gated.blocks[0].attn.out, plain.blocks[0].attn.out) as calls:
        gated(x), plain(x)
    (_, (o_gated,), _), (_, (o_plain,), _) = calls
    assert torch.allclose(o_gated, o_plain * torch.sigmoid(torch.tensor(1.0)), atol=1e-7)


def topk_probs(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Zhao et al. (2019, arXiv:1912.11637, eq. 2-4): softmax over each causal row's k largest scores."""
    s = scores.shape[-1]
    masked = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    kth = masked.topk(k, dim=-1).values[..., -1:]
    return masked.masked_fill(masked < kth, float("-inf")).softmax(-1)


def probs_of(q: torch.Tensor, k: torch.Tensor, modifier: ScoreOptions | None) -> torch.Tensor:
    """The attention weights ``[B, H, Sq, Sk]`` of the reference path: attention over the identity values."""
    s = k.shape[2]
    eye = torch.eye(s).expand(q.shape[0], q.shape[1], s, s)  # [B, H, Sk, Sk]: the output is the weights
    return reference_attention(q, k, eye, AttnMask(q.shape[2], s, causal=True), modifier=modifier)


def test_topk_keeps_k_weights_per_query() -> None:
    so = ScoreOptions(ModelSpec(dim=32, heads=4, attn_topk=3))
    q, k = torch.randn(2, 2, 4, 9, 8).unbind(0)
    probs = probs_of(q, k, so)
    assert ((probs > 0).sum(-1) <= 3).all() and ((probs > 0).sum(-1)[..., 2:] == 3).all()
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    assert torch.allclose(probs, topk_probs(scores, 3), atol=1e-6)


def test_topk_straight_through() -> None:
    """The forward is the hard top-k; the gradient is the dense softmax's (arXiv:2505.22074)."""
    st = ScoreOptions(ModelSpec(dim=32, heads=4, attn_topk=3, attn_topk_straight_through=True))
    q, k = torch.randn(2, 2, 4, 9, 8).unbind(0)
    w = torch.randn(2, 4, 9, 9)
    grads = []
    for modifier in (st, None):
        qq = q.clone().requires_grad_()
        probs = probs_of(qq, k, modifier)
        (probs * w).sum().backward()
        grads.append(qq.grad)
        if modifier is st:
            assert torch.allclose(probs, topk_probs(q @ k.transpose(-1, -2) / math.sqrt(8), 3), atol=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert grads[1].abs().sum() > 0


def test_attention_on_attention() -> None:
    """Huang et al. (2019, arXiv:1908.06954): info * sigmoid(gate), both linear in [attended | layer input]."""
    model = tiny(attn_on_attn=True)
    attn = model.blocks[0].attn
    with torch.no_grad(), record(attn, attn.out) as calls:
        model(torch.randint(0, V, (2, 10)))
    (_, _, a), (_, (x, *_), (out, _)) = calls  # the output projection's a, then the attention's x and output
    w, b = attn.aoa.proj.weight, attn.aoa.proj.bias  # [2D, 2D]
    info, gate = (torch.cat((a, x), dim=-1) @ w.T + b).chunk(2, dim=-1)
    assert torch.allclose(out, info * torch.sigmoid(gate), atol=1e-6)


# -- sublayer layouts ----------------------------------------------------------------------------------


def ffn_counts(model: XfamModel) -> list[int]:
    return [len(b.before) + (b.ffn is not None) + len(b.after) for b in model.blocks]


def run_order(model: XfamModel) -> str:
    """The sublayers as they run: ``a`` per attention, ``f`` per FFN."""
    subs = [m for m in model.modules() if isinstance(m, SelfAttention | FeedForward)]
    with torch.no_grad(), record(*subs) as calls:
        model(torch.randint(0, V, (1, 5)))
    return "".join("a" if isinstance(m, SelfAttention) else "f" for m, _, _ in calls)


@pytest.mark.parametrize(
    "opts, order",
    [
        ({}, "afafafaf"),
        ({"macaron": True}, "faf" * 4),
        ({"sandwich_coef": 1}, "a" + "af" * 3 + "f"),
        ({"sandwich_coef": 2}, "aa" + "af" * 2 + "ff"),
        ({"sandwich_coef": 3}, "aaa" + "af" + "fff"),
        ({"layer_order": "ffaafafaff"}, "ffaafafaff"),
    ],
)
def test_sublayer_order_runs_as_specified(opts: dict, order: str) -> None:
    """Press et al. (2020, arXiv:1911.03864): sandwich k is a^k (af)^(L-k) f^k; macaron is FFN-attention-FFN."""
    model = tiny(layers=4, **opts)
    assert sublayer_order(model.spec) == order
    assert run_order(model) == order
    assert sum(ffn_counts(model)) == order.count("f") and len(model.blocks) == 4


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sandwich_ffn_counts(k: int) -> None:
    spec = ModelSpec(dim=32, layers=4, heads=4, sandwich_coef=k)
    expected = [0] * k + [1] * (4 - k - 1) + [1 + k]
    assert [lay.before + lay.after for lay in block_layouts(spec)] == expected
    assert ffn_counts(tiny(layers=4, sandwich_coef=k)) == expected


def test_macaron_half_steps() -> None:
    """Lu et al. (2019, arXiv:1906.02762): x + FFN(x)/2, attention, x + FFN(x)/2, separate FFN weights."""
    for block in tiny(macaron=True).blocks:
        assert len(block.before) == 1 and len(block.after) == 0
        assert block.before[0].link.scale == 0.5 and block.link_ffn.scale == 0.5 and block.link_attn.scale == 1.0
        assert block.before[0].ffn.up.weight.data_ptr() != block.ffn.up.weight.data_ptr()
    link = Link(ModelSpec(dim=8, heads=2, macaron=True), half=True, ffn=True)
    x, ffn, norm = torch.randn(2, 3, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
    assert torch.allclose(link(x, ffn, norm), x + 0.5 * ffn(norm(x)), atol=1e-7)


@pytest.mark.parametrize(
    "opts, says",
    [
        ({"layer_order": "aff"}, "model.layer_order='aff' must be a string of 'a'"),
        ({"layer_order": "afxaf"}, "the characters ['x']"),
        ({"macaron": True, "sandwich_coef": 1}, "model.macaron and model.sandwich_coef each set the sublayer order"),
        ({"sandwich_coef": 3}, "model.sandwich_coef=3 is more than model.layers=2"),
        ({"share_layers": True, "sandwich_coef": 1}, "model.share_layers=true shares one block's weights"),
    ],
)
def test_invalid_layouts_refused(opts: dict, says: str) -> None:
    problems = ModelSpec(dim=32, layers=2, heads=4, **opts).problems()
    assert len(problems) == 1 and says in problems[0] and "Fix:" in problems[0]


# -- token shift ---------------------------------------------------------------------------------------


def test_shift_tokens_causal_half_channels_from_previous_row() -> None:
    h = torch.randn(2, 6, 8)
    out = shift_tokens(h, (0, 1), None, None)
    assert torch.equal(out[..., :4], h[..., :4])
    assert torch.equal(out[:, 1:, 4:], h[:, :-1, 4:])
    assert torch.equal(out[:, 0, 4:], torch.zeros(2, 4))


def test_shift_tokens_never_across_documents_or_from_padding() -> None:
    h = torch.randn(1, 6, 8)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out = shift_tokens(h, (0, 1), None, seg)
    assert torch.equal(out[0, 3, 4:], torch.zeros(4))  # a document's first row: nothing from the last document
    assert torch.equal(out[0, 4, 4:], h[0, 3, 4:]) and torch.equal(out[0, 1, 4:], h[0, 0, 4:])
    pad = torch.tensor([[False, False, True, True, True, True]])  # left padding
    out = shift_tokens(h, (0, 1), pad, None)
    assert torch.equal(out[0, 2, 4:], torch.zeros(4))  # the first real row takes nothing from padding
    assert torch.equal(out[0, 3, 4:], h[0, 2, 4:])


def test_shift_tokens_bidirectional() -> None:
    """Amounts -1, 0, 1 in three groups of 10 channels of 32; the 2 left over stay in place."""
    h = torch.randn(2, 5, 32)
    out = shift_tokens(h, (-1, 0, 1), None, None)
    assert torch.equal(out[:, :-1, :10], h[:, 1:, :10]) and torch.equal(out[:, -1, :10], torch.zeros(2, 10))
    assert torch.equal(out[..., 10:20], h[..., 10:20])
    assert torch.equal(out[:, 1:, 20:30], h[:, :-1, 20:30]) and torch.equal(out[:, 0, 20:30], torch.zeros(2, 10))
    assert torch.equal(out[..., 30:], h[..., 30:])


def test_shift_tokens_with_previous_rows_equals_full() -> None:
    h = torch.randn(2, 9, 8)
    full = shift_tokens(h, (0, 1, 2), None, None)
    assert torch.equal(shift_tokens(h[:, 5:], (0, 1, 2), None, None, prev=h[:, 3:5]), full[:, 5:])


def test_shift_tokens_in_the_block() -> None:
    """The sublayer sees the shifted normed input; the stream it joins is not shifted; documents stay apart."""
    model = tiny(shift_tokens=1)
    block = model.blocks[0]
    x = torch.randint(0, V, (2, 10))
    seg = torch.tensor([[0] * 5 + [1] * 5] * 2)
    with torch.no_grad(), record(block.link_attn, block.attn) as calls:
        out = model(x, segments=seg).logits
    (_, (h, *_), (a, _)), (_, (stream, *_), joined) = calls  # the attention runs inside its link's call
    assert torch.equal(h, shift_tokens(block.norm1(stream), (0, 1), None, seg))
    assert torch.allclose(joined, stream + a, atol=1e-7)
    y = x.clone()
    y[:, 4] = (y[:, 4] + 1) % V  # the last token of document 0
    with torch.no_grad():
        assert torch.equal(model(y, segments=seg).logits[:, 5:], out[:, 5:])


# -- layer sharing -------------------------------------------------------------------------------------


def block_params(model: XfamModel) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks."))


def test_share_layers_is_one_block_run_l_times() -> None:
    """ALBERT (Lan et al., 2019, arXiv:1909.11942): one block's weights (norms included) at every layer."""
    shared = tiny(layers=3, share_layers=True)
    assert len(shared.blocks) == 1 and block_params(shared) == block_params(tiny(layers=1))
    unrolled = tiny(layers=3)
    state = {k: v for k, v in shared.state_dict().items() if not k.startswith("blocks.")}
    for i in range(3):
        state |= {
            k.replace("blocks.0.", f"blocks.{i}.", 1): v for k, v in shared.state_dict().items() if "blocks." in k
        }
    unrolled.load_state_dict(state)
    x = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        assert torch.allclose(shared(x).logits, unrolled(x).logits, atol=1e-6)


# -- forgetful causal mask -----------------------------------------------------------------------------


def test_forgetful_keys_hide_half_the_ratio_on_average() -> None:
    """Liu et al. (2022, arXiv:2210.13432): each row hides a fraction r ~ U[0, ratio] of its keys, ratio/2 on
    average, never its first key."""
    keep = forgetful_keys(None, None, 0.3, batch=4000, rows=50, front=0, device=torch.device("cpu"))
    assert keep[:, 0].all()
    assert (~keep).float().mean().item() == pytest.approx(0.15 * 49 / 50, abs=0.01)
    per_row = (~keep).float().mean(1)
    assert per_row.std() > 0.08  # the ratio varies between rows (std 0.1; a fixed ratio 0.15 would give 0.05)


def test_forgetful_keys_never_hide_document_starts_memory_or_revive_padding() -> None:
    seg = torch.tensor([[7, 7, 7, 0, 0, 0, 0, 1, 1, 1, 1, 1]] * 500)  # 3 memory keys in front, then 9 rows
    pad = torch.ones(500, 12, dtype=torch.bool)
    pad[:, 3:5] = False  # the rows' first two are padding
    keep = forgetful_keys(pad, seg, 1.0, batch=500, rows=9, front=3, device=torch.device("cpu"))
    assert keep[:, :3].all()  # memory
    assert not keep[:, 3:5].any()  # padding stays hidden
    assert keep[:, 5].all() and keep[:, 7].all()  # the first real token, a document's first token
    assert not keep[:, 8:].all()  # the others are hidden at times


def test_forgetful_mask_only_in_training() -> None:
    forgetful, plain = tiny(forgetful_mask=1.0), tiny()
    assert all(torch.equal(a, b) for a, b in zip(forgetful.state_dict().values(), plain.state_dict().values()))
    x = torch.randint(0, V, (4, 12))
    with torch.no_grad():
        assert torch.equal(forgetful(x).logits, plain(x).logits)
        assert not torch.allclose(forgetful.train()(x).logits, plain.train()(x).logits, atol=1e-5)


# -- embeddings and dropouts ---------------------------------------------------------------------------


def block_input(model: XfamModel, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), record(model.blocks[0]) as calls:
        model(x)
    return calls[0][1][0]


def test_l2norm_embed() -> None:
    """FixNorm (Nguyen & Chiang, 2018, arXiv:1710.01329) as x-transformers: unit-norm token embeddings, init
    N(0, 1e-5)."""
    model = tiny(l2norm_embed=True, dim=256, heads=4)
    assert model.embed.weight.std().item() == pytest.approx(1e-5, rel=0.05)
    h = block_input(model, torch.randint(0, V, (2, 10)))
    assert torch.allclose(h.norm(dim=-1), torch.ones(2, 10), atol=1e-6)


def test_l2norm_embed_leaves_learned_positions_alone() -> None:
    """docs/blocks.md: xfam normalises the token embedding only; a learned position table is added as it is."""
    model = tiny(l2norm_embed=True, pos="learned")
    x = torch.randint(0, V, (2, 10))
    expected = F.normalize(model.embed(x), dim=-1) + model.pos.table(torch.arange(10))
    assert torch.allclose(block_input(model, x), expected, atol=1e-7)


def test_post_emb_norm() -> None:
    """BLOOM's embedding norm: the blocks' input is norm(embedding) (layernorm: zero mean, unit variance)."""
    model = tiny(post_emb_norm=True)
    x = torch.randint(0, V, (2, 10))
    h = block_input(model, x)
    assert isinstance(model.emb_norm, torch.nn.LayerNorm)
    assert torch.allclose(h, model.emb_norm(model.embed(x)), atol=1e-7)
    assert torch.allclose(h.mean(-1), torch.zeros(2, 10), atol=1e-5)
    assert tiny().emb_norm is None


def test_dropout_defaults() -> None:
    spec = ModelSpec(dropout=0.2)
    assert (spec.emb_drop, spec.resid_drop, spec.ffn_dropout) == (0.2, 0.2, 0.0)
    spec = ModelSpec(dropout=0.2, emb_dropout=0.0, resid_dropout=0.3, ffn_dropout=0.4)
    assert (spec.emb_drop, spec.resid_drop) == (0.0, 0.3)
    model = tiny(dropout=0.2, emb_dropout=0.0, resid_dropout=0.3, ffn_dropout=0.4)
    assert isinstance(model.drop, torch.nn.Identity)
    block = model.blocks[0]
    assert block.link_attn.drop.p == block.link_ffn.drop.p == 0.3 and block.ffn.drop.p == 0.4
    plain = tiny().blocks[0]
    assert plain.link_attn.drop is None and plain.ffn.drop is None


def zero_fraction(t: torch.Tensor) -> float:
    return (t == 0).float().mean().item()


def test_dropouts_act_where_documented() -> None:
    """emb_dropout on the blocks' input, ffn_dropout on the FFN's hidden activations, resid_dropout on each
    sublayer's output before it joins the stream (training only)."""
    x = torch.randint(0, V, (8, 32))
    model = tiny(emb_dropout=0.5).train()
    h = block_input(model, x)
    assert zero_fraction(h) == pytest.approx(0.5, abs=0.05)
    kept = h != 0
    assert torch.allclose(h[kept], 2 * model.embed(x)[kept], atol=1e-7)  # the kept ones scaled by 1/(1 - p)

    model = tiny(ffn_dropout=0.5).train()
    with torch.no_grad(), record(model.blocks[0].ffn.down) as calls:
        model(x)
    assert zero_fraction(calls[0][1][0]) == pytest.approx(0.5, abs=0.05)
    assert zero_fraction(block_input(model, x)) == 0.0

    link = Link(ModelSpec(dim=32, heads=4, resid_dropout=0.5)).train()
    stream = torch.randn(8, 32, 32)
    assert zero_fraction(link(stream, lambda h: h + 1.0, torch.nn.Identity()) - stream) == pytest.approx(0.5, abs=0.05)
    assert torch.equal(link.eval()(stream, lambda h: torch.ones_like(h), torch.nn.Identity()), stream + 1)


# -- the default model is what it was --------------------------------------------------------------------

#: Made by tests/fixtures/block_reference/make_reference.py at commit 56576d4.
REFERENCE = Path(__file__).parents[1] / "fixtures" / "block_reference" / "default_models.pt"


def reference_cases() -> dict:
    return torch.load(REFERENCE, weights_only=True)


@pytest.mark.parametrize("case", sorted(reference_cases()))
def test_default_models_unchanged(case: str) -> None:
    """The models of make_reference.py, built now with the same seed: the same parameters and the same logits as
    before the block options existed."""
    ref = reference_cases()[case]
    torch.manual_seed(0)
    model = XfamModel(
        ModelSpec(dim=32, layers=2, heads=4, max_len=64, **ref["kw"]),
        task=ref["task"],
        vocab_size=40,
        num_classes=3 if ref["task"] == "classify" else None,
        attention={"name": "vanilla", "backend": "torch"},
        pos=ref["pos"],
        memory={"name": "none"},
        exit={"name": "none"},
    ).eval()
    state = {k: (tuple(v.shape), float(v.double().sum())) for k, v in model.state_dict().items()}
    assert list(state) == list(ref["state"])  # the same names in the same order: an optimiser's saved state maps
    assert state == ref["state"]  # onto parameters by their order
    names = [n for n, _ in model.named_parameters()]
    assert names == [k for k in ref["state"] if k in dict(model.named_parameters())]
    with torch.no_grad():
        assert torch.allclose(model(ref["tokens"]).logits, ref["logits"], atol=1e-6, rtol=0)
