"""The kNN distribution and its interpolation with the model (Khandelwal et al., 2020, Eq. 2-3).

    p_kNN(y | x) ∝ Σ_{(k_i, v_i) ∈ N(x)} 1[v_i = y] exp(-d(k_i, q(x)) / T)
    p(y | x)     = λ p_kNN(y | x) + (1 - λ) p_LM(y | x)

``d`` is the squared Euclidean distance (what the authors' code and FAISS's ``IndexFlatL2`` return; the
paper's Eq. 2 calls it the L2 distance), T a temperature (1 in the paper). Everything is computed in log
space: ``log p = logaddexp(log λ + log p_kNN, log(1 - λ) + log p_LM)``, so λ = 0 returns the model's
log-probabilities exactly and λ = 1 exactly p_kNN, and a token no neighbour carries has
``log p_kNN = -inf`` rather than an underflowed 0.

Shapes: N queries, K neighbours, V vocabulary.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core.errors import ConfigError

if TYPE_CHECKING:
    from xfam.knnlm.datastore import Datastore


def check_knn_options(k: int, lam: float, temperature: float) -> None:
    """One ConfigError listing every out-of-range kNN-LM option."""
    problems = []
    if k < 1:
        problems.append(f"k={k}: the number of neighbours must be >= 1. Fix: k=1024 (the paper's value).")
    if not 0.0 <= lam <= 1.0:
        problems.append(f"lambda={lam}: the interpolation weight must be in [0, 1]. Fix: lambda=0.25.")
    if not temperature > 0:
        problems.append(f"temperature={temperature}: must be > 0. Fix: temperature=1.0 (the paper's value).")
    if problems:
        raise ConfigError(problems)


def neighbour_log_weights(dists: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(-d / T)`` over the neighbours: ``[N, K] -> [N, K]``."""
    return F.log_softmax(-dists.float() / temperature, dim=-1)


def knn_log_probs(dists: Tensor, values: Tensor, vocab_size: int, temperature: float = 1.0) -> Tensor:
    """The whole kNN distribution ``log p_kNN [N, V]`` from neighbour distances ``[N, K]`` and their
    values (next tokens) ``[N, K]``; tokens no neighbour carries get ``-inf``.

    Aggregated per token in log space: ``m_y = max_i log w_i`` over the neighbours with value y, then
    ``log p_kNN(y) = m_y + log Σ_i exp(log w_i - m_y)`` (no underflow for far neighbours)."""
    logw = neighbour_log_weights(dists, temperature)  # [N, K]
    n = logw.shape[0]
    peak = logw.new_full((n, vocab_size), float("-inf")).scatter_reduce(1, values, logw, reduce="amax")  # [N, V]
    mass = logw.new_zeros(n, vocab_size).scatter_add(1, values, (logw - peak.gather(1, values)).exp())  # [N, V]
    return peak + mass.log()  # -inf + log 0 = -inf where no neighbour carries the token


def knn_target_log_probs(dists: Tensor, values: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """``log p_kNN(target)`` only, ``[N]``: a logsumexp over the neighbours whose value is the target
    (``O(N K)``, no ``[N, V]`` tensor); ``-inf`` when none is."""
    logw = neighbour_log_weights(dists, temperature)  # [N, K]
    return torch.logsumexp(logw.masked_fill(values != targets.unsqueeze(-1), float("-inf")), dim=-1)  # [N]


def interpolate(lm_log_probs: Tensor, knn_log_probs: Tensor, lam: float) -> Tensor:
    """``log(λ p_kNN + (1 - λ) p_LM)`` from the two log-probabilities (any equal shapes), in log space.

    λ = 0 gives ``lm_log_probs`` exactly (``log(1 - 0) = 0`` and ``log 0 = -inf`` drop the kNN term),
    λ = 1 gives ``knn_log_probs`` exactly."""
    if not 0.0 <= lam <= 1.0:
        raise ConfigError(f"lambda={lam}: the interpolation weight must be in [0, 1]. Fix: lambda=0.25.")
    log_lam = math.log(lam) if lam > 0 else float("-inf")
    log_rest = math.log1p(-lam) if lam < 1 else float("-inf")
    return torch.logaddexp(lm_log_probs.float() + log_rest, knn_log_probs.float() + log_lam)


def interpolated_log_probs(
    logits: Tensor,
    keys: Tensor,
    store: Datastore,
    *,
    k: int = 1024,
    lam: float = 0.25,
    temperature: float = 1.0,
    self_rows: Tensor | None = None,
) -> Tensor:
    """kNN-LM log-probabilities ``[N, V]`` for a batch of the model's ``logits [N, V]`` and their keys
    ``[N, D]`` (the final layer's FFN input, ``xfam.knnlm.keys.KeyCapture``), with ``k`` neighbours from
    ``store``; ``self_rows [N]`` excludes each query's own store row (see ``Datastore.search``)."""
    check_knn_options(k, lam, temperature)
    lm = F.log_softmax(logits.float(), dim=-1)  # [N, V]
    nb = store.search(keys, k, self_rows)
    return interpolate(lm, knn_log_probs(nb.dists, nb.values, lm.shape[-1], temperature), lam)


class KnnMixer:
    """kNN-LM for sampling (``xfam.eval.generate.generate(knn=...)``): within its context, turns the model's
    next-token logits ``[B, V]`` of the latest forward into kNN-LM log-probabilities ``[B, V]``, the key
    being the final layer's FFN input at the last position of that forward (the prompt, then each new
    token of the decode cache)."""

    def __init__(
        self, model: nn.Module, store: Datastore, *, k: int = 1024, lam: float = 0.25, temperature: float = 1.0
    ):
        from xfam.knnlm.keys import KeyCapture, check_supported

        check_supported(model)
        check_knn_options(k, lam, temperature)
        self.store, self.k, self.lam, self.temperature = store, k, lam, temperature
        self.capture = KeyCapture(model)

    def __enter__(self) -> KnnMixer:
        self.capture.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.capture.__exit__(*exc)

    def __call__(self, logits: Tensor) -> Tensor:
        keys = self.capture.take()[:, -1]  # [B, D]: the key of the position these logits predict from
        return interpolated_log_probs(logits, keys, self.store, k=self.k, lam=self.lam, temperature=self.temperature)
