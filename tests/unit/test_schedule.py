"""Per-layer and per-head schedules (xfam.core.schedule), through the model builder and by hand."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model, decode_logits

from xfam.attention.vanilla import Vanilla
from xfam.core.errors import ConfigError
from xfam.core.mask import AttnMask
from xfam.core.schedule import per_head, per_layer
from xfam.model.head_groups import HeadGroups
from xfam.model.transformer import build_mechanism
from xfam.pos.alibi import AlibiBias


def layer_params(attention: dict, layers: int = 4) -> list[dict]:
    model = build_model(attention=attention, layers=layers)
    return [block.attn.mechanism.params for block in model.blocks]


def test_per_layer_mapping_index_negative_range_and_list():
    params = layer_params(
        {
            "name": "toy_record",
            "tag": "base",
            "per_layer": {"0": {"temp": 2.0}, "-1": {"tag": "top"}, "1-2": {"temp": 3.0}},
        },
        layers=4,
    )
    assert [p["temp"] for p in params] == [2.0, 3.0, 3.0, 1.0]
    assert [p["tag"] for p in params] == ["base", "base", "base", "top"]
    assert [p["layer"] for p in params] == [0, 1, 2, 3]  # the builder injects each layer's index
    assert all(p["heads"] == 4 and p["kv_heads"] == 4 for p in params)

    params = layer_params({"name": "toy_record", "per_layer": {"0,2": {"tag": "even"}, "-3": {"tag": "one"}}})
    assert [p["tag"] for p in params] == ["even", "one", "even", ""]


def test_per_layer_cyclic_list():
    params = layer_params({"name": "toy_record", "per_layer": [{"tag": "a"}, {"tag": "b", "temp": 0.5}]}, layers=5)
    assert [p["tag"] for p in params] == ["a", "b", "a", "b", "a"]
    assert [p["temp"] for p in params] == [1.0, 0.5, 1.0, 0.5, 1.0]


def test_per_layer_can_change_the_component():
    """A name override starts from the new component's defaults: the slot's own keys (a composed YAML
    holds every default of its component) do not leak into a different component."""
    model = build_model(attention={"name": "toy_record", "temp": 2.0, "per_layer": {"1": {"name": "vanilla"}}})
    assert model.blocks[0].attn.mechanism.params["temp"] == 2.0
    assert isinstance(model.blocks[1].attn.mechanism, Vanilla)
    cfgs = per_layer({"name": "vanilla", "backend": "sdpa", "per_layer": [{}, {"name": "toy_record"}]}, 2, "attention")
    assert cfgs == [{"name": "vanilla", "backend": "sdpa"}, {"name": "toy_record"}]


@pytest.mark.parametrize(
    ("sched", "needle"),
    [
        ({"0-1": {"temp": 2.0}, "1": {"temp": 3.0}}, "layer 1 is named by both '0-1' and '1'"),
        ({"4": {"temp": 2.0}}, "layer 4 is outside 0..3"),
        ({"-5": {"temp": 2.0}}, "layer -5 is outside 0..3"),
        ({"2-7": {"temp": 2.0}}, "outside 0..3"),
        ({"top": {"temp": 2.0}}, "is not a layer spec"),
        ({"1": {"per_layer": {"0": {}}}}, "cannot be nested"),
        ([{"per_layer": [{}]}], "cannot be nested"),
        ({"1": 2.0}, "must be a mapping of overrides"),
        ([], "empty list"),
        ("0", "must be a mapping of layer specs or a list"),
    ],
)
def test_per_layer_errors(sched, needle):
    with pytest.raises(ConfigError, match="Fix:") as info:
        per_layer({"name": "toy_record", "per_layer": sched}, 4, "attention")
    assert needle in str(info.value)
    assert str(info.value).startswith("attention.per_layer") or "per_layer key" in str(info.value)


def test_per_layer_override_is_validated_like_the_slot():
    with pytest.raises(ConfigError, match="unknown key 'temperature'.*Did you mean 'temp'"):
        build_model(attention={"name": "toy_record", "per_layer": {"1": {"temperature": 2.0}}})


@pytest.mark.parametrize(
    ("groups", "kv_heads", "needle"),
    [
        ([{"heads": 2}, {"heads": 1}], 4, "groups cover 3 heads but model.heads=4"),
        ([{"heads": 2}, {"heads": 3}], 4, "groups cover 5 heads"),
        ([{"heads": 1}, {"heads": 3}], 2, "must be a positive multiple of 2"),
        ([{"temp": 2.0}], 4, "per_head[0].heads=None"),
        ([], 4, "non-empty list"),
        ([{"heads": 4, "per_layer": {}}], 4, "cannot be nested"),
    ],
)
def test_per_head_errors(groups, kv_heads, needle):
    with pytest.raises(ConfigError, match="Fix:") as info:
        per_head({"name": "toy_record", "per_head": groups}, 4, kv_heads, "attention")
    assert needle in str(info.value)


STRUCT = dict(dim=32, head_dim=8, max_len=32, causal=True, num_layers=1)


def hand_attention(q, k, v, temps, bias, causal=True):
    """Per head h, written out: softmax(temp_h q_h k_g^T / sqrt(Dh) + bias_h + causal) v_g, g = h // (H / Hkv)."""
    b, heads, s, dh = q.shape
    per_kv = heads // k.shape[1]
    out = torch.empty_like(q)
    for h in range(heads):
        g = h // per_kv
        scores = temps[h] * q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(dh)  # [B, S, S]
        for i in range(s):
            for j in range(s):
                scores[:, i, j] += float(bias[h, i, j])
                if causal and j > i:
                    scores[:, i, j] = float("-inf")
        out[:, h] = torch.softmax(scores, -1) @ v[:, g]
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_head_groups_equal_each_member_on_its_head_slice(kv_heads):
    cfg = {
        "name": "toy_record",
        "per_head": [{"heads": 2, "temp": 0.5, "tag": "a"}, {"heads": 2, "temp": 2.0}],
    }
    mech = build_mechanism(cfg, {**STRUCT, "heads": 4, "kv_heads": kv_heads}, layer=0)
    assert isinstance(mech, HeadGroups)
    members = [m.params for m in mech.members]
    assert [(p["temp"], p["tag"], p["heads"], p["kv_heads"]) for p in members] == [
        (0.5, "a", 2, kv_heads // 2),
        (2.0, "", 2, kv_heads // 2),
    ]
    s = 6
    q = torch.randn(2, 4, s, 8, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, s, 8, dtype=torch.float64) for _ in range(2))
    bias = AlibiBias(4, 4).double()  # a different slope per head: a misrouted head slice shows
    mask = AttnMask(q_len=s, k_len=s, causal=True)
    out = mech(q, k, v, mask, bias)
    pos = torch.arange(s)
    dense_bias = bias.pairs(pos[:, None], pos[None, :])  # [H, S, S]
    expected = hand_attention(q, k, v, [0.5, 0.5, 2.0, 2.0], dense_bias)
    assert torch.allclose(out, expected, atol=1e-10)


def test_head_groups_of_different_mechanisms_with_gqa():
    """vanilla on heads 0-1 and toy_record (temp 3) on heads 2-5 of 6, two query heads per key/value head."""
    cfg = {
        "name": "vanilla",
        "backend": "sdpa",
        "per_head": [{"heads": 2}, {"heads": 4, "name": "toy_record", "temp": 3.0}],
    }
    mech = build_mechanism(cfg, {**STRUCT, "heads": 6, "kv_heads": 3}, layer=0)
    assert isinstance(mech.members[0], Vanilla) and mech.members[1].params["kv_heads"] == 2
    q = torch.randn(1, 6, 5, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 3, 5, 8, dtype=torch.float64) for _ in range(2))
    out = mech(q, k, v, AttnMask(q_len=5, k_len=5, causal=True))
    expected = hand_attention(q, k, v, [1.0, 1.0, 3.0, 3.0, 3.0, 3.0], torch.zeros(6, 5, 5))
    assert torch.allclose(out, expected, atol=1e-10)


@pytest.mark.parametrize("pos", ["alibi", "rope"])
def test_decode_through_head_groups_equals_full_recompute(pos):
    """Decode state per group: a key/value cache for vanilla, running sums for toy_linear."""
    attention = {"name": "vanilla", "per_head": [{"heads": 2}, {"heads": 2, "name": "toy_linear"}]}
    if pos == "alibi":  # toy_linear takes no score bias
        attention = {"name": "vanilla", "per_head": [{"heads": 2}, {"heads": 2, "name": "toy_record", "temp": 2.0}]}
    model = build_model(attention=attention, pos=pos, kv_heads=2)
    tokens = torch.randint(0, 13, (2, 10))
    full = model(tokens).logits
    assert torch.allclose(decode_logits(model, tokens, prompt=4), full, atol=1e-5)
    assert torch.allclose(decode_logits(model, tokens, prompt=1, step=3), full, atol=1e-5)
