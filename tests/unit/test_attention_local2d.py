"""Image Transformer 2D local attention (``attention=local2d``, Parmar et al., 2018, sec. 3.2) against its definition.

The neighbourhood of each query is rebuilt here by brute force from the paper's words, pixel by pixel: the image is
cut into ``q_h x q_w`` query blocks, a query block's memory block adds ``h_m`` rows above and ``w_m`` columns on each
side, and a causal query sees exactly the pixels of its memory block that come no later in the generation order
(query blocks in raster order, raster inside each; or plain raster). The mechanism's output must equal dense
attention under that mask (block engine and reference path), never leak the future, and decode as it recomputes.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from doubles import build_model, decode_logits

from xfam.attention import ATTENTION
from xfam.core.errors import ConfigError
from xfam.core.mask import AttnMask

B, H, DH = 2, 2, 8
#: (shape, query_block, memory): a square and an oblong image, blocks smaller than the image
GEOMETRIES = [((8, 8), (2, 4), (2, 2)), ((4, 8), (2, 2), (1, 3))]


def generation_order(shape, query_block, order: str) -> list[tuple[int, int]]:
    """The pixels ``(row, col)`` in the order they are generated, from the paper's description."""
    (h, w), (qh, qw) = shape, query_block
    if order == "raster":
        return [(r, c) for r in range(h) for c in range(w)]
    return [
        (top + r, left + c) for top in range(0, h, qh) for left in range(0, w, qw) for r in range(qh) for c in range(qw)
    ]


