"""The Triton kernels as custom operators (``xfam::flash_attention``, ``xfam::causal_linear_attention``,
``xfam::rope`` and their backwards): torch.library's own consistency checks (schema, fake tensors, autograd
registration, AOT dispatch), one graph without a break when a function calling each kernel is traced by dynamo,
and a model with every kernel switched on traced as one graph (Triton's interpreter on CPU tensors; the same
with inductor on CUDA is ``scripts/gpu_checks.sh``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from xfam.kernels import runtime  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if runtime.why_not(DEVICE) is not None:
    pytest.skip(f"Triton kernels cannot run here: {runtime.why_not(DEVICE)}", allow_module_level=True)

import xfam.kernels.flash_attention as fa  # noqa: E402
import xfam.kernels.linear_attention as la  # noqa: E402
import xfam.kernels.rope as rp  # noqa: E402
from xfam.training.lit.compile import dynamo_settings  # noqa: E402

B, H, S, DH = 2, 2, 24, 16


def _qkv(s: int = S, dh: int = DH, grad: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, s, dh, generator=g).to(DEVICE).requires_grad_(grad) for _ in range(3)]


def _tables(s: int = S, r: int = DH) -> tuple[torch.Tensor, torch.Tensor]:
    f = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(r // 2)[None]  # [S, r/2]
    f = torch.cat((f, f), -1).to(DEVICE)
    sin = f.sin()
    return f.cos(), torch.cat((-sin[:, : r // 2], sin[:, r // 2 :]), -1)


def _one_graph(fn, *args, allowed: str | None = None, most: int = 0) -> None:  # noqa: ANN001
    """``fn(*args)`` traces as one graph; or, with ``allowed``, at most ``most`` breaks, none at another frame."""
    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(*args)
    reasons = [(r.reason, [f.name for f in r.user_stack]) for r in out.break_reasons]
    if allowed is None:
        assert (out.graph_count, out.graph_break_count) == (1, 0), reasons
    else:
        assert out.graph_break_count <= most and all(allowed in names for _, names in reasons), reasons


def test_flash_attention_op_passes_opcheck() -> None:
    q, k, v = _qkv()
    slopes = torch.tensor([0.5, 0.25], device=DEVICE)
    ex = fa._Extras(True, None, None, None, slopes, None, 32.0, None, 64, DH**-0.5)
    torch.library.opcheck(fa._forward_op, (q, k, v, None, None, *fa._flat(ex)))


def test_linear_attention_op_passes_opcheck() -> None:
    q, k, v = (x.detach().abs().requires_grad_() for x in _qkv())
    ld = torch.full((B, H, S), -0.1, device=DEVICE)
    torch.library.opcheck(la._forward_op, (q, k, v, ld, None, None, 16))


def test_rope_op_passes_opcheck() -> None:
    (x, *_), (cos, sin) = _qkv(), _tables()
    torch.library.opcheck(rp._rope_op, (x, cos, sin, False))


def test_each_kernel_is_one_graph_under_dynamo() -> None:
    q, k, v = _qkv()
    cos, sin = _tables()
    _one_graph(lambda q, k, v: fa.flash_attention(q, k, v, causal=True).sum(), q, k, v)
    _one_graph(lambda q, k, v: la.causal_linear_attention(q.abs(), k.abs(), v)[0].sum(), q, k, v)
    _one_graph(lambda x, c, s: rp.rope(x, c, s).sum(), q, cos, sin)


def test_compiled_kernels_equal_eager_with_gradients() -> None:
    """aot_eager runs the fakes and the autograd registrations through AOTAutograd, as inductor would."""
    q, k, v = _qkv()
    cos, sin = _tables()

    def fn(q, k, v, cos, sin):  # noqa: ANN001, ANN202
        q, k = rp.rope(q, cos, sin), rp.rope(k, cos, sin)
        a = fa.flash_attention(q, k, v, causal=True)
        b = la.causal_linear_attention(q.exp(), k.exp(), v)[0]
        return (a * b).sum()

    torch._dynamo.reset()
    eager = torch.autograd.grad(fn(q, k, v, cos, sin), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, cos, sin), (q, k, v))
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("overrides", "allowed"),
    [
        ({"attention": {"name": "vanilla", "backend": "triton"}, "pos": {"name": "rope", "backend": "triton"}}, None),
        # Kernelised attention's feature redraw reads its step counter on the host (attention/_linear.py,
        # ``new_step``), at most once per layer, before the layers run; the kernel alone is one graph (above).
        ({"attention": {"name": "performer", "backend": "triton"}, "pos": {"name": "none"}}, "new_step"),
    ],
    ids=["flash+rope", "linear"],
)
def test_a_model_on_the_kernels_is_one_graph(overrides: dict, allowed: str | None) -> None:
    from xfam.model.build import build_model

    dynamo_settings()  # as trainer.compile has them (a backend choice's log_once does not split the graph)
    cfg = {
        "model": {"name": "t", "dim": 32, "layers": 2, "heads": 2, "max_len": 64},
        "memory": {"name": "none"},
        "exit": {"name": "none"},
        **overrides,
    }
    model = build_model(cfg, {"task": "lm", "vocab_size": 64}).to(DEVICE).train()
    ids = torch.randint(0, 64, (2, 24), device=DEVICE)
    _one_graph(lambda x: model(x).logits.sum(), ids, allowed=allowed, most=model.num_layers)
