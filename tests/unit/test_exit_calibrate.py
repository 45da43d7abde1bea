"""Early-exit threshold calibration: Learn-then-Test (CALM, Schuster et al., 2022) and grid search (Elbayad et al.)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from xfam.eval.calibrate import (
    binomial_cdf,
    grid_threshold,
    hoeffding_bentkus_pvalue,
    ltt_threshold,
    split_check,
)


def explicit_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, min(k, n) + 1))


def explicit_pvalue(risk: float, n: int, delta: float) -> float:
    a = min(risk, delta)
    h1 = (a * math.log(a / delta) if a > 0 else 0.0) + (1 - a) * math.log((1 - a) / (1 - delta))
    return min(1.0, math.exp(-n * h1), math.e * explicit_cdf(math.ceil(n * risk), n, delta))


def bernoulli_losses(n: int, probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[n, K] losses, column k Bernoulli(probs[k]); nested (one uniform per example) as for real exits."""
    u = torch.rand(n, 1, generator=gen, dtype=torch.float64)
    return (u < probs.double()).float()


# ---------------------------------------------------------------- p-value


@pytest.mark.parametrize("k,n,p", [(0, 10, 0.3), (3, 10, 0.3), (7, 50, 0.1), (20, 60, 0.45), (49, 50, 0.9)])
def test_binomial_cdf_matches_explicit_sum(k, n, p):
    assert binomial_cdf(k, n, p) == pytest.approx(explicit_cdf(k, n, p), rel=1e-9, abs=1e-15)


def test_binomial_cdf_edges():
    assert binomial_cdf(-1, 10, 0.5) == 0.0
    assert binomial_cdf(10, 10, 0.5) == 1.0
    assert binomial_cdf(0, 5, 0.2) == pytest.approx(0.8**5)


@pytest.mark.parametrize(
    "risk,n,delta", [(0.0, 20, 0.1), (0.05, 100, 0.1), (0.08, 300, 0.1), (0.13, 37, 0.2), (0.3, 50, 0.25)]
)
def test_pvalue_matches_direct_computation(risk, n, delta):
    assert hoeffding_bentkus_pvalue(risk, n, delta) == pytest.approx(explicit_pvalue(risk, n, delta), rel=1e-9)


def test_pvalue_zero_risk_is_hoeffding_or_bentkus():
    # risk 0: Hoeffding gives (1 - delta)^n, Bentkus e * (1 - delta)^n, so the minimum is (1 - delta)^n.
    assert hoeffding_bentkus_pvalue(0.0, 30, 0.1) == pytest.approx(0.9**30)


def test_pvalue_ceil_ignores_float_noise():
    # (7 / 100) * 100 is 7.000000000000001 in floats; the Bentkus term must use ceil = 7, not 8.
    assert 100 * (7 / 100) > 7
    expected = min(1.0, math.e * explicit_cdf(7, 100, 0.15), explicit_pvalue(0.07 - 1e-12, 100, 0.15))
    assert hoeffding_bentkus_pvalue(7 / 100, 100, 0.15) == pytest.approx(expected, rel=1e-6)
    assert math.e * explicit_cdf(7, 100, 0.15) < math.e * explicit_cdf(8, 100, 0.15)


def test_pvalue_monotone_in_risk():
    values = [hoeffding_bentkus_pvalue(r, 200, 0.1) for r in torch.linspace(0, 1, 101).tolist()]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert all(0.0 <= v <= 1.0 for v in values)


def test_pvalue_extremes():
    assert hoeffding_bentkus_pvalue(0.5, 1000, 0.1) == pytest.approx(1.0)
    assert hoeffding_bentkus_pvalue(1.0, 10, 0.1) == pytest.approx(1.0)
    assert hoeffding_bentkus_pvalue(0.01, 2000, 0.1) < 1e-30


def test_pvalue_is_valid_at_the_boundary_null():
    # Binary losses with true risk exactly delta: P(p <= eps) <= eps, summed exactly over the binomial.
    n, delta = 150, 0.2
    pmf = [math.comb(n, k) * delta**k * (1 - delta) ** (n - k) for k in range(n + 1)]
    for eps in (0.01, 0.05, 0.1, 0.3):
        rejected = sum(w for k, w in enumerate(pmf) if hoeffding_bentkus_pvalue(k / n, n, delta) <= eps)
        assert rejected <= eps


