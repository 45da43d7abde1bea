"""The block options on the residual stream, the norms and the FFN (docs/blocks.md), each against its paper's
equations: ReZero, LayerScale, GTrXL's gate, DeepNorm, ResiDual, sandwich norm, NormFormer, ScaleNorm and the simple
RMSNorm, the GLU and squared-ReLU FFNs, stochastic depth. The options' common contract and the attention, layout
and embedding options: tests/unit/test_block_options.py.

One file over 400 lines: every residual, norm and FFN option shares the reference block and its fixtures.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xfam.model.attn_options import Carry
from xfam.model.block import SelfAttention
from xfam.model.layers import FeedForward, ScaleNorm, make_norm
from xfam.model.residual import GRUGate, Link, deepnorm_constants, layerscale_init
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

V = 50  # vocabulary of the tiny models


def tiny(task: str = "lm", pos: str = "rope", seed: int = 0, cross: dict | None = None, **opts) -> XfamModel:
    """A seeded dim-32, 2-layer, 4-head model with the block options ``opts``, in eval mode."""
    torch.manual_seed(seed)
    spec = ModelSpec(**{"dim": 32, "layers": 2, "heads": 4, "max_len": 64, **opts})
    none = {"name": "none"}
    num_classes = 3 if task == "classify" else None
    model = XfamModel(
        spec,
        task=task,
        vocab_size=V,
        num_classes=num_classes,
        attention={"name": "vanilla"},
        pos={"name": pos},
        memory=none,
        exit=none,
        cross=cross,
        partner_layers=6 if task == "encode" or cross else 0,
    )
    return model.eval()


@contextlib.contextmanager
def record(*modules: nn.Module):
    """Every forward call of ``modules`` in order, as ``(module, args, output)``."""
    calls: list = []
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args, out))) for m in modules]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def block_io(model: XfamModel, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input, output) [B, S, D]`` of every block run."""
    with torch.no_grad(), record(*model.blocks) as calls:
        model(x)
    return [(args[0], out[0]) for _, args, out in calls]


def links(model: XfamModel) -> list[Link]:
    return [m for m in model.modules() if isinstance(m, Link)]


def tokens(b: int = 2, s: int = 10) -> torch.Tensor:
    return torch.randint(0, V, (b, s))


def branch() -> nn.Module:
    """A sublayer stand-in with outputs of both signs."""
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


# -- ReZero, LayerScale --------------------------------------------------------------------------------


def test_rezero_blocks_are_the_identity_at_init() -> None:
    """Bachlechner et al. (2020, arXiv:2003.04887): x + alpha F(x), alpha = 0 at init and no norm anywhere, so at
    init every block is exactly the identity and the logits are the head of the embedding."""
    model = tiny(residual="rezero")
    assert not any(isinstance(m, nn.LayerNorm | nn.RMSNorm | ScaleNorm) for m in model.modules())
    assert all(link.gain.shape == (1,) and link.gain.item() == 0.0 for link in links(model))
    x = tokens()
    for h, out in block_io(model, x):
        assert torch.equal(out, h)
    with torch.no_grad():
        assert torch.equal(model(x).logits, model.head(model.embed(x)))


def test_rezero_link() -> None:
    link = Link(ModelSpec(dim=8, heads=2, residual="rezero"))
    with torch.no_grad():
        link.gain.fill_(0.3)
    x, f = torch.randn(2, 3, 8), branch()
    assert torch.allclose(link(x, f, nn.Identity()), x + 0.3 * f(x), atol=1e-7)


def test_layerscale_small_init_keeps_blocks_near_identity() -> None:
    """CaiT (Touvron et al., 2021, arXiv:2103.17239): x + diag(lambda) F(x); with lambda = 1e-6 a block moves its
    input by about 1e-6 of the branch."""
    model = tiny(residual="layerscale", layerscale_init=1e-6)
    assert all(torch.equal(link.gain, torch.full((32,), 1e-6)) for link in links(model))
    for h, out in block_io(model, tokens()):
        assert ((out - h).norm(dim=-1) < 1e-4 * h.norm(dim=-1)).all()
        assert not torch.equal(out, h)


