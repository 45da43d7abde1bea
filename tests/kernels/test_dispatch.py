"""The Triton path behind the mechanisms' ``backend``: a model with ``backend=triton`` (Triton's interpreter
on CPU) computes what its PyTorch reference path computes, outputs and every parameter's gradient, for
each mechanism that offers the kernel; ``auto`` picks by device and call, logs why, and an explicit
``backend=triton`` that cannot run is a clear error."""

from __future__ import annotations

import logging

import pytest
import torch

import xfam.core.logs

pytest.importorskip("triton")

from doubles import ToyModifier, build_model  # noqa: E402

from xfam.attention import _fused as fused  # noqa: E402
from xfam.core.errors import ConfigError  # noqa: E402
from xfam.core.mask import AttnMask  # noqa: E402
from xfam.kernels import runtime  # noqa: E402

if runtime.why_not(torch.device("cpu")) is not None and not torch.cuda.is_available():
    pytest.skip(f"Triton kernels cannot run here: {runtime.why_not(torch.device('cpu'))}", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run(attention: dict, pos: str | dict = "none", task: str = "lm", seq: int = 32, **spec) -> tuple:
    """Logits and parameter gradients of one forward/backward of a tiny model (fixed seed and batch)."""
    model = build_model(task=task, attention=attention, pos=pos, heads=2, layers=1, **spec).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 13, (2, seq), generator=g).to(DEVICE)
    pad = torch.ones(2, seq, dtype=torch.bool, device=DEVICE)
    pad[1, : seq // 4] = False  # a left-padded row
    segments = torch.cat((torch.zeros(2, seq // 2), torch.ones(2, seq - seq // 2)), 1).long().to(DEVICE)
    out = model(tokens, key_padding=pad, segments=segments if task == "lm" else None).logits
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


CASES = {
    "vanilla alibi, GQA": ({"name": "vanilla"}, "alibi", "lm", {"kv_heads": 1}),
    "vanilla t5": ({"name": "vanilla"}, "t5", "lm", {}),
    "vanilla rope (fused rotation)": ({"name": "vanilla"}, {"name": "rope", "backend": "triton"}, "lm", {}),
    "vanilla bidirectional t5": ({"name": "vanilla"}, "t5", "classify", {}),
    "adaptive_span": ({"name": "adaptive_span", "init_span": 0.3, "ramp": 8, "block": 16}, "alibi", "lm", {}),
    "local": ({"name": "local", "window": 16, "block": 16}, "alibi", "lm", {}),
    "strided": ({"name": "strided", "stride": 16, "block": 16}, "none", "lm", {}),
    "fixed": ({"name": "fixed", "stride": 16, "summary": 4, "block": 16}, "none", "lm", {}),
    "longformer (global token)": ({"name": "longformer", "window": 16, "block": 16}, "none", "classify", {}),
    "bigbird": ({"name": "bigbird", "block": 16, "random_blocks": 1}, "none", "classify", {"max_len": 64}),
    "blockwise": ({"name": "blockwise", "n_blocks": 2}, "none", "classify", {}),
    "performer alibi (a decay)": ({"name": "performer", "num_features": 16, "chunk": 16}, "alibi", "lm", {}),
    "rfa gate (learned decays)": ({"name": "rfa", "num_features": 16, "gate": True, "chunk": 16}, "none", "lm", {}),
}
REFERENCE = {"vanilla": "torch", "adaptive_span": "dense", "performer": "chunked", "rfa": "chunked"}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_backend_equals_the_reference_path(case: str) -> None:
    attention, pos, task, spec = CASES[case]
    seq = 64 if attention["name"] == "bigbird" else 32
    ref = {**attention, "backend": REFERENCE.get(attention["name"], "dense")}
    ref_pos = {**pos, "backend": "torch"} if isinstance(pos, dict) else pos
    out_ref, grads_ref = run(ref, ref_pos, task, seq, **spec)
    out, grads = run({**attention, "backend": "triton"}, pos, task, seq, **spec)
    torch.testing.assert_close(out, out_ref, atol=2e-5, rtol=1e-4)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():  # span ratios and the T5 table included
        torch.testing.assert_close(grad, grads_ref[name], atol=2e-5, rtol=1e-3, msg=name)


def test_auto_takes_the_kernel_only_on_cuda_for_calls_it_computes(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(xfam.core.logs, "_seen", set())  # log_once: as if nothing had been logged yet
    q = torch.zeros(1, 2, 8, 16)
    mask = AttnMask(8, 8, causal=True)
    caplog.set_level(logging.INFO, logger="xfam")
    assert fused.choose("vanilla", "auto", "sdpa", q, mask, None, 0.0) == "sdpa"  # CPU: never the interpreter
    assert "sdpa path (not on CUDA (cpu))" in caplog.text
    assert fused.choose("vanilla", "auto", "torch", q, mask, None, 0.0, ToyModifier(16, 0.1, 0.1)) == "torch"
    assert "torch path (a score modifier (ToyModifier) needs explicit scores)" in caplog.text
    monkeypatch.setattr(fused, "on_cuda", lambda x: True)
    monkeypatch.setattr(runtime, "why_not", lambda device, interpreted=None: None)
    assert fused.choose("vanilla", "auto", "sdpa", q, mask, None, 0.0) == "triton"
    assert fused.choose("vanilla", "auto", "sdpa", q, mask, None, 0.1) == "sdpa"  # dropout
    assert fused.choose("vanilla", "auto", "sdpa", q[:, :, :1], AttnMask(1, 8, causal=True), None, 0.0) == "sdpa"
    assert fused.choose("vanilla", "auto", "sdpa", q, AttnMask(8, 10, True, persistent=2), None, 0.0) == "sdpa"
    assert fused.choose("local", "block", "block", q, mask, None, 0.0) == "block"  # an explicit backend stays
    assert "sdpa path (attention dropout" in caplog.text


def test_an_explicit_triton_backend_that_cannot_run_is_a_clear_error() -> None:
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ConfigError, match="backend=triton cannot compute this call: attention dropout.*Fix"):
        fused.choose("vanilla", "triton", "sdpa", q, AttnMask(8, 8, causal=True), None, 0.1)
    model = build_model(attention={"name": "adaptive_span", "dynamic": True, "backend": "triton"})
    with pytest.raises(ConfigError, match="per-query \\(dynamic\\) spans"):
        model(torch.randint(0, 13, (1, 8)))


def test_the_command_line_refuses_triton_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.helpers import compose_cfg
    from xfam.config import check_machine

    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    cfg = compose_cfg(["attention.backend=triton"])
    if torch.cuda.is_available():
        check_machine(cfg)
        return
    with pytest.raises(ConfigError, match="attention.backend=triton: Triton kernels run on CUDA.*Fix: backend=auto"):
        check_machine(cfg)


@pytest.mark.skipif(not runtime.interpreting(), reason="CPU kernels need Triton's interpreter (TRITON_INTERPRET=1)")
def test_kernels_decorated_before_the_interpreter_was_switched_on_are_refused_with_the_fix() -> None:
    """One check in runtime serves every kernel module: compiled-for-GPU kernels never meet CPU tensors."""
    cpu = torch.device("cpu")
    assert runtime.why_not(cpu, interpreted=True) is None and runtime.why_not(cpu) is None
    reason = runtime.why_not(cpu, interpreted=False)
    assert "TRITON_INTERPRET=1 was set after the kernel modules were imported" in reason and "Fix:" in reason


def test_gpus_older_than_ampere_are_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton supports compute capability 8.0 and newer: on a T4 (7.5) ``why_not`` gives the reason and the fix
    (``auto`` logs it and takes the PyTorch path, ``backend=triton`` raises it); A100, L4 and H100 pass."""
    cuda = torch.device("cuda", 0)
    for cc in ((8, 0), (8, 9), (9, 0)):
        monkeypatch.setattr(runtime, "capability", lambda index, cc=cc: cc)
        assert runtime.why_not(cuda) is None
    monkeypatch.setattr(runtime, "capability", lambda index: (7, 5))
    reason = runtime.why_not(cuda)
    assert "compute capability 8.0 or newer" in reason and "this one is 7.5" in reason and "Fix: backend=auto" in reason
