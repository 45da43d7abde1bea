"""``data=timeseries``: a generated multi-frequency time series, for continuous autoregressive modelling
(``task=regress``: predict the next vector from the ones before it; ``xfam.model.inputs``).

Each row is one series of ``seq_len + 1`` steps of F = ``channels`` values. Channel c of a row is a sum of
K = ``num_freqs`` sinusoids with their own periods, amplitudes and phases, plus optional white noise:

    x[t, c] = sum_k a_kc sin(2 pi t / T_kc + phi_kc) + noise * e_tc,

T_kc uniform in [``min_period``, ``max_period``] steps, a_kc uniform in [0.5, 1.5] / sqrt(K), phi_kc uniform in
[0, 2 pi), e_tc ~ N(0, 1), all drawn per row, so a model must read the frequencies from the context. Without
noise a channel obeys a linear recurrence of order 2K (each sinusoid is one of order 2), so the next value is
an exact function of the 2K before it: the MSE a perfect model reaches is ``noise**2``. The manifest reports
two reference errors of every split: predicting zero (the signal's mean square) and the last value
(persistence).

Rows: ``series`` float32 ``[S + 1, F]``; batches (``collate``): ``inputs`` ``[B, S, F]`` = series[:, :-1],
``targets`` ``[B, S, F]`` = series[:, 1:]. Each split is drawn from its own stream (``[seed, split index]``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np
import torch
from torch import Tensor

from xfam.core.registry import NonNegative, Range
from xfam.data.base import DATA
from xfam.data.cache import cached_generate
from xfam.data.packing import FORMAT, NUM_KEY, SPLITS, GeneratedSource
from xfam.data.tokenize import short_hash

VERSION = "multi-sine-1"


def sine_series(
    num: int, length: int, channels: int, num_freqs: int, periods: tuple[float, float], noise: float, rng: Any
) -> np.ndarray:
    """``[num, length, channels]`` float32 series: per row and channel a sum of ``num_freqs`` sinusoids with
    periods uniform in ``periods``, amplitudes uniform in [0.5, 1.5] / sqrt(K), phases uniform, plus
    N(0, noise^2) white noise (module docstring)."""
    shape = (num, 1, num_freqs, channels)
    period = rng.uniform(periods[0], periods[1], size=shape)  # [n, 1, K, F]
    amp = rng.uniform(0.5, 1.5, size=shape) / np.sqrt(num_freqs)
    phase = rng.uniform(0.0, 2 * np.pi, size=shape)
    t = np.arange(length, dtype=np.float64)[None, :, None, None]  # [1, L, 1, 1]
    x = (amp * np.sin(2 * np.pi * t / period + phase)).sum(axis=2)  # [n, L, F]
    if noise:
        x = x + noise * rng.standard_normal(x.shape)
    return x.astype(np.float32)


def _rows(params: dict[str, Any], split: str) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng([params["seed"], SPLITS.index(split)])
    periods = (params["min_period"], params["max_period"])
    series = sine_series(
        params[NUM_KEY[split]],
        params["seq_len"] + 1,
        params["channels"],
        params["num_freqs"],
        periods,
        params["noise"],
        rng,
    )
    for row in series:
        yield {"series": row}


def _check(rows: int) -> Any:
    """A cached split is usable when it holds ``rows`` series of finite values."""

    def check(ds: Any) -> str | None:
        if len(ds) != rows:
            return f"{len(ds)} rows where this stage makes {rows}"
        values = ds.with_format("numpy")[:]["series"]
        return None if np.isfinite(values).all() else "non-finite values in 'series'"

    return check


def collate_regress(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Series ``[S + 1, F]`` to ``inputs`` and ``targets`` float ``[B, S, F]`` (the next vector of each step)."""
    x = torch.stack([r["series"] for r in rows]).float()  # [B, S + 1, F]
    return {"inputs": x[:, :-1].contiguous(), "targets": x[:, 1:].contiguous()}


@DATA.register("timeseries")
class TimeSeries(GeneratedSource):
    """Sums of sinusoids with random periods, amplitudes and phases per row and channel, for task=regress.

    Args:
        seq_len: steps per row (the model reads S and predicts S next vectors).
        channels: F, values per step.
        num_freqs: K, sinusoids per channel.
        min_period / max_period: the range of the periods, in steps (a period under 2 steps aliases).
        noise: standard deviation of the white noise added to every value (0: none).
        num_train / num_val / num_test: rows per split (each split its own random stream).
        batch_size: rows per batch.
        seed: data seed; the same seed gives the same data.
    """

    task = "regress"
    paper = "generated (sums of sinusoids)"

    def __init__(
        self,
        *,
        seq_len: Annotated[int, Range(ge=2)] = 64,
        channels: Annotated[int, Range(ge=1)] = 2,
        num_freqs: Annotated[int, Range(ge=1)] = 3,
        min_period: Annotated[float, Range(ge=2.0)] = 4.0,
        max_period: Annotated[float, Range(ge=2.0)] = 32.0,
        noise: Annotated[float, NonNegative] = 0.0,
        num_train: Annotated[int, Range(ge=1)] = 4000,
        num_val: Annotated[int, Range(ge=1)] = 400,
        num_test: Annotated[int, Range(ge=1)] = 400,
        batch_size: Annotated[int, Range(ge=1)] = 32,
        seed: int = 0,
    ):
        self.keep_params(locals())
        self.vocab_size, self.target_dim = 0, channels

    @classmethod
    def inputs_for(cls, params: dict[str, Any]) -> dict[str, Any]:
        return {"kind": "vectors", "dim": params["channels"]}

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        lo, hi = params["min_period"], params["max_period"]
        if lo > hi:
            return [
                f"min_period={lo} > max_period={hi}: the range of the periods is empty. "
                f"Fix: data.min_period <= data.max_period."
            ]
        return []

    def prepare(self) -> None:
        from datasets import Array2D, Features

        if getattr(self, "_splits", None):
            return
        params = {"version": VERSION, **self.params}
        features = Features({"series": Array2D(shape=(self.seq_len + 1, self.params["channels"]), dtype="float32")})
        self.fingerprint = short_hash(FORMAT, self.registry_name, params)
        self._splits, self.manifest = {}, {"source": "timeseries", "generator": VERSION, **self.params, "splits": {}}
        for name in SPLITS:
            kwargs, key = {"params": params, "split": name}, short_hash(self.fingerprint, name)
            ds = cached_generate(_rows, kwargs, features, name, key, _check(params[NUM_KEY[name]]))
            x = ds.with_format("numpy")[:]["series"].astype(np.float64)  # [n, S + 1, F]
            self.manifest["splits"][name] = {
                "rows": len(ds),
                "mse_zero": float((x[:, 1:] ** 2).mean()),  # predicting 0 (the signal's mean square)
                "mse_last": float(((x[:, 1:] - x[:, :-1]) ** 2).mean()),  # predicting the last value
            }
            self._splits[name] = ds.with_format("torch")
        self.manifest["fingerprint"] = self.fingerprint

    def collate(self, rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        return collate_regress(rows)
