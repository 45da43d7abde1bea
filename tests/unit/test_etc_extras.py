"""ETC's extras (Ainslie et al., 2020, arXiv:2004.08483): relative position labels in the four attention pieces
(clipped distances in l2l and g2g, own/other segment in l2g and g2l, learned per label and head) and the CPC
auxiliary loss (InfoNCE of a global token's masked-segment view against the summary of its segment)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from doubles import build_model

from xfam.attention import ATTENTION
from xfam.attention.etc import ETC, RelativeScores, info_nce
from xfam.core.mask import AttnMask
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import compat
from xfam.pos import POS

B, H, DH = 2, 2, 4


def etc(**params) -> ETC:
    torch.manual_seed(0)
    mech = ATTENTION.build({"name": "etc", "relative": True, "block": 4, **params}, heads=H, head_dim=DH, max_len=12)
    with torch.no_grad():  # tables away from their init (b starts at 0)
        for p in mech.relative.parameters():
            p.copy_(torch.randn_like(p))
    return mech.double()


def label(i: int, j: int, n_g: int, k: int, segment: int) -> int:
    """ETC's label of query row i -> key row j over [globals | long], written out."""
    if (i < n_g) == (j < n_g):  # l2l or g2g: the clipped distance
        return max(-k, min(k, j - i)) + k
    s, t = (i, j - n_g) if i < n_g else (j, i - n_g)  # the global token and the long token
    return 2 * k + 1 + int(t // segment == s)  # other / own


def explicit(mech: ETC, q, k, v, pad=None) -> torch.Tensor:
    """Softmax over the ETC rule of (q.k + q.a_l + b_l) / sqrt(Dh), one (row, key) pair at a time."""
    n_g, n = mech.aux_tokens, q.shape[2]
    rel, kk, seg = mech.relative, mech.relative.k, mech.segment
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(H):
            for i in range(n):
                emb, bias = (rel.global_emb, rel.global_bias) if i < n_g else (rel.long_emb, rel.long_bias)
                scores = torch.full((n,), -math.inf, dtype=q.dtype)
                for j in range(n):
                    if i < n_g:
                        ok = j < n_g or mech.chunk is None or (j - n_g) // seg == i
                    else:
                        ok = j < n_g or abs(i - j) <= mech.radius
                    if ok and (pad is None or pad[b, j]):
                        lab = label(i, j, n_g, kk, seg)
                        scores[j] = (q[b, h, i] @ (k[b, h, j] + emb[lab, h]) + bias[lab, h]) / math.sqrt(DH)
                out[b, h, i] = scores.softmax(-1) @ v[b, h]
    return out


@pytest.mark.parametrize("g2l", ["segment", "full"])
@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_relative_labels_are_the_paper_scores(g2l, backend):
    mech = etc(global_tokens=3, radius=2, max_distance=2, g2l=g2l, backend=backend)
    n = 3 + 12
    q, k, v = (torch.randn(B, H, n, DH, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(B, n, dtype=torch.bool)
    pad[1, -3:] = False
    out = mech(q, k, v, AttnMask(n, n, key_padding=pad))
    ref = explicit(mech, q, k, v, pad)
    assert torch.allclose(out[0], ref[0], atol=1e-10) and torch.allclose(out[1, :, :-3], ref[1, :, :-3], atol=1e-10)


def test_a_global_token_tells_its_own_segment_from_the_others():
    """With no content score, g2l and l2g scores differ only by label: raising the *own* label's bias moves a
    global token's attention onto the long tokens of its segment, and a long token's onto its global token."""
    mech = etc(global_tokens=3, radius=2, max_distance=2, g2l="full")
    n_g, n, own = 3, 15, 2 * 2 + 2
    with torch.no_grad():
        for p in mech.relative.parameters():
            p.zero_()
        mech.relative.global_bias[own] = 100.0
        mech.relative.long_bias[own] = 100.0
    q = torch.randn(1, H, n, DH, dtype=torch.float64)
    k = torch.zeros(1, H, n, DH, dtype=torch.float64)
    where = [0] * n_g + [1 + t // mech.segment for t in range(12)]  # 0: a global token, 1 + s: segment s
    v = F.one_hot(torch.tensor(where), DH).double()[None, None].expand(1, H, n, DH)  # output = mass per class
    out = mech(q, k, v, AttnMask(n, n))[0]  # [H, n, 4]
    for s in range(n_g):
        assert torch.allclose(out[:, s], F.one_hot(torch.tensor(1 + s), DH).double(), atol=1e-9)
    globals_seen = mech(q, k, torch.eye(n, dtype=torch.float64)[None, None, :, :DH].expand(1, H, n, DH), AttnMask(n, n))
    for t in range(12):  # long token t: all its mass on global token t // segment (keys 0..2 carry e_0..e_2)
        mass = globals_seen[0, :, n_g + t, :n_g]
        assert torch.allclose(mass, F.one_hot(torch.tensor(t // mech.segment), n_g).double(), atol=1e-9)


def test_l2l_labels_depend_on_the_clipped_distance_only():
    """The same query at two positions sees the same relative term at the same distances (shift invariance);
    distances beyond k share the clipped label."""
    mech = etc(global_tokens=2, radius=6, max_distance=3)
    n_g, n = 2, 14
    q = torch.randn(1, H, n, DH, dtype=torch.float64)
    q[:, :, n_g + 9] = q[:, :, n_g + 4]  # long tokens 4 and 9 hold the same query
    rel = RelativeScores(mech.relative, q, 0, n_g, None)
    at = lambda t, u: rel.pairs(torch.tensor(n_g + t), torch.tensor(n_g + u))[0]  # noqa: E731  [H]
    for d in range(-4, 5):
        assert torch.equal(at(4, 4 + d), at(9, 9 + d))
    assert torch.equal(at(4, 4 + 3), at(4, 4 + 4)) and torch.equal(at(9, 9 - 3), at(9, 9 - 5))  # clipped at k = 3
    assert not torch.allclose(at(4, 5), at(4, 6))


def _view(q, k, v, b: int, s: int, keys: list[int]) -> torch.Tensor:
    """Global token s of row b attending over ``keys`` only, heads concatenated: ``[H * Dh]``."""
    return torch.cat([(q[b, h, s] @ k[b, h, keys].T / math.sqrt(DH)).softmax(-1) @ v[b, h, keys] for h in range(H)])


def cpc_explicit(mech: ETC, q, k, v, pad) -> torch.Tensor:
    """Predictions (segment hidden) and targets (segment alone) of every (row, segment), then InfoNCE."""
    n_g, n = mech.aux_tokens, q.shape[2]
    preds, targets = [], []
    for b in range(q.shape[0]):
        for s in range(n_g):
            own = [j for j in range(n_g, n) if pad[b, j] and (j - n_g) // mech.segment == s]
            rest = [j for j in range(n_g, n) if pad[b, j] and (j - n_g) // mech.segment != s]
            if not own or not rest:
                continue
            preds.append(_view(q, k, v, b, s, rest))
            targets.append(_view(q, k, v, b, s, own))
    p, t = torch.stack(preds), torch.stack(targets)  # [N, H*Dh]
    logits = p @ t.T / math.sqrt(H * DH)
    return -torch.stack([logits[i].log_softmax(-1)[i] for i in range(len(p))]).mean()


def test_cpc_loss_is_infonce_over_the_segments_of_the_batch():
    mech = etc(global_tokens=3, radius=2, cpc_weight=0.5)
    n = 3 + 12
    q, k, v = (torch.randn(B, H, n, DH, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(B, n, dtype=torch.bool)
    pad[1, -4:] = False  # row 1's last segment is all padding: no target, left out
    mech(q, k, v, AttnMask(n, n, key_padding=pad))
    assert torch.allclose(mech.aux_losses()["cpc"], 0.5 * cpc_explicit(mech, q, k, v, pad), atol=1e-10)


def test_infonce_is_minimal_when_predictions_match_their_own_targets():
    target = torch.eye(6, 8) * 10.0
    matched = info_nce(target, target)
    shuffled = info_nce(target.roll(1, 0), target)
    blind = info_nce(torch.zeros(6, 8), target)
    assert matched < 1e-3 and blind == pytest.approx(math.log(6)) and shuffled > blind
    assert info_nce(target[:1], target[:1]) == 0.0  # one pair: nothing to contrast


def test_model_trains_the_tables_and_the_cpc_loss():
    attention = {"name": "etc", "global_tokens": 2, "radius": 3, "block": 4, "relative": True, "cpc_weight": 1.0}
    model = build_model(task="classify", attention=attention, pos="none", causal=False, max_len=16).train()
    out = model(torch.randint(0, 13, (3, 14)))
    assert set(out.aux) == {"attention/cpc"}
    (F.cross_entropy(out.logits, torch.tensor([0, 1, 2])) + out.aux["attention/cpc"]).backward()
    rel = model.blocks[0].attn.mechanism.relative
    assert rel.long_emb.grad.abs().sum() > 0 and rel.global_bias.grad.abs().sum() > 0
    plain = build_model(task="classify", attention={**attention, "relative": False, "cpc_weight": 0.0}, causal=False)
    assert plain(torch.randint(0, 13, (2, 16))).aux == {}


def test_cpc_is_refused_with_reversible_layers():
    def sel(weight: float) -> compat.Selection:
        return compat.Selection(
            attention=[(ATTENTION.get("etc"), {"cpc_weight": weight}, False)],
            pos=(POS.get("none"), {}),
            memory=[(MEMORY.get("none"), {})],
            exit=(EXIT.get("none"), {}),
            causal=False,
            task="classify",
            reversible=True,
        )

    assert any("cpc_weight=0" in p for p in compat.check(sel(0.5)))
    assert not any("cpc" in p for p in compat.check(sel(0.0)))
