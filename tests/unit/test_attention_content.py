"""Content-based attention: LSH (Reformer), routing (Routing Transformer), Sinkhorn (Sparse Sinkhorn).

Each mechanism is checked against its paper's definitions written out independently here (hashes by
hand, sort order, chunk and cluster membership, balanced clusters, a doubly stochastic Sinkhorn
matrix), against its degenerate limit, for causal leaks through sorting and clustering, for
decoding = full recomputation, and for its approximation or training-state claims.

One file over 400 lines: the three content-based mechanisms share their fixtures and limits.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from doubles import TableBias, build_model

from xfam.attention import ATTENTION
from xfam.attention.lsh import LSH, _sorted_windows, bucket_attention, route
from xfam.attention.routing import Routing
from xfam.attention.sinkhorn import Sinkhorn, sinkhorn
from xfam.attention.vanilla import reference_attention
from xfam.core.errors import ConfigError
from xfam.core.mask import AttnMask
from xfam.model.compat import matrix

B, H, D = 2, 4, 8
ORIGINAL_SORTED_WINDOWS = _sorted_windows
PAD = torch.tensor([[False] * 3 + [True] * 21, [True] * 19 + [False] * 5])
SEG = torch.tensor([[0] * 10 + [1] * 14, [2] * 7 + [3] * 17])
MASKS = {"plain": {}, "padding": {"key_padding": PAD}, "segments": {"segments": SEG}, "window": {"window": 6}}


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def qkv(n=24, seed=0, heads=H):
    return rand(B, heads, n, D, seed=seed), rand(B, heads, n, D, seed=seed + 1), rand(B, heads, n, D, seed=seed + 2)


def lsh(**kw) -> LSH:
    return LSH(**{"max_len": 64, "n_buckets": 4, "chunk": 4, **kw}).double().eval()


def routing(**kw) -> Routing:
    torch.manual_seed(3)
    return Routing(**{"heads": H, "head_dim": D, "n_clusters": 3, "window": 5, **kw}).double().eval()


def sink(**kw) -> Sinkhorn:
    torch.manual_seed(3)
    return Sinkhorn(**{"kv_heads": H, "head_dim": D, "max_len": 32, "block": 4, **kw}).double().eval()


def visible(mask: AttnMask, b: int, i: int, j: int) -> bool:
    """The mask's rule for one pair, written out (i, j key coordinates)."""
    ok = (not mask.causal or j <= i) and (mask.window is None or abs(i - j) < mask.window)
    ok = ok and (mask.key_padding is None or bool(mask.key_padding[b, j]))
    return ok and (mask.segments is None or bool(mask.segments[b, i] == mask.segments[b, j]))


def softmax_rows(scores: dict[int, float], v: torch.Tensor) -> torch.Tensor:
    js = sorted(scores)
    w = torch.softmax(torch.tensor([scores[j] for j in js], dtype=v.dtype), 0)
    return (w[:, None] * v[js]).sum(0)


def assert_no_leak(mech, q, k, v, t, causal_kw=None):
    mask = lambda: AttnMask(q.shape[2], q.shape[2], causal=True, **(causal_kw or {}))  # noqa: E731
    out = mech(q, k, v, mask())
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, t:] += rand(*x[:, :, t:].shape, seed=99)
    out2 = mech(q2, k2, v2, mask())
    assert (out[:, :, :t] - out2[:, :, :t]).abs().max() < 1e-12  # rounding only: no path from the future
    assert not torch.allclose(out[:, :, t:], out2[:, :, t:], atol=1e-3)


def decode_all(mech, q, k, v, steps=(5, 1, 3, 4, 1, 6, 4), **mask_kw):
    outs, state, t = [], None, 0
    for n in steps:
        kw = {key: val[:, : t + n] for key, val in mask_kw.items()}
        out, state = mech.decode(q[:, :, t : t + n], k[:, :, t : t + n], v[:, :, t : t + n], state,
                                 AttnMask(n, t + n, causal=True, **kw))  # fmt: skip
        outs.append(out)
        t += n
    return torch.cat(outs, dim=2)