@pytest.mark.parametrize(
    "layers, eps", [(1, 0.1), (12, 0.1), (18, 0.1), (19, 1e-5), (24, 1e-5), (25, 1e-6), (36, 1e-6)]
)
def test_layerscale_default_init_follows_cait(layers: int, eps: float) -> None:
    """CaiT's rule: 0.1 up to depth 18, 1e-5 up to 24, 1e-6 beyond."""
    assert layerscale_init(ModelSpec(layers=layers, residual="layerscale")) == eps


def test_layerscale_is_per_channel() -> None:
    assert all(torch.equal(link.gain, torch.full((32,), 0.1)) for link in links(tiny(residual="layerscale")))
    link = Link(ModelSpec(dim=8, heads=2, residual="layerscale"))
    lam = torch.randn(8)
    with torch.no_grad():
        link.gain.copy_(lam)
    x, f, norm = torch.randn(2, 3, 8), branch(), nn.LayerNorm(8)
    assert torch.allclose(link(x, f, norm), x + lam * f(norm(x)), atol=1e-6)


# -- GTrXL ---------------------------------------------------------------------------------------------


def test_gru_gate_equations() -> None:
    """Parisotto et al. (2019, arXiv:1910.06764, sec. 3.2): r = s(W_r y + U_r x), z = s(W_z y + U_z x - b_g),
    h = tanh(W_g y + U_g (r * x)), g = (1 - z) * x + z * h; x the stream, y the sublayer output."""
    gate = GRUGate(8, 2.0)
    with torch.no_grad():
        for p in gate.parameters():
            p.normal_(0, 0.5)
    w_r, w_z, w_g = gate.w.weight.chunk(3, dim=0)  # [D, D] each
    u_r, u_z = gate.u.weight.chunk(2, dim=0)
    u_g, b_g = gate.u_g.weight, gate.b_g
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    r = torch.sigmoid(y @ w_r.T + x @ u_r.T)
    z = torch.sigmoid(y @ w_z.T + x @ u_z.T - b_g)
    h = torch.tanh(y @ w_g.T + (r * x) @ u_g.T)
    assert torch.allclose(gate(x, y), (1 - z) * x + z * h, atol=1e-6)


def test_gtrxl_large_gate_bias_is_near_identity() -> None:
    """b_g = 20: z ~ sigmoid(-20) ~ 2e-9, so g(x, y) ~ x; with the paper's b_g = 2 the block does move its input."""
    model = tiny(residual="gtrxl", gtrxl_bias=20.0)
    for h, out in block_io(model, tokens()):
        assert torch.allclose(out, h, atol=1e-7, rtol=0)
    for h, out in block_io(tiny(residual="gtrxl"), tokens()):
        assert (out - h).abs().max() > 1e-3


def test_gtrxl_update_gate_starts_near_sigmoid_minus_bias() -> None:
    """With small weights (init std 0.02) z ~ sigmoid(-b_g) = sigmoid(-2) ~ 0.12 at init; b_g is learned per channel."""
    model = tiny(residual="gtrxl")
    gate = model.blocks[0].link_attn.gate
    assert isinstance(gate.b_g, nn.Parameter) and torch.equal(gate.b_g, torch.full((32,), 2.0))
    with torch.no_grad(), record(gate) as calls:
        model(tokens())
    x, y = calls[0][1]
    w_z, u_z = gate.w.weight.chunk(3)[1], gate.u.weight.chunk(2)[1]
    z = torch.sigmoid(y @ w_z.T + x @ u_z.T - gate.b_g)
    assert torch.allclose(z, torch.sigmoid(torch.tensor(-2.0)).expand_as(z), atol=0.01)


def test_gtrxl_relu_before_the_gate() -> None:
    """The identity-map reordering: Y = g(E, ReLU(MHA(LN(E))))."""
    link = Link(ModelSpec(dim=8, heads=2, residual="gtrxl"))
    x, f, norm = torch.randn(2, 3, 8), branch(), nn.LayerNorm(8)
    y = f(norm(x))
    assert (y < 0).any()
    assert torch.allclose(link(x, f, norm), link.gate(x, torch.relu(y)), atol=1e-7)
    assert not torch.allclose(link(x, f, norm), link.gate(x, y), atol=1e-4)


