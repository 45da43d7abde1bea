"""model.num_mem_kv: persistent memory (Sukhbaatar et al., 2019, arXiv:1907.01470), learned keys/values
without position in front of every query's keys.

The mechanism is checked against a hand-written softmax over [persistent; keys] (independent of
``AttnMask.dense``), for every mask form and with a score bias and a score modifier; the model against
its own limits: zero is the model without the option, no causal leak, rotation shift invariance,
gradients, decode = full forward, and Transformer-XL memory holding the input's states only."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import ToyModifier, assert_decode_equals_full, assert_no_causal_leak, assert_same_model, build_model

from xfam.attention import ATTENTION
from xfam.core.context import LayerContext
from xfam.core.errors import ConfigError
from xfam.core.mask import AttnMask
from xfam.pos.alibi import AlibiBias
from xfam.training.precheck import precheck

V, B, H, DH, P = 13, 2, 4, 8, 3


def big_persistent(model, std: float = 1.0, seed: int = 7) -> None:
    """Persistent vectors large enough to matter (their init, std 0.02, barely moves a tiny model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            for p in (block.attn.persistent_k, block.attn.persistent_v):
                p.copy_(torch.randn(p.shape, generator=g) * std)


# -- the mechanism against a hand-written reference -------------------------------------------------


def hand_reference(q, k, v, pk, pv, allowed, bias=None, modifier=None, mask=None):
    """softmax([q pk^T | q k^T / sqrt(d) + bias, masked]) [pv | v]; pk/pv ``[B, Hkv, P, Dh]``, allowed
    ``[B, Sq, Sk]``; the modifier (if any) acts on the positioned keys with ``mask`` (no persistent keys)."""
    rep = q.shape[1] // k.shape[1]
    k, v, pk, pv = (t.repeat_interleave(rep, 1) for t in (k, v, pk, pv))
    sp = q @ pk.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Sq, P]: no position, no bias
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Sq, Sk]
    if modifier is not None:
        s = modifier.logits(s, q, k, mask)
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(torch.cat((sp, s), -1), -1)
    out = probs @ torch.cat((pv, v), 2)
    return out if modifier is None else out + modifier.output(probs[..., P:], mask)