def brute_force_mask(shape, query_block, memory, order: str, causal: bool) -> torch.Tensor:
    """``[N, N]`` bool: query i may see key j (sequence positions = places in the generation order)."""
    (qh, qw), (hm, wm) = query_block, memory
    pixels = generation_order(shape, query_block, order)
    n = len(pixels)
    ok = torch.zeros(n, n, dtype=torch.bool)
    for i, (r, c) in enumerate(pixels):
        top, left = (r // qh) * qh, (c // qw) * qw  # the query block's first row and column
        for j, (kr, kc) in enumerate(pixels):
            in_memory_block = top - hm <= kr < top + qh and left - wm <= kc < left + qw + wm
            ok[i, j] = in_memory_block and (j <= i or not causal)
    return ok


def masked_attention(q, k, v, ok: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~ok, float("-inf")).softmax(-1) @ v


def build(shape, query_block, memory, order, causal, backend="block"):
    cfg = {"name": "local2d", "shape": list(shape), "query_block": list(query_block), "memory": list(memory)}
    cfg |= {"order": order, "backend": backend}
    n = shape[0] * shape[1]
    return ATTENTION.build(cfg, dim=H * DH, heads=H, kv_heads=H, max_len=n, causal=causal).double().eval()


def qkv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, n, DH, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("order", ["blocks", "raster"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(("shape", "query_block", "memory"), GEOMETRIES)
def test_output_is_dense_attention_under_the_2d_neighbourhood(shape, query_block, memory, order, causal):
    n = shape[0] * shape[1]
    ok = brute_force_mask(shape, query_block, memory, order, causal)
    assert ok.sum(-1).min() > 0 and ok.sum(-1).max() < n  # local: no query sees the whole image
    q, k, v = qkv(n)
    want = masked_attention(q, k, v, ok)
    mask = AttnMask(q_len=n, k_len=n, causal=causal)
    for backend in ("block", "dense"):
        mech = build(shape, query_block, memory, order, causal, backend)
        torch.testing.assert_close(mech(q, k, v, mask), want, atol=1e-10, rtol=0)
    pattern = mech.pattern
    rule = pattern.allowed(torch.arange(n)[:, None], torch.arange(n)[None, :])
    assert torch.equal(rule & (ok if causal else True), ok)  # the pattern's own rule is the memory block


def test_the_paper_neighbourhood_of_one_pixel():
    """8 x 8 image, 2 x 4 query blocks, memory [2, 2]: the last pixel of query block (1, 0) (pixel (3, 3)) sees rows
    0..3 and columns 0..5 (left of column 0 is outside), minus block (1, 1)'s pixels, which come later."""
    shape, qb, mem = (8, 8), (2, 4), (2, 2)
    pixels = generation_order(shape, qb, "blocks")
    i = pixels.index((3, 3))
    seen = {pixels[j] for j in brute_force_mask(shape, qb, mem, "blocks", True)[i].nonzero().flatten().tolist()}
    assert seen == {(r, c) for r in range(4) for c in range(6)} - {(r, c) for r in (2, 3) for c in (4, 5)}
    assert i == 23  # the 24th pixel generated: blocks (0, 0) and (0, 1) first, then (1, 0)


@pytest.mark.parametrize("order", ["blocks", "raster"])
def test_a_later_pixel_never_changes_an_earlier_output(order):
    shape, qb, mem = GEOMETRIES[0]
    n = shape[0] * shape[1]
    mech = build(shape, qb, mem, order, causal=True)
    q, k, v = qkv(n)
    out = mech(q, k, v, AttnMask(q_len=n, k_len=n, causal=True))
    for t in (1, 9, 30, 63):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t:] += 1.0
        v2[:, :, t:] -= 2.0
        out2 = mech(q, k2, v2, AttnMask(q_len=n, k_len=n, causal=True))
        torch.testing.assert_close(out2[:, :, :t], out[:, :, :t], atol=0, rtol=0)
        assert not torch.allclose(out2[:, :, t], out[:, :, t])  # a query sees its own position


@pytest.mark.parametrize("order", ["blocks", "raster"])
def test_the_tiles_visited_cover_the_memory_block_and_little_more(order):
    """The engine gathers, per tile, only tiles of its memory block: O(N l_m), never N x N."""
    from xfam.attention._sparse.engine import geometry

    shape, qb, mem = (8, 16), (2, 4), (2, 4)  # memory multiples of the block: tiles fit the memory block exactly
    n, l_m = shape[0] * shape[1], (qb[0] + mem[0]) * (qb[1] + 2 * mem[1])
    for causal in (True, False):
        mech = build(shape, qb, mem, order, causal)
        geo = geometry(mech.pattern, AttnMask(q_len=n, k_len=n, causal=causal), torch.device("cpu"))
        assert geo.k_pos.shape[-1] <= l_m < n // 2  # keys gathered per tile


@pytest.mark.parametrize("order", ["blocks", "raster"])
def test_decoding_pixel_by_pixel_equals_recomputation(order):
    shape, qb, mem = GEOMETRIES[0]
    n = shape[0] * shape[1]
    mech = build(shape, qb, mem, order, causal=True)
    q, k, v = qkv(n)
    full = mech(q, k, v, AttnMask(q_len=n, k_len=n, causal=True))
    outs, state, t = [], None, 0
    for step in (5, 1, 3, 8, *([1] * 15), 32):  # chunks straddling tiles and query blocks
        mask = AttnMask(q_len=step, k_len=t + step, causal=True)
        out, state = mech.decode(q[:, :, t : t + step], k[:, :, t : t + step], v[:, :, t : t + step], state, mask)
        outs.append(out)
        t += step
    assert t == n
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-10, rtol=0)


@torch.no_grad()
def test_a_model_decodes_as_it_recomputes_and_is_causal():
    attention = {"name": "local2d", "shape": [4, 8], "query_block": [2, 4], "memory": [1, 2]}
    model = build_model(attention=attention, pos="rope", max_len=32, heads=2, layers=2)
    x = torch.randint(0, 13, (2, 32))
    full = model(x).logits
    torch.testing.assert_close(decode_logits(model, x, prompt=3, step=1), full, atol=1e-5, rtol=0)
    x2 = x.clone()
    x2[:, 20:] = (x2[:, 20:] + 1) % 13
    torch.testing.assert_close(model(x2).logits[:, :20], full[:, :20], atol=0, rtol=0)


def problems(cfg: dict, max_len: int) -> list[str]:
    return ATTENTION.check({"name": "local2d", **cfg}, {"max_len": max_len, "causal": True, "heads": 2})


def test_bad_geometry_is_refused_before_building():
    (msg,) = problems({"shape": [32, 32]}, max_len=256)
    assert "1024 pixels, but model.max_len=256" in msg and "Fix: model.max_len=1024" in msg
    (msg,) = problems({"shape": [8, 8], "query_block": [3, 4]}, max_len=64)
    assert "does not tile the image" in msg and "q_h among [1, 2, 4, 8]" in msg
    (msg,) = problems({"shape": [8]}, max_len=64)
    assert "attention.shape" in msg and "2 items" in msg
    assert problems({"shape": [8, 8], "query_block": [4, 4], "memory": [0, 8]}, max_len=64) == []


def test_longer_rows_than_the_image_are_a_clear_error():
    mech = build((2, 4), (2, 2), (0, 0), "blocks", causal=True)
    q, k, v = qkv(9)
    with pytest.raises(ValueError, match="more than the image's 8 pixels"):
        mech(q, k, v, AttnMask(q_len=9, k_len=9, causal=True))


@functools.cache
def composed() -> dict:
    """``python train.py data=pixels attention=local2d`` on 8 x 8 images in 4 x 4 blocks, as a plain config."""
    from tests.integration.helpers import compose_cfg

    image = ["data.seq_len=64", "data.width=8", "data.block=[4,4]", "model.max_len=64"]
    return compose_cfg(
        ["data=pixels", "attention=local2d", *image, "attention.shape=[8,8]", "attention.query_block=[4,4]"]
    )


def refusals(**changes: dict) -> list[str]:
    """The problems ``validate`` reports for ``composed()`` with its sections updated by ``changes``."""
    from xfam.config import validate

    cfg = copy.deepcopy(composed())
    for section, values in changes.items():
        cfg[section] = values if "name" in values else {**cfg[section], **values}
    try:
        validate(cfg)
    except ConfigError as err:
        return err.problems
    return []


def test_the_data_images_must_be_the_attention_images():
    assert refusals() == []
    (msg,) = refusals(attention={"shape": [4, 16]})
    assert msg.startswith("attention=local2d shape=[4, 16], but data=pixels images are [8, 8]") and "Fix:" in msg
    (msg,) = refusals(data={"order": "raster"})
    assert "order=blocks, but data=pixels lays the pixels out in raster order" in msg
    assert "Fix: attention.order=raster (or data.order=blocks)" in msg
    (msg,) = refusals(data={"block": [2, 8]})
    assert "Fix: attention.query_block=[2,8] (or data.block=[4, 4])" in msg
    assert refusals(data={"order": "raster"}, attention={"order": "raster"}) == []


def test_what_it_cannot_host_is_refused_with_the_reason():
    from xfam.core.registry import defaults_of
    from xfam.memory import MEMORY
    from xfam.pos import POS

    shaw = {"name": "shaw", **defaults_of(POS.get("shaw"))}
    for changes, words in (
        ({"model": {"num_memory_tokens": 2}}, "model.num_memory_tokens=2: the tokens in front"),
        ({"memory": {"name": "xl", **defaults_of(MEMORY.get("xl"))}}, "local2d cannot attend to memory keys"),
        ({"model": {"num_mem_kv": 2}}, "attention=local2d does not"),
        ({"pos": shaw}, "pos=shaw runs only inside attention in"),
    ):
        found = refusals(**changes)
        assert any(words in p for p in found) and all("Fix:" in p or "Alternatives:" in p for p in found), found
