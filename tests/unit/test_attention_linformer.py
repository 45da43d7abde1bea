"""Linformer (Wang et al., 2020): the identity limit is dense attention, the sharing modes really share,
padding and shorter sequences are ignored exactly, the pooling/convolution projections are what the
paper says, and impossible settings are refused before anything is built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from doubles import build_model

from xfam.attention import ATTENTION
from xfam.attention.vanilla import reference_attention
from xfam.config import validate
from xfam.core.errors import ConfigError
from xfam.core.mask import AttnMask

B, H, DH, N = 2, 4, 8, 12


def build(kv_heads: int = H, max_len: int = N, shared: dict | None = None, layer: int = 0, **params):
    struct = dict(dim=H * DH, heads=H, kv_heads=kv_heads, head_dim=DH, max_len=max_len, causal=False, num_layers=2)
    if shared is not None:
        struct["shared"] = shared
    torch.manual_seed(layer)
    return ATTENTION.build({"name": "linformer", **params}, **struct, layer=layer).eval().double()


def qkv(sq: int = N, sk: int = N, kv_heads: int = H):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, sq, DH, generator=g, dtype=torch.float64)
    return q, *(torch.randn(B, kv_heads, sk, DH, generator=g, dtype=torch.float64) for _ in range(2))


PAD = torch.tensor([[True] * 12, [True] * 7 + [False] * 5])
SEG = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 7 + [4] * 5])
FORMS = {"plain": {}, "padding": {"key_padding": PAD}, "segments": {"segments": SEG}, "window": {"window": 3}}


@pytest.mark.parametrize("backend", ["projected", "reference"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("sharing", ["none", "headwise", "kv", "layerwise"])
def test_identity_projection_with_k_equal_to_n_is_dense_attention(backend, form, sharing):
    mech = build(k=N, init="identity", backend=backend, sharing=sharing)
    q, k, v = qkv()
    out = mech(q, k, v, AttnMask(q_len=N, k_len=N, **FORMS[form]))
    assert torch.allclose(out, reference_attention(q, k, v, AttnMask(q_len=N, k_len=N, **FORMS[form])), atol=1e-12)


@pytest.mark.parametrize("sk", [5, 9])
def test_identity_on_shorter_sequences_is_dense_attention(sk):
    mech = build(k=N, init="identity")
    q, k, v = qkv(sq=sk, sk=sk)
    mask = AttnMask(q_len=sk, k_len=sk)
    assert torch.allclose(mech(q, k, v, mask), reference_attention(q, k, v, mask), atol=1e-12)


PROJECTIONS = [("linear", 4), ("mean", 4), ("max", 4), ("conv", 3)]


@pytest.mark.parametrize(("projection", "k"), PROJECTIONS)
def test_padded_keys_contribute_nothing(projection, k):
    mech = build(k=k, projection=projection)
    q, kk, v = qkv()
    mask = lambda: AttnMask(q_len=N, k_len=N, key_padding=PAD)  # noqa: E731
    out = mech(q, kk, v, mask())
    k2, v2 = kk.clone(), v.clone()
    k2[1, :, 7:] = 100 * torch.randn_like(k2[1, :, 7:])  # change only the padded keys and values
    v2[1, :, 7:] = 100.0
    assert torch.equal(out, mech(q, k2, v2, mask()))
    # Right padding = the shorter sequence itself (the keys padded to n and masked before projecting).
    short = mech(q[1:, :, :7], kk[1:, :, :7], v[1:, :, :7], AttnMask(q_len=7, k_len=7))
    assert torch.allclose(out[1:, :, :7], short, atol=1e-12)
    assert not torch.allclose(out, mech(q, kk, v, AttnMask(q_len=N, k_len=N)), atol=1e-6)  # padding mattered


@pytest.mark.parametrize(("projection", "k"), PROJECTIONS)
@pytest.mark.parametrize("form", ["plain", "padding", "segments"])
def test_projected_path_equals_the_per_query_reference(projection, k, form):
    fast = build(k=k, projection=projection, backend="projected")
    ref = build(k=k, projection=projection, backend="reference")
    ref.load_state_dict(fast.state_dict())
    q, kk, v = qkv()
    out = fast(q, kk, v, AttnMask(q_len=N, k_len=N, **FORMS[form]))
    assert torch.allclose(out, ref(q, kk, v, AttnMask(q_len=N, k_len=N, **FORMS[form])), atol=1e-12)


def test_segments_are_projected_document_by_document():
    mech = build(k=4)
    q, k, v = qkv()
    out = mech(q, k, v, AttnMask(q_len=N, k_len=N, segments=SEG))
    # Row 1, document 4 = positions 7..11: as if the other keys were padding.
    pad = torch.tensor([[False] * 7 + [True] * 5] * B)
    alone = mech(q, k, v, AttnMask(q_len=N, k_len=N, key_padding=pad))
    assert torch.allclose(out[1, :, 7:], alone[1, :, 7:], atol=1e-12)


def test_pooling_and_convolution_are_the_papers_projections():
    q, k, v = qkv()
    mask = AttnMask(q_len=N, k_len=N)
    r = N // 4
    for projection, pool in (
        ("mean", lambda x: x.unflatten(2, (4, r)).mean(3)),
        ("max", lambda x: x.unflatten(2, (4, r)).amax(3)),
    ):
        out = build(k=4, projection=projection)(q, k, v, mask)
        kp, vp = pool(k), pool(v)
        assert torch.allclose(out, torch.softmax(q @ kp.mT / DH**0.5, -1) @ vp, atol=1e-12)
    mech = build(k=4, projection="conv", sharing="kv")
    w = mech.proj_k.weight[0]  # [Dh_out, Dh_in, r]

    def conv(x):
        return F.conv1d(x.flatten(0, 1).mT, w, stride=r).mT.unflatten(0, (B, H))  # [B, H, k, Dh]

    expected = torch.softmax(q @ conv(k).mT / DH**0.5, -1) @ conv(v)
    assert torch.allclose(mech(q, k, v, mask), expected, atol=1e-12)


def n_params(m) -> int:
    return sum(p.numel() for p in m.parameters())


def test_sharing_modes_share_parameters():
    kv_heads = 2
    none = build(kv_heads=kv_heads, k=4, sharing="none")
    headwise = build(kv_heads=kv_heads, k=4, sharing="headwise")
    kv = build(kv_heads=kv_heads, k=4, sharing="kv")
    assert n_params(none) == 2 * kv_heads * 4 * N
    assert n_params(headwise) == 2 * 4 * N and headwise.proj_k is not headwise.proj_v
    assert n_params(kv) == 4 * N and kv.proj_k is kv.proj_v
    shared: dict = {}
    layers = [build(k=4, sharing="layerwise", shared=shared, layer=i) for i in range(3)]
    assert all(m.proj_k.weight is layers[0].proj_k.weight and m.proj_v is m.proj_k for m in layers)
    assert len(shared) == 1
    # In a model: one E for all layers, counted once.
    per_layer = build_model(
        task="classify", attention={"name": "linformer", "k": 4, "sharing": "kv"}, layers=3, max_len=N
    )
    model = build_model(
        task="classify", attention={"name": "linformer", "k": 4, "sharing": "layerwise"}, layers=3, max_len=N
    )
    assert n_params(per_layer) - n_params(model) == 2 * 4 * N
    weights = {id(b.attn.mechanism.proj_k.weight) for b in model.blocks}
    assert len(weights) == 1
    model.train()
    tokens = torch.randint(0, 13, (2, N))
    model(tokens).logits.sum().backward()
    assert model.blocks[0].attn.mechanism.proj_k.weight.grad.abs().sum() > 0


def test_bad_settings_are_config_errors_with_the_valid_range():
    with pytest.raises(ConfigError, match=r"k=13 exceeds model.max_len=12; valid: 1..12"):
        build(k=13)
    with pytest.raises(ConfigError, match=r"k must divide model.max_len=12"):
        build(k=5, projection="mean")
    with pytest.raises(ConfigError, match="init=identity"):
        build(k=6, init="identity")


def _cfg(task: str) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from xfam.training.run_names import CONFIG_DIR, register_resolvers

    data = (
        ["data=duplication", "data.seq_len=16"]
        if task == "lm"
        else ["data=listops", "data.seq_len=16", "data.min_length=5", "data.max_length=16"]
    )
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                *data,
                "attention=linformer",
                "attention.k=8",
                "model.max_len=16",
                "model.dim=32",
                "model.heads=4",
                "model.layers=2",
            ],
        )
    GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg, resolve=True)


def test_a_causal_model_is_refused_and_an_encoder_works():
    with pytest.raises(ConfigError, match="attention=linformer cannot be causal"):
        validate(_cfg("lm"))
    validate(_cfg("classify"))
    model = build_model(task="classify", attention={"name": "linformer", "k": 4}, max_len=N).train()
    pad = torch.ones(2, N, dtype=torch.bool)
    pad[1, 8:] = False
    out = model(torch.randint(0, 13, (2, N)), key_padding=pad)
    assert out.logits.shape == (2, 3) and torch.isfinite(out.logits).all()
