"""Sparse Transformer factorised attention (strided, fixed) and BlockBERT blockwise attention: the
masks are the papers' definitions, the fast paths equal the engine's dense reference, the union
patterns reach every earlier position within two hops, the degenerate limits are dense attention,
and the three ways to use factorised patterns in a model build through the schedule form."""

from __future__ import annotations

import pytest
import torch
from doubles import TableBias, build_model, decode_logits

from tests.integration.helpers import compose_cfg
from xfam.attention import ATTENTION
from xfam.attention._factorized import factorized_attention
from xfam.attention._sparse import block_sparse_attention, dense_sparse_attention
from xfam.attention.blockwise import BlockPermutationPattern, default_shifts, head_permutations
from xfam.attention.fixed import FixedPattern
from xfam.attention.strided import StridedPattern
from xfam.attention.vanilla import reference_attention
from xfam.config import validate
from xfam.core.mask import AttnMask
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import compat
from xfam.model.build import build_model as build_from_config
from xfam.model.compat import Selection
from xfam.model.head_groups import HeadGroups
from xfam.pos import POS
from xfam.pos.alibi import AlibiBias

B, H, DH = 2, 4, 8
PARTS = [1, 2, "union"]


# -- the papers' definitions, written out -------------------------------------------------------------


def strided_definition(n: int, ell: int, part, causal: bool) -> torch.Tensor:
    """Child et al. sec. 4.2: A(1)_i = {max(0, i - l), ..., i}, A(2)_i = {j : (i - j) mod l = 0};
    bidirectional: |i - j| <= l and the same residues, without the causal cut."""
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if causal and j > i:
                continue
            a1 = max(0, i - ell) <= j <= i if causal else abs(i - j) <= ell
            a2 = (i - j) % ell == 0
            out[i, j] = {1: a1, 2: a2, "union": a1 or a2}[part]
    return out


def fixed_definition(n: int, ell: int, c: int, part, causal: bool) -> torch.Tensor:
    """A(1)_i = {j : floor(j / l) = floor(i / l)}, A(2)_i = {j : j mod l in {l - c, ..., l - 1}}."""
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if causal and j > i:
                continue
            a1 = j // ell == i // ell
            a2 = j % ell in range(ell - c, ell)
            out[i, j] = {1: a1, 2: a2, "union": a1 or a2}[part]
    return out


