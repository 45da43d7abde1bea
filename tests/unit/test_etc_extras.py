"""ETC's extras (Ainslie et al., 2020, arXiv:2004.08483): relative position labels in the four attention pieces
(clipped distances in l2l and g2g, own/other segment in l2g and g2l, learned per label and head) and the CPC
pre-training objective (whole sentences masked in the input; InfoNCE of their global tokens' states against those
of a pass that sees each sentence alone)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from doubles import build_model

from xfam.attention import ATTENTION
from xfam.attention._etc_cpc import info_nce
from xfam.attention.etc import ETC, RelativeScores
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


# -- CPC (xfam/attention/_etc_cpc.py) -------------------------------------------------------------------------

CPC = {"name": "etc", "global_tokens": 3, "radius": 3, "block": 4, "cpc_weight": 0.5, "cpc_mask_prob": 1.0}


def cpc_model(**attention) -> torch.nn.Module:
    return build_model(task="mlm", attention={**CPC, **attention}, pos="learned", causal=False, max_len=12).double()


def cpc_explicit(model, tokens: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """ETC's CPC, one masked sentence at a time: the prediction is its global token's state when the row's masked
    sentences are absent from the input; the target that global token's state when the row is the sentence alone."""
    seg, n_g = model.objective.segment, model.objective.n_global
    preds, targets = [], []
    for b in range(tokens.shape[0]):
        for s in range(n_g):
            if not chosen[b, s]:
                continue
            shown = torch.tensor([not chosen[b, t // seg] for t in range(tokens.shape[1])])
            alone = torch.tensor([t // seg == s for t in range(tokens.shape[1])])
            preds.append(model.global_states(tokens[b : b + 1], shown[None])[0, s])
            targets.append(model.global_states(tokens[b : b + 1], alone[None])[0, s])
    p, t = torch.stack(preds), torch.stack(targets)  # [N, D]
    logits = p @ t.T / math.sqrt(p.shape[-1])
    return -torch.stack([logits[i].log_softmax(-1)[i] for i in range(len(p))]).mean()


def test_cpc_is_infonce_of_masked_sentences_against_each_sentence_alone():
    model = cpc_model()
    tokens = torch.randint(0, 13, (3, 12))
    chosen, _, _ = model.objective.choose(tokens, None, training=False)
    assert chosen.sum(-1).tolist() == [2, 2, 2]  # mask_prob 1: every sentence but one per row
    loss = model(tokens).aux["attention/cpc"]
    assert torch.allclose(loss, 0.5 * cpc_explicit(model, tokens, chosen), atol=1e-10)


def test_the_prediction_never_sees_its_sentence_and_the_target_sees_only_it():
    model = cpc_model()
    seg = model.objective.segment  # 4 tokens per sentence
    tokens = torch.randint(0, 13, (1, 12))
    shown = torch.ones(1, 12, dtype=torch.bool)
    shown[0, seg : 2 * seg] = False  # sentence 1 masked
    alone = ~shown
    other = tokens.clone()
    other[0, seg : 2 * seg] = (other[0, seg : 2 * seg] + 1) % 13  # sentence 1 rewritten
    assert torch.equal(model.global_states(tokens, shown), model.global_states(other, shown))
    assert not torch.allclose(model.global_states(tokens, alone)[0, 1], model.global_states(other, alone)[0, 1])
    rest = tokens.clone()
    rest[0, :seg] = (rest[0, :seg] + 1) % 13  # everything outside sentence 1 rewritten
    rest[0, 2 * seg :] = (rest[0, 2 * seg :] + 1) % 13
    assert torch.equal(model.global_states(tokens, alone), model.global_states(rest, alone))


def test_cpc_draws_its_sentences_from_the_rng_in_training_and_a_fixed_seed_in_evaluation():
    model = cpc_model(cpc_mask_prob=0.5)
    tokens = torch.randint(0, 13, (8, 12))
    pad = torch.ones(8, 12, dtype=torch.bool)
    pad[0, 4:] = False  # row 0: one sentence, never masked (one stays visible)
    draws = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        draws.append(model.objective.choose(tokens, pad, training=True)[0])
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert not draws[0][0].any() and not draws[2][0].any()
    first = model.objective.choose(tokens, pad, training=False)[0]
    torch.manual_seed(5)
    assert torch.equal(first, model.objective.choose(tokens, pad, training=False)[0])
    assert torch.equal(
        model(tokens, key_padding=pad).aux["attention/cpc"], model(tokens, key_padding=pad).aux["attention/cpc"]
    )


def test_cpc_trains_the_encoder_through_both_passes_and_needs_two_sentences():
    model = cpc_model().train()
    loss = model(torch.randint(0, 13, (2, 12))).aux["attention/cpc"]
    loss.backward()
    assert model.aux_embed.weight.grad.abs().sum() > 0 and model.embed.weight.grad.abs().sum() > 0
    one = model(torch.randint(0, 13, (1, 8)), key_padding=None).aux["attention/cpc"]  # 2 sentences, 1 masked
    assert one.item() == 0.0
    plain = build_model(task="classify", attention={**CPC, "cpc_weight": 0.0}, causal=False, max_len=12)
    assert plain(torch.randint(0, 13, (2, 12))).aux == {} and plain.objective is None


def test_cpc_learns_to_recognise_a_sentence_from_its_context():
    """Rows repeat one random sentence three times: a masked copy is predictable from the visible ones, so
    InfoNCE falls well below where it starts when only CPC trains (about 4 s)."""
    model = cpc_model(cpc_weight=1.0, cpc_mask_prob=0.4).float().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(150):
        tokens = torch.randint(0, 13, (16, 4), generator=gen).repeat(1, 3)  # [16, 12]
        loss = model(tokens).aux["attention/cpc"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.75 * sum(losses[:20]) / 20


def test_cpc_runs_with_reversible_layers_and_activation_checkpointing():
    for spec in ({"reversible": True}, {"checkpoint_activations": True}):
        model = build_model(task="mlm", attention=CPC, causal=False, max_len=12, **spec).train()
        model(torch.randint(0, 13, (3, 12))).aux["attention/cpc"].backward()
        assert model.aux_embed.weight.grad.abs().sum() > 0


def test_cpc_settings_must_agree_across_layers_and_need_row_inputs():
    def sel(*params, inputs="tokens") -> compat.Selection:
        return compat.Selection(
            attention=[(ATTENTION.get("etc"), p, False) for p in params],
            pos=(POS.get("none"), {}),
            memory=[(MEMORY.get("none"), {})],
            exit=(EXIT.get("none"), {}),
            causal=False,
            task="classify",
            inputs=inputs,
        )

    assert any("every layer" in p for p in compat.check(sel({"cpc_weight": 0.5}, {"cpc_weight": 0.1})))
    assert not any("cpc" in p for p in compat.check(sel({"cpc_weight": 0.5}, {"cpc_weight": 0.5, "radius": 3})))
    assert any("image" in p for p in compat.check(sel({"cpc_weight": 0.5}, inputs="image")))
    assert not any("cpc" in p for p in compat.check(sel({"cpc_weight": 0.0}, inputs="image")))


def test_infonce_is_minimal_when_predictions_match_their_own_targets():
    target = torch.eye(6, 8) * 10.0
    matched = info_nce(target, target)
    shuffled = info_nce(target.roll(1, 0), target)
    blind = info_nce(torch.zeros(6, 8), target)
    assert matched < 1e-3 and blind == pytest.approx(math.log(6)) and shuffled > blind
    assert info_nce(target[:1], target[:1]) == 0.0  # one pair: nothing to contrast


def test_model_trains_the_relative_tables_with_the_cpc_loss():
    attention = {**CPC, "global_tokens": 2, "relative": True, "cpc_mask_prob": 0.5}
    model = build_model(task="classify", attention=attention, pos="none", causal=False, max_len=16).train()
    out = model(torch.randint(0, 13, (3, 14)))
    assert set(out.aux) == {"attention/cpc"}
    (F.cross_entropy(out.logits, torch.tensor([0, 1, 2])) + out.aux["attention/cpc"]).backward()
    rel = model.blocks[0].attn.mechanism.relative
    assert rel.long_emb.grad.abs().sum() > 0 and rel.global_bias.grad.abs().sum() > 0
