"""``data=pixels``: image generation as language modelling over pixel intensities, on scikit-learn's bundled images
(no download): the Image Transformer's unconditional generation task (Parmar et al., 2018, arXiv:1802.05751,
sec. 4), in grayscale.

Sources (``source``):

* ``digits``: the 1,797 handwritten digits of ``sklearn.datasets.load_digits`` (8 x 8, intensities 0..16),
  scaled to 0..255 and resized to H x W by bilinear interpolation (half-pixel centres; 8 x 8 is the original);
* ``photos``: the two photographs of ``sklearn.datasets.load_sample_images`` (427 x 640 RGB), converted to
  grayscale (ITU-R BT.601 luma, 0.299 R + 0.587 G + 0.114 B, rounded) and cut into non-overlapping H x W tiles
  (13 x 20 = 260 tiles of 32 x 32 per photograph; the bottom and right remainders are dropped).

The images are ``width`` = W pixels wide and ``seq_len / width`` = H high: a row is one image, ``seq_len = H W``.
Rows (lm): ``tokens`` ``[H W + 1]`` = BOS (id 256) then the H W intensities (ids 0..255) in the generation order
``order``: ``blocks`` (blocks of ``block = [b_h, b_w]`` pixels in raster order, raster order inside each: the
Image Transformer's 2D local order) or ``raster``. The inputs are BOS and the first H W - 1 pixels, the targets
all H W pixels, so sequence position i predicts pixel i of the order; loss / ln 2 is bits per pixel. For
``attention=local2d`` the order and blocks must be the attention's (validation compares them: ``image_geometry``).

Splits: the images (``max_images`` of them, when set: the first in a seeded shuffle) are shuffled with ``seed`` and
cut into test, validation and training images by ``test_fraction`` and ``val_fraction`` (at least one each): the
same seed gives the same splits. The manifest records scikit-learn's version, a SHA-256 of the images, the split
sizes and two context-free baselines on the test split (a uniform guess: 8 bits per pixel; the training split's
intensity histogram, add-one smoothed); the fingerprint covers the images' hash and every parameter.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import numpy as np

from xfam.core.registry import Positive, Range
from xfam.data.base import DATA
from xfam.data.digits import digit_arrays
from xfam.data.packing import NUM_KEY, SPLITS, GeneratedSource
from xfam.data.tokenize import token_dtype

VERSION = "pixels-1"
LEVELS = 256  # intensities 0..255 are ids 0..255
BOS = LEVELS
DIGITS = 1797  # images of load_digits
PHOTO = (427, 640)  # height and width of each load_sample_images photograph
PHOTOS = 2

Side = Annotated[int, Positive]
Fraction = Annotated[float, Range(ge=0, lt=1)]


def pixel_order(shape: tuple[int, int], order: str, block: tuple[int, int]) -> np.ndarray:
    """``[H W]``: the raster index (``row * W + col``) of the i-th pixel of the generation order ``order``."""
    (h, w), (bh, bw) = shape, block
    grid = np.arange(h * w).reshape(h, w)
    if order == "raster":
        return grid.ravel()
    blocks = grid.reshape(h // bh, bh, w // bw, bw).transpose(0, 2, 1, 3)  # [H/bh, W/bw, bh, bw]
    return blocks.reshape(-1)


def to_sequence(images: np.ndarray, order: str, block: tuple[int, int]) -> np.ndarray:
    """``[n, H, W]`` images to ``[n, H W]`` pixel sequences in ``order``."""
    return images.reshape(len(images), -1)[:, pixel_order(images.shape[1:], order, block)]


def to_images(seqs: np.ndarray, shape: tuple[int, int], order: str, block: tuple[int, int]) -> np.ndarray:
    """``[n, H W]`` sequences in ``order`` back to ``[n, H, W]`` images (the inverse of ``to_sequence``)."""
    out = np.empty_like(seqs)
    out[:, pixel_order(shape, order, block)] = seqs
    return out.reshape(len(seqs), *shape)


def digit_images(shape: tuple[int, int]) -> np.ndarray:
    """``[1797, H, W]`` uint8: the digits scaled to 0..255 and resized bilinearly (8 x 8: unchanged)."""
    images, _ = digit_arrays(shape)  # [n, 1, H, W] in [0, 1]
    return np.rint(images[:, 0] * 255).clip(0, 255).astype(np.uint8)


def photo_tiles(shape: tuple[int, int]) -> np.ndarray:
    """``[n, H, W]`` uint8: non-overlapping tiles of the two sample photographs in grayscale, photograph by
    photograph, tiles in raster order."""
    from sklearn.datasets import load_sample_images

    h, w = shape
    out = []
    for rgb in load_sample_images().images:  # [427, 640, 3] uint8 each
        gray = np.rint(rgb.astype(np.float64) @ np.array([0.299, 0.587, 0.114])).clip(0, 255).astype(np.uint8)
        rows, cols = gray.shape[0] // h, gray.shape[1] // w
        tiles = gray[: rows * h, : cols * w].reshape(rows, h, cols, w).transpose(0, 2, 1, 3)  # [rows, cols, H, W]
        out.append(tiles.reshape(-1, h, w))
    return np.concatenate(out)


def image_shape(params: dict[str, Any]) -> tuple[int, int]:
    """``(H, W)`` of the images of a ``data=pixels`` config: ``(seq_len / width, width)``."""
    return params["seq_len"] // params["width"], params["width"]


@functools.lru_cache(maxsize=4)
def _images(source: str, shape: tuple[int, int]) -> np.ndarray:
    """Every image of ``source`` at ``shape``, once per process (each split's generator reads them)."""
    images = digit_images(shape) if source == "digits" else photo_tiles(shape)
    images.setflags(write=False)
    return images


def source_images(params: dict[str, Any]) -> np.ndarray:
    """``[n, H, W]`` uint8: every image of ``params["source"]`` (capped at ``max_images``, a seeded choice)."""
    images = _images(params["source"], image_shape(params))
    cap = params["max_images"]
    if cap is not None and cap < len(images):
        keep = np.sort(np.random.default_rng([params["seed"], 1]).permutation(len(images))[:cap])
        images = images[keep]
    return images


def image_count(params: dict[str, Any]) -> int:
    """How many images ``source_images`` returns, from the sizes of scikit-learn's bundled files alone."""
    h, w = image_shape(params)
    n = DIGITS if params["source"] == "digits" else PHOTOS * (PHOTO[0] // h) * (PHOTO[1] // w)
    return n if params["max_images"] is None else min(n, params["max_images"])


def split_sizes(n: int, val_fraction: float, test_fraction: float) -> dict[str, int]:
    """Images per split: at least one test and one validation image, the rest for training."""
    test, val = max(1, round(n * test_fraction)), max(1, round(n * val_fraction))
    return {"train": n - val - test, "validation": val, "test": test}


def split_indices(n: int, sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """Indices of each split's images in a seeded shuffle of ``n``: test first, then validation, then training."""
    perm = np.random.default_rng([seed, 0]).permutation(n)
    test, val = sizes["test"], sizes["validation"]
    return {"test": perm[:test], "validation": perm[test : test + val], "train": perm[test + val :]}


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    images = source_images(params)
    sizes = split_sizes(len(images), params["val_fraction"], params["test_fraction"])
    idx = split_indices(len(images), sizes, params["seed"])
    seqs = to_sequence(images[idx[split]], params["order"], tuple(params["block"]))  # [n, H W]
    for seq in seqs:
        yield {"tokens": np.concatenate(([BOS], seq.astype(np.int64)))}


@DATA.register("pixels")
class Pixels(GeneratedSource):
    """Grayscale images as pixel sequences behind a BOS token, for autoregressive image generation.

    Args:
        source: ``digits`` (scikit-learn's 8 x 8 digits, resized to H x W) or ``photos`` (H x W tiles of its two
            sample photographs, in grayscale).
        seq_len: pixels per image, H W: the length of a row (one image).
        width: W; the images are ``seq_len / width`` pixels high.
        order: the pixel order of a row, which is the generation order: ``blocks`` (``block``-sized blocks in
            raster order, raster inside each: the Image Transformer's 2D order) or ``raster``.
        block: ``[b_h, b_w]``, the blocks of the ``blocks`` order (with ``attention=local2d``: its query blocks).
        val_fraction / test_fraction: shares of the images in the validation and test splits (at least one each).
        max_images: use only this many images (a seeded choice), for quick runs; null: all.
        batch_size: rows per batch.
        seed: the split (and ``max_images``) seed.
    """

    task = "lm"
    paper = "Parmar et al., 2018 (Image Transformer, sec. 4)"
    contiguous = False

    def __init__(
        self,
        *,
        source: Literal["digits", "photos"] = "digits",
        seq_len: Side = 1024,
        width: Side = 32,
        order: Literal["blocks", "raster"] = "blocks",
        block: list[Side] = [8, 8],  # noqa: B006  (copied, never mutated; YAML mirrors it)
        val_fraction: Fraction = 0.1,
        test_fraction: Fraction = 0.1,
        max_images: Annotated[int | None, Range(ge=3)] = None,
        batch_size: Side = 16,
        seed: int = 0,
    ):
        self.params = {
            "source": source,
            "seq_len": seq_len,
            "width": width,
            "order": order,
            "block": list(block),
            "val_fraction": val_fraction,
            "test_fraction": test_fraction,
            "max_images": max_images,
            "seed": seed,
        }
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.vocab_size = LEVELS + 1

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        n, w, block = params["seq_len"], params["width"], params["block"]
        if n % w:
            return [
                f"seq_len={n} is not a whole number of rows of width={w} (an image is seq_len / width rows of width "
                f"pixels). Fix: data.seq_len a multiple of {w}, e.g. data.seq_len={w * max(1, round(n / w))}."
            ]
        (h, w), out = image_shape(params), []
        if len(block) != 2:
            out.append(f"block={block} must be [b_h, b_w]. Fix: e.g. data.block=[8,8].")
        elif params["order"] == "blocks" and (h % block[0] or w % block[1]):
            out.append(
                f"block={block} does not tile the {h} x {w} images (order=blocks cuts them into blocks). "
                f"Fix: data.block sides dividing {h} and {w}, or data.order=raster."
            )
        if params["source"] == "photos" and (h > PHOTO[0] or w > PHOTO[1]):
            out.append(
                f"{h} x {w} images are larger than the sample photographs ({PHOTO[0]} x {PHOTO[1]}), so they cut no "
                f"tile. Fix: smaller images (data.seq_len, data.width), e.g. data.seq_len=1024 data.width=32."
            )
        elif params["val_fraction"] + params["test_fraction"] >= 1 or (
            split_sizes(image_count(params), params["val_fraction"], params["test_fraction"])["train"] < 1
        ):
            out.append(
                f"val_fraction={params['val_fraction']} and test_fraction={params['test_fraction']} of "
                f"{image_count(params)} images leave no training image. Fix: smaller fractions, or more images "
                f"(data.max_images)."
            )
        return out

    @classmethod
    def image_geometry(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The images' shape, order and blocks, for ``compat.Selection.image`` (validation reads it)."""
        h, w = image_shape(params)
        return {"source": "pixels", "shape": [h, w], "order": params["order"], "block": list(params["block"])}

    def prepare(self) -> None:
        from datasets import Features, List, Value

        if getattr(self, "_splits", None):
            return
        import sklearn

        images = source_images(self.params)
        sizes = split_sizes(len(images), self.params["val_fraction"], self.params["test_fraction"])
        digest = hashlib.sha256(np.ascontiguousarray(images).tobytes()).hexdigest()
        counts = {NUM_KEY[name]: sizes[name] for name in SPLITS}
        features = Features({"tokens": List(Value(token_dtype(self.vocab_size)), length=self.seq_len + 1)})
        self.generate(_rows, {"version": VERSION, **self.params, **counts, "images_sha256": digest}, features)
        idx = split_indices(len(images), sizes, self.seed)
        self.manifest = {
            "source": "pixels",
            "generator": VERSION,
            **self.params,
            "scikit_learn": sklearn.__version__,
            "images_sha256": digest,
            "images": {name: sizes[name] for name in SPLITS},
            "baselines_test_bits_per_pixel": {
                "uniform": 8.0,
                "train_histogram": histogram_bits(images[idx["train"]], images[idx["test"]]),
            },
            "fingerprint": self.fingerprint,
        }

    def encode(self, text: str) -> list[int]:
        """Intensities as text (``"<bos> 0 17 255"``) to ids."""
        return [BOS if t == "<bos>" else int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("<bos>" if int(i) == BOS else str(int(i)) for i in ids)


def histogram_bits(train: np.ndarray, test: np.ndarray) -> float:
    """Bits per pixel of ``test`` under the add-one smoothed intensity histogram of ``train``: a context-free
    baseline any image model must beat."""
    counts = np.bincount(train.ravel(), minlength=LEVELS).astype(np.float64) + 1
    p = counts / counts.sum()
    return float(-np.log2(p[test.ravel()]).mean())
