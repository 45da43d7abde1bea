"""Calibrating early-exit thresholds on held-out losses (no model runs here: inputs are precomputed losses).

Two ways to pick the confidence threshold at which a token (or example) leaves the network early:

* **Learn-then-Test with fixed-sequence testing** (CALM: Schuster et al., "Confident Adaptive Language
  Modeling", NeurIPS 2022, arXiv:2207.07061, sec. 4; LTT: Angelopoulos et al., "Learn then Test:
  Calibrating Predictive Algorithms to Achieve Risk Control", arXiv:2110.01052).
  For each candidate threshold ``lambda_k`` and each calibration example ``i`` a loss ``L_ik`` in [0, 1] is
  given, e.g. the share of the example's tokens whose early-exit prediction differs from the full
  model's. For each candidate the null ``H_k: R(lambda_k) > delta`` (R = expected loss on a fresh example)
  is tested with the Hoeffding-Bentkus p-value; the candidates are visited from the most conservative
  (largest threshold, least exiting) to the most aggressive, and the walk stops at the first p-value
  above ``epsilon``. Fixed-sequence testing controls the family-wise error rate at ``epsilon`` with no
  multiplicity correction, hence the guarantee:

      if the calibration examples and a test example are i.i.d., then with probability >= 1 - epsilon over
      the calibration draw, the chosen threshold lambda_hat satisfies E[L(lambda_hat)] <= delta.

  The guarantee is on the *expected* loss; the loss measured on one finite test set fluctuates around it.
  The ordering must be fixed before looking at the calibration data (the usual choice, as in CALM, is
  by threshold value), and it is not required that the risk be monotone in the threshold.

* **Grid search on a validation split** (Depth-Adaptive Transformer: Elbayad et al., ICLR 2020,
  arXiv:1910.10073): among the candidates whose validation quality stays within a tolerance of
  the full model, take the one with the smallest average depth. No statistical guarantee.

``split_check`` is an empirical sanity check of the LTT guarantee by repeated calibration/test splits.
Shapes: ``losses`` is ``[n, K]`` (n examples, K candidate thresholds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# ceil(n * risk) is taken after removing this much (relative) float noise, so that a mean of n binary
# losses such as 7 / 100 does not turn 100 * (7 / 100) = 7.000000000000001 into ceil = 8.
_CEIL_SLACK = 1e-9


def _check_open_unit(name: str, value: float) -> None:
    """Raise ValueError unless ``0 < value < 1``."""
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {value}")


def _kl_bernoulli(a: float, b: float) -> float:
    """h1(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b)), the Bernoulli KL divergence, with 0 log 0 = 0.

    Args:
        a: in [0, 1].
        b: in (0, 1).

    Returns:
        The divergence (>= 0).
    """
    first = 0.0 if a <= 0.0 else a * math.log(a / b)
    second = 0.0 if a >= 1.0 else (1.0 - a) * math.log((1.0 - a) / (1.0 - b))
    return max(first + second, 0.0)


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed in log space with ``torch.lgamma`` (float64).

    Args:
        k: upper end of the sum (any integer; < 0 gives 0, >= n gives 1).
        n: number of trials, >= 0.
        p: success probability in (0, 1).

    Returns:
        The cumulative probability, clipped to [0, 1].
    """
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    i = torch.arange(k + 1, dtype=torch.float64)  # [k+1]
    n_t = torch.tensor(float(n), dtype=torch.float64)
    log_pmf = (
        torch.lgamma(n_t + 1)
        - torch.lgamma(i + 1)
        - torch.lgamma(n_t - i + 1)
        + i * math.log(p)
        + (n_t - i) * math.log1p(-p)
    )  # [k+1]
    return min(max(torch.logsumexp(log_pmf, dim=0).exp().item(), 0.0), 1.0)