# -- DeepNorm ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "role, layers, partner, alpha, beta",
    [
        ("encoder", 6, 0, 1.8612, 0.3799),  # (2N)^(1/4), (8N)^(-1/4)
        ("decoder", 18, 0, 2.4495, 0.2887),
        ("encdec_encoder", 6, 6, 1.4179, 0.4970),  # 0.81 (N^4 M)^(1/16), 0.87 (N^4 M)^(-1/16)
        ("encdec_decoder", 6, 6, 2.0598, 0.3433),  # (3M)^(1/4), (12M)^(-1/4)
        ("encdec_encoder", 18, 6, 1.8661, 0.3776),
        ("encdec_decoder", 6, 18, 2.0598, 0.3433),  # (the decoder's constants depend on its own depth only)
    ],
)
def test_deepnorm_constants(role: str, layers: int, partner: int, alpha: float, beta: float) -> None:
    """Wang et al. (2022, arXiv:2203.00555), DeepNet's table of alpha and beta."""
    assert deepnorm_constants(role, layers, partner) == pytest.approx((alpha, beta), abs=1e-4)


@pytest.mark.parametrize(
    "task, cross, role",
    [("lm", None, "decoder"), ("classify", None, "encoder"), ("encode", None, "encdec_encoder")]
    + [("lm", {"name": "vanilla"}, "encdec_decoder")],
)
def test_deepnorm_alpha_on_every_link(task: str, cross: dict | None, role: str) -> None:
    """The model's role picks the constants (an encoder-decoder's with the other stack's depth, 6 here)."""
    model = tiny(task=task, cross=cross, norm_position="deepnorm")
    alpha, beta = deepnorm_constants(role, 2, 6)
    assert model.deepnorm == (alpha, beta) and alpha != 1.0
    assert len(links(model)) == (6 if cross else 4)
    assert all(link.alpha == alpha for link in links(model))


def test_deepnorm_link() -> None:
    """x_{l+1} = LN(alpha x_l + G(x_l))."""
    link = Link(ModelSpec(dim=8, heads=2, norm_position="deepnorm"))
    link.alpha = 1.7
    x, f, norm = torch.randn(2, 3, 8), branch(), nn.LayerNorm(8)
    assert torch.allclose(link(x, f, norm), norm(1.7 * x + f(x)), atol=1e-6)


def test_deepnorm_init() -> None:
    """Xavier-normal with gain beta for the value, output and FFN weights, gain 1 for queries and keys (DeepNet's
    Fig. 2), not the GPT-2 scaled normal init."""
    model = tiny(dim=256, heads=4, norm_position="deepnorm")
    beta = model.deepnorm[1]
    assert beta == pytest.approx(0.5)  # (8 * 2)^(-1/4)

    def xavier(w: torch.Tensor, gain: float) -> float:
        return gain * math.sqrt(2 / (w.shape[0] + w.shape[1]))

    for block in model.blocks:
        q, k, v = block.attn.qkv.weight.split(256, dim=0)  # [256, 256] each
        expected = [(q, 1.0), (k, 1.0), (v, beta), (block.attn.out.weight, beta)]
        expected += [(block.ffn.up.weight, beta), (block.ffn.down.weight, beta)]
        for w, gain in expected:
            assert w.std().item() == pytest.approx(xavier(w, gain), rel=0.05)
            assert w.mean().abs().item() < 0.1 * xavier(w, gain)
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)


# -- ResiDual ------------------------------------------------------------------------------------------


def test_resi_dual_output_is_post_norm_stream_plus_normed_dual_stream() -> None:
    """Xie et al. (2023, arXiv:2304.14802): x_{k+1} = LN(x_k + f_k(x_k)), d_{k+1} = d_k + f_k(x_k) with d_1 the
    embedding; the head reads x_L + LN_d(d_L)."""
    model = tiny(norm_position="resi_dual")
    assert isinstance(model.norm, nn.Identity)  # (no final norm but the dual stream's)
    with torch.no_grad():
        for norm in (model.dual_norm, model.blocks[0].norm1, model.blocks[0].norm2):
            norm.weight.uniform_(0.5, 1.5)
    x = tokens()
    subs = [m for m in model.modules() if isinstance(m, SelfAttention | FeedForward)]
    with torch.no_grad(), record(*model.blocks, *subs) as calls:
        logits = model(x).logits
    outs = [out[0] if isinstance(mod, SelfAttention) else out for mod, _, out in calls if mod in subs]
    assert len(outs) == 4
    dual = model.embed(x) + sum(outs)  # d_L: the embedding plus every sublayer's output
    last = [out[0] for mod, _, out in calls if mod is model.blocks[-1]][0]  # x_L
    with torch.no_grad():
        assert torch.allclose(logits, model.head(last + model.dual_norm(dual)), atol=1e-6)
    # the post-norm stream inside the first block: the FFN reads LN(x + attention(x))
    first = model.blocks[0]
    ins = {mod: args[0] for mod, args, _ in calls if mod in (first.attn, first.ffn)}
    assert torch.allclose(ins[first.ffn], first.norm1(model.embed(x) + outs[0]), atol=1e-6)
    assert torch.equal(ins[first.attn], model.embed(x))  # (post-norm: the sublayer reads the stream as it is)


