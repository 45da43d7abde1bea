"""RoPE on a subset of heads (``pos.rotary_heads``): the first n query heads (and the key/value heads they
read) are rotated, so their scores depend on relative positions only; the other heads carry no position."""

from __future__ import annotations

import pytest
import torch

from xfam.pos.rope import Rope


def _scores(rope: Rope, q: torch.Tensor, k: torch.Tensor, start: int) -> torch.Tensor:
    s = q.shape[2]
    tables = rope.rotary_tables(torch.arange(start, start + s), torch.float32)
    rq, rk = rope.rotate(q, tables), rope.rotate(k, tables, key=True)
    rk = rk.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return rq @ rk.transpose(-1, -2)  # [B, H, S, S]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_rotated_heads_are_relative_and_the_others_positionless(kv_heads: int) -> None:
    torch.manual_seed(0)
    rope = Rope(head_dim=8, heads=4, kv_heads=kv_heads, rotary_heads=2)
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, kv_heads, 6, 8)
    a, b = _scores(rope, q, k, 0), _scores(rope, q, k, 37)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # a shift of every position changes nothing
    plain = q @ k.repeat_interleave(4 // kv_heads, dim=1).transpose(-1, -2)
    torch.testing.assert_close(a[:, 2:], plain[:, 2:])  # unrotated heads: content only
    assert (a[:, :2] - plain[:, :2]).abs().max() > 1e-2  # rotated heads: positions enter


def test_all_heads_when_unset_or_covering_every_head() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 4, 5, 8)
    tables = Rope(head_dim=8).rotary_tables(torch.arange(5), torch.float32)
    full = Rope(head_dim=8, heads=4).rotate(q, tables)
    torch.testing.assert_close(Rope(head_dim=8, heads=4, rotary_heads=4).rotate(q, tables), full)


def test_invalid_head_counts_are_refused_with_the_valid_ones() -> None:
    problems = Rope.check({"rotary_dim": None, "rotary_heads": 3}, {"head_dim": 8, "heads": 4, "kv_heads": 2})
    assert problems and "pos.rotary_heads in [2, 4]" in problems[0]
    assert Rope.check({"rotary_dim": None, "rotary_heads": 2}, {"head_dim": 8, "heads": 4, "kv_heads": 2}) == []