def allowed_pairs(sq, sk, causal=False, window=None, pad=None, seg=None):
    """``[B, Sq, Sk]`` by hand: query i sits at key index sk - sq + i."""
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    ok = torch.ones(B, sq, sk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (i - j).abs() < window
    if pad is not None:
        ok &= pad[:, None, :]
    if seg is not None:
        ok &= seg[:, sk - sq :, None] == seg[:, None, :]
    return ok


SK = 10
PAD = torch.tensor([[True] * 10, [True] * 7 + [False] * 3])  # right padding: every query sees a key
SEG = torch.tensor([[0] * 4 + [1] * 6, [2] * 8 + [3] * 2])
FORMS = {  # name -> (Sq, AttnMask kwargs)
    "causal": (10, dict(causal=True)),
    "causal_with_keys_in_front": (4, dict(causal=True)),
    "causal_window": (10, dict(causal=True, window=3)),
    "causal_segments": (10, dict(causal=True, segments=SEG)),
    "bidirectional": (10, dict()),
    "bidirectional_padding": (10, dict(key_padding=PAD)),
    "bidirectional_window": (10, dict(window=2)),
    "bidirectional_segments": (10, dict(segments=SEG)),
}


def hand_allowed(sq: int, kw: dict) -> torch.Tensor:
    return allowed_pairs(sq, SK, kw.get("causal", False), kw.get("window"), kw.get("key_padding"), kw.get("segments"))


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_vanilla_equals_softmax_over_persistent_and_keys(backend, form, kv_heads):
    sq, kw = FORMS[form]
    mech = ATTENTION.build({"name": "vanilla", "backend": backend}, heads=H, kv_heads=kv_heads).eval()
    torch.manual_seed(0)
    q = torch.randn(B, H, sq, DH)
    k, v = torch.randn(B, kv_heads, SK, DH), torch.randn(B, kv_heads, SK, DH)
    pk, pv = torch.randn(B, kv_heads, P, DH), torch.randn(B, kv_heads, P, DH)
    mask = AttnMask(sq, P + SK, persistent=P, **kw)
    out = mech(q, torch.cat((pk, k), 2), torch.cat((pv, v), 2), mask)
    assert torch.allclose(out, hand_reference(q, k, v, pk, pv, hand_allowed(sq, kw)), atol=1e-5)
    # with ALiBi: the bias applies to the positioned keys only (zero on the persistent columns)
    alibi = AlibiBias(H, H)
    bias = -alibi.slopes[:, None, None] * (torch.arange(sq)[:, None] + SK - sq - torch.arange(SK)).abs()  # [H, Sq, Sk]
    mask = AttnMask(sq, P + SK, persistent=P, **kw)
    out = mech(q, torch.cat((pk, k), 2), torch.cat((pv, v), 2), mask, alibi)
    assert torch.allclose(out, hand_reference(q, k, v, pk, pv, hand_allowed(sq, kw), bias), atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_a_score_modifier_acts_on_the_positioned_keys_only(form):
    sq, kw = FORMS[form]
    mech = ATTENTION.build({"name": "vanilla", "backend": "torch"}, heads=H, kv_heads=H).eval()
    torch.manual_seed(1)
    q, k, v = torch.randn(B, H, sq, DH), torch.randn(B, H, SK, DH), torch.randn(B, H, SK, DH)
    pk, pv = torch.randn(B, H, P, DH), torch.randn(B, H, P, DH)
    mod = ToyModifier(DH, alpha=0.3, beta=0.2)
    out = mech(q, torch.cat((pk, k), 2), torch.cat((pv, v), 2), AttnMask(sq, P + SK, persistent=P, **kw), None, mod)
    plain = AttnMask(sq, SK, **kw)  # the same positions without persistent keys
    want = hand_reference(q, k, v, pk, pv, hand_allowed(sq, kw), modifier=mod, mask=plain)
    assert torch.allclose(out, want, atol=1e-5)


def test_persistent_keys_are_seen_by_a_query_that_sees_nothing_else():
    """A left-padded query under a causal mask has no visible key but its own (AttnMask's fallback); the
    persistent keys are visible to it all the same."""
    mask = AttnMask(4, P + 4, causal=True, key_padding=torch.tensor([[False, False, True, True]]), persistent=P)
    dense = mask.dense()[0, 0]  # [Sq, P + Sk]
    assert dense[:, :P].all()
    assert dense[:, P:].tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


# -- the model --------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ["none", "rope", "alibi", "xl"])
def test_zero_is_the_model_without_persistent_memory(pos):
    assert_same_model(build_model(pos=pos), build_model(pos=pos, num_mem_kv=0), torch.randint(0, V, (2, 9)))


def test_parameters_per_layer_shared_by_a_recurrent_block():
    model = build_model(num_mem_kv=P, kv_heads=2, layers=3)
    names = [n for n, _ in model.named_parameters() if "persistent" in n]
    assert len(names) == 2 * 3 and model.blocks[0].attn.persistent_k.shape == (2, P, 32 // H)
    act = build_model(num_mem_kv=P, layers=3, exit={"name": "act"})
    assert len(act.blocks) == 1 and len([n for n, _ in act.named_parameters() if "persistent" in n]) == 2


@pytest.mark.parametrize("pos", ["rope", "alibi", "xl", "t5"])
def test_no_causal_leak(pos):
    model = build_model(pos=pos, num_mem_kv=P)
    big_persistent(model)
    assert_no_causal_leak(model, V)


def test_persistent_memory_changes_the_output():
    x = torch.randint(0, V, (2, 8))
    model = build_model(pos="rope", num_mem_kv=P)
    before = model(x).logits
    big_persistent(model)
    assert not torch.allclose(before, model(x).logits, atol=1e-3)


@pytest.mark.parametrize("pos", [{"name": "rope"}, {"name": "rope", "xpos": True}])
def test_under_rope_the_persistent_scores_take_no_position(pos):
    """Position-free under a rotary encoding: the layer equals a hand-written softmax over
    [q . pk | (R q) . (R k)] (unrotated query against a persistent key), so it is invariant to shifting
    every position by c; a query rotated against an unrotated persistent key (x-transformers) is not."""
    model = build_model(pos=pos, num_mem_kv=P, kv_heads=2)
    big_persistent(model)
    attn, rope = model.blocks[0].attn, model.pos
    h = torch.randn(2, 7, 32)

    def layer(shift: int) -> torch.Tensor:
        tables = rope.rotary_tables(torch.arange(7) + shift, h.dtype)
        return attn(h, LayerContext(AttnMask(7, P + 7, causal=True, persistent=P), rope, None, tables))[0]

    q, k, v = attn.qkv(h).split((32, 16, 16), dim=-1)
    q, k, v = (t.view(2, 7, -1, 8).transpose(1, 2) for t in (q, k, v))  # [B, heads, S, Dh]
    tables = rope.rotary_tables(torch.arange(7) + 5, h.dtype)
    qr, kr = rope.rotate(q, tables), rope.rotate(k, tables, key=True)
    pk, pv = (t.expand(2, -1, -1, -1) for t in (attn.persistent_k, attn.persistent_v))  # [B, Hkv, P, Dh]
    kr, v, pk, pv = (t.repeat_interleave(2, 1) for t in (kr, v, pk, pv))  # GQA: 2 query heads per key head
    scores = (qr @ kr.transpose(-1, -2)).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(torch.cat((q @ pk.transpose(-1, -2), scores), -1) / math.sqrt(8), -1)
    want = attn.out((probs @ torch.cat((pv, v), 2)).transpose(1, 2).reshape(2, 7, 32))
    assert torch.allclose(layer(5), want, atol=1e-5)
    assert torch.allclose(layer(0), layer(37), atol=1e-5)
    rotated = torch.softmax(torch.cat((qr @ pk.transpose(-1, -2), scores), -1) / math.sqrt(8), -1)
    assert not torch.allclose(probs, rotated, atol=1e-3)  # the distinction is visible at this size


def test_gradients_reach_the_persistent_vectors_of_every_layer():
    model = build_model(pos="alibi", num_mem_kv=P, layers=3).train()
    x = torch.randint(0, V, (2, 8))
    model(x).logits.logsumexp(-1).sum().backward()
    for block in model.blocks:
        for p in (block.attn.persistent_k, block.attn.persistent_v):
            assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("pos", ["rope", "alibi", "xl", "t5", "learned"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_decode_with_the_cache_equals_the_full_forward(pos, kv_heads):
    model = build_model(pos=pos, num_mem_kv=P, kv_heads=kv_heads)
    big_persistent(model)
    x = torch.randint(0, V, (2, 11))
    pad = torch.ones(2, 11, dtype=torch.bool)
    pad[1, :3] = False  # a left-padded row
    for key_padding in (None, pad):
        assert_decode_equals_full(model, x, key_padding)
        state = model(x[:, :4], cache=model.empty_cache()).cache.layers[0]
        assert state["k"].shape[:3] == (2, kv_heads, 4)  # the cache holds the tokens' keys only


@pytest.mark.parametrize("pos", ["xl", "rope", "alibi"])
def test_with_xl_memory_segments_equal_one_full_run(pos):
    """Persistent keys lead [memory | segment] in every segment, as they lead the keys of one full run."""
    model = build_model(pos=pos, layers=2, num_mem_kv=P, memory={"name": "xl", "mem_len": 12})
    big_persistent(model)
    x = torch.randint(0, V, (2, 12))
    full = model(x).logits
    state = model.init_memory(2, x.device)
    for i in range(0, 12, 4):
        out = model(x[:, i : i + 4], memory=state)
        state = out.memory
        assert torch.allclose(out.logits, full[:, i : i + 4], atol=1e-5), i
    assert model(x[:, -4:]).logits.shape == (2, 4, V)


def test_xl_memory_holds_the_layer_inputs_only():
    model = build_model(pos="xl", layers=2, num_mem_kv=P, memory={"name": "xl", "mem_len": 5})
    big_persistent(model)
    x = torch.randint(0, V, (2, 8))
    seen = []
    hook = model.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    out = model(x, memory=model.init_memory(2, x.device))
    hook.remove()
    h0, h1 = out.memory[0]["h"], out.memory[1]["h"]
    assert h0.shape == h1.shape == (2, 5, 32)
    assert torch.equal(h0, model.embed(x)[:, -5:])  # layer 1's input: the embeddings (pos=xl adds none)
    assert torch.equal(h1, seen[0][:, -5:])  # layer 2's input: block 1's output


# -- refusals ---------------------------------------------------------------------------------------


def test_a_mechanism_without_persistent_keys_is_refused_before_anything_is_built():
    with pytest.raises(ConfigError) as err:
        precheck(["attention=local", "model.num_mem_kv=4"])
    assert len(err.value.problems) == 1, str(err.value)
    msg = str(err.value)
    assert "model.num_mem_kv=4 (persistent memory" in msg and "attention=local does not" in msg
    assert "Supported: attention in [vanilla]" in msg and "Fix: model.num_mem_kv=0" in msg
    precheck(["attention=vanilla", "pos=rope", "model.num_mem_kv=4"])
    precheck(["memory=xl", "pos=xl", "model.num_mem_kv=4", "model.num_memory_tokens=2"])