def test_resi_dual_link_updates_the_dual_stream() -> None:
    link = Link(ModelSpec(dim=8, heads=2, norm_position="resi_dual"))
    x, d, f, norm = torch.randn(2, 3, 8), torch.randn(2, 3, 8), branch(), nn.LayerNorm(8)
    carry = Carry(dual=[d])
    assert torch.allclose(link(x, f, norm, None, carry.dual), norm(x + f(x)), atol=1e-6)
    assert torch.allclose(carry.dual[0], d + f(x), atol=1e-7)


# -- sandwich norm, NormFormer -------------------------------------------------------------------------


def test_sandwich_norm_block() -> None:
    """CogView (Ding et al., 2021, arXiv:2105.13290): x + N'(f(N(x))) for the attention and the FFN."""
    model = tiny(norm_position="sandwich")
    block = model.blocks[0]
    assert block.link_attn.post_norm is not None and block.link_ffn.post_norm is not None
    assert isinstance(model.norm, nn.LayerNorm)  # pre-norm's final norm stays
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
    with torch.no_grad(), record(block.attn, block.ffn, block.link_attn, block.link_ffn) as calls:
        model(tokens())
    got = {mod: (args[0], out) for mod, args, out in calls}
    pairs = ((block.attn, block.link_attn, block.norm1), (block.ffn, block.link_ffn, block.norm2))
    for sub, link, norm in pairs:
        (sub_in, sub_out), (stream, joined) = got[sub], got[link]
        sub_out = sub_out[0] if sub is block.attn else sub_out
        assert torch.allclose(sub_in, norm(stream), atol=1e-6)
        assert torch.allclose(joined, stream + link.post_norm(sub_out), atol=1e-6)


def test_attn_post_norm_on_the_attention_only() -> None:
    """NormFormer (Shleifer et al., 2021, arXiv:2110.09456): x + LN(MHA(LN(x))); the FFN link is plain."""
    block = tiny(attn_post_norm=True).blocks[0]
    assert isinstance(block.link_attn.post_norm, nn.LayerNorm) and block.link_ffn.post_norm is None
    link = Link(ModelSpec(dim=8, heads=2), post_norm=True)
    with torch.no_grad():
        link.post_norm.weight.uniform_(0.5, 1.5)
    x, f, norm = torch.randn(2, 3, 8), branch(), nn.LayerNorm(8)
    assert torch.allclose(link(x, f, norm), x + link.post_norm(f(norm(x))), atol=1e-6)


def test_head_scale_scales_each_head_before_the_output_projection() -> None:
    """NormFormer's HeadScale: Concat(g_1 h_1, ..., g_n h_n) W^O, each g_i init 1."""
    model = tiny(attn_head_scale=True)
    attn = model.blocks[0].attn
    assert torch.equal(attn.head_scale, torch.ones(4))
    x = tokens()
    seen = []
    for scale in ([1.0, 1.0, 1.0, 1.0], [2.0, 1.0, 1.0, 1.0]):
        with torch.no_grad():
            attn.head_scale.copy_(torch.tensor(scale))
        with torch.no_grad(), record(attn.out) as calls:
            model(x)
        seen.append(calls[0][1][0])  # [B, S, H*Dh], head h in channels h*8 .. h*8 + 7
    assert torch.allclose(seen[1][..., :8], 2 * seen[0][..., :8], atol=1e-7)
    assert torch.equal(seen[1][..., 8:], seen[0][..., 8:])