@pytest.mark.parametrize("risk,n,delta", [(-0.1, 10, 0.1), (1.1, 10, 0.1), (0.1, 0, 0.1), (0.1, 10, 0.0)])
def test_pvalue_rejects_bad_inputs(risk, n, delta):
    with pytest.raises(ValueError):
        hoeffding_bentkus_pvalue(risk, n, delta)


# ---------------------------------------------------------------- ltt_threshold


def column_losses(n: int, risks: list[float]) -> torch.Tensor:
    """[n, K] binary losses whose column k has mean exactly risks[k] (risks[k] * n must be an integer)."""
    cols = [torch.cat([torch.ones(round(r * n)), torch.zeros(n - round(r * n))]) for r in risks]
    return torch.stack(cols, dim=1)


def test_ltt_picks_the_last_rejected_threshold():
    losses = column_losses(500, [0.0, 0.02, 0.05, 0.3, 0.5])
    assert ltt_threshold(losses, [0.9, 0.8, 0.7, 0.6, 0.5], delta=0.1, epsilon=0.05) == 2


def test_ltt_stops_at_the_first_failure():
    # Threshold 1 fails; threshold 2 would pass on its own but fixed-sequence testing never reaches it.
    losses = column_losses(500, [0.0, 0.4, 0.0, 0.0])
    assert ltt_threshold(losses, [0.9, 0.8, 0.7, 0.6], delta=0.1, epsilon=0.05) == 0


def test_ltt_none_when_the_first_fails():
    losses = column_losses(500, [0.3, 0.0, 0.0])
    assert ltt_threshold(losses, [0.9, 0.8, 0.7], delta=0.1, epsilon=0.05) is None


def test_ltt_none_when_too_few_examples():
    # Zero observed loss, but 5 examples cannot show risk <= 0.1 at epsilon 0.05 ((0.9)^5 = 0.59).
    assert ltt_threshold(torch.zeros(5, 2), [0.9, 0.8], delta=0.1, epsilon=0.05) is None


def test_ltt_accepts_fractional_losses_and_equal_thresholds():
    losses = torch.full((400, 3), 0.01)
    losses[:, 2] = 0.5
    assert ltt_threshold(losses, [0.9, 0.9, 0.5], delta=0.1, epsilon=0.1) == 1


@pytest.mark.parametrize(
    "losses,thresholds,delta,epsilon,match",
    [
        (torch.zeros(10, 3), [0.9, 0.8], 0.1, 0.1, "columns"),
        (torch.zeros(10), [0.9], 0.1, 0.1, "2-D"),
        (torch.full((10, 2), 1.5), [0.9, 0.8], 0.1, 0.1, r"\[0, 1\]"),
        (torch.full((10, 2), -0.1), [0.9, 0.8], 0.1, 0.1, r"\[0, 1\]"),
        (torch.full((10, 2), float("nan")), [0.9, 0.8], 0.1, 0.1, "NaN"),
        (torch.zeros(10, 2), [0.9, 0.8], 0.0, 0.1, "delta"),
        (torch.zeros(10, 2), [0.9, 0.8], 0.1, 1.0, "epsilon"),
        (torch.zeros(10, 2), [0.8, 0.9], 0.1, 0.1, "non-increasing"),
        (torch.zeros(0, 2), [0.9, 0.8], 0.1, 0.1, "at least one"),
    ],
)
def test_ltt_validation(losses, thresholds, delta, epsilon, match):
    with pytest.raises(ValueError, match=match):
        ltt_threshold(losses, thresholds, delta, epsilon)


# ---------------------------------------------------------------- grid_threshold


def test_grid_lower_is_better():
    # bits per byte of 5 candidates; full model 1.00, tolerance 0.05 -> candidates 0, 1, 2, 4 qualify.
    quality = [1.00, 1.02, 1.04, 1.20, 1.03]
    depth = [12.0, 9.0, 7.0, 3.0, 7.0]
    assert grid_threshold(quality, depth, full_quality=1.00, tolerance=0.05) == 4  # depth tie 2/4: better bpb
    assert grid_threshold(quality, depth, full_quality=1.00, tolerance=0.5) == 3
    assert grid_threshold(quality, depth, full_quality=0.90, tolerance=0.05) is None


