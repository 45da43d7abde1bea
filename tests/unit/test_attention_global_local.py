"""Global-local attention: Longformer, BigBird (ITC) and ETC.

Each rule is compared with its paper's definition written out by brute force; the block path with
the dense reference on every mask form under an ALiBi bias; the degenerate limits with dense
attention; causal variants for leaks and for decoding = full recompute; global tokens for two-hop
reachability; BigBird's random blocks for being fixed (across forwards and a save/load), different
across layers and causal; ETC's auxiliary global tokens through a model.

One file over 400 lines: the three mechanisms share their brute-force rules and fixtures.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from doubles import TableBias, build_model, decode_logits

from xfam.attention import ATTENTION
from xfam.attention._sparse import pattern_dense
from xfam.attention.bigbird import BigBirdPattern
from xfam.attention.longformer import LongformerPattern
from xfam.attention.vanilla import reference_attention
from xfam.core.mask import AttnMask
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import compat
from xfam.model.compat import Selection
from xfam.pos import POS
from xfam.pos.alibi import AlibiBias

B, H, DH = 2, 4, 8
CPU = torch.device("cpu")


def qkv(sq: int, sk: int, kv_heads: int = H, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, sq, DH, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, sk, DH, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def explicit_attention(q, k, v, allowed, bias=None, offset=0):
    """softmax over an explicit ``allowed [H|1, Sq, Sk]`` boolean matrix (the brute-force definition)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        q_pos, k_pos = torch.arange(q.shape[2]) + offset, torch.arange(k.shape[2])
        scores = scores + bias.pairs(q_pos[:, None], k_pos[None, :])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def build(name: str, causal: bool, max_len: int = 64, heads: int = H, kv_heads: int = H, layer: int = 0, **params):
    return ATTENTION.build(
        {"name": name, **params}, max_len=max_len, causal=causal, heads=heads, kv_heads=kv_heads, layer=layer
    ).eval()


def two_hops(allowed: torch.Tensor) -> torch.Tensor:
    """Pairs (i, j) joined by a path of at most two allowed edges."""
    a = allowed.double()
    return allowed | ((a @ a) > 0)


# -- Longformer --------------------------------------------------------------------------------


