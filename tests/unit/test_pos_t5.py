"""T5 relative bias: buckets equal the reference bucketing at every edge, the bias is relative and
shared by all layers, and bad settings are config errors."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model

from xfam.core.mask import AttnMask
from xfam.pos.t5 import T5, T5Bias, t5_bucket


def reference_bucket(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Mesh TensorFlow's ``_relative_position_bucket`` for one ``relative_position = key - query``."""
    ret, n = 0, -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += int(n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(large, num_buckets - 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20), (6, 9)])
def test_buckets_equal_the_reference_bucketing_at_every_distance(causal, num_buckets, max_distance):
    n = torch.arange(-300, 301)  # query - key: covers the exact range, every log bucket and beyond max_distance
    got = t5_bucket(n, causal, num_buckets, max_distance).tolist()
    want = [reference_bucket(-int(d), not causal, num_buckets, max_distance) for d in n]
    assert got == want


def test_bucket_edges_of_the_default_table():
    # bidirectional, 32 buckets: 16 per side, exact up to 7, log buckets 8..15 up to 128
    b = lambda d: int(t5_bucket(torch.tensor(d), False, 32, 128))  # noqa: E731
    assert [b(0), b(1), b(7), b(8), b(127), b(128), b(10_000)] == [0, 1, 7, 8, 15, 15, 15]
    assert [b(-1), b(-7), b(-8), b(-10_000)] == [17, 23, 24, 31]  # keys after the query use the other half
    c = lambda d: int(t5_bucket(torch.tensor(d), True, 32, 128))  # noqa: E731
    assert [c(-5), c(0), c(15), c(16), c(127), c(128)] == [0, 0, 15, 16, 31, 31]


@pytest.mark.parametrize("causal", [True, False])
def test_bias_is_the_table_at_the_bucket_and_relative(causal):
    torch.manual_seed(0)
    bias = T5Bias(heads=3, causal=causal, num_buckets=16, max_distance=40)
    q, k = torch.arange(20)[:, None], torch.arange(20)[None, :]
    dense = bias.pairs(q, k)  # [H, 20, 20]
    assert dense.shape == (3, 20, 20)
    assert torch.equal(dense[:, 7, 2], bias.table[t5_bucket(torch.tensor(5), causal, 16, 40)])
    assert torch.equal(bias.pairs(q + 13, k + 13), dense)  # shifting every position changes nothing
    mask = AttnMask(q_len=4, k_len=20, causal=causal)  # keys in front of the queries: positions 16..19
    assert torch.equal(bias.dense(mask)[0], dense[:, 16:, :])


def test_one_table_shared_by_every_layer_and_trained():
    model = build_model(pos="t5", layers=3).train()
    tables = [p for n, p in model.named_parameters() if n.endswith("table")]
    assert len(tables) == 1
    x = torch.randint(0, 13, (2, 12))
    model(x).logits.sum().backward()
    assert tables[0].grad is not None and tables[0].grad.abs().sum() > 0


def test_bad_settings_are_config_errors():
    assert "odd" in T5.check({"num_buckets": 31, "max_distance": 128}, {"causal": False})[0]
    assert T5.check({"num_buckets": 31, "max_distance": 128}, {"causal": True}) == []
    assert "exact range" in T5.check({"num_buckets": 32, "max_distance": 8}, {"causal": False})[0]
    assert "pos.num_buckets >= 4" in T5.check({"num_buckets": 2, "max_distance": 128}, {"causal": False})[0]
    assert T5.check({"num_buckets": 2, "max_distance": 128}, {"causal": True}) == []  # one exact bucket, one far


def test_the_smallest_tables_the_check_accepts_bucket_every_distance():
    n = torch.arange(-300, 301)
    for causal, nb in ((True, 2), (False, 4)):
        assert T5.check({"num_buckets": nb, "max_distance": 128}, {"causal": causal}) == []
        got = t5_bucket(n, causal, nb, 128)
        assert got.min() >= 0 and got.max() == nb - 1


@pytest.mark.parametrize("name", ["local", "longformer", "bigbird", "fixed"])
@pytest.mark.parametrize("causal", [True, False])
def test_sparse_paths_evaluate_the_bias_on_their_visited_pairs(name, causal):
    """The block engine's T5 bias (on gathered pairs) equals dense attention with the dense bias, masked
    to the pattern (the dense_sparse_attention reference)."""
    from xfam.attention._base import ATTENTION

    torch.manual_seed(0)
    bias = T5Bias(heads=4, causal=causal, num_buckets=8, max_distance=12)
    params = {
        "local": {"window": 5, "block": 4},
        "longformer": {"window": 4, "block": 4},
        "bigbird": {"block": 4, "random_blocks": 1, "global_blocks": 1},
        "fixed": {"stride": 4, "summary": 1},
    }
    fast = ATTENTION.build({"name": name, **params[name], "backend": "block"}, max_len=24, causal=causal, heads=4)
    ref = ATTENTION.build({"name": name, **params[name], "backend": "dense"}, max_len=24, causal=causal, heads=4)
    q, k, v = (torch.randn(2, 4, 24, 8, dtype=torch.float64) for _ in range(3))
    mask = AttnMask(q_len=24, k_len=24, causal=causal)
    assert torch.allclose(fast(q, k, v, mask, bias.double()), ref(q, k, v, mask, bias.double()), atol=1e-10)