# -- LSH -----------------------------------------------------------------------------------------


def test_lsh_hash_is_argmax_of_rotations_and_their_negatives():
    m = lsh(n_buckets=6)
    q = rand(1, 2, 5, D)
    rot = m._rotations(2, 3, q)  # [H, R, Dh, nb/2]
    got = m.hash(q, 3)
    for h in range(2):
        for r in range(3):
            for i in range(5):
                proj = [float(sum(q[0, h, i, d] * rot[h, r, d, c] for d in range(D))) for c in range(3)]
                vals = proj + [-x for x in proj]
                assert got[0, h, r, i] == max(range(6), key=lambda c: vals[c])


def test_lsh_rotations_seeded_in_eval_redrawn_in_training_and_nested_over_rounds():
    q = rand(1, 2, 5, D)
    a, b = lsh(seed=1), lsh(seed=1)
    assert torch.equal(a._rotations(2, 2, q), b._rotations(2, 2, q))
    assert not torch.equal(a._rotations(2, 2, q), lsh(seed=2)._rotations(2, 2, q))
    assert not torch.equal(a._rotations(2, 2, q), lsh(seed=1, layer=1)._rotations(2, 2, q))
    assert torch.equal(a._rotations(2, 8, q)[:, :2], a._rotations(2, 2, q))  # more eval rounds extend fewer
    a.train()
    assert not torch.equal(a._rotations(2, 2, q), a._rotations(2, 2, q))
    assert torch.equal(lsh(seed=1, redraw=False).train()._rotations(2, 2, q), b._rotations(2, 2, q))


def test_route_sorts_by_bucket_then_position_and_chunks_by_rank_within_bucket():
    buckets = torch.randint(0, 4, (3, 30), generator=torch.Generator().manual_seed(0))
    perm, rc = route(buckets, 3)[:2]
    for row in range(3):
        bk = buckets[row].tolist()
        assert perm[row].tolist() == sorted(range(30), key=lambda i: (bk[i], i))
        for i in range(30):
            rank = sum(1 for j in range(i) if bk[j] == bk[i])
            assert rc[row, i] == rank // 3