@pytest.mark.parametrize("ffn", ["gelu", "geglu"])
def test_ffn_post_act_norm(ffn: str) -> None:
    """NormFormer's FFN norm: W2 LN(act(W1 x)), over the hidden width (after the GLU product for a GLU)."""
    ff = FeedForward(ModelSpec(dim=32, heads=4, ffn=ffn, ffn_post_act_norm=True))
    hidden = ModelSpec(dim=32, ffn=ffn).ffn_hidden
    assert isinstance(ff.post_act_norm, nn.LayerNorm) and ff.post_act_norm.normalized_shape == (hidden,)
    with torch.no_grad():
        ff.post_act_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 32)
    h = ff.up(x)
    h = F.gelu(h) if ffn == "gelu" else F.gelu(h[..., :hidden]) * h[..., hidden:]
    assert torch.allclose(ff(x), ff.down(ff.post_act_norm(h)), atol=1e-6)


def test_resid_scale_on_ffn_links_only() -> None:
    """NormFormer's ResScale: lambda x + FFN(LN(x)), per channel, init 1, on the FFN residuals only (as fairseq)."""
    model = tiny(resid_scale=True, macaron=True)
    for block in model.blocks:
        assert block.link_attn.stream_scale is None
        for link in (block.link_ffn, block.before[0].link):
            assert torch.equal(link.stream_scale, torch.ones(32))
    link = Link(ModelSpec(dim=8, heads=2, resid_scale=True), ffn=True)
    lam = torch.randn(8)
    with torch.no_grad():
        link.stream_scale.copy_(lam)
    x, f, norm = torch.randn(2, 3, 8), branch(), nn.LayerNorm(8)
    assert torch.allclose(link(x, f, norm), lam * x + f(norm(x)), atol=1e-6)


# -- norms ---------------------------------------------------------------------------------------------


def test_scalenorm() -> None:
    """Nguyen & Salazar (2019, arXiv:1910.05895): g x / ||x|| with one scalar g, init sqrt(D)."""
    norm = make_norm(ModelSpec(dim=32, norm="scalenorm"))
    assert isinstance(norm, ScaleNorm) and [p.shape for p in norm.parameters()] == [torch.Size([])]
    assert norm.g.item() == pytest.approx(math.sqrt(32))
    x = torch.randn(3, 4, 32) * 5
    assert torch.allclose(norm(x).norm(dim=-1), torch.full((3, 4), math.sqrt(32)), atol=1e-5)
    with torch.no_grad():
        norm.g.fill_(3.0)
    assert torch.allclose(norm(x), 3.0 * x / x.norm(dim=-1, keepdim=True), atol=1e-6)
    assert torch.equal(norm(torch.zeros(2, 32)), torch.zeros(2, 32))  # (eps: no NaN)
    model = tiny(norm="scalenorm")
    assert all(isinstance(n, ScaleNorm) for n in (model.norm, model.blocks[0].norm1, model.blocks[0].norm2))


def test_simple_rmsnorm_has_no_parameters() -> None:
    norm = make_norm(ModelSpec(dim=32, norm="simple_rmsnorm"))
    assert list(norm.parameters()) == []
    x = torch.randn(3, 4, 32)
    assert torch.allclose(norm(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), atol=1e-6)
    model = tiny(norm="simple_rmsnorm")
    assert not [n for n, _ in model.named_parameters() if "norm" in n]


# -- FFN kinds -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("geglu", lambda x, w, v, w2: (F.gelu(x @ w.T) * (x @ v.T)) @ w2.T),  # Shazeer, 2020, eq. 6
        ("reglu", lambda x, w, v, w2: (F.relu(x @ w.T) * (x @ v.T)) @ w2.T),
        ("swiglu", lambda x, w, v, w2: (F.silu(x @ w.T) * (x @ v.T)) @ w2.T),
        ("relu2", lambda x, w, v, w2: F.relu(x @ w.T).square() @ w2.T),  # Primer (So et al., 2021)
    ],
)
def test_ffn_kinds(kind: str, expected) -> None:
    ff = FeedForward(ModelSpec(dim=32, heads=4, ffn=kind))
    hidden = ff.down.in_features
    w, v = ff.up.weight[:hidden], ff.up.weight[hidden:]  # (v empty for relu2)
    x = torch.randn(2, 5, 32)
    assert torch.allclose(ff(x), expected(x, w, v, ff.down.weight), atol=1e-6)