def blockwise_definition(n: int, perm: list[int]) -> torch.Tensor:
    """BlockBERT: M[i, j] = 1 iff pi(floor(i b / n)) = floor(j b / n) for b blocks."""
    b = len(perm)
    return torch.tensor([[perm[i * b // n] == j * b // n for j in range(n)] for i in range(n)])


def self_if_empty(allowed: torch.Tensor) -> torch.Tensor:
    """The AttnMask convention: a query that may see nothing attends to itself."""
    return allowed | (torch.eye(allowed.shape[-1], dtype=torch.bool) & ~allowed.any(-1, keepdim=True))


def support(mech, n: int, causal: bool, heads: int = H) -> torch.Tensor:
    """Which keys each head's queries attend to, read off the mechanism's own output ``[H, n, n]``:
    zero queries give uniform weights over the allowed keys, and one-hot values reveal them."""
    q = torch.zeros(1, heads, n, n, dtype=torch.float64)
    k = torch.randn(1, heads, n, n, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(1, heads, n, n)
    return mech(q, k, v, AttnMask(q_len=n, k_len=n, causal=causal))[0] > 1e-12


def build(name: str, causal: bool, heads: int = H, max_len: int = 64, **params):
    struct = dict(dim=heads * DH, heads=heads, kv_heads=heads, head_dim=DH, max_len=max_len, causal=causal)
    return ATTENTION.build({"name": name, **params}, **struct, num_layers=1, layer=0).double().eval()


# -- pattern semantics ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["factorized", "block", "dense"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize(("ell", "n"), [(4, 19), (5, 20), (3, 7)])
def test_strided_mask_is_the_paper_definition(backend, causal, part, ell, n):
    mech = build("strided", causal, stride=ell, part=part, block=2, backend=backend)
    want = self_if_empty(strided_definition(n, ell, part, causal))
    assert torch.equal(support(mech, n, causal), want.expand(H, n, n))


@pytest.mark.parametrize("backend", ["factorized", "block", "dense"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize(("ell", "c", "n"), [(4, 1, 19), (6, 2, 20), (5, 5, 13)])
def test_fixed_mask_is_the_paper_definition(backend, causal, part, ell, c, n):
    mech = build("fixed", causal, stride=ell, summary=c, part=part, block=3, backend=backend)
    want = self_if_empty(fixed_definition(n, ell, c, part, causal))
    assert torch.equal(support(mech, n, causal), want.expand(H, n, n))


@pytest.mark.parametrize("causal", [True, False])
def test_union_is_the_union_of_the_two_subsets(causal):
    n = 23
    for make in (lambda p: StridedPattern(4, p, 2), lambda p: FixedPattern(5, 2, p, 2)):
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        a1, a2, union = (make(p).allowed(q, k) for p in PARTS)
        assert torch.equal(union, a1 | a2) and not torch.equal(a1, union) and not torch.equal(a2, union)


def _hops(*steps: torch.Tensor) -> torch.Tensor:
    out = steps[0].double()
    for s in steps[1:]:
        out = out @ s.double()
    return out > 0


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_every_earlier_position_is_reachable_within_two_hops(name):
    """The issue's "pattern semantics": for the union (merged head) M, M @ M covers every j <= i
    (causal) and every j (bidirectional); one hop does not. The interleaved layers A(1) then A(2)
    reach it too, counting the residual path (A(2) | I) @ A(1)."""
    n, ell, c = 64, 8, 2
    params = dict(stride=ell, summary=c) if name == "fixed" else dict(stride=ell)
    for causal in (True, False):
        sup = {p: support(build(name, causal, part=p, **params), n, causal)[0] for p in PARTS}
        full = torch.ones(n, n, dtype=torch.bool)
        full = full.tril() if causal else full
        assert not torch.equal(sup["union"], full)  # sparse: one hop misses positions
        assert torch.equal(_hops(sup["union"], sup["union"]), full)
        assert torch.equal(_hops(sup[2] | torch.eye(n, dtype=torch.bool), sup[1]), full)
        assert not torch.equal(_hops(sup[1], sup[1]), full)  # A(1) alone needs more hops


# -- parity of the fast paths with the engine's dense reference -------------------------------------


def _masks(sq: int, sk: int) -> dict[str, AttnMask]:
    g = torch.Generator().manual_seed(2)
    pad = torch.rand(B, sk, generator=g) > 0.25
    seg = torch.cumsum(torch.rand(B, sk, generator=g) < 0.15, dim=1)
    return {
        "causal": AttnMask(q_len=sq, k_len=sk, causal=True),
        "bidirectional": AttnMask(q_len=sq, k_len=sk),
        "padded": AttnMask(q_len=sq, k_len=sk, causal=True, key_padding=pad),
        "packed": AttnMask(q_len=sq, k_len=sk, causal=True, segments=seg),
        "bidirectional-padded": AttnMask(q_len=sq, k_len=sk, key_padding=pad),
        "bidirectional-packed": AttnMask(q_len=sq, k_len=sk, segments=seg),
        "window": AttnMask(q_len=sq, k_len=sk, causal=True, window=6),
    }


PATTERNS = {
    "strided": lambda p: StridedPattern(5, p, 4),
    "strided-wide-band": lambda p: StridedPattern(8, p, 16),
    "fixed": lambda p: FixedPattern(6, 2, p, 4),
    "fixed-odd": lambda p: FixedPattern(7, 3, p, 5),
}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("form", list(_masks(1, 1)))
@pytest.mark.parametrize(("sq", "sk"), [(37, 37), (13, 37), (1, 37)], ids=["full", "offset", "one-query"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "alibi"])
def test_fast_paths_equal_the_dense_reference(pattern, part, form, sq, sk, with_bias):
    p = PATTERNS[pattern](part)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, sq, DH, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, 2, sk, DH, generator=g, dtype=torch.float64) for _ in range(2))  # grouped-query
    bias = AlibiBias(H, H).double() if with_bias else None
    ref = dense_sparse_attention(q, k, v, p, _masks(sq, sk)[form], bias)
    for path in (factorized_attention, block_sparse_attention):
        assert torch.allclose(path(q, k, v, p, _masks(sq, sk)[form], bias), ref, atol=1e-10), path.__name__


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_gradients_of_the_factorized_path_equal_the_reference(name):
    params = dict(stride=4, summary=2) if name == "fixed" else dict(stride=4)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, 22, DH, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pad = torch.ones(B, 22, dtype=torch.bool)
    pad[0, :5] = False  # left padding: the first queries of row 0 see nothing
    grads = []
    for backend in ("factorized", "dense"):
        mech = build(name, True, backend=backend, **params)
        out = mech(q, k, v, AttnMask(q_len=22, k_len=22, causal=True, key_padding=pad), TableBias(H).double())
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, DH)).sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-10)


# -- degenerate limits and honest parameters ---------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["factorized", "block"])
@pytest.mark.parametrize(
    "params",
    [
        dict(name="strided", stride=21, part=1),
        dict(name="strided", stride=20, part="union"),  # l >= L - 1 already covers every pair
        dict(name="fixed", stride=21, summary=3, part=1),
        dict(name="fixed", stride=21, summary=3, part="union"),
    ],
)
def test_stride_covering_the_sequence_is_dense_attention(causal, backend, params):
    mech = build(causal=causal, backend=backend, **params)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, H, 21, DH, generator=g, dtype=torch.float64) for _ in range(3))
    mask = AttnMask(q_len=21, k_len=21, causal=causal)
    assert torch.allclose(mech(q, k, v, mask), reference_attention(q, k, v, mask), atol=1e-10)


