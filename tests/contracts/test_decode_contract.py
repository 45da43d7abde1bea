"""The decode-state contract for state that is not a key/value cache, proven with ``toy_linear``
(causal linear attention whose decode state is the running sums S = sum phi(k) v^T and z = sum phi(k))."""

from __future__ import annotations

import pytest
import torch
from doubles import ToyLinear, build_model, elu1

from xfam.core.mask import AttnMask
from xfam.testing import decode as decode_contract


def test_toy_linear_forward_is_causal_linear_attention():
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    out = ToyLinear()(q, k, v, AttnMask(q_len=5, k_len=5, causal=True))
    fq, fk = elu1(q), elu1(k)
    for i in range(5):
        s = sum(fk[0, :, j, :, None] * v[0, :, j, None, :] for j in range(i + 1))  # [H, Dh, Dh]
        z = sum(fk[0, :, j] for j in range(i + 1))  # [H, Dh]
        expected = torch.einsum("hd,hde->he", fq[0, :, i], s) / (fq[0, :, i] * z).sum(-1, keepdim=True)
        assert torch.allclose(out[0, :, i], expected, atol=1e-12)


def test_decode_state_is_running_sums_not_a_cache():
    mech = ToyLinear()
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    _, state = mech.decode(q[:, :, :3], k[:, :, :3], v[:, :, :3], None, AttnMask(q_len=3, k_len=3, causal=True))
    _, state = mech.decode(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], state, AttnMask(q_len=3, k_len=6, causal=True))
    assert set(state) == {"s", "z"} and state["s"].shape == (1, 2, 4, 4) and state["z"].shape == (1, 2, 4)
    assert torch.allclose(state["s"], torch.einsum("bhsd,bhse->bhde", elu1(k), v), atol=1e-5)
    assert torch.allclose(state["z"], elu1(k).sum(2), atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize(("prompt", "step"), [(4, 1), (1, 1), (3, 5)])
def test_model_decoding_with_running_sums_equals_full_recompute(kv_heads, prompt, step):
    """The kit's model-level decode contract (every xfam mechanism runs it too) on more schedules, and the cache
    holds running sums, not keys and values."""
    decode_contract.test_model_decoding_equals_full_recompute("toy_linear", {}, kv_heads, prompt, step)
    model = build_model(attention={"name": "toy_linear"}, pos="rope", layers=3, kv_heads=kv_heads)
    x = torch.randint(0, 13, (2, 14))
    cache = model(x, cache=model.empty_cache()).cache
    assert cache.length == 14 and all(set(st) == {"s", "z"} for st in cache.layers)
