"""Length-extrapolation evaluation (xfam/eval/extrapolation.py): which targets each protocol scores, with how
much context, and that the batched computation equals scoring each target by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from doubles import build_model
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.data.packing import pack_rows
from xfam.eval.extrapolation import evaluate_length, split_stream, token_nll, windows

V = 13


def _stream(n: int, seed: int = 0) -> Tensor:
    return torch.randint(0, V, (n + 1,), generator=torch.Generator().manual_seed(seed))


def _brute(model: nn.Module, stream: Tensor, context_start) -> Tensor:
    """Target t (``stream[t + 1]``) scored alone from inputs ``stream[context_start(t) : t + 1]``."""
    out = []
    for t in range(stream.numel() - 1):
        ids = stream[context_start(t) : t + 1][None]  # [1, c]
        logits = model(ids).logits[0, -1]  # [V]
        out.append(F.cross_entropy(logits[None], stream[t + 1 : t + 2]).item())
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(("n", "length", "stride"), [(50, 8, 3), (64, 16, 16), (7, 16, 4), (33, 8, 1)])
def test_windows_score_every_target_once_with_at_least_L_minus_s_context(n: int, length: int, stride: int) -> None:
    for protocol in ("nonoverlapping", "sliding"):
        wins = windows(n, length, protocol, stride)
        scored = [t for w in wins for t in range(w.score_from, w.end)]
        assert sorted(scored) == list(range(n))
        assert all(0 <= w.start <= w.score_from < w.end <= n and w.end - w.start <= length for w in wins)
    for w in windows(n, length, "sliding", stride)[1:]:  # after the first window
        assert w.end - w.start == length and w.score_from - w.start >= length - stride


def test_sliding_with_stride_L_is_nonoverlapping() -> None:
    assert windows(64, 16, "sliding", 16) == windows(64, 16, "nonoverlapping")
    model = build_model(pos="rope", vocab_size=V)
    stream = _stream(64)
    a = token_nll(model, stream, 16, "sliding", 16, progress=False)
    b = token_nll(model, stream, 16, "nonoverlapping", progress=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("pos", ["alibi", "rope", "learned"])
def test_sliding_equals_scoring_each_target_alone(pos: str) -> None:
    """Batched windows equal one forward per target with exactly the context the protocol promises:
    stride 1 (the paper's), a stride that leaves a remainder, and non-overlapping chunks."""
    model = build_model(pos=pos, vocab_size=V, max_len=8)
    n, length = 21, 6
    stream = _stream(n, seed=1)
    one = token_nll(model, stream, length, "sliding", 1, batch_tokens=12, progress=False)
    torch.testing.assert_close(one, _brute(model, stream, lambda t: max(0, t + 1 - length)))
    chunks = token_nll(model, stream, length, "nonoverlapping", batch_tokens=12, progress=False)
    torch.testing.assert_close(chunks, _brute(model, stream, lambda t: t // length * length))
    s = 4  # windows end at 6, 10, 14, 18, 21: target t is scored by the first window ending after it
    three = token_nll(model, stream, length, "sliding", s, progress=False)
    ends = [w.end for w in windows(n, length, "sliding", s)]
    expected = _brute(model, stream, lambda t: next(e for e in ends if e > t) - length if t >= length else 0)
    torch.testing.assert_close(three, expected)


class _Unigram(nn.Module):
    """Logits that depend only on the current token (no position, no context)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(V, V)

    def forward(self, ids: Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table(ids))  # [B, S, V]


def test_a_context_free_model_scores_the_same_at_every_length_and_protocol() -> None:
    model, stream = _Unigram(), _stream(100)
    ref = token_nll(model, stream, 100, "nonoverlapping", progress=False)
    for length in (1, 7, 16, 64, 128):
        for protocol, stride in (("nonoverlapping", None), ("sliding", 1), ("sliding", min(5, length))):
            torch.testing.assert_close(token_nll(model, stream, length, protocol, stride, progress=False), ref)


def test_the_scored_targets_are_the_same_at_every_length() -> None:
    model, stream = build_model(pos="alibi", vocab_size=V), _stream(70)
    token_bytes = [1] * (V - 1) + [0]  # the last id stands for no byte (like eos)
    results = [
        evaluate_length(model, stream, length, protocol, 4, token_bytes=token_bytes, progress=False)
        for length in (4, 8, 32, 128)
        for protocol in ("nonoverlapping", "sliding")
    ]
    assert {r.tokens for r in results} == {70}
    n_bytes = int((stream[1:] != V - 1).sum())
    for r in results:
        assert r.ppl == pytest.approx(math.exp(r.nll))
        assert r.bpb == pytest.approx(r.nll * 70 / math.log(2) / n_bytes)
    longest = [r for r in results if r.length == 128]  # one window of all 70 targets either way
    assert longest[0].nll == pytest.approx(longest[1].nll) and longest[0].windows == longest[1].windows == 1


def test_learned_positions_past_the_table_refuse_with_a_clear_error() -> None:
    model = build_model(pos="learned", vocab_size=V, max_len=8)
    stream = _stream(40)
    assert evaluate_length(model, stream, 8, "sliding", 2, progress=False).tokens == 40
    for protocol in ("nonoverlapping", "sliding"):
        with pytest.raises(ConfigError, match=r"evaluation length 16 .*past the learned table \(8 positions\)"):
            token_nll(model, stream, 16, protocol, 4, progress=False)


def test_bad_settings_are_errors() -> None:
    with pytest.raises(ConfigError, match="stride=9 must lie in 1..length=8"):
        windows(20, 8, "sliding", 9)
    with pytest.raises(ConfigError, match="unknown protocol 'overlapping'"):
        windows(20, 8, "overlapping")  # type: ignore[arg-type]


def test_split_stream_undoes_the_packing_of_rows() -> None:
    stream = torch.arange(1000) % 251
    rows = torch.from_numpy(pack_rows(stream.numpy(), 16))  # [62, 17], consecutive rows share a token
    source = SimpleNamespace(split=lambda name: {"tokens": rows}, seq_len=16, contiguous=True)
    assert torch.equal(split_stream(source, "test", 100), stream[:101])
    assert torch.equal(split_stream(source, "test", 992), stream[:993])
    with pytest.raises(ConfigError, match="992 contiguous tokens"):
        split_stream(source, "test", 993)