def longformer_definition(n: int, w: int, d: int, causal: bool, globals_: tuple[int, ...]) -> torch.Tensor:
    """Sec. 3.1 written out: w/2 keys on each side (causal: w keys back) with gaps of d, plus global tokens."""
    ok = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            dist = i - j
            in_window = dist % d == 0 and (0 <= dist <= w * d if causal else abs(dist) <= (w // 2) * d)
            ok[i, j] = in_window or i in globals_ or j in globals_
            if causal and j > i:
                ok[i, j] = False
    return ok


def test_longformer_window_examples() -> None:
    i, j = torch.tensor(10), torch.arange(30)
    assert LongformerPattern(2, (1,), (), 4).allowed(i, j).nonzero().flatten().tolist() == [8, 9, 10, 11, 12]  # w=4
    dilated = LongformerPattern(2, (2,), (), 4).allowed(i, j).nonzero().flatten().tolist()
    assert dilated == [6, 8, 10, 12, 14]  # w=4, d=2: the same 4 keys over w*d = 8 positions
    causal = LongformerPattern(4, (1,), (), 4).allowed(i, j) & (j <= i)  # causal w=4: the 4 keys before
    assert causal.nonzero().flatten().tolist() == [6, 7, 8, 9, 10]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("window", "dilation"), [(4, 1), (6, 2), (2, 3)])
def test_longformer_mechanism_is_the_paper_rule(causal, window, dilation) -> None:
    n, glob = 29, (0, 17)
    mech = build("longformer", causal, window=window, dilation=dilation, global_tokens=list(glob), block=4)
    q, k, v = qkv(n, n)
    bias = AlibiBias(H, H).double()
    out = mech(q, k, v, AttnMask(q_len=n, k_len=n, causal=causal), bias)
    want = explicit_attention(q, k, v, longformer_definition(n, window, dilation, causal, glob), bias)
    assert torch.allclose(out, want, atol=1e-10)


def test_longformer_per_head_dilation_uses_each_heads_rule() -> None:
    n, dil = 26, [1, 2, 1, 3]
    mech = build("longformer", False, window=4, dilation=dil, global_tokens=[3], block=4)
    assert mech.pattern.heads == H
    q, k, v = qkv(n, n)
    allowed = torch.stack([longformer_definition(n, 4, d, False, (3,)) for d in dil])  # [H, Sq, Sk]
    assert torch.allclose(mech(q, k, v, AttnMask(q_len=n, k_len=n)), explicit_attention(q, k, v, allowed), atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_longformer_window_covering_the_sequence_is_dense_attention(causal) -> None:
    n = 23
    window = n - 1 if causal else 2 * (n - 1)  # the w keys back, or w/2 on each side, reach every key
    mech = build("longformer", causal, max_len=n, window=window, global_tokens=[], block=4)
    q, k, v = qkv(n, n)
    mask = AttnMask(q_len=n, k_len=n, causal=causal)
    assert torch.allclose(mech(q, k, v, mask), reference_attention(q, k, v, mask), atol=1e-10)
    smaller = build("longformer", causal, max_len=n, window=window - 2, global_tokens=[], block=4)
    assert not torch.allclose(smaller(q, k, v, mask), reference_attention(q, k, v, mask), atol=1e-4)


def test_longformer_config_errors_name_the_valid_range() -> None:
    (msg,) = ATTENTION.check({"name": "longformer", "window": 300}, {"max_len": 256, "causal": True, "heads": 4})
    assert "valid: 1..256" in msg and "Fix:" in msg
    (msg,) = ATTENTION.check({"name": "longformer", "window": 514}, {"max_len": 256, "causal": False, "heads": 4})
    assert "valid: 1..512" in msg
    assert ATTENTION.check({"name": "longformer", "window": 512}, {"max_len": 256, "causal": False, "heads": 4}) == []
    (msg,) = ATTENTION.check({"name": "longformer", "window": 5}, {"max_len": 256, "causal": False, "heads": 4})
    assert "must be even" in msg
    (msg,) = ATTENTION.check(
        {"name": "longformer", "window": 64, "dilation": [1, 2]}, {"max_len": 256, "causal": True, "heads": 4}
    )
    assert "4 values" in msg
    (msg,) = ATTENTION.check(
        {"name": "longformer", "window": 64, "global_tokens": [0, 300]}, {"max_len": 256, "causal": True, "heads": 4}
    )
    assert "[300]" in msg and "0..255" in msg


def test_longformer_per_layer_schedule_gives_each_layer_its_window() -> None:
    attention = {"name": "longformer", "window": 8, "per_layer": {"0": {"window": 2}, "-1": {"window": 16}}}
    model = build_model(attention=attention, layers=3)
    mechs = [b.attn.mechanism for b in model.blocks]
    assert [m.window for m in mechs] == [2, 8, 16]
    assert [m.pattern.reach for m in mechs] == [2, 8, 16]  # causal LM: the whole window looks back
    cyclic = build_model(attention={"name": "longformer", "per_layer": [{"window": 4}, {"window": 12}]}, layers=4)
    assert [b.attn.mechanism.window for b in cyclic.blocks] == [4, 12, 4, 12]
    x = torch.randint(0, 13, (2, 20))
    assert torch.isfinite(model(x).logits).all()


# -- BigBird -----------------------------------------------------------------------------------


def bigbird_definition(pattern: BigBirdPattern, n: int, w: int, g: int, causal: bool, head: int) -> torch.Tensor:
    """ITC over blocks written out: window blocks, global blocks (first/last, causal: first) and the random
    blocks of ``pattern`` (checked apart), expanded to positions."""
    b = pattern.block
    nb = -(-n // b)
    glob = set(range(g)) if causal else set(range(-(-g // 2))) | set(range(nb - g // 2, nb))
    rand = pattern.random_blocks[head if pattern.random_blocks.shape[0] > 1 else 0]
    ok = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            qb, kb = i // b, j // b
            ok[i, j] = abs(qb - kb) <= (w - 1) // 2 or qb in glob or kb in glob or bool(rand[qb, kb])
            if causal and j > i:
                ok[i, j] = False
    return ok


@pytest.mark.parametrize("causal", [True, False])
def test_bigbird_random_blocks_follow_the_paper(causal) -> None:
    n, b, w, g, r = 64, 4, 3, 2, 3
    p = BigBirdPattern(block=b, window=w, n_global=g, random=r, seed=5, layer=1, heads=H, causal=causal, k_len=n)
    nb = n // b
    glob = set(range(g)) if causal else {0, nb - 1}
    assert set(p.global_positions) == {pos for blk in glob for pos in range(blk * b, blk * b + b)}
    for h in range(H):
        for i in range(nb):
            chosen = p.random_blocks[h, i].nonzero().flatten().tolist()
            pool = [j for j in range(nb) if abs(i - j) > 1 and j not in glob and (j < i or not causal)]
            assert len(chosen) == min(r, len(pool)) and set(chosen) <= set(pool)  # r blocks outside W(i) and G
    # the heads draw their own blocks
    assert not torch.equal(p.random_blocks[0], p.random_blocks[1])


@pytest.mark.parametrize("causal", [True, False])
def test_bigbird_mechanism_is_the_paper_rule(causal) -> None:
    n = 38  # not a multiple of the block: a partial last block
    mech = build("bigbird", causal, block=4, window_blocks=3, global_blocks=2, random_blocks=2, seed=3)
    q, k, v = qkv(n, n)
    pattern = mech.pattern_for(n)
    allowed = torch.stack([bigbird_definition(pattern, n, 3, 2, causal, h) for h in range(H)])
    out = mech(q, k, v, AttnMask(q_len=n, k_len=n, causal=causal))
    assert torch.allclose(out, explicit_attention(q, k, v, allowed), atol=1e-10)


def test_bigbird_random_blocks_are_fixed_per_layer_and_survive_save_load() -> None:
    attention = {"name": "bigbird", "block": 2, "window_blocks": 1, "global_blocks": 1, "random_blocks": 2}
    model = build_model(attention=attention, layers=2, seed=0)
    tables = [b.attn.mechanism.pattern_for(32).random_blocks for b in model.blocks]
    assert not torch.equal(tables[0], tables[1])  # different across layers
    x = torch.randint(0, 13, (2, 32))
    first, second = model(x).logits, model(x).logits
    assert torch.equal(first, second)  # the same across forwards
    assert torch.equal(tables[0], model.blocks[0].attn.mechanism.pattern_for(32).random_blocks)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    torch.manual_seed(123)  # a different global RNG state must not matter
    reloaded = build_model(attention=attention, layers=2, seed=7)
    reloaded.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert torch.equal(reloaded(x).logits, first)
    assert all(torch.equal(t, b.attn.mechanism.pattern_for(32).random_blocks) for t, b in zip(tables, reloaded.blocks))
    reseeded = build("bigbird", True, block=2, window_blocks=1, global_blocks=1, random_blocks=2, seed=1)
    assert not torch.equal(reseeded.pattern_for(32).random_blocks, tables[0])  # the seed matters


def test_bigbird_causal_pattern_does_not_depend_on_the_length() -> None:
    kw = dict(block=4, window=3, n_global=2, random=3, seed=0, layer=2, heads=H, causal=True)
    short, long = BigBirdPattern(**kw, k_len=40), BigBirdPattern(**kw, k_len=96)
    assert torch.equal(long.random_blocks[:, :10, :10], short.random_blocks)
    assert short.global_positions == long.global_positions


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("covering", ["window", "random"])
def test_bigbird_window_or_random_covering_everything_is_dense(causal, covering) -> None:
    n, block = 30, 4
    nb = -(-n // block)
    params = {"window_blocks": 2 * nb - 1} if covering == "window" else {"random_blocks": nb}
    mech = build("bigbird", causal, max_len=n, block=block, **params)
    q, k, v = qkv(n, n)
    mask = AttnMask(q_len=n, k_len=n, causal=causal)
    bias = AlibiBias(H, H).double()
    assert torch.allclose(mech(q, k, v, mask, bias), reference_attention(q, k, v, mask, bias), atol=1e-10)


def test_bigbird_config_errors_name_the_valid_range() -> None:
    ctx = {"max_len": 256, "causal": True, "heads": 4}
    (msg,) = ATTENTION.check({"name": "bigbird", "window_blocks": 4}, ctx)
    assert "odd" in msg
    (msg,) = ATTENTION.check({"name": "bigbird", "block": 512}, ctx)
    assert "valid: 1..256" in msg
    (msg,) = ATTENTION.check({"name": "bigbird", "random_blocks": 5}, {**ctx, "max_len": 256 - 64})
    assert "valid: 0..3" in msg and "Fix:" in msg


# -- ETC ---------------------------------------------------------------------------------------


def etc_definition(n_g: int, n_l: int, radius: int, chunk: int | None) -> torch.Tensor:
    """Sec. 3: g2g full, g2l to the global token's segment (or full), l2g full, l2l within the radius."""
    n = n_g + n_l
    ok = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if i < n_g:
                ok[i, j] = j < n_g or chunk is None or (j - n_g) // chunk == i  # g2g, g2l
            else:
                ok[i, j] = j < n_g or abs(i - j) <= radius  # l2g, l2l
    return ok


@pytest.mark.parametrize("g2l", ["segment", "full"])
def test_etc_mechanism_is_the_paper_rule(g2l) -> None:
    n_g, n_l, max_len = 3, 25, 27
    mech = build("etc", False, max_len=max_len, global_tokens=n_g, radius=4, g2l=g2l, block=4)
    chunk = 9 if g2l == "segment" else None  # ceil(27 / 3)
    q, k, v = qkv(n_g + n_l, n_g + n_l)
    bias = TableBias(H, 64).double()
    out = mech(q, k, v, AttnMask(q_len=n_g + n_l, k_len=n_g + n_l), bias)
    assert torch.allclose(out, explicit_attention(q, k, v, etc_definition(n_g, n_l, 4, chunk), bias), atol=1e-10)


def test_etc_radius_covering_the_input_with_full_g2l_is_dense_over_globals_and_long() -> None:
    n_g, n_l = 4, 21
    mech = build("etc", False, max_len=n_l, global_tokens=n_g, radius=n_l - 1, g2l="full", block=4)
    q, k, v = qkv(n_g + n_l, n_g + n_l, kv_heads=2)
    pad = torch.ones(B, n_g + n_l, dtype=torch.bool)
    pad[1, -5:] = False
    mask = AttnMask(q_len=n_g + n_l, k_len=n_g + n_l, key_padding=pad)
    bias = AlibiBias(H, H).double()
    assert torch.allclose(mech(q, k, v, mask, bias), reference_attention(q, k, v, mask, bias), atol=1e-10)


def test_etc_config_errors_and_refusals() -> None:
    (msg,) = ATTENTION.check({"name": "etc", "radius": 300}, {"max_len": 256})
    assert "valid: 1..256" in msg
    (msg,) = ATTENTION.check({"name": "etc", "global_tokens": 300}, {"max_len": 256})
    assert "g2l=full" in msg

    def sel(causal=False, memory="none", per_head=False, exit="none", more=()):
        return Selection(
            attention=[(ATTENTION.get("etc"), {"global_tokens": 4}, per_head), *more],
            pos=(POS.get("rope"), {}),
            memory=[(MEMORY.get(memory), {})] * 2,
            exit=(EXIT.get(exit), {}),
            causal=causal,
        )

    assert compat.check(sel()) == []
    assert any("attention=etc cannot be causal" in p for p in compat.check(sel(causal=True)))
    assert any("attention=etc cannot attend to memory" in p for p in compat.check(sel(memory="toy_memory")))
    assert any("per_head" in p for p in compat.check(sel(per_head=True)))
    assert any("exit=none" in p for p in compat.check(sel(exit="toy_stop")))
    other = ((ATTENTION.get("etc"), {"global_tokens": 2}, False),)
    assert any("same global_tokens" in p for p in compat.check(sel(more=other)))


def test_etc_model_prepends_global_tokens_and_drops_them_before_the_head() -> None:
    attention = {"name": "etc", "global_tokens": 3, "radius": 2, "block": 4}
    model = build_model(task="classify", attention=attention, pos="learned", causal=False, max_len=24)
    assert model.aux_tokens == 3 and model.aux_embed.weight.shape == (3, 32)
    seen = []
    model.blocks[0].attn.mechanism.register_forward_hook(lambda m, args, out: seen.append((args[0].shape, args[3])))
    x = torch.randint(0, 13, (2, 20))
    pad = torch.ones(2, 20, dtype=torch.bool)
    pad[1, 15:] = False
    out = model(x, key_padding=pad)
    assert out.logits.shape == (2, 3)
    (q_shape, mask) = seen[0]
    assert q_shape[2] == 23 and mask.q_len == 23  # [globals | input]
    assert mask.key_padding[:, :3].all() and torch.equal(mask.key_padding[:, 3:], pad)
    # padded input tokens stay invisible: changing them changes nothing
    x2 = x.clone()
    x2[1, 15:] = (x2[1, 15:] + 1) % 13
    assert torch.allclose(model(x2, key_padding=pad).logits, out.logits, atol=1e-6)
    # the global tokens carry information: their embeddings change the output
    with torch.no_grad():
        model.aux_embed.weight.copy_(torch.randn(3, 32))
    assert not torch.allclose(model(x, key_padding=pad).logits, out.logits, atol=1e-4)


def test_etc_model_keeps_input_positions_and_gives_lm_logits_per_input_token() -> None:
    attention = {"name": "etc", "global_tokens": 2, "radius": 3, "block": 4}
    model = build_model(task="lm", attention=attention, pos="learned", causal=False, max_len=16)
    seen = []
    model.pos.register_forward_hook(lambda m, args, out: seen.append(args))
    model.pos.embed = lambda x, positions, f=model.pos.embed: seen.append(positions) or f(x, positions)
    x = torch.randint(0, 13, (2, 16))  # as long as max_len: the learned table must not be indexed beyond it
    out = model(x)
    assert out.logits.shape == (2, 16, 13)
    assert torch.equal(seen[0], torch.arange(16))
    # packed rows: the globals belong to no document, so no document sees another through them
    seg = torch.tensor([[0] * 8 + [1] * 8] * 2)
    a = model(x, segments=seg).logits
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 3) % 13
    assert torch.allclose(model(x2, segments=seg).logits[:, :8], a[:, :8], atol=1e-6)


# -- shared: block path = reference, two hops, no leak, decoding ---------------------------------

MECHS = {  # name -> (params, causal variants)
    "longformer": ({"window": 4, "dilation": [1, 2, 1, 3], "global_tokens": [0, 9], "block": 4}, (True, False)),
    "bigbird": ({"block": 4, "window_blocks": 3, "global_blocks": 2, "random_blocks": 2, "seed": 1}, (True, False)),
    "etc": ({"global_tokens": 3, "radius": 3, "g2l": "segment", "block": 4}, (False,)),
}
CASES = [pytest.param(n, c, id=f"{n}-{'causal' if c else 'bidir'}") for n, (_, cs) in MECHS.items() for c in cs]


def mask_forms(sq: int, sk: int, causal: bool) -> dict[str, AttnMask]:
    g = torch.Generator().manual_seed(2)
    pad = torch.rand(B, sk, generator=g) > 0.25
    pad[:, :4] = True  # ETC's global tokens are never padding
    seg = torch.cumsum(torch.rand(B, sk, generator=g) < 0.1, dim=1)
    return {
        "plain": AttnMask(q_len=sq, k_len=sk, causal=causal),
        "padded": AttnMask(q_len=sq, k_len=sk, causal=causal, key_padding=pad),
        "packed": AttnMask(q_len=sq, k_len=sk, causal=causal, segments=seg),
        "window": AttnMask(q_len=sq, k_len=sk, causal=causal, window=7),
    }


OFFSET_CASES = [pytest.param(*c.values, 0, id=c.id) for c in CASES] + [
    pytest.param(*c.values, 6, id=f"{c.id}-offset")
    for c in CASES
    if "-causal" in c.id  # keys in front: a cache
]


@pytest.mark.parametrize(("name", "causal", "offset"), OFFSET_CASES)
def test_block_path_equals_dense_reference_with_alibi(name, causal, offset) -> None:
    sk = 37
    block = build(name, causal, kv_heads=2, backend="block", **MECHS[name][0])
    dense = build(name, causal, kv_heads=2, backend="dense", **MECHS[name][0])
    q, k, v = qkv(sk - offset, sk, kv_heads=2)
    bias = AlibiBias(H, H).double()
    for form, mask in mask_forms(sk - offset, sk, causal).items():
        a, b = block(q, k, v, mask, bias), dense(q, k, v, mask, bias)
        assert torch.allclose(a, b, atol=1e-10), (form, (a - b).abs().max())


@pytest.mark.parametrize(("name", "causal"), [c for c in CASES if "bidir" in c.id])
def test_every_pair_is_reachable_within_two_hops_through_the_global_tokens(name, causal) -> None:
    n = 40
    mech = build(name, causal, **MECHS[name][0])
    mask = AttnMask(q_len=n, k_len=n)
    rule = mech.rule(0, False) if name == "etc" else getattr(mech, "pattern_for", lambda _: mech.pattern)(n)
    allowed = pattern_dense(rule, mask, CPU)  # [Hp, Sq, Sk]
    assert not allowed.all()  # sparse ...
    assert two_hops(allowed[0]).all()  # ... yet every key reaches every query within two hops


@pytest.mark.parametrize(("name", "causal"), [c for c in CASES if "-causal" in c.id])
def test_no_causal_leak_with_sparse_settings(name, causal) -> None:
    n, t = 37, 21
    mech = build(name, True, **MECHS[name][0])
    q, k, v = qkv(n, n)
    out = mech(q, k, v, AttnMask(q_len=n, k_len=n, causal=True))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t:] += 1.0
    v2[:, :, t:] -= 2.0
    out2 = mech(q, k2, v2, AttnMask(q_len=n, k_len=n, causal=True))
    assert torch.equal(out[:, :, :t], out2[:, :, :t]) and not torch.allclose(out[:, :, t:], out2[:, :, t:])


@pytest.mark.parametrize(("name", "causal"), [c for c in CASES if "-causal" in c.id])
def test_decoding_equals_full_recompute_with_sparse_settings(name, causal) -> None:
    n = 30
    mech = build(name, True, kv_heads=2, **MECHS[name][0])
    q, k, v = qkv(n, n, kv_heads=2)
    bias = AlibiBias(H, H).double()
    full = mech(q, k, v, AttnMask(q_len=n, k_len=n, causal=True), bias)
    outs, state, t = [], None, 0
    for step in (5, 1, 1, 7, 1, 3, 1, 11):
        mask = AttnMask(q_len=step, k_len=t + step, causal=True)
        out, state = mech.decode(q[:, :, t : t + step], k[:, :, t : t + step], v[:, :, t : t + step], state, mask, bias)
        outs.append(out)
        t += step
    assert t == n and torch.allclose(torch.cat(outs, dim=2), full, atol=1e-10)


@pytest.mark.parametrize("name", ["longformer", "bigbird"])
def test_model_decoding_equals_full_recompute(name) -> None:
    params = {k: v for k, v in MECHS[name][0].items() if k != "dilation"}
    model = build_model(attention={"name": name, **params}, pos="alibi", layers=2, max_len=32)
    x = torch.randint(0, 13, (2, 26))
    assert torch.allclose(decode_logits(model, x, prompt=6, step=3), model(x).logits, atol=1e-5)


def test_bigbird_global_blocks_with_memory_are_refused():
    """With memory in front, the first key blocks are the oldest memory slots, not the segment's tokens
    (as Longformer's global_tokens); without global blocks, or without memory, BigBird is accepted."""

    def sel(memory="xl", global_blocks=2):
        return Selection(
            attention=[(ATTENTION.get("bigbird"), {"global_blocks": global_blocks}, False)],
            pos=(POS.get("rope"), {}),
            memory=[(MEMORY.get(memory), {})] * 2,
            exit=(EXIT.get("none"), {}),
            causal=True,
            streams=memory != "none",
        )

    assert any("attention.global_blocks=0, or memory=none" in p for p in compat.check(sel()))
    assert compat.check(sel(global_blocks=0)) == []
    assert compat.check(sel(memory="none")) == []
