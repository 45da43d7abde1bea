"""scripts/bench_memory.py's two evaluations: the vanilla sliding window and Transformer-XL's cached
segments score the right positions, and cached XL with a memory covering the stream is exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_memory as bm  # noqa: E402

T, V = 40, 17
SIZES = {"layers": 2, "dim": 32, "heads": 4, "vocab": V, "max_len": T}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_xl_with_full_memory_equals_full_forward(pos: str, tokens: torch.Tensor) -> None:
    model = bm.build_model(pos, T, **SIZES)
    xl = bm.xl_cached_logprobs(model, tokens, seg_len=7)  # segments do not divide T - 1 = 39
    full = bm.full_logprobs(model, tokens)
    assert xl.shape == full.shape == (T - 1,)
    torch.testing.assert_close(xl, full, atol=1e-5, rtol=0)


def test_xl_with_short_memory_sees_less(tokens: torch.Tensor) -> None:
    """With M = 4 states per layer the context is cut, so the log-probs change after the first segment."""
    short = bm.xl_cached_logprobs(bm.build_model("xl", 4, **SIZES), tokens, seg_len=4)
    full = bm.full_logprobs(bm.build_model("xl", T, **SIZES), tokens)
    assert short.shape == (T - 1,)
    torch.testing.assert_close(short[:4], full[:4], atol=1e-5, rtol=0)  # first segment: no memory needed
    assert (short[8:] - full[8:]).abs().max() > 1e-4


@pytest.mark.parametrize("start", [1, 5, 20])
def test_sliding_window_scores_each_position_from_its_own_window(start: int, tokens: torch.Tensor) -> None:
    model, context = bm.build_model("xl", 0, **SIZES), 8
    one = bm.sliding_window_logprobs(model, tokens, context, start, batch=1)
    batched = bm.sliding_window_logprobs(model, tokens, context, start, batch=3)
    assert one.shape == batched.shape == (T - start,)
    torch.testing.assert_close(batched, one, atol=1e-5, rtol=0)
    for t in (start, T - 1):  # each prediction: the last position of a forward over x_{t-context} .. x_{t-1}
        window = tokens[max(0, t - context) : t]
        want = model(window[None]).logits[0, -1].log_softmax(-1)[tokens[t]]
        torch.testing.assert_close(one[t - start], want.detach(), atol=1e-5, rtol=0)
    if start < context:  # short windows at the stream's start: all previous tokens, as in a full forward
        torch.testing.assert_close(one[: context - start], bm.full_logprobs(model, tokens)[start - 1 : context - 1])


def test_same_weights_for_every_mem_len() -> None:
    a, b = bm.build_model("xl", 4, **SIZES).state_dict(), bm.build_model("xl", 32, **SIZES).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_flop_ratio_grows_with_length() -> None:
    ratios = [bm.flop_ratio(n, n // 2, n - n // 2, 4, 256, 256) for n in (128, 256, 512, 1024)]
    assert all(1 < a < b for a, b in zip(ratios, ratios[1:]))
