"""The sources of inputs beyond tokens (``data=timeseries``, ``data=digits``) and the refusals of what needs token
ids, made before anything is built."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.integration.helpers import compose_cfg
from xfam.config import validate
from xfam.core.errors import ConfigError
from xfam.data.base import DATA
from xfam.data.digits import split_arrays
from xfam.data.timeseries import sine_series


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    tiny = ["model.dim=32", "model.layers=2", "model.heads=2", "model.max_len=64"]
    return {
        "digits": compose_cfg(["data=digits", "model.patch_size=2", "pos=learned", *tiny]),
        "timeseries": compose_cfg(["data=timeseries", "data.seq_len=32", *tiny]),
    }


def with_(cfg: dict, **sections: dict) -> dict:
    out = copy.deepcopy(cfg)
    for section, values in sections.items():
        out[section].update(values)
    return out


def problems(cfg: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    return str(err.value)


def test_the_sources_validate_with_their_task_shape_and_inputs(configs: dict) -> None:
    rc = validate(configs["timeseries"])
    assert (rc.task, rc.arch, rc.causal) == ("regress", "decoder", True)
    assert rc.selection.inputs == "vectors"
    rc = validate(configs["digits"])
    assert (rc.task, rc.arch, rc.causal, rc.selection.inputs) == ("classify", "encoder", False, "image")


@pytest.mark.parametrize(
    ("name", "sections", "expected"),
    [
        ("digits", {"model": {"patch_size": 3}}, "model.patch_size=3 does not divide the 8x8 images"),
        ("digits", {"model": {"patch_size": 1, "max_len": 32}}, "make 64 rows of 1x1 patches"),
        ("digits", {"model": {"tie_embeddings": True}}, "model.tie_embeddings=true ties the output layer"),
        ("timeseries", {"model": {"l2norm_embed": True}}, "model.l2norm_embed=true l2-normalises"),
        ("timeseries", {"model": {"vocab_size": 32}}, "model.vocab_size=32 sizes a token embedding"),
        ("timeseries", {"task": {"name": "mlm"}}, "task=mlm masks tokens of a text stream"),
        ("timeseries", {"model": {"arch": "encoder"}}, "predicts each next vector"),
        ("timeseries", {"model": {"causal": False}}, "predict the next vector"),
        ("timeseries", {"exit": {"name": "calm"}}, "task=regress predicts vectors with a squared error"),
        ("digits", {"memory": {"name": "spalm", "store": "/nonexistent"}}, "not token ids. Fix: memory=none"),
        ("timeseries", {"data": {"min_period": 9.0, "max_period": 5.0}}, "min_period=9.0 > max_period=5.0"),
        ("digits", {"data": {"num_val": 1000, "num_test": 900}}, "the training set would be empty"),
    ],
)
def test_what_needs_token_ids_or_cannot_fit_is_refused_with_the_fix(configs, name, sections, expected) -> None:
    msg = problems(with_(configs[name], **sections))
    assert expected in msg and "Fix:" in msg


def test_the_time_series_is_a_sum_of_sinusoids_predictable_from_2k_past_values() -> None:
    """Without noise each channel obeys a linear recurrence of order 2K: least squares on 2K lags fits it exactly
    (the floor a perfect model reaches), and on fewer lags it does not."""
    x = sine_series(1, 200, 2, 3, (4.0, 32.0), 0.0, np.random.default_rng(0))[0, :, 0].astype(np.float64)

    def residual(lags: int) -> float:
        rows = np.stack([x[i : len(x) - lags + i] for i in range(lags)], axis=1)
        coef, *_ = np.linalg.lstsq(rows, x[lags:], rcond=None)
        return float(np.mean((rows @ coef - x[lags:]) ** 2))

    assert residual(6) < 1e-8 < 1e-4 < residual(3)


def test_time_series_rows_batches_and_fingerprints() -> None:
    params = {"name": "timeseries", "seq_len": 16, "channels": 3, "num_train": 8, "num_val": 4, "num_test": 4}
    src = DATA.build({**params, "batch_size": 4})
    src.prepare()
    batch = src.collate([src.split("train")[i] for i in range(4)])
    assert batch["inputs"].shape == batch["targets"].shape == (4, 16, 3)
    assert torch.equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert src.inputs == {"kind": "vectors", "dim": 3} and src.target_dim == 3
    m = src.manifest["splits"]["validation"]
    assert m["rows"] == 4 and m["mse_zero"] > 0 and m["mse_last"] > 0
    again, other = DATA.build({**params, "batch_size": 2}), DATA.build({**params, "seed": 1, "batch_size": 4})
    again.prepare(), other.prepare()
    assert again.fingerprint == src.fingerprint != other.fingerprint
    assert torch.equal(again.split("test")[0]["series"], src.split("test")[0]["series"])


def test_digits_split_is_fixed_disjoint_and_upsampled_on_request() -> None:
    params = {"size": 8, "num_val": 250, "num_test": 250, "seed": 0}
    parts = {s: split_arrays(params, s) for s in ("train", "validation", "test")}
    assert [len(parts[s][1]) for s in parts] == [1297, 250, 250]
    from sklearn.datasets import load_digits

    every = sorted(x.tobytes() for s in parts for x in parts[s][0])  # the three splits partition the 1797 images
    assert every == sorted((x / 16).astype(np.float32)[None].tobytes() for x in load_digits().images)
    images = parts["train"][0]
    assert images.shape[1:] == (1, 8, 8) and images.min() >= 0 and images.max() <= 1
    big, labels = split_arrays({**params, "size": 16}, "test")
    assert big.shape == (250, 1, 16, 16) and np.array_equal(labels, parts["test"][1])
    src = DATA.build({"name": "digits", "size": 16, "batch_size": 8})
    src.prepare()
    batch = src.collate([src.split("validation")[i] for i in range(8)])
    assert batch["inputs"].shape == (8, 1, 16, 16) and batch["label"].dtype == torch.long
    assert src.inputs == {"kind": "image", "channels": 1, "height": 16, "width": 16}
    assert sum(src.manifest["splits"]["train"]["class_counts"]) == 1297