def hoeffding_bentkus_pvalue(risk: float, n: int, delta: float) -> float:
    """Hoeffding-Bentkus p-value of the null ``H: R > delta`` (LTT, arXiv:2110.01052).

    ``p = min(exp(-n h1(min(risk, delta), delta)), e * P(Binomial(n, delta) <= ceil(n * risk)))``, valid for
    i.i.d. losses bounded in [0, 1] (not only binary ones).

    Args:
        risk: empirical mean of the n calibration losses, in [0, 1].
        n: number of calibration examples, >= 1.
        delta: the risk level being tested, in (0, 1).

    Returns:
        The p-value in [0, 1]; small values are evidence that the true risk is <= delta.

    Raises:
        ValueError: on a risk outside [0, 1], n < 1 or delta outside (0, 1).
    """
    if not 0.0 <= risk <= 1.0:
        raise ValueError(f"risk must lie in [0, 1], got {risk}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    _check_open_unit("delta", delta)
    hoeffding = math.exp(-n * _kl_bernoulli(min(risk, delta), delta))
    k = math.ceil(n * risk - _CEIL_SLACK * n)
    bentkus = math.e * binomial_cdf(k, n, delta)
    return min(max(min(hoeffding, bentkus), 0.0), 1.0)


def _validate_losses(losses: Tensor, thresholds: Sequence[float]) -> None:
    """Shape, range and ordering checks shared by ``ltt_threshold`` and ``split_check``."""
    if losses.dim() != 2:
        raise ValueError(f"losses must be 2-D [n, K], got shape {tuple(losses.shape)}")
    n, k = losses.shape
    if n < 1 or k < 1:
        raise ValueError(f"losses must have at least one example and one threshold, got shape {(n, k)}")
    if k != len(thresholds):
        raise ValueError(f"losses has {k} columns but {len(thresholds)} thresholds were given")
    if not bool(((losses >= 0) & (losses <= 1)).all()):
        raise ValueError("losses must lie in [0, 1] (and not be NaN)")
    for j in range(1, len(thresholds)):
        if thresholds[j] > thresholds[j - 1]:
            raise ValueError(
                "thresholds must be non-increasing (most conservative first), "
                f"but thresholds[{j}] = {thresholds[j]} > thresholds[{j - 1}] = {thresholds[j - 1]}"
            )


def ltt_threshold(losses: Tensor, thresholds: Sequence[float], delta: float, epsilon: float) -> int | None:
    """Learn-then-Test with fixed-sequence testing (CALM, arXiv:2207.07061, sec. 4).

    Visits the candidates in the given order (most conservative first), computes the Hoeffding-Bentkus
    p-value of ``H_k: R(lambda_k) > delta`` for each, and stops at the first p-value above ``epsilon``.

    Guarantee: if the calibration examples and a new example are i.i.d., then with probability
    >= 1 - epsilon over the calibration draw, the returned threshold's expected loss is <= delta
    (returning None, i.e. keeping exits disabled, is always safe).

    Args:
        losses: ``[n, K]`` per-example losses in [0, 1] at each candidate threshold.
        thresholds: the K candidates, non-increasing (largest threshold = least exiting first).
        delta: tolerated risk level, in (0, 1).
        epsilon: allowed failure probability of the calibration, in (0, 1).

    Returns:
        The index of the last candidate whose null was rejected (p <= epsilon), or None when even the
        first one is not rejected.

    Raises:
        ValueError: on a shape mismatch, losses outside [0, 1], delta or epsilon outside (0, 1), or
            thresholds that are not non-increasing.
    """
    _validate_losses(losses, thresholds)
    _check_open_unit("delta", delta)
    _check_open_unit("epsilon", epsilon)
    n = losses.shape[0]
    risks = losses.double().mean(dim=0).clamp(0.0, 1.0).tolist()  # [K]
    chosen = None
    for j, risk in enumerate(risks):
        if hoeffding_bentkus_pvalue(risk, n, delta) > epsilon:
            break
        chosen = j
    return chosen


def grid_threshold(
    quality: Sequence[float],
    depth: Sequence[float],
    full_quality: float,
    tolerance: float,
    higher_is_better: bool = False,
) -> int | None:
    """Depth-Adaptive Transformer grid search (Elbayad et al., ICLR 2020) over validation results.

    A candidate qualifies when its quality is within ``tolerance`` of the full model:
    ``quality <= full_quality + tolerance`` when lower is better (loss, bits per byte), or
    ``quality >= full_quality - tolerance`` when higher is better (accuracy, BLEU).

    Args:
        quality: validation quality of each of the K candidates.
        depth: average depth (layers used) of each candidate, same length.
        full_quality: quality of the full-depth model.
        tolerance: allowed degradation, >= 0.
        higher_is_better: direction of ``quality``.

    Returns:
        The index of the qualifying candidate with the smallest average depth (ties: better quality,
        then the lower index), or None when none qualifies.

    Raises:
        ValueError: on lengths that differ or a negative tolerance.
    """
    if len(quality) != len(depth):
        raise ValueError(f"quality has {len(quality)} entries but depth has {len(depth)}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    sign = -1.0 if higher_is_better else 1.0  # sign * quality: lower is better
    limit = sign * full_quality + tolerance
    best: int | None = None
    for j, (q, d) in enumerate(zip(quality, depth)):
        if not sign * q <= limit:  # also rejects NaN
            continue
        if best is None or (d, sign * q) < (depth[best], sign * quality[best]):
            best = j
    return best


def _split_once(
    losses: Tensor, thresholds: Sequence[float], delta: float, epsilon: float, n_cal: int, gen: torch.Generator
) -> tuple[int | None, float]:
    """One random calibration/test split: the chosen index and its mean test loss (0 when None)."""
    perm = torch.randperm(losses.shape[0], generator=gen)  # [n]
    calib, test = losses[perm[:n_cal]], losses[perm[n_cal:]]  # [n_cal, K], [n - n_cal, K]
    chosen = ltt_threshold(calib, thresholds, delta, epsilon)
    risk = 0.0 if chosen is None else test[:, chosen].double().mean().item()
    return chosen, risk


def split_check(
    losses: Tensor,
    thresholds: Sequence[float],
    delta: float,
    epsilon: float,
    repeats: int = 100,
    calib_fraction: float = 0.5,
    seed: int = 0,
) -> dict:
    """Empirical check of the LTT guarantee by repeated random calibration/test splits.

    Each repeat shuffles the n examples (``torch.Generator`` seeded with ``seed``), calibrates with
    ``ltt_threshold`` on the first ``round(calib_fraction * n)`` and measures the mean test loss at the
    chosen threshold. A split where nothing is chosen falls back to exits disabled (test loss 0, counted
    as satisfied) and is also counted in ``none_chosen``. Note the measured test risk is a noisy
    estimate of the expected loss that the guarantee is about, so ``share_ok`` may dip slightly below
    1 - epsilon on small test sets even when the guarantee holds.

    Args:
        losses: ``[n, K]`` per-example losses in [0, 1] at each candidate threshold.
        thresholds: the K candidates, non-increasing.
        delta: tolerated risk level, in (0, 1).
        epsilon: allowed failure probability, in (0, 1).
        repeats: number of random splits, >= 1.
        calib_fraction: share of the examples used for calibration, in (0, 1); both parts must be non-empty.
        seed: seed of the splitting generator.

    Returns:
        ``{"share_ok": float, "chosen": list[int | None], "test_risk": list[float], "none_chosen": int}``.

    Raises:
        ValueError: on invalid losses or thresholds (see ``ltt_threshold``), ``repeats < 1``, or a
            ``calib_fraction`` that leaves the calibration or the test part empty.
    """
    _validate_losses(losses, thresholds)
    _check_open_unit("delta", delta)
    _check_open_unit("epsilon", epsilon)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    _check_open_unit("calib_fraction", calib_fraction)
    n = losses.shape[0]
    n_cal = round(calib_fraction * n)
    if not 1 <= n_cal <= n - 1:
        raise ValueError(f"calib_fraction={calib_fraction} with n={n} leaves an empty calibration or test part")
    gen = torch.Generator().manual_seed(seed)
    chosen: list[int | None] = []
    test_risk: list[float] = []
    for _ in range(repeats):
        idx, risk = _split_once(losses, thresholds, delta, epsilon, n_cal, gen)
        chosen.append(idx)
        test_risk.append(risk)
    ok = sum(risk <= delta for risk in test_risk)
    return {
        "share_ok": ok / repeats,
        "chosen": chosen,
        "test_risk": test_risk,
        "none_chosen": sum(idx is None for idx in chosen),
    }