def test_a2_alone_is_not_dense_at_a_covering_stride():
    """With l >= L, strided A(2) keeps only j = i and fixed A(2) only the last c positions: not the
    degenerate limit, which is why ``exact_params`` uses A(1) or the union."""
    n = 12
    assert torch.equal(support(build("strided", True, stride=12, part=2), n, True)[0], torch.eye(n, dtype=torch.bool))
    fixed = support(build("fixed", False, stride=12, summary=2, part=2), n, False)[0]
    assert torch.equal(fixed.nonzero()[:, 1].unique(), torch.tensor([10, 11]))


def test_bad_hyperparameters_are_config_errors_with_the_fix():
    ctx = {"max_len": 64, "heads": 4, "causal": True}
    (msg,) = ATTENTION.check({"name": "strided", "stride": 65}, ctx)
    assert "valid: 1..64" in msg and "Fix:" in msg
    (msg,) = ATTENTION.check({"name": "fixed", "stride": 8, "summary": 9}, ctx)
    assert "valid: 1..8" in msg and "Fix:" in msg
    assert "unknown key 'sumary'" in ATTENTION.check({"name": "fixed", "sumary": 2}, ctx)[0]
    assert "must be one of 1, 2, 'union'" in ATTENTION.check({"name": "strided", "part": 3}, ctx)[0]
    (msg,) = ATTENTION.check({"name": "blockwise", "shifts": [0, 1]}, ctx)
    assert "2 entries for 4 heads" in msg
    (msg,) = ATTENTION.check({"name": "blockwise", "n_blocks": 3, "permutations": [[0, 1, 1]] * 4}, ctx)
    assert "permutations of 0..2" in msg
    (msg,) = ATTENTION.check({"name": "blockwise", "n_blocks": 5}, ctx)
    assert "leaves no identity head" in msg and "attention.shifts" in msg
    assert (
        "n_blocks=65 > model.max_len=64"
        in ATTENTION.check({"name": "blockwise", "n_blocks": 65, "shifts": [0] * 4}, ctx)[0]
    )


# -- the three ways to use factorised patterns in a model ---------------------------------------------

MODES = {
    "interleaved": {"per_layer": [{"part": 1}, {"part": 2}]},
    "merged": {"part": "union"},
    "split": {"per_head": [{"heads": 2, "part": 1}, {"heads": 2, "part": 2}]},
}


def _parts(mech) -> list:
    """The ``part`` of every head of one layer's mechanism."""
    if isinstance(mech, HeadGroups):
        return [m.pattern.part for m, n in zip(mech.members, mech.head_counts) for _ in range(n)]
    return [mech.pattern.part] * H


@pytest.mark.parametrize("name", ["strided", "fixed"])
def test_usage_modes_give_every_layer_and_head_its_pattern(name):
    params = {"name": name, "stride": 4, **({"summary": 2} if name == "fixed" else {})}
    expected = {
        "interleaved": [[1] * 4, [2] * 4, [1] * 4, [2] * 4],
        "merged": [["union"] * 4] * 4,
        "split": [[1, 1, 2, 2]] * 4,
    }
    define = {
        "strided": lambda p, c: strided_definition(20, 4, p, c),
        "fixed": lambda p, c: fixed_definition(20, 4, 2, p, c),
    }
    for mode, sched in MODES.items():
        model = build_model(attention={**params, **sched}, layers=4, heads=4)
        for layer, block in enumerate(model.blocks):
            mech = block.attn.mechanism.double()
            assert _parts(mech) == expected[mode][layer]
            got = support(mech, 20, True)  # [H, n, n]: each head's own keys
            for h, part in enumerate(expected[mode][layer]):
                assert torch.equal(got[h], self_if_empty(define[name](part, True))), (mode, layer, h)


