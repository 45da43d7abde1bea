"""xfam.model.fused: the hand-written backward passes equal autograd's on the composite expressions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xfam.model.fused import glu, l2_normalize


def _grads(fn, *xs: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]
    out = fn(*leaves)
    out.backward(g)
    return out.detach(), [leaf.grad for leaf in leaves if leaf.requires_grad]


@pytest.mark.parametrize("scale", [1.0, 80.0])
def test_l2_normalize_equals_scaled_f_normalize(scale: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16, requires_grad=True)
    g = torch.randn(2, 3, 7, 16)
    ref, (dref,) = _grads(lambda t: F.normalize(t, dim=-1) * scale, x, g=g)
    out, (dx,) = _grads(lambda t: l2_normalize(t, scale), x, g=g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, dref)
    assert torch.allclose(out.norm(dim=-1), torch.full((2, 3, 7), scale))


def test_l2_normalize_learned_scale_gradient() -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(l2_normalize, (x, s))
    g = torch.randn(3, 5, 8, dtype=torch.float64)
    _, (dx_ref, ds_ref) = _grads(lambda t, c: F.normalize(t, dim=-1) * c, x, s, g=g)
    _, (dx, ds) = _grads(l2_normalize, x, s, g=g)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(ds, ds_ref)


def test_l2_normalize_clamped_rows_match_f_normalize() -> None:
    """A zero row and a row below the 1e-12 clamp: there the norm is a constant, as in F.normalize."""
    x = torch.randn(3, 4, dtype=torch.float64)
    x[0] = 0.0
    x[1] = 1e-14
    x.requires_grad_(True)
    g = torch.randn(3, 4, dtype=torch.float64)
    ref, (dref,) = _grads(lambda t: F.normalize(t, dim=-1) * 2.0, x, g=g)
    out, (dx,) = _grads(lambda t: l2_normalize(t, 2.0), x, g=g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, dref)


@pytest.mark.parametrize("act", [F.gelu, F.silu, F.relu])
def test_glu_equals_chunked_expression(act) -> None:
    torch.manual_seed(2)
    h = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: glu(t, act), (h,))
    g = torch.randn(2, 5, 6, dtype=torch.float64)
    ref, (dref,) = _grads(lambda t: act(t[..., :6]) * t[..., 6:], h, g=g)
    out, (dh,) = _grads(lambda t: glu(t, act), h, g=g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dh, dref)


def test_glu_refuses_an_activation_without_a_fused_backward() -> None:
    with pytest.raises(ValueError, match="F.gelu, F.silu, F.relu"):
        glu(torch.randn(2, 4), torch.tanh)


def test_double_backward_raises_rather_than_being_wrong() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(l2_normalize(x, 2.0).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()