def test_grid_higher_is_better():
    accuracy = [0.90, 0.89, 0.85, 0.88]
    depth = [6.0, 4.0, 2.0, 4.0]
    assert grid_threshold(accuracy, depth, full_quality=0.90, tolerance=0.02, higher_is_better=True) == 1
    assert grid_threshold(accuracy, depth, full_quality=0.90, tolerance=0.1, higher_is_better=True) == 2
    assert grid_threshold(accuracy, depth, full_quality=0.95, tolerance=0.01, higher_is_better=True) is None


def test_grid_validation_and_nan():
    with pytest.raises(ValueError, match="depth"):
        grid_threshold([1.0, 1.1], [3.0], 1.0, 0.1)
    with pytest.raises(ValueError, match="tolerance"):
        grid_threshold([1.0], [3.0], 1.0, -0.1)
    assert grid_threshold([float("nan"), 1.0], [1.0, 5.0], 1.0, 0.1) == 1


# ---------------------------------------------------------------- split_check

DELTA, EPSILON = 0.1, 0.1
PROBS = torch.linspace(0.0, 0.3, 31)  # p_k increasing in k; thresholds decreasing
THRESHOLDS = torch.linspace(1.0, 0.0, 31).tolist()


def test_split_check_holds_on_bernoulli_losses():
    losses = bernoulli_losses(400, PROBS, torch.Generator().manual_seed(0))
    res = split_check(losses, THRESHOLDS, DELTA, EPSILON, repeats=200, seed=1)
    assert set(res) == {"share_ok", "chosen", "test_risk", "none_chosen"}
    assert len(res["chosen"]) == len(res["test_risk"]) == 200
    assert res["share_ok"] >= 1 - EPSILON
    assert res["none_chosen"] <= 10  # 200 calibration examples are plenty for delta 0.1
    assert all(0.0 <= r <= 1.0 for r in res["test_risk"])
    assert all(r == 0.0 for idx, r in zip(res["chosen"], res["test_risk"]) if idx is None)


def test_split_check_is_deterministic_and_counts_fallbacks():
    losses = bernoulli_losses(60, PROBS, torch.Generator().manual_seed(2))
    a = split_check(losses, THRESHOLDS, DELTA, EPSILON, repeats=20, seed=3)
    b = split_check(losses, THRESHOLDS, DELTA, EPSILON, repeats=20, seed=3)
    assert a == b
    # 4 calibration examples cannot reject anything (zero loss gives p = 0.9^4 = 0.66): exits stay off.
    tiny = split_check(losses[:8], THRESHOLDS, DELTA, EPSILON, repeats=5, seed=0)
    assert tiny["none_chosen"] == 5 and tiny["share_ok"] == 1.0 and tiny["test_risk"] == [0.0] * 5


def test_split_check_validation():
    losses = torch.zeros(10, 2)
    with pytest.raises(ValueError, match="repeats"):
        split_check(losses, [0.9, 0.8], 0.1, 0.1, repeats=0)
    with pytest.raises(ValueError, match="calib_fraction"):
        split_check(losses, [0.9, 0.8], 0.1, 0.1, calib_fraction=0.01)
    with pytest.raises(ValueError, match="calib_fraction"):
        split_check(losses, [0.9, 0.8], 0.1, 0.1, calib_fraction=1.0)


def test_ltt_guarantee_on_fresh_draws_is_tight_ish():
    # Fresh calibration sets from the distribution itself, so the true risk of the choice is PROBS[idx].
    gen = torch.Generator().manual_seed(4)
    true_risk = []
    for _ in range(200):
        idx = ltt_threshold(bernoulli_losses(200, PROBS, gen), THRESHOLDS, DELTA, EPSILON)
        true_risk.append(0.0 if idx is None else PROBS[idx].item())
    assert sum(r <= DELTA + 1e-6 for r in true_risk) / len(true_risk) >= 1 - EPSILON / 2
    assert statistics.median(true_risk) >= 0.4 * DELTA  # not vacuous: it does exit a fair amount
