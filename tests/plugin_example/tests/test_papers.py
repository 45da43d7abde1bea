"""What the papers promise, beyond xfam's contracts.

``pos=clipped_bias`` (Shaw et al., 2018; T5): the bias of a query and key depends only on ``j - i``, has its own
value for every distance up to the clip, and one value beyond it on each side. ``attention=talking_heads`` (Shazeer
et al., 2020): the heads exchange logits before the softmax and weights after it, exactly as the paper's equations
say, so a change in one head's query reaches every head's output, which plain multi-head attention never does.
"""

from __future__ import annotations

import math

import torch
from xfam_example_plugin import ClippedBias, TalkingHeads

from xfam.api import AttnMask, reference_attention
from xfam.testing.doubles import build_model, decode_logits


def test_clipped_bias_depends_only_on_the_clipped_distance():
    bias = ClippedBias(heads=3, clip=4)
    with torch.no_grad():
        bias.table.copy_(torch.randn(9, 3))  # distinct values for the 2k + 1 distances
    q, k = torch.arange(20)[:, None], torch.arange(20)[None, :]
    b = bias.pairs(q, k)  # [H, 20, 20]
    assert b.shape == (3, 20, 20)
    for i in range(20):
        for j in range(20):
            d = max(-4, min(4, j - i))
            assert torch.equal(b[:, i, j], bias.table[d + 4]), (i, j)
    assert not torch.equal(b[:, 10, 13], b[:, 10, 14])  # within the clip: every distance its own value
    assert torch.equal(b[:, 10, 0], b[:, 10, 6]) and torch.equal(b[:, 0, 10], b[:, 0, 19])  # beyond: one value


def test_a_model_with_the_clipped_bias_decodes_with_its_cache():
    model = build_model(pos={"name": "clipped_bias", "clip": 3})
    with torch.no_grad():
        model.pos.bias.table.normal_()
    x = torch.randint(0, 13, (2, 10))
    assert torch.allclose(decode_logits(model, x, prompt=4, step=2), model(x).logits, atol=1e-5)


def talking_heads_by_the_paper(q, k, v, p_l, p_w, causal):
    """The paper's equations, one (batch, head, query) at a time."""
    b_, h_, s, d = q.shape
    out = torch.zeros_like(q)
    for b in range(b_):
        for i in range(s):
            keys = i + 1 if causal else s
            logits = torch.stack([q[b, h, i] @ k[b, h, :keys].T / math.sqrt(d) for h in range(h_)])  # [H, keys]
            weights = torch.softmax(p_l @ logits, dim=-1)  # mixed logits, softmax per head
            mixed = p_w @ weights  # mixed weights
            for h in range(h_):
                out[b, h, i] = mixed[h] @ v[b, h, :keys]
    return out


def test_talking_heads_is_the_papers_computation_and_its_heads_talk():
    torch.manual_seed(0)
    mech = TalkingHeads(heads=4).double()
    with torch.no_grad():
        mech.logit_mix.copy_(torch.randn(4, 4))
        mech.weight_mix.copy_(torch.randn(4, 4))
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    for causal in (True, False):
        out = mech(q, k, v, AttnMask(q_len=6, k_len=6, causal=causal))
        want = talking_heads_by_the_paper(q, k, v, mech.logit_mix.detach(), mech.weight_mix.detach(), causal)
        torch.testing.assert_close(out, want)
    q2 = q.clone()
    q2[:, 0] += 1.0  # only head 0's queries change
    moved = mech(q2, k, v, AttnMask(q_len=6, k_len=6, causal=True)) - mech(
        q, k, v, AttnMask(q_len=6, k_len=6, causal=True)
    )
    assert all(moved[:, h].abs().max() > 1e-3 for h in range(4)), "every head hears head 0"
    plain = TalkingHeads(heads=4).double()  # at the identity: multi-head attention, heads independent
    torch.testing.assert_close(plain(q, k, v, AttnMask(q_len=6, k_len=6)), reference_attention(q, k, v, AttnMask(6, 6)))
    moved = plain(q2, k, v, AttnMask(q_len=6, k_len=6)) - plain(q, k, v, AttnMask(q_len=6, k_len=6))
    assert moved[:, 0].abs().max() > 1e-3 and moved[:, 1:].abs().max() == 0
