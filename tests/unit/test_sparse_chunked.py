"""The block engine in chunks of query blocks (``xfam/attention/_sparse/chunked.py``): the output is bitwise
the whole path's, gradients are bitwise the same for every chunk size and equal autograd's whole path up to
summation order; a learned bias or attention dropout takes the whole path."""

from __future__ import annotations

import pytest
import torch
from test_sparse import PATTERNS, masks, qkv

from xfam.attention._sparse import block_sparse_attention, chunked
from xfam.attention._sparse.engine import geometry
from xfam.attention.local import WindowPattern
from xfam.core.bias import ScoreBias
from xfam.core.mask import AttnMask
from xfam.pos.alibi import AlibiBias


def _run(pattern, mask, bias, mode: str, monkeypatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Output and (q, k, v) gradients of a weighted sum, on the whole path, in one chunk or one block per chunk."""
    q, k, v = (t.requires_grad_() for t in qkv(mask.q_len, mask.k_len, kv_heads=2, dtype=torch.float32))
    with monkeypatch.context() as m:
        if mode == "whole":
            m.setattr(chunked, "applies", lambda bias, dropout: False)
        m.setattr(chunked, "CHUNK_BYTES", 1 if mode == "blocks" else 2**40)
        out = block_sparse_attention(q, k, v, pattern, mask, bias)
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    return out, grads


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("form", ["causal", "bidirectional", "padding", "segments"])
@pytest.mark.parametrize(("sq", "sk"), [(37, 37), (13, 37)], ids=["full", "offset"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "alibi"])
def test_chunks_equal_the_whole_path(pattern, form, sq, sk, with_bias, monkeypatch) -> None:
    p, mask = PATTERNS[pattern](), masks(sq, sk)[form]
    bias = AlibiBias(4, 4) if with_bias else None
    whole, g_whole = _run(p, mask, bias, "whole", monkeypatch)
    one, g_one = _run(p, mask, bias, "one", monkeypatch)
    blocks, g_blocks = _run(p, mask, bias, "blocks", monkeypatch)
    assert torch.equal(whole, one) and torch.equal(one, blocks)  # bitwise, whatever the chunking
    assert all(torch.equal(a, b) for a, b in zip(g_one, g_blocks))  # the summation order does not depend on it
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(g_whole, g_one)), [
        float((a - b).abs().max()) for a, b in zip(g_whole, g_one)
    ]


def test_plan_keeps_each_chunk_within_the_budget() -> None:
    p, mask = WindowPattern(64, 16, True), AttnMask(q_len=256, k_len=256, causal=True)
    q = torch.zeros(2, 4, 256, 8)
    geo = geometry(p, mask, q.device)
    per_block = 2 * 4 * 16 * geo.k_pos.shape[-1] * 4  # [B, H, 1, b, Kb] floats
    plan = chunked.plan(q, geo, 16, mask, None, budget=3 * per_block)
    assert [c1 - c0 for c0, c1 in plan.chunks] == [3, 3, 3, 3, 3, 1]
    assert chunked.plan(q, geo, 16, mask, None, budget=1).chunks[:2] == ((0, 1), (1, 2))  # at least one block


class LearnedDistance(ScoreBias):
    """A bias with a parameter: ``w[h] * (i - j)``."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads, self.w = heads, torch.nn.Parameter(torch.linspace(-0.5, 0.5, heads))

    def pairs(self, q_pos, k_pos):
        return self.w.view(-1, *[1] * len(torch.broadcast_shapes(q_pos.shape, k_pos.shape))) * (q_pos - k_pos)


def test_a_learned_bias_and_dropout_take_the_whole_path() -> None:
    table = LearnedDistance(4)
    assert not chunked.applies(table, 0.0) and not chunked.applies(None, 0.1)
    assert chunked.applies(AlibiBias(4, 4), 0.0) and chunked.applies(None, 0.0)
    with torch.no_grad():  # nothing learns without grad
        assert chunked.applies(table, 0.0)
    per_call = type("PerCallTerm", (), {"pairs": lambda self, q_pos, k_pos: q_pos - k_pos})()  # not a module (ETC's)
    assert not chunked.applies(per_call, 0.0)
    q, k, v = qkv(20, 20, dtype=torch.float32)
    mask = AttnMask(q_len=20, k_len=20, causal=True)
    (block_sparse_attention(q, k, v, WindowPattern(5, 4, True), mask, table) * torch.rand(2, 4, 20, 8)).sum().backward()
    assert table.w.grad is not None and table.w.grad.abs().sum() > 0


def test_bfloat16_autocast_gradients_match_the_whole_path(monkeypatch) -> None:
    p, mask = WindowPattern(7, 4, True), AttnMask(q_len=37, k_len=37, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole, g_whole = _run(p, mask, None, "whole", monkeypatch)
        one, g_one = _run(p, mask, None, "blocks", monkeypatch)
    assert whole.dtype == one.dtype and torch.equal(whole, one)
    assert all(a.dtype == torch.float32 and torch.allclose(a, b, atol=2e-2) for a, b in zip(g_one, g_whole))
