"""The fused Triton path behind a mechanism's ``backend`` (the kernel: ``kernels/flash_attention.py``).

``backend=auto`` takes it on CUDA when the kernel computes the call exactly, and the mechanism's
PyTorch path otherwise, logging the choice once (with the reason when it falls back);
``backend=triton`` takes it always and refuses, with the reason, a call it cannot compute. What the
kernel evaluates in-kernel: causal / window / key padding / document masks (``AttnMask``), the ALiBi
and T5 score biases (``ScoreBias.kernel_params``), adaptive-span soft masks and block-sparse layouts.
What sends a call to PyTorch: attention dropout, a score modifier, persistent keys, a score bias
without kernel parameters, a head width the kernel does not tile, a device it cannot run on
(``xfam.kernels.runtime.why_not``); under ``auto`` also single-query decoding, where SDPA is as good.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import xfam.kernels.runtime as runtime  # (a plain import: mypy cannot follow xfam.kernels, see pyproject)
from xfam.attention._base import AttentionMechanism
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.errors import ConfigError
from xfam.core.logs import log_once
from xfam.core.mask import AttnMask

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def blocker(
    q: Tensor, mask: AttnMask, bias: ScoreBias | None, dropout: float, modifier: ScoreModifier | None
) -> str | None:
    """Why the flash kernel cannot compute this call exactly (its device aside), or None."""
    if dropout:
        return "attention dropout (the kernel has none)"
    if modifier is not None:
        return f"a score modifier ({type(modifier).__name__}) needs explicit scores"
    if mask.persistent:
        return "persistent keys (model.num_mem_kv) are not in the kernel"
    if mask.cross:
        return "cross-attention (the kernel places queries among the keys)"
    if bias is not None and bias.kernel_params() is None:
        return f"the score bias {type(bias).__name__} has no in-kernel form"
    if q.dtype not in DTYPES or q.shape[-1] > 256:
        return f"{q.dtype} with head width {q.shape[-1]} (the kernel takes fp32/fp16/bf16, head width <= 256)"
    return None


def triton_refusals(
    cls: type[AttentionMechanism],
    params: dict[str, Any],
    selection: Any,
    fallback: str,
    own: tuple[str | None, ...] = (),
) -> list[str]:
    """Before launch: the ``blocker`` reasons (and the mechanism's ``own``) that the configuration alone fixes for
    every call of a ``backend=triton`` mechanism ``cls`` (``params`` its settings, ``selection`` an
    ``xfam.model.compat.Selection``), phrased as ``choose`` refuses them once training has started."""
    if params.get("backend") != "triton":
        return []
    name, whys = cls.registry_name, [w for w in own if w]
    if params.get("dropout"):
        whys.append("attention dropout (the kernel has none)")
    if selection.num_mem_kv and cls.accepts_persistent_kv:  # (otherwise compat refuses num_mem_kv itself)
        whys.append("persistent keys (model.num_mem_kv) are not in the kernel")
    return [
        f"attention={name} backend=triton cannot compute this model's calls: {why}. Fix: attention.backend=auto "
        f"(the Triton kernel where it applies, {fallback} elsewhere) or attention.backend={fallback}."
        for why in whys
    ]


def choose(
    name: str,
    backend: str,
    fallback: str,
    q: Tensor,
    mask: AttnMask,
    bias: ScoreBias | None,
    dropout: float,
    modifier: ScoreModifier | None = None,
    unsupported: str | None = None,
) -> str:
    """The path of one call: ``"triton"``, or the mechanism's own ``backend`` / ``fallback`` (for auto).
    ``unsupported``: a reason of the mechanism's own why the kernel cannot take it (e.g. dynamic spans)."""
    if backend not in ("auto", "triton"):
        return backend
    why = unsupported or blocker(q, mask, bias, dropout, modifier)
    if why is None and (backend == "triton" or on_cuda(q)):
        why = runtime.why_not(q.device)  # (looked up at call time: tests replace it)
    if backend == "triton":
        if why is not None:
            raise ConfigError(
                f"attention={name} backend=triton cannot compute this call: {why}. Fix: attention.backend=auto "
                f"(the Triton kernel where it applies, {fallback} elsewhere) or attention.backend={fallback}."
            )
        log_once(f"attention={name} backend=triton: Triton flash kernel")
        return "triton"
    if why is None and not on_cuda(q):
        why = f"not on CUDA ({q.device.type})"
    elif why is None and mask.q_len == 1:
        why = "single-query decoding"
    if why is None:
        log_once(f"attention={name} backend=auto: Triton flash kernel (CUDA)")
        return "triton"
    log_once(f"attention={name} backend=auto: {fallback} path ({why})")
    return fallback


def on_cuda(q: Tensor) -> bool:
    return q.device.type == "cuda"


def kernel_args(mask: AttnMask, bias: ScoreBias | None, device: torch.device) -> dict[str, Any]:
    """``flash_attention`` keyword arguments for ``mask`` and ``bias`` (bias buckets memoised on the mask)."""
    args: dict[str, Any] = {
        "causal": mask.causal,
        "window": mask.window,
        "key_padding": mask.key_padding,
        "segments": mask.segments,
    }
    params = bias.kernel_params() if bias is not None else None
    if params is None:
        return args
    if params["kind"] == "alibi":
        return args | {"alibi_slopes": params["slopes"]}
    if params["kind"] == "table":
        n = mask.k_len
        make = lambda: params["bucket"](torch.arange(-(n - 1), n, device=device)).to(torch.int32)  # noqa: E731
        buckets = mask.memo(("kernel_buckets", bias, device), make)  # [2 Sk - 1]: distance qpos - kpos + Sk - 1
        return args | {"bias_table": params["table"], "bias_buckets": buckets}
    raise ValueError(f"unknown kernel bias kind {params['kind']!r}")


def flash(q: Tensor, k: Tensor, v: Tensor, mask: AttnMask, bias: ScoreBias | None, **extra: Any) -> Tensor:
    """The flash kernel on one call (``extra``: span / layout arguments): ``[B, H, Sq, Dh]``."""
    from xfam.kernels.flash_attention import flash_attention  # imported on first use (TRITON_INTERPRET)

    return flash_attention(q, k, v, **kernel_args(mask, bias, q.device), **extra)
