"""``data=digits``: scikit-learn's bundled handwritten digits as images, a 10-class classification with no
download (``sklearn.datasets.load_digits``: the test set of the UCI "Optical Recognition of Handwritten
Digits" data, 1797 images of 8x8 pixels with 17 grey levels, shipped inside scikit-learn).

Rows: ``image`` float32 ``[1, size, size]`` in [0, 1] (the grey level / 16) and ``label`` 0..9. ``size`` 8 keeps
the pixels as they are; a larger size upsamples every image bilinearly (``torch.nn.functional.interpolate``,
``align_corners=False``), for models that need larger images. The split is fixed by ``seed``: a seeded
permutation of the 1797 images, whose first ``num_test`` are the test set, the next ``num_val`` the validation
set and the rest (1297 by default) the training set. Batches (``collate``): ``inputs`` float ``[B, 1, size,
size]`` and ``label`` long ``[B]``. A ViT (``xfam.model.inputs``) cuts the images into ``model.patch_size``
patches; ``split_arrays`` gives the same split as arrays, for baselines on the same pixels.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np
import torch
from torch import Tensor

from xfam.core.registry import Range
from xfam.data.base import DATA
from xfam.data.cache import cached_generate, rows_check
from xfam.data.packing import FORMAT, SPLITS, GeneratedSource
from xfam.data.tokenize import short_hash

VERSION = "sklearn-digits-1"
TOTAL = 1797  # images in sklearn's bundled copy
LEVELS = 16.0  # the grey levels are 0..16


def digit_arrays(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``(images [1797, 1, H, W] float64 in [0, 1], labels [1797])``: every bundled digit, the grey level / 16,
    resized bilinearly to ``shape`` (8 x 8: as they are). ``data=pixels`` draws its digits from here too."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = data.images[:, None] / LEVELS  # [n, 1, 8, 8]
    if tuple(shape) != images.shape[-2:]:
        up = torch.nn.functional.interpolate(
            torch.from_numpy(images), size=tuple(shape), mode="bilinear", align_corners=False
        )
        images = up.clamp(0, 1).numpy()
    return images, data.target


def split_arrays(params: dict[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images [n, 1, size, size] float32 in [0, 1], labels [n] int64)`` of one split (module docstring)."""
    images, labels = digit_arrays((params["size"],) * 2)
    order = np.random.default_rng(params["seed"]).permutation(len(labels))
    n_test, n_val = params["num_test"], params["num_val"]
    pick = {"test": order[:n_test], "validation": order[n_test : n_test + n_val], "train": order[n_test + n_val :]}
    idx = np.sort(pick[split])
    return images[idx].astype(np.float32), labels[idx].astype(np.int64)


def pixels_hash() -> str:
    """A hash of the bundled images and labels (enters the fingerprint: another copy names other data)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    raw = data.images.astype(np.uint8).tobytes() + data.target.astype(np.uint8).tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    images, labels = split_arrays(params, split)
    for image, label in zip(images, labels.tolist(), strict=True):
        yield {"image": image, "label": label}


def collate_images(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Rows to ``inputs`` float ``[B, C, H, W]`` and ``label`` long ``[B]``."""
    images = torch.stack([r["image"] for r in rows]).float()
    return {"inputs": images, "label": torch.stack([torch.as_tensor(r["label"]) for r in rows]).long()}


@DATA.register("digits")
class Digits(GeneratedSource):
    """scikit-learn's 8x8 handwritten digits as ``[1, size, size]`` images in [0, 1], 10 classes, a fixed split.

    Args:
        size: side of the images: 8 (the pixels as they are) or larger (bilinear upsampling).
        num_val / num_test: images in the validation and test sets; the training set has the other
            1797 - num_val - num_test.
        batch_size: images per batch.
        seed: the permutation that makes the split; the same seed gives the same split.
    """

    task = "classify"
    paper = "scikit-learn's digits (UCI optical recognition of handwritten digits)"
    id_column = "label"

    def __init__(
        self,
        *,
        size: Annotated[int, Range(ge=8)] = 8,
        num_val: Annotated[int, Range(ge=1)] = 250,
        num_test: Annotated[int, Range(ge=1)] = 250,
        batch_size: Annotated[int, Range(ge=1)] = 32,
        seed: int = 0,
    ):
        args = locals()
        self.params = {k: v for k, v in args.items() if k not in ("self", "__class__", "batch_size")}
        self.batch_size, self.seed = batch_size, seed
        # (an image per row, no token window: data_info records seq_len None, as a checkpoint of it holds)
        self.seq_len = None  # type: ignore[assignment]
        self.vocab_size, self.num_classes = 0, 10

    @classmethod
    def inputs_for(cls, params: dict[str, Any]) -> dict[str, Any]:
        return {"kind": "image", "channels": 1, "height": params["size"], "width": params["size"]}

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        held = params["num_val"] + params["num_test"]
        if held >= TOTAL:
            return [
                f"num_val + num_test = {held}: scikit-learn's digits has {TOTAL} images, and the training set "
                f"would be empty. Fix: data.num_val + data.num_test < {TOTAL} (e.g. 250 and 250)."
            ]
        return []

    def prepare(self) -> None:
        from datasets import Array3D, Features, Value

        if getattr(self, "_splits", None):
            return
        size = self.params["size"]
        features = Features({"image": Array3D(shape=(1, size, size), dtype="float32"), "label": Value("int64")})
        params = {"version": VERSION, "pixels": pixels_hash(), **self.params}
        self.fingerprint = short_hash(FORMAT, self.registry_name, params)
        counts = {"test": self.params["num_test"], "validation": self.params["num_val"]}
        counts["train"] = TOTAL - counts["test"] - counts["validation"]
        self._splits, self.manifest = {}, {"source": "sklearn.datasets.load_digits", **params, "splits": {}}
        for name in SPLITS:
            kwargs, key = {"params": params, "split": name}, short_hash(self.fingerprint, name)
            check = rows_check(counts[name], labels=("label", 10))
            ds = cached_generate(_rows, kwargs, features, name, key, check)
            labels = ds.with_format("numpy")[:]["label"]
            hist = np.bincount(labels, minlength=10)
            self.manifest["splits"][name] = {
                "images": len(ds),
                "class_counts": hist.tolist(),
                "majority_class_rate": float(hist.max() / max(1, len(ds))),
            }
            self._splits[name] = ds.with_format("torch")
        self.manifest["fingerprint"] = self.fingerprint

    def collate(self, rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        return collate_images(rows)
