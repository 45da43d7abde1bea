"""The sparse engine: the block path equals the dense reference for every mask form, layouts cover
their patterns, and the local patterns are the papers' definitions."""

from __future__ import annotations

import pytest
import torch
from doubles import TableBias

from xfam.attention._base import ATTENTION
from xfam.attention._sparse import (
    SparsePattern,
    auto_block,
    block_sparse_attention,
    dense_sparse_attention,
    pattern_dense,
)
from xfam.attention._sparse.engine import geometry
from xfam.attention.local import BlockLocalPattern, WindowPattern
from xfam.attention.vanilla import reference_attention
from xfam.core.mask import AttnMask
from xfam.pos.alibi import AlibiBias

B, H, DH = 2, 4, 8


class RandomBlocks(SparsePattern):
    """Test pattern: per-head random key blocks plus global positions, exercising the gather path
    (not banded), per-head layouts and global rows and columns."""

    def __init__(self, block: int, heads: int, seed: int, globals_: tuple[int, ...] = ()):
        self.block, self.heads, self.seed, self.global_positions = block, heads, seed, globals_

    def _chosen(self, n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.rand(self.heads, n_q, n_k, generator=g).to(device) < 0.4  # [H, nQ, nK]

    def allowed(self, q_pos, k_pos, head=None):
        chosen = self._chosen(64, 64, q_pos.device)
        qb, kb = (
            torch.div(q_pos, self.block, rounding_mode="floor"),
            torch.div(k_pos, self.block, rounding_mode="floor"),
        )
        head, qb, kb = torch.broadcast_tensors(head, qb, kb)
        return chosen[head, qb, kb]

    def layout(self, n_q, n_k, offset, causal, device):
        chosen = self._chosen(64, 64, device)
        rows = torch.div(offset + torch.arange(n_q, device=device) * self.block, self.block, rounding_mode="floor")
        # A query block may straddle two pattern rows when offset is not a multiple of the block.
        both = chosen[:, rows, :n_k] | chosen[:, (rows + 1).clamp(max=63), :n_k]  # [H, nQ, nK]
        k = int(both.sum(-1).max())
        idx = torch.full((self.heads, n_q, max(k, 1)), -1, dtype=torch.long, device=device)
        for h in range(self.heads):
            for i in range(n_q):
                cols = both[h, i].nonzero().flatten()
                idx[h, i, : len(cols)] = cols
        return idx


def qkv(sq: int, sk: int, kv_heads: int = H, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, sq, DH, generator=g, dtype=dtype)
    k, v = (torch.randn(B, kv_heads, sk, DH, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def masks(sq: int, sk: int):
    g = torch.Generator().manual_seed(2)
    pad = torch.rand(B, sk, generator=g) > 0.25
    seg = torch.cumsum(torch.rand(B, sk, generator=g) < 0.1, dim=1)
    return {
        "causal": AttnMask(q_len=sq, k_len=sk, causal=True),
        "bidirectional": AttnMask(q_len=sq, k_len=sk),
        "padding": AttnMask(q_len=sq, k_len=sk, causal=True, key_padding=pad),
        "segments": AttnMask(q_len=sq, k_len=sk, causal=True, segments=seg),
        "window": AttnMask(q_len=sq, k_len=sk, causal=False, window=5),
        "bidirectional-padding": AttnMask(q_len=sq, k_len=sk, key_padding=pad),
    }


PATTERNS = {
    "window": lambda: WindowPattern(7, 4, True),
    "window-wide-tile": lambda: WindowPattern(7, 16, True),
    "image-block": lambda: BlockLocalPattern(5, 6, 4),
    "random-per-head": lambda: RandomBlocks(4, H, seed=3),
    "random-globals": lambda: RandomBlocks(4, H, seed=4, globals_=(0, 9, 30)),
}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("form", ["causal", "bidirectional", "padding", "segments", "window", "bidirectional-padding"])
@pytest.mark.parametrize(("sq", "sk"), [(37, 37), (13, 37), (1, 37)], ids=["full", "offset", "one-query"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_block_path_equals_dense_reference(pattern, form, sq, sk, with_bias) -> None:
    p = PATTERNS[pattern]()
    mask = masks(sq, sk)[form]
    q, k, v = qkv(sq, sk, kv_heads=2)
    bias = None
    if with_bias:
        bias = TableBias(H, 64).double() if pattern.startswith("random") else AlibiBias(H, H).double()
    a = block_sparse_attention(q, k, v, p, mask, bias)
    b = dense_sparse_attention(q, k, v, p, mask, bias)
    assert torch.allclose(a, b, atol=1e-10), (a - b).abs().max()


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("offset", [0, 3, 16])
def test_layout_covers_every_allowed_pair(pattern, offset) -> None:
    p = PATTERNS[pattern]()
    for causal in (True, False):
        mask = AttnMask(q_len=40, k_len=40 + offset, causal=causal)
        geo = geometry(p, mask, torch.device("cpu"))
        q_pos, k_pos = mask.positions()
        want = pattern_dense(p, mask, torch.device("cpu")) & (mask.dense()[0] if causal else True)  # [Hp, Sq, Sk]
        got = torch.zeros_like(want)
        for h in range(geo.k_pos.shape[0]):
            for i in range(geo.k_pos.shape[1]):
                for r in range(p.block):
                    qi = i * p.block + r
                    if qi < 40:
                        keys = geo.k_pos[h, i][geo.ok[h, i, r]]
                        got[h % want.shape[0], qi, keys] = True
        g = torch.tensor(p.global_positions, dtype=torch.long)
        if len(g):  # global keys and rows are handled beside the blocks
            got[:, :, g[g < 40 + offset]] |= want[:, :, g[g < 40 + offset]]
            rows = g[(g >= offset) & (g < 40 + offset)] - offset
            got[:, rows] = want[:, rows]
        assert torch.equal(got, want.expand_as(got))


def test_window_pattern_is_the_sliding_window() -> None:
    i, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    ok = WindowPattern(4, 8, True).allowed(i, j)
    assert torch.equal(ok, (i - j).abs() < 4)
    assert ok[10].nonzero().flatten().tolist() == [7, 8, 9, 10, 11, 12, 13]  # causal keeps 7..10


def test_image_transformer_block_rule() -> None:
    # query blocks of 4 with 3 memory positions: query 9 (block 8..11) sees 5..11
    ok = BlockLocalPattern(4, 3, 2).allowed(torch.tensor(9), torch.arange(16))
    assert ok.nonzero().flatten().tolist() == [5, 6, 7, 8, 9, 10, 11]
    ok0 = BlockLocalPattern(4, 3, 2).allowed(torch.tensor(1), torch.arange(16))
    assert ok0.nonzero().flatten().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tile", [4, 16, 64])
def test_window_covering_the_sequence_is_dense_attention(causal: bool, tile: int) -> None:
    mech = ATTENTION.build({"name": "local", "window": 37, "block": tile}, max_len=64, causal=causal)
    q, k, v = qkv(37, 37)
    mask = AttnMask(q_len=37, k_len=37, causal=causal)
    assert torch.allclose(mech(q, k, v, mask), reference_attention(q, k, v, mask), atol=1e-10)


def test_result_does_not_depend_on_the_tile() -> None:
    q, k, v = qkv(50, 50)
    mask = AttnMask(q_len=50, k_len=50, causal=True)
    outs = [block_sparse_attention(q, k, v, WindowPattern(9, tile, True), mask) for tile in (1, 3, 8, 64)]
    assert all(torch.allclose(outs[0], o, atol=1e-10) for o in outs[1:])


def test_auto_tile_is_the_power_of_two_near_half_the_reach_within_64_to_256() -> None:
    assert [auto_block(r) for r in (1, 100, 128, 256, 512, 600, 4096)] == [64, 64, 64, 128, 256, 256, 256]
    assert ATTENTION.build({"name": "local", "window": 512}, max_len=1024, causal=True).pattern.block == 256


def test_gradients_are_finite_with_empty_rows_and_match_the_reference() -> None:
    q, k, v = (t.requires_grad_() for t in qkv(20, 20))
    pad = torch.ones(B, 20, dtype=torch.bool)
    pad[:, :6] = False  # left padding: the first queries see nothing under causality
    mask = AttnMask(q_len=20, k_len=20, causal=True, key_padding=pad)
    block_sparse_attention(q, k, v, WindowPattern(4, 4, True), mask).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    assert all(torch.isfinite(g).all() for g in grads)
    for t in (q, k, v):
        t.grad = None
    dense_sparse_attention(q, k, v, WindowPattern(4, 4, True), mask).sum().backward()
    assert all(torch.allclose(g, t.grad, atol=1e-10) for g, t in zip(grads, (q, k, v)))


def test_geometry_is_cached_across_calls() -> None:
    p = WindowPattern(5, 4, True)
    mask = AttnMask(q_len=16, k_len=16, causal=True)
    assert geometry(p, mask, torch.device("cpu")) is geometry(p, AttnMask(q_len=16, k_len=16, causal=True), "cpu")


def test_window_larger_than_max_len_is_a_config_error() -> None:
    problems = ATTENTION.check({"name": "local", "window": 300}, {"max_len": 256, "causal": True})
    assert problems and "valid: 1..256" in problems[0] and "Fix:" in problems[0]
