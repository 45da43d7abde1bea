"""The fused RoPE kernel (kernels/rope.py) against xfam's PyTorch rotation: outputs and gradients, full and
partial rotary, xPos tables, odd lengths, fp32 and fp16 (Triton's interpreter on CPU, bf16 on CUDA only)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from xfam.kernels.runtime import why_not  # noqa: E402
from xfam.pos.rope import Rope  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if why_not(DEVICE) is not None:
    pytest.skip(f"Triton kernels cannot run here: {why_not(DEVICE)}", allow_module_level=True)

from xfam.kernels.rope import rope, rope_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim", "xpos", "key"), [(32, None, False, False), (40, 24, True, True)])
def test_kernel_equals_xfams_rotation(dtype: torch.dtype, head_dim: int, rotary_dim: int | None, xpos: bool, key: bool):
    pos = Rope(head_dim=head_dim, rotary_dim=rotary_dim, xpos=xpos, xpos_scale_base=64.0).to(DEVICE)
    x = torch.randn(2, 3, 37, head_dim, device=DEVICE, dtype=dtype)  # 37: not a multiple of the block
    tables = pos.rotary_tables(torch.arange(5, 42, device=DEVICE), dtype)  # a decode offset of 5
    expected = pos.rotate(x, tables, key=key)
    cos, sin = tables[2:] if key and xpos else tables[:2]
    torch.testing.assert_close(rope(x, cos, sin), expected, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(rope_reference(x, cos, sin), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("xpos_key", [False, True], ids=["rope", "xpos_key"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_is_the_transposed_rotation(dtype: torch.dtype, xpos_key: bool) -> None:
    """With xPos's key tables (c / sigma, s / sigma) the backward is the transpose, not the inverse."""
    pos = Rope(head_dim=32, rotary_dim=16, xpos=xpos_key, xpos_scale_base=8.0).to(DEVICE)
    tables = pos.rotary_tables(torch.arange(19, device=DEVICE), dtype)
    cos, sin = tables[2:] if xpos_key else tables
    x = torch.randn(1, 2, 19, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    (dx,) = torch.autograd.grad(rope(x, cos, sin), x, g)
    (ref,) = torch.autograd.grad(pos.rotate(x, tables, key=True), x, g)
    torch.testing.assert_close(dx, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_refuses_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import xfam.kernels.rope as module

    monkeypatch.setattr(module, "why_not", lambda device, interpreted=None: "no GPU here. Fix: backend=auto")
    with pytest.raises(RuntimeError, match="cannot run here: no GPU here"):
        rope(torch.randn(1, 1, 4, 8), torch.ones(4, 8), torch.zeros(4, 8))