def lsh_by_definition(m: LSH, q, v, mask: AttnMask, rounds: int) -> torch.Tensor:
    """Shared-QK attention over the union of the rounds' visited pairs, from the definitions: same
    bucket, key's rank-chunk equal to or one before the query's, visible under the mask; itself only
    when nothing else is visible."""
    buckets = m.hash(q, rounds)
    k = F.normalize(q, dim=-1)
    out = torch.empty_like(q)
    n = q.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            rcs = [route(buckets[b, h, r], m.chunk)[1] for r in range(rounds)]
            for i in range(n):
                union = {
                    j for r in range(rounds) for j in range(n)
                    if buckets[b, h, r, i] == buckets[b, h, r, j] and rcs[r][i] - 1 <= rcs[r][j] <= rcs[r][i]
                    and visible(mask, b, i, j)
                }  # fmt: skip
                union = (union - {i}) or union or {i}
                scores = {j: float(q[b, h, i] @ k[b, h, j]) / math.sqrt(D) for j in union}
                out[b, h, i] = softmax_rows(scores, v[b, h])
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", ["plain", "padding", "segments"])
def test_lsh_is_softmax_over_the_union_of_visited_pairs(causal, form):
    m = lsh(n_hashes=3, eval_hashes=3)
    q, k, v = qkv()
    mask = AttnMask(24, 24, causal=causal, **MASKS[form])
    assert torch.allclose(m(q, k, v, mask), lsh_by_definition(m, q, v, mask, 3), atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", list(MASKS))
def test_lsh_chunked_path_equals_dense_reference(causal, form):
    q, k, v = qkv(n=24)
    for kw in ({"n_hashes": 1}, {"n_hashes": 3, "eval_hashes": 3, "chunk": 3, "n_buckets": 8}):
        outs = [
            lsh(backend=backend, **kw)(q, k, v, AttnMask(24, 24, causal=causal, **MASKS[form]), TableBias(H))
            for backend in ("chunked", "dense")
        ]
        assert torch.allclose(*outs, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shared_self", [True, False])
def test_lsh_fast_path_equals_dense_reference_in_values_lse_and_gradients(causal, shared_self):
    """Plain masks without bias take the windowed fast path (its own autograd function): per-round
    outputs, log-normalisers and the gradients of q, k, v equal the L x L reference, with ragged
    last chunks, buckets larger than a chunk (windows of every width) and 1-3 rounds."""
    gen = torch.Generator().manual_seed(5)
    for n, chunk, n_buckets, rounds in ((37, 4, 3, 3), (50, 8, 2, 2), (29, 3, 8, 1), (5, 5, 2, 2)):
        q, k, v = (rand(1, 2, n, D, seed=n + i).requires_grad_() for i in range(3))
        buckets = torch.randint(0, n_buckets, (1, 2, rounds, n), generator=gen)
        got = []
        for dense in (False, True):
            out, lse = bucket_attention(q, k, v, buckets, chunk, AttnMask(n, n, causal=causal), None, shared_self,
                                        dense=dense)  # fmt: skip
            weights = rand(*out.shape, seed=7)
            lse_w = lse.masked_fill(torch.isinf(lse), 0) * (rounds > 1)  # the reference's lse is 0 for one round
            grads = torch.autograd.grad((out * weights).sum() + lse_w.sum(), (q, k, v))
            got.append((out, lse_w, *grads))
        for a, b in zip(*got):
            assert torch.allclose(a, b, atol=1e-10)


def test_lsh_fast_path_in_fp32_matches_fp64_and_is_used_for_plain_masks_only(monkeypatch):
    import xfam.attention.lsh as lsh_module

    calls = []
    monkeypatch.setattr(lsh_module, "_sorted_windows", lambda *a: calls.append(1) or ORIGINAL_SORTED_WINDOWS(*a))
    m = lsh(n_buckets=4, chunk=3, n_hashes=2)
    q, k, v = qkv(n=24)
    for causal in (True, False):
        ref = m(q, k, v, AttnMask(24, 24, causal=causal))
        out = m.float()(q.float(), k.float(), v.float(), AttnMask(24, 24, causal=causal))
        assert torch.allclose(out.double(), ref, atol=1e-5)
        m.double()
    assert len(calls) == 4
    m(q, k, v, AttnMask(24, 24, causal=True, key_padding=PAD))  # padding: the general path
    m(q, k, v, AttnMask(24, 24, causal=True), TableBias(H))  # a score bias: the general path
    assert len(calls) == 4


@pytest.mark.parametrize("causal", [True, False])
def test_lsh_degenerate_limit_is_dense_shared_qk_attention_without_self(causal):
    q, k, v = qkv(n=20)
    out = lsh(n_buckets=1, chunk=20)(q, k, v, AttnMask(20, 20, causal=causal))
    keys = q / q.norm(dim=-1, keepdim=True)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(D)
    allowed = torch.ones(20, 20, dtype=torch.bool).tril() if causal else torch.ones(20, 20, dtype=torch.bool)
    allowed = allowed & ~torch.eye(20, dtype=torch.bool)
    allowed = allowed | (torch.eye(20, dtype=torch.bool) & ~allowed.any(-1, keepdim=True))  # row 0 (causal)
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    assert torch.allclose(out, ref, atol=1e-12)
    assert causal == torch.allclose(out[:, :, 0], v[:, :, 0])  # the first causal query has only itself


@pytest.mark.parametrize("causal", [True, False])
def test_lsh_more_hash_rounds_is_closer_to_full_attention(causal):
    """Mean squared error to dense shared-QK attention (same self rule), averaged over 12 seeds."""
    n, errs = 48, {r: 0.0 for r in (1, 2, 4, 8)}
    for seed in range(12):
        q, v = 2 * rand(1, 2, n, D, seed=seed), rand(1, 2, n, D, seed=seed + 100)
        full = lsh(n_buckets=1, chunk=n)(q, q, v, AttnMask(n, n, causal=causal))
        for r in errs:
            out = lsh(n_buckets=8, chunk=6, eval_hashes=r, seed=seed)(q, q, v, AttnMask(n, n, causal=causal))
            errs[r] += (out - full).pow(2).mean().item() / 12
    assert errs[1] > errs[2] > errs[4] > errs[8] and errs[8] < errs[1] / 4, errs


def test_lsh_no_causal_leak_although_future_hashes_move_past_tokens_in_the_global_sort():
    m = lsh(n_buckets=8, chunk=3, n_hashes=2, eval_hashes=2)
    q, k, v = qkv(n=24)
    q2 = q.clone()
    q2[:, :, 14:] += rand(*q2[:, :, 14:].shape, seed=99)
    perm, perm2 = route(m.hash(q, 2), 3)[0], route(m.hash(q2, 2), 3)[0]
    slot = lambda p, i: (p == i).nonzero()[:, -1]  # noqa: E731 - sorted slot of position i per (b, h, r)
    moved = any(not torch.equal(slot(perm, i), slot(perm2, i)) for i in range(14))
    assert moved  # a global chunk grid would now put past tokens in other chunks: the hazard is real here
    for t in (5, 14, 23):
        assert_no_leak(m, q, k, v, t)
        assert_no_leak(m, q, k, v, t, {"key_padding": PAD, "segments": SEG})


def test_lsh_decoding_recomputes_the_prefix_and_equals_the_full_forward():
    m = lsh(n_buckets=8, chunk=3, n_hashes=2, eval_hashes=3)
    q, k, v = qkv(n=24)
    full = m(q, k, v, AttnMask(24, 24, causal=True, key_padding=PAD), TableBias(H))
    assert torch.allclose(decode_all_bias(m, q, k, v, TableBias(H), key_padding=PAD), full, atol=1e-12)


def decode_all_bias(mech, q, k, v, bias, **mask_kw):
    outs, state, t = [], None, 0
    for n in (5, 1, 3, 4, 1, 6, 4):
        kw = {key: val[:, : t + n] for key, val in mask_kw.items()}
        mask = AttnMask(n, t + n, causal=True, **kw)
        out, state = mech.decode(q[:, :, t : t + n], k[:, :, t : t + n], v[:, :, t : t + n], state, mask, bias)
        outs.append(out)
        t += n
    return torch.cat(outs, dim=2)


def test_lsh_eval_is_deterministic_and_uses_eval_hashes_training_redraws():
    m = lsh(n_hashes=2, eval_hashes=5)
    seen = []
    hash_ = m.hash
    m.hash = lambda q, rounds: seen.append(rounds) or hash_(q, rounds)
    q, k, v = qkv()
    mask = lambda: AttnMask(24, 24, causal=True)  # noqa: E731
    assert torch.equal(m(q, k, v, mask()), m(q, k, v, mask()))
    m.train()
    assert not torch.equal(m(q, k, v, mask()), m(q, k, v, mask()))
    assert seen == [5, 5, 2, 2]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"chunk": 128}, "chunk=128 is larger than model.max_len=64"),
        ({"n_buckets": 5}, "n_buckets=5 is odd"),
        ({"n_buckets": 128}, "n_buckets=128 exceeds model.max_len=64"),
        ({"shared_qk": False}, "shared_qk=false needs n_buckets=1"),
    ],
)
def test_lsh_nonsense_settings_are_config_errors(params, expected):
    with pytest.raises(ConfigError, match=expected):
        ATTENTION.build({"name": "lsh", "n_buckets": 4, **params}, max_len=64, causal=True)