@pytest.mark.parametrize("mode", MODES)
def test_usage_modes_decode_equals_full_recompute(mode):
    model = build_model(attention={"name": "strided", "stride": 4, **MODES[mode]}, layers=2, heads=4, pos="alibi")
    tokens = torch.randint(0, 13, (2, 19), generator=torch.Generator().manual_seed(5))
    full = model(tokens).logits
    assert torch.allclose(decode_logits(model, tokens, prompt=6), full, atol=1e-5)
    assert torch.allclose(decode_logits(model, tokens, prompt=3, step=4), full, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_experiment_configs_build_their_usage_mode(mode):
    small = ["model.dim=32", "model.max_len=64"]
    cfg = compose_cfg([f"experiment=sparse_transformer_{mode}", *small])
    validate(cfg)
    model = build_from_config(cfg, {"task": "lm", "vocab_size": 256})
    parts = [_parts(block.attn.mechanism) for block in model.blocks]
    want = {"interleaved": [[1] * 4, [2] * 4] * 2, "merged": [["union"] * 4] * 4, "split": [[1, 1, 2, 2]] * 4}
    assert parts == want[mode]
    out = model(torch.randint(0, 256, (1, 40)))
    out.logits.sum().backward()


# -- blockwise -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["block", "dense"])
@pytest.mark.parametrize(
    ("n", "perms"),
    [
        (24, [[0, 1], [1, 0], [0, 1], [1, 0]]),
        (24, [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]]),
        (13, [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 2, 1]]),  # 3 does not divide 13: blocks of 4, 4, 5
        (20, [[3, 0, 2, 1]] * 4),
    ],
)
def test_blockwise_mask_is_the_definition_per_head(backend, n, perms):
    mech = build("blockwise", False, n_blocks=len(perms[0]), permutations=perms, backend=backend)
    got = support(mech, n, False)
    for h, perm in enumerate(perms):
        assert torch.equal(got[h], blockwise_definition(n, perm)), h


def test_blockwise_shifts_and_the_paper_default():
    assert default_shifts(2, 12) == [0] * 10 + [1] * 2  # BlockBERT n = 2: 10:2
    assert default_shifts(3, 12) == [0] * 8 + [1] * 2 + [2] * 2  # n = 3: 8:2:2
    assert head_permutations(4, 2, [0, 3], None) == ((0, 1, 2, 3), (3, 0, 1, 2))
    mech = build("blockwise", False, n_blocks=4, shifts=[0, 1, 2, 3])
    got = support(mech, 16, False)
    for h in range(4):
        assert torch.equal(got[h], blockwise_definition(16, [(i + h) % 4 for i in range(4)]))
    assert len({tuple(map(tuple, g.nonzero().tolist())) for g in got}) == 4  # every head differs


@pytest.mark.parametrize("backend", ["block", "dense"])
def test_one_block_is_dense_bidirectional_attention(backend):
    mech = build("blockwise", False, n_blocks=1, backend=backend)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, H, 17, DH, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(B, 17, dtype=torch.bool)
    pad[1, 12:] = False
    for mask in (AttnMask(q_len=17, k_len=17), AttnMask(q_len=17, k_len=17, key_padding=pad)):
        assert torch.allclose(mech(q, k, v, mask), reference_attention(q, k, v, mask), atol=1e-10)


@pytest.mark.parametrize("form", ["bidirectional", "bidirectional-padded", "bidirectional-packed"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "alibi"])
def test_blockwise_block_path_equals_the_dense_reference(form, with_bias):
    pattern = BlockPermutationPattern(head_permutations(3, H, [0, 1, 2, 1], None), 37)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, 37, DH, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, 2, 37, DH, generator=g, dtype=torch.float64) for _ in range(2))
    bias = AlibiBias(H, H).double() if with_bias else None
    ref = dense_sparse_attention(q, k, v, pattern, _masks(37, 37)[form], bias)
    assert torch.allclose(block_sparse_attention(q, k, v, pattern, _masks(37, 37)[form], bias), ref, atol=1e-10)


def test_blockwise_is_refused_by_a_causal_model_with_the_reason():
    def sel(causal: bool) -> Selection:
        return Selection(
            attention=[(ATTENTION.get("blockwise"), {}, False)],
            pos=(POS.get("none"), {}),
            memory=[(MEMORY.get("none"), {})],
            exit=(EXIT.get("none"), {}),
            causal=causal,
        )

    (msg,) = compat.check(sel(causal=True))
    assert "attention=blockwise cannot be causal" in msg and "Alternatives" in msg
    assert "strided" in msg and "fixed" in msg  # causal-capable alternatives are listed
    assert compat.check(sel(causal=False)) == []
