"""AttnMask: the semantic mask against a brute-force loop over (batch, query, key)."""

from __future__ import annotations

import pytest
import torch

from xfam.attention.vanilla import Vanilla, reference_attention
from xfam.core.mask import AttnMask


def brute_force(mask: AttnMask, batch: int) -> torch.Tensor:
    """``[B, 1, Sq, Sk]`` allowed pairs, one pair at a time, straight from the AttnMask docstring."""
    out = torch.zeros(batch, 1, mask.q_len, mask.k_len, dtype=torch.bool)
    off = mask.k_len - mask.q_len
    for b in range(batch):
        for i in range(mask.q_len):
            qi = off + i  # the query's own key index
            for j in range(mask.k_len):
                ok = True
                if mask.causal and j > qi:
                    ok = False
                if mask.window is not None and abs(qi - j) >= mask.window:
                    ok = False
                if mask.key_padding is not None and not bool(mask.key_padding[b, j]):
                    ok = False
                if mask.segments is not None and int(mask.segments[b, qi]) != int(mask.segments[b, j]):
                    ok = False
                out[b, 0, i, j] = ok
            if not out[b, 0, i].any():  # a query that sees nothing attends to itself
                out[b, 0, i, qi] = True
    return out


PAD = torch.tensor([[False, False, True, True, True, True, True, True], [True] * 6 + [False] * 2])
SEG = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7]])

FORMS = {
    "causal": dict(q_len=8, k_len=8, causal=True),
    "causal_offset": dict(q_len=3, k_len=8, causal=True),
    "causal_left_padding": dict(q_len=8, k_len=8, causal=True, key_padding=PAD),
    "causal_offset_padding": dict(q_len=5, k_len=8, causal=True, key_padding=PAD),
    "causal_segments": dict(q_len=8, k_len=8, causal=True, segments=SEG),
    "causal_offset_segments": dict(q_len=4, k_len=8, causal=True, segments=SEG),
    "causal_window": dict(q_len=8, k_len=8, causal=True, window=3),
    "causal_window_offset": dict(q_len=3, k_len=8, causal=True, window=2),
    "bidirectional_padding": dict(q_len=8, k_len=8, key_padding=PAD),
    "bidirectional_segments": dict(q_len=8, k_len=8, segments=SEG),
    "bidirectional_window": dict(q_len=8, k_len=8, window=2),
    "everything": dict(q_len=6, k_len=8, causal=True, key_padding=PAD, segments=SEG, window=4),
}


@pytest.mark.parametrize("form", FORMS)
def test_dense_matches_brute_force(form):
    mask = AttnMask(**FORMS[form])
    dense = mask.dense()
    assert dense is not None and dense.dtype == torch.bool
    expected = brute_force(mask, batch=2)
    assert torch.equal(dense.expand_as(expected), expected)


@pytest.mark.parametrize("form", [f for f, kw in FORMS.items() if "key_padding" not in kw and "segments" not in kw])
def test_visible_agrees_with_dense(form):
    mask = AttnMask(**FORMS[form])
    q_idx = torch.arange(mask.q_len)[:, None]
    k_idx = torch.arange(mask.k_len)[None, :]
    assert torch.equal(mask.visible(q_idx, k_idx), mask.dense()[0, 0])
    # gathered pairs (a sparse path's view): the same answer pair by pair
    qs, ks = torch.randint(0, mask.q_len, (50,)), torch.randint(0, mask.k_len, (50,))
    assert torch.equal(mask.visible(qs, ks), mask.dense()[0, 0, qs, ks])


def test_full_masks_need_no_tensor():
    assert AttnMask(q_len=5, k_len=5).dense() is None  # bidirectional, unrestricted
    assert AttnMask(q_len=1, k_len=9, causal=True).dense() is None  # one decode step sees every key
    assert AttnMask(q_len=1, k_len=9, causal=True, window=4).dense() is not None
    assert AttnMask(q_len=5, k_len=5, causal=True).is_plain_causal
    assert not AttnMask(q_len=4, k_len=5, causal=True).is_plain_causal  # offset: not SDPA's is_causal
    assert not AttnMask(q_len=5, k_len=5, causal=True, window=2).is_plain_causal


def test_positions_are_key_indices():
    q_pos, k_pos = AttnMask(q_len=3, k_len=7, causal=True).positions()
    assert q_pos.tolist() == [4, 5, 6] and k_pos.tolist() == list(range(7))


def test_more_queries_than_keys_is_refused():
    with pytest.raises(ValueError, match="k_len"):
        AttnMask(q_len=4, k_len=3)


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_fully_masked_row_stays_finite_and_isolated(backend):
    """Left padding under a causal mask: pad queries see no real key. Their output must stay finite
    (no NaN from a softmax over nothing), and real tokens must not see the pads."""
    mask = AttnMask(q_len=8, k_len=8, causal=True, key_padding=PAD)
    q, k, v = (torch.randn(2, 2, 8, 4, requires_grad=True) for _ in range(3))
    mech = Vanilla(backend=backend)
    out = mech(q, k, v, mask)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # changing the values of padded keys leaves every real query's output unchanged
    v2 = v.detach().clone()
    v2[0, :, :2] += 10.0
    v2[1, :, 6:] += 10.0
    out2 = mech(q.detach(), k.detach(), v2, AttnMask(q_len=8, k_len=8, causal=True, key_padding=PAD))
    real = PAD[:, None, :, None].expand_as(out)
    assert torch.allclose(out.detach()[real], out2[real], atol=1e-6)
    assert torch.allclose(reference_attention(q, k, v, mask), out, atol=1e-5)