# -- routing -------------------------------------------------------------------------------------


def nearest(m: Routing, x, b, h, c, keep=None) -> list[int]:
    """The ``window`` positions nearest centroid c, by hand (padded positions last)."""
    d = [float((x[b, h, i] - m.centroids[h, c]).norm()) for i in range(x.shape[2])]
    d = [di if keep is None or keep[b, i] else math.inf for i, di in enumerate(d)]
    return sorted(sorted(range(x.shape[2]), key=lambda i: d[i])[: m.window])


def test_routing_balanced_clusters_take_the_window_nearest_queries_and_keys():
    m = routing(window=5)
    q, k, _ = qkv()
    for x in (F.layer_norm(q, (D,)), F.layer_norm(k, (D,))):
        got = m.members(x)
        assert got.shape == (B, H, 3, 5)  # every cluster has exactly ``window`` members
        for b in range(B):
            for h in range(H):
                for c in range(3):
                    assert got[b, h, c].tolist() == nearest(m, x, b, h, c)
    keep = torch.ones(B, 24, dtype=torch.bool)
    keep[:, ::2] = False
    assert (m.members(F.layer_norm(q, (D,)), keep) % 2 == 1).all()  # padding is never chosen


def routing_by_definition(m: Routing, q, k, v, mask: AttnMask) -> torch.Tensor:
    """Bidirectional: each query averages, over the clusters that chose it, softmax attention to the
    chosen keys it may see; causal: a query sees earlier-or-equal positions of its own cluster whose
    rank in the cluster is in its group or the previous one. Itself when it sees nothing."""
    qn, kn = F.layer_norm(q, (D,)), F.layer_norm(k, (D,))
    out, pad = torch.empty_like(q), mask.key_padding
    n = q.shape[2]
    for b in range(B):
        for h in range(H):
            if mask.causal:
                cl = m.assign(qn)[b, h].tolist()
                rank = [sum(1 for j in range(i) if cl[j] == cl[i]) // m.window for i in range(n)]
            for i in range(n):
                parts = []
                groups = (
                    [{j for j in range(n) if cl[j] == cl[i] and rank[i] - 1 <= rank[j] <= rank[i]}]
                    if mask.causal
                    else [set(nearest(m, kn, b, h, c, pad)) for c in range(m.n_clusters)
                          if i in nearest(m, qn, b, h, c, pad)]
                )  # fmt: skip
                for keys in groups:
                    seen = {j: float(q[b, h, i] @ k[b, h, j]) / math.sqrt(D) for j in keys if visible(mask, b, i, j)}
                    if seen:
                        parts.append(softmax_rows(seen, v[b, h]))
                out[b, h, i] = sum(parts) / len(parts) if parts else v[b, h, i]
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", ["plain", "padding", "segments"])
def test_routing_matches_its_definition(causal, form):
    m = routing()
    q, k, v = qkv()
    mask = AttnMask(24, 24, causal=causal, **MASKS[form])
    assert torch.allclose(m(q, k, v, mask), routing_by_definition(m, q, k, v, mask), atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", list(MASKS))
def test_routing_grouped_path_equals_dense_reference(causal, form):
    q, k, v = qkv()
    outs = [
        routing(backend=backend)(q, k, v, AttnMask(24, 24, causal=causal, **MASKS[form]), TableBias(H))
        for backend in ("grouped", "dense")
    ]
    assert torch.allclose(*outs, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_routing_one_cluster_is_dense_attention(causal):
    q, k, v = qkv()
    mask = lambda: AttnMask(24, 24, causal=causal, key_padding=PAD)  # noqa: E731
    out = routing(n_clusters=1, window=24)(q, k, v, mask(), TableBias(H))
    assert torch.allclose(out, reference_attention(q, k, v, mask(), TableBias(H)), atol=1e-12)


def test_routing_no_causal_leak_and_decoding_equals_full():
    m = routing(window=4)
    q, k, v = qkv()
    for t in (3, 12, 20):
        assert_no_leak(m, q, k, v, t)
        assert_no_leak(m, q, k, v, t, {"segments": SEG})
    full = m(q, k, v, AttnMask(24, 24, causal=True, key_padding=PAD), TableBias(H))
    assert torch.allclose(decode_all_bias(m, q, k, v, TableBias(H), key_padding=PAD), full, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_routing_centroids_move_by_ema_of_cluster_means_in_training_only(causal):
    m = routing(decay=0.9)
    q, k, v = qkv()
    before = m.centroids.clone()
    m(q, k, v, AttnMask(24, 24, causal=causal))
    assert torch.equal(m.centroids, before)  # eval: no update
    m.train()
    with torch.no_grad():
        m(q, k, v, AttnMask(24, 24, causal=causal))
    assert torch.equal(m.centroids, before)  # no autograd recording (a reversible stack's forward)
    routed = [F.layer_norm(q, (D,))] + ([] if causal else [F.layer_norm(k, (D,))])
    near = [(x[..., None, :] - before[:, None]).norm(dim=-1).argmin(-1) for x in routed]  # [B, H, L] each
    expected = before.clone()
    for h in range(H):
        for c in range(3):
            members = [
                x[b, h, i] for x, cl in zip(routed, near) for b in range(B) for i in range(24) if cl[b, h, i] == c
            ]
            if members:
                expected[h, c] = 0.9 * before[h, c] + 0.1 * torch.stack(members).mean(0)
    m(q.requires_grad_(), k, v, AttnMask(24, 24, causal=causal))
    assert torch.allclose(m.centroids, expected, atol=1e-12) and not torch.equal(m.centroids, before)


def test_routing_centroids_travel_in_the_state_dict_and_resume_exactly():
    a = routing().train()
    q, k, v = qkv()
    a(q.requires_grad_(), k, v, AttnMask(24, 24, causal=True))
    assert "centroids" in a.state_dict()
    b = routing(decay=0.999).train()
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(q, k, v, AttnMask(24, 24, causal=True))
    assert torch.equal(a.centroids, b.centroids)


def test_routing_commitment_loss_is_the_distance_to_the_assigned_centroid():
    m = routing(commitment=0.5).train()
    q = rand(B, H, 24, D).requires_grad_()
    _, k, v = qkv()
    centroids = m.centroids.clone()
    m(q, k, v, AttnMask(24, 24, causal=True))
    qn = F.layer_norm(q, (D,))
    clusters = (qn[..., None, :] - centroids[:, None]).norm(dim=-1).argmin(-1)  # nearest centroid [B, H, L]
    near = centroids[torch.arange(H)[:, None], clusters]
    loss = m.aux_losses()["routing"]
    assert torch.allclose(loss, 0.5 * (qn - near).pow(2).mean())
    loss.backward()
    assert q.grad.abs().sum() > 0


def test_routing_mixed_heads_experiment_builds_and_trains():
    path = Path(__file__).parents[2] / "configs" / "experiment" / "routing_mixed_heads.yaml"
    groups = yaml.safe_load(path.read_text())["attention"]["per_head"]
    defaults = yaml.safe_load((path.parents[1] / "attention" / "routing.yaml").read_text())
    groups[1]["window"] = 8  # CPU-test sizes: windows that fit max_len=32
    attention = {**defaults, "window": 8, "per_head": groups}
    model = build_model(attention=attention, layers=2, heads=4, max_len=32).train()
    members = model.blocks[0].attn.mechanism.members
    assert [type(mm).registry_name for mm in members] == ["routing", "local"]
    routing_heads = members[0]
    before = routing_heads.centroids.clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 13, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        out = model(x)
        loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, 13), x[:, 1:].reshape(-1))
        (loss + sum(out.aux.values())).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert "attention/routing" in out.aux and losses[-1] < losses[0]
    assert not torch.equal(routing_heads.centroids, before)


# -- Sinkhorn ------------------------------------------------------------------------------------


def test_sinkhorn_matrix_is_doubly_stochastic():
    logits = rand(3, 6, 6, seed=5)
    s = sinkhorn(logits / 0.75, torch.ones(6, 6, dtype=torch.bool), iters=60, causal=False)
    assert torch.allclose(s.sum(-1), torch.ones(3, 6, dtype=s.dtype), atol=1e-6)
    assert torch.allclose(s.sum(-2), torch.ones(3, 6, dtype=s.dtype), atol=1e-10)  # the last step: columns
    one = sinkhorn(logits, torch.ones(6, 6, dtype=torch.bool), iters=1, causal=False)
    rows = torch.softmax(logits, -1)
    assert torch.allclose(one, rows / rows.sum(-2, keepdim=True), atol=1e-10)  # S^1 = F_c(F_r(exp R))


def test_causal_sinkhorn_uses_only_past_blocks_and_past_rows():
    allowed = torch.ones(6, 6, dtype=torch.bool).tril(-1)
    logits = rand(2, 6, 6, seed=5)
    s = sinkhorn(logits, allowed, iters=5, causal=True)
    assert torch.equal(s[..., ~allowed], torch.zeros_like(s[..., ~allowed])) and (s[..., allowed] > 0).all()
    later = logits.clone()
    later[:, 4:] += rand(2, 2, 6, seed=6)
    s2 = sinkhorn(later, allowed, iters=5, causal=True)
    assert torch.equal(s[:, :4], s2[:, :4]) and not torch.allclose(s[:, 4:], s2[:, 4:])


@pytest.mark.parametrize("causal", [True, False])
def test_sinkhorn_sorting_network_reads_block_sums_or_causal_prefix_means(causal):
    m = sink(sinkhorn_iters=1, temperature=1.0)
    _, k, _ = qkv(n=22)
    s, _ = m.sort_matrix(k, AttnMask(22, 22, causal=causal))
    n = 6  # ceil(22 / 4)
    for b in range(B):
        for h in range(H):
            rows = []
            for i in range(n):
                psi = k[b, h, : 4 * i + 1].mean(0) if causal else k[b, h, 4 * i : 4 * i + 4].sum(0)
                hidden = torch.relu(psi @ m.w_p[h] + m.b_p[h, 0])
                rows.append(hidden @ m.w_b[h, :, :n] + m.b_b[h, 0, :n])
            r = torch.stack(rows)  # R [nB, nB]
            allowed = torch.ones(n, n, dtype=torch.bool).tril(-1) if causal else torch.ones(n, n, dtype=torch.bool)
            e = r.exp() * allowed
            e = e / e.sum(-1, keepdim=True).clamp_min(1e-300)  # F_r
            e = e / (e.cumsum(0) if causal else e.sum(0, keepdim=True)).clamp_min(1e-300) * allowed  # F_c
            assert torch.allclose(s[b, h], e.nan_to_num(), atol=1e-10)


def sinkhorn_by_definition(m: Sinkhorn, q, k, v, mask: AttnMask) -> torch.Tensor:
    """Query block i attends, under one softmax, to its own block's visible keys and to the sorted
    block sum_j S_ij K_j (renormalised over unpadded keys). Plain and padding masks only."""
    with torch.no_grad():
        s, _ = m.sort_matrix(k, mask)
    n, b, out = s.shape[-1], m.block, torch.empty_like(q)
    keep = mask.key_padding if mask.key_padding is not None else torch.ones(B, q.shape[2], dtype=torch.bool)
    for bb in range(B):
        for h in range(H):
            for i in range(q.shape[2]):
                blk = i // b
                keys = [(k[bb, h, j], v[bb, h, j]) for j in range(blk * b, min(blk * b + b, q.shape[2]))
                        if visible(mask, bb, i, j)]  # fmt: skip
                for t in range(b):
                    w = [(float(s[bb, h, blk, jb]), jb * b + t) for jb in range(n)
                         if jb * b + t < q.shape[2] and keep[bb, jb * b + t]]  # fmt: skip
                    tot = sum(x for x, _ in w)
                    if tot > 0:
                        keys.append(
                            (sum(x * k[bb, h, p] for x, p in w) / tot, sum(x * v[bb, h, p] for x, p in w) / tot)
                        )
                if not keys:
                    out[bb, h, i] = v[bb, h, i]
                    continue
                scores = torch.stack([q[bb, h, i] @ kk for kk, _ in keys]) / math.sqrt(D)
                out[bb, h, i] = (torch.softmax(scores, 0)[:, None] * torch.stack([vv for _, vv in keys])).sum(0)
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", ["plain", "padding"])
def test_sinkhorn_matches_its_definition(causal, form):
    m = sink()
    q, k, v = qkv(n=22)
    kw = {key: val[:, :22] for key, val in MASKS[form].items()}
    mask = AttnMask(22, 22, causal=causal, **kw)
    assert torch.allclose(m(q, k, v, mask), sinkhorn_by_definition(m, q, k, v, mask), atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", list(MASKS))
def test_sinkhorn_block_path_equals_dense_reference(causal, form):
    q, k, v = qkv(n=23)
    kw = {key: val[:, :23] for key, val in MASKS[form].items() if key != "window"}
    kw |= {"window": 9} if form == "window" else {}
    outs = [sink(backend=bk)(q, k, v, AttnMask(23, 23, causal=causal, **kw)) for bk in ("block", "dense")]
    assert torch.allclose(*outs, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_sinkhorn_one_block_is_dense_attention_even_with_gumbel_noise(causal):
    q, k, v = qkv()
    m = sink(block=24, max_len=24).train()
    mask = lambda: AttnMask(24, 24, causal=causal, key_padding=PAD)  # noqa: E731
    assert torch.allclose(m(q, k, v, mask()), reference_attention(q, k, v, mask()), atol=1e-12)


def test_sinkhorn_no_causal_leak_and_decoding_equals_full():
    m = sink()
    q, k, v = qkv()
    for t in (4, 9, 14, 21):  # block starts and mid-block
        assert_no_leak(m, q, k, v, t)
        assert_no_leak(m, q, k, v, t, {"key_padding": PAD, "segments": SEG})
    full = m(q, k, v, AttnMask(24, 24, causal=True, segments=SEG))
    assert torch.allclose(decode_all(m, q, k, v, segments=SEG), full, atol=1e-12)


def test_sinkhorn_sorted_blocks_respect_documents_and_gumbel_only_in_training():
    m = sink()
    q, k, v = qkv()
    s, _ = m.sort_matrix(k, AttnMask(24, 24, causal=False, segments=SEG))
    # row 0 has blocks 0-1 (document 0) and block 2 straddling: only uniform blocks of its document
    assert (s[0, :, 0, 2:] == 0).all() and (s[0, :, 0, :2] > 0).all()
    mask = lambda: AttnMask(24, 24, causal=False)  # noqa: E731
    assert torch.equal(m(q, k, v, mask()), m(q, k, v, mask()))
    m.train()
    assert not torch.equal(m(q, k, v, mask()), m(q, k, v, mask()))
    assert not torch.equal(sink(gumbel_noise=False).train()(q, k, v, mask()), m(q, k, v, mask()))


def test_sinkhorn_refuses_a_bias_and_too_large_blocks():
    assert not Sinkhorn.accepts_bias and "score bias" in matrix()[("sinkhorn", "alibi")]
    with pytest.raises(ConfigError, match="block=128 is larger than model.max_len=64"):
        ATTENTION.build({"name": "sinkhorn", "block": 128}, max_len=64, kv_heads=4, head_dim=8)
    with pytest.raises(ConfigError, match="window=128 is larger than model.max_len=64"):
        ATTENTION.build({"name": "routing", "window": 128}, max_len=64, heads=4, head_dim=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_hashes", [1, 2])
def test_lsh_general_path_runs_in_half_precision(dtype, causal, n_hashes):
    """With padding the general path runs: its self penalty (a float times a bool mask) once came out fp32 and
    met bf16 values in the last matmul; in fp16 the penalty itself, 1e5, overflowed."""
    m = lsh(n_hashes=n_hashes).float()
    q, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    pad = torch.ones(2, 16, dtype=torch.bool)
    pad[1, 12:] = False
    mask = AttnMask(16, 16, causal=causal, key_padding=pad)
    want = m(q, q, v, mask)
    got = m.to(dtype)(q.to(dtype), q.to(dtype), v.to(dtype), mask)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)
