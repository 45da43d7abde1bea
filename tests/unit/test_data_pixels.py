"""``data=pixels``: scikit-learn's bundled images as pixel sequences behind BOS, in the generation order of
``attention=local2d`` (the same pixel at the same position), with seeded fixed splits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xfam.attention.local2d import Local2DPattern
from xfam.data import DATA
from xfam.data.images import BOS, digit_images, histogram_bits, photo_tiles, pixel_order, to_images, to_sequence

SMALL = {"name": "pixels", "seq_len": 64, "width": 8, "block": [4, 4], "max_images": 30, "batch_size": 4}


@pytest.mark.parametrize("order", ["blocks", "raster"])
def test_the_pixel_order_is_the_attention_generation_order(order):
    """Position i of a row holds the pixel the attention places at position i (both built independently)."""
    shape, block = (8, 16), (2, 4)
    flat = pixel_order(shape, order, block)  # raster index of the i-th pixel
    pattern = Local2DPattern(shape, block, (1, 1), order)
    row, col = pattern.coords(torch.arange(128))
    assert np.array_equal(flat, (row * 16 + col).numpy())
    assert torch.equal(pattern.position(row, col), torch.arange(128))
    images = np.random.default_rng(0).integers(0, 256, size=(3, *shape))
    assert np.array_equal(to_images(to_sequence(images, order, block), shape, order, block), images)
    if order == "blocks":  # the first block is the top-left 2 x 4 pixels, in raster order
        assert to_sequence(images, order, block)[0, :8].tolist() == images[0, :2, :4].ravel().tolist()


def test_rows_are_bos_then_the_images_and_the_splits_are_fixed_by_the_seed():
    src = DATA.build(SMALL)
    src.prepare()
    sizes = {name: len(src.split(name)) for name in ("train", "validation", "test")}
    assert sizes == {"train": 24, "validation": 3, "test": 3} and src.vocab_size == 257
    rows = src.split("train")[:]["tokens"]  # [24, 65]
    assert rows.shape == (24, 65) and (rows[:, 0] == BOS).all() and int(rows[:, 1:].max()) < 256
    digits = to_sequence(digit_images((8, 8)), "blocks", (4, 4))  # every digit, 8 x 8 as in scikit-learn
    assert all(any(np.array_equal(r[1:].numpy(), d) for d in digits) for r in rows[:5])
    batch = src.collate([src.split("train")[i] for i in range(4)])
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])  # position i predicts pixel i
    again = DATA.build(SMALL)
    again.prepare()
    assert again.fingerprint == src.fingerprint
    assert torch.equal(again.split("test")[:]["tokens"], src.split("test")[:]["tokens"])
    other = DATA.build({**SMALL, "seed": 1})
    other.prepare()
    assert other.fingerprint != src.fingerprint
    assert not torch.equal(other.split("test")[:]["tokens"], src.split("test")[:]["tokens"])
    assert src.manifest["images"] == sizes and src.manifest["baselines_test_bits_per_pixel"]["uniform"] == 8.0


def test_the_images_are_at_least_32_by_32_and_photos_are_grayscale_tiles():
    digits = digit_images((32, 32))
    assert digits.shape == (1797, 32, 32) and digits.dtype == np.uint8 and digits.max() == 255
    tiles = photo_tiles((32, 32))
    assert tiles.shape == (2 * 13 * 20, 32, 32)
    from sklearn.datasets import load_sample_images

    rgb = load_sample_images().images[1][32:64, 64:96].astype(float)  # flower.jpg, tile (1, 2)
    luma = np.rint(rgb @ [0.299, 0.587, 0.114])
    assert np.array_equal(tiles[260 + 20 + 2], luma)
    assert 0 < histogram_bits(tiles[::2], tiles[1::2]) < 8


def test_bad_settings_are_refused_with_the_fix():
    (msg,) = DATA.check({**SMALL, "seq_len": 60}, {})
    assert "not a whole number of rows of width=8" in msg and "Fix:" in msg
    (msg,) = DATA.check({**SMALL, "block": [3, 4]}, {})
    assert "does not tile the 8 x 8 images" in msg and "data.order=raster" in msg
    (msg,) = DATA.check({**SMALL, "source": "photos", "seq_len": 512 * 512, "width": 512}, {})
    assert "larger than the sample photographs" in msg
    (msg,) = DATA.check({**SMALL, "max_images": 3, "test_fraction": 0.5}, {})
    assert "leave no training image" in msg
