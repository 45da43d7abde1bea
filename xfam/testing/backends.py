"""Every fast path equals the reference path, in a model: for a component with a ``backend`` parameter, a tiny
model built with each backend gives the reference backend's logits and parameter gradients (left padding, and
packed documents in a language model), beyond the degenerate limit: an attention with ``exact_params`` for half
the sequence, so windows and blocks cover half of it.

The reference is the last of ``backends`` (an attention's class attribute; else the choices of the ``backend``
annotation, ``auto`` aside) that is not ``triton``. A Triton kernel is compared on CUDA only (on a CPU, Triton's
interpreter is too slow for a contract test)."""

from __future__ import annotations

import typing

import pytest
import torch

from xfam.core.errors import ConfigError
from xfam.core.registry import signature_params
from xfam.testing._suite import each
from xfam.testing.doubles import build_model

V, S = 13, 32


def backends_of(cls: type) -> tuple[str, ...]:
    """The backends a component offers (``auto`` aside), fast paths first and the reference last."""
    param = signature_params(cls).get("backend")
    if param is None:
        return ()
    declared = getattr(cls, "backends", None)
    if declared is not None:
        return tuple(declared)
    hint = param.annotation
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return tuple(b for b in typing.get_args(hint) if isinstance(b, str) and b != "auto")


def reference_of(backends: tuple[str, ...]) -> str:
    return [b for b in backends if b != "triton"][-1]


def backend_cases(comps) -> list:
    out = []
    for name in comps.names:
        backends = backends_of(comps.cls(name))
        if "backend" in comps.params or len(backends) < 2:
            continue
        ref = reference_of(backends)
        for b in backends:
            if b != ref:
                out.append(pytest.param(comps.slot, name, dict(comps.params), b, ref, id=f"{name}-{b}"))
    return out


def settings(slot: str, name: str, params: dict, backend: str, causal: bool) -> dict:
    """The component's config: an attention's ``exact_params`` for half the sequence (windows, blocks, chunks
    covering half of it, so the fast paths do real work), or for all of it where ``backend`` does not build with
    half (an image's shape, a kernel's tiles)."""
    if slot != "attention":
        return {"name": name, **params, "backend": backend}
    from xfam.attention import ATTENTION

    ctx = dict(dim=32, heads=4, kv_heads=4, head_dim=8, max_len=S, causal=causal, num_layers=2, layer=0)
    for seq_len in (S // 2, S):
        cfg = {"name": name, **ATTENTION.get(name).exact_params(seq_len), **params, "backend": backend}
        if not ATTENTION.check(cfg, ctx):
            break
    return cfg


def run(slot: str, component: dict, causal: bool, device: torch.device) -> tuple[torch.Tensor, dict]:
    """Logits and parameter gradients of one forward/backward of a tiny model (fixed seed and batch)."""
    attention, pos = (component, "none") if slot == "attention" else (None, component)
    model = build_model(task="lm" if causal else "classify", max_len=S, attention=attention, pos=pos).to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (2, S), generator=g).to(device)
    pad = torch.ones(2, S, dtype=torch.bool, device=device)
    pad[1, : S // 4] = False  # a left-padded row
    segments = torch.cat((torch.zeros(2, S // 2), torch.ones(2, S - S // 2)), 1).long().to(device)
    out = model(tokens, key_padding=pad, segments=segments if causal else None).logits
    out.float().pow(2).mean().backward()
    return out.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


def _causal(name: str) -> bool:
    from xfam.attention import ATTENTION

    return ATTENTION.get(name).causal


@each(("slot", "name", "params", "backend", "reference"), backend_cases)
def test_backend_equals_the_reference_path(slot, name, params, backend, reference):
    if backend == "triton" and not torch.cuda.is_available():
        pytest.skip("a Triton kernel is compared with the reference on CUDA (Triton's CPU interpreter is too slow)")
    device = torch.device("cuda" if backend == "triton" else "cpu")
    causal = slot != "attention" or _causal(name)
    component = settings(slot, name, params, backend, causal)
    try:
        out, grads = run(slot, component, causal, device)
    except ConfigError as err:  # xfam refuses it, with the reason: a kernel's limits, not a wrong result
        if backend != "triton":
            raise
        pytest.skip(f"backend=triton refuses this call: {err}")
    out_ref, grads_ref = run(slot, {**component, "backend": reference}, causal, device)
    torch.testing.assert_close(out, out_ref, atol=2e-5, rtol=1e-4)
    assert grads.keys() == grads_ref.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[key], atol=2e-5, rtol=1e-3, msg=key)