@pytest.mark.parametrize("dim, mult, hidden", [(32, 4.0, 88), (768, 4.0, 2048), (48, 4.0, 128), (64, 2.0, 88)])
def test_glu_hidden_width(dim: int, mult: float, hidden: int) -> None:
    """The GLUs' hidden width is 2/3 of mult * dim, rounded up to a multiple of 8 (Shazeer: 3072 -> 2048 at
    d = 768), so their three matrices hold about the two of the plain FFN."""
    for kind in ("geglu", "reglu", "swiglu"):
        spec = ModelSpec(dim=dim, heads=4, ffn=kind, ffn_mult=mult)
        assert spec.ffn_hidden == hidden and hidden % 8 == 0
        ff = FeedForward(spec)
        assert ff.up.out_features == 2 * hidden and ff.down.in_features == hidden
    plain = ModelSpec(dim=dim, heads=4, ffn_mult=mult).ffn_hidden
    assert plain == int(mult * dim) and abs(3 * hidden - 2 * plain) <= 3 * 8


# -- stochastic depth ----------------------------------------------------------------------------------


def test_stochastic_depth_schedule() -> None:
    """Huang et al. (2016, arXiv:1603.09382): layer l of L (1-based) survives with p_l = 1 - l / L (1 - p_L)."""
    block = tiny(layers=4, layer_drop=0.2).blocks[0]
    assert [block.survival(step) for step in range(4)] == pytest.approx([0.95, 0.9, 0.85, 0.8])


def test_stochastic_depth_off_in_evaluation() -> None:
    dropped, plain = tiny(layer_drop=0.5), tiny()
    assert all(torch.equal(a, b) for a, b in zip(dropped.state_dict().values(), plain.state_dict().values()))
    x = tokens()
    with torch.no_grad():
        assert torch.equal(dropped(x).logits, plain(x).logits) and torch.equal(dropped(x).logits, dropped(x).logits)


@pytest.mark.parametrize(
    "opts",
    [{}, {"share_layers": True}, {"residual": "gtrxl"}, {"norm_position": "post"}, {"resid_scale": True}],
    ids=["pre", "shared", "gtrxl", "post", "resid_scale"],
)
def test_stochastic_depth_skips_samples_at_the_scheduled_rate(opts: dict) -> None:
    """In training a sample skips layer l (the block's output is its input) with probability (l + 1) / L *
    layer_drop, per sample, whatever joins the branch to the stream (a gate, a post-norm, a scaled stream); a
    shared block (ALBERT) takes the rate of the layer it runs as."""
    model = tiny(layer_drop=0.4, **opts).train()
    runs = block_io(model, tokens(2000, 4))
    assert len(runs) == 2
    for step, (h, out) in enumerate(runs):
        skipped = (out == h).flatten(1).all(1).float().mean().item()
        assert skipped == pytest.approx(0.4 * (step + 1) / 2, abs=0.04), step


def test_stochastic_depth_scales_kept_samples() -> None:
    """The kept branches are scaled by 1 / survival in training (timm's DropPath), so the mean is the plain block."""
    block = tiny(layer_drop=0.4).blocks[0].train()
    keep = block._survivors(torch.zeros(20000, 3, 8), step=1)  # survival 0.6
    assert keep.shape == (20000, 1, 1)
    assert keep.unique().tolist() == pytest.approx([0.0, 1 / 0.6])
    assert keep.mean().item() == pytest.approx(1.0, abs=0.03)
    assert block.eval()._survivors(torch.zeros(4, 3, 8), step=1) is None


def test_rezero_shares_one_alpha_per_layer() -> None:
    """The ReZero reference code has one alpha per layer, for its attention and its FFN."""
    block = tiny(residual="rezero", macaron=True).blocks[0]
    gains = {id(link.gain) for link in block.links()}
    assert len(block.links()) == 3 and len(gains) == 1
    assert sum(p.numel() for n, p in block.named_parameters() if "gain" in n) == 1


def test_deepnorm_encoder_alone_takes_the_encoder_only_rule() -> None:
    assert deepnorm_constants("encdec_encoder", 6, 0) == deepnorm_constants("encoder", 6)
