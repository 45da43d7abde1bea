"""The cases of the attention contract: sizes, masks, and which (mechanism, backend, direction, mask form)
combinations a mechanism is tested on, read from its capabilities."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from xfam.attention import ATTENTION, AttentionMechanism
from xfam.core.mask import SHARED, AttnMask
from xfam.core.registry import signature_params
from xfam.testing.doubles import manual_seed

B, H, DH, S = 2, 4, 8, 12


def variants(comps) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(name, params, id parts): one per backend where the mechanism has a ``backend`` parameter that the
    ``params`` of the class leave open. (A Triton kernel runs in a slow interpreter on CPU and tiles blocks
    of at least 16: its parity with the reference path is the ``backends`` part's, on CUDA.)"""
    out = []
    for name in comps.names:
        cls = ATTENTION.get(name)
        if "backend" in signature_params(cls) and "backend" not in comps.params:
            out += [(name, {**comps.params, "backend": b}, [b]) for b in cls.backends if b != "triton"]
        else:
            out.append((name, dict(comps.params), [str(comps.params["backend"])] if "backend" in comps.params else []))
    return out


def cases(comps, causal_only: bool = False) -> list:
    """pytest params ``(name, params, causal)`` over every variant and mask direction it supports."""
    out = []
    for name, params, parts in variants(comps):
        cls = ATTENTION.get(name)
        directions = [c for c, ok in ((True, cls.causal), (False, cls.bidirectional)) if ok]
        for causal in directions:
            if causal or not causal_only:
                label = "-".join([name, *parts, "causal" if causal else "bidir"])
                out.append(pytest.param(name, params, causal, id=label))
    return out


def build(
    name: str, params: dict, causal: bool, heads: int = H, kv_heads: int = H, seq_len: int = S
) -> AttentionMechanism:
    """The mechanism in its degenerate limit for ``seq_len`` tokens (``exact_params``), ``params`` on top."""
    cls = ATTENTION.get(name)
    cfg = {"name": name, **cls.exact_params(seq_len), **params}
    struct = dict(dim=heads * DH, heads=heads, kv_heads=kv_heads, head_dim=DH, max_len=S, causal=causal, num_layers=2)
    manual_seed(0)
    return ATTENTION.build(cfg, **struct, layer=0).eval()


def qkv(sq: int = S, sk: int = S, kv_heads: int = H, dtype=torch.float32, grad: bool = False):
    q = torch.randn(B, H, sq, DH, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, kv_heads, sk, DH, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, kv_heads, sk, DH, dtype=dtype, requires_grad=grad)
    return q, k, v


PAD_LEFT = torch.tensor([[False] * 3 + [True] * 9, [True] * 12])
PAD_RIGHT = torch.tensor([[True] * 12, [True] * 8 + [False] * 4])
SEGMENTS = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 7 + [4] * 5])
# memory tokens in packed rows: keys every document sees (AttnMask's SHARED id), mechanisms with ``shared_keys``
SHARED_SEGMENTS = torch.tensor([[SHARED] * 2 + [0] * 6 + [1] * 4, [SHARED] * 3 + [3] * 4 + [4] * 5])

MASKS: dict[str, tuple[int, dict[str, Any]]] = {  # name -> (Sq, AttnMask kwargs without q_len); Sk = 12 throughout
    "causal": (12, dict(causal=True)),
    "causal_offset": (5, dict(causal=True)),  # keys (memory or cache) in front of the queries
    "causal_single_query": (1, dict(causal=True)),
    "causal_left_padding": (12, dict(causal=True, key_padding=PAD_LEFT)),
    "causal_offset_padding": (7, dict(causal=True, key_padding=PAD_LEFT)),
    "causal_segments": (12, dict(causal=True, segments=SEGMENTS)),
    "causal_shared_segments": (12, dict(causal=True, segments=SHARED_SEGMENTS)),
    "causal_window": (12, dict(causal=True, window=4)),
    "causal_window_offset": (6, dict(causal=True, window=3)),
    "bidirectional": (12, dict()),
    "bidirectional_padding": (12, dict(key_padding=PAD_RIGHT)),
    "bidirectional_segments": (12, dict(segments=SEGMENTS)),
    "bidirectional_shared_segments": (12, dict(segments=SHARED_SEGMENTS)),
    "bidirectional_window": (12, dict(window=3)),
}


def mask_cases(comps) -> list:
    """``(name, params, causal, form)`` over every case and every mask form of its direction."""
    out = []
    for p in cases(comps):
        name, params, causal = p.values
        for form, (sq, kw) in MASKS.items():
            cls = ATTENTION.get(name)
            if "shared" in form and not cls.shared_keys:
                continue
            if kw.get("causal", False) == causal and (sq == S or not cls.fixed_length):
                out.append(pytest.param(name, params, causal, form, id=f"{p.id}-{form}"))
    return out


def modifier_cases(comps) -> list:
    """``(name, params, causal, form)`` for the mechanisms that host score modifiers (their default backend)."""
    out = []
    for name in comps.names:
        cls = ATTENTION.get(name)
        for form, (sq, kw) in MASKS.items():
            causal = kw.get("causal", False)
            supported = cls.causal if causal else cls.bidirectional
            if cls.hosts_modifiers and supported and (sq == S or not cls.fixed_length):
                out.append(pytest.param(name, dict(comps.params), causal, form, id=f"{name}-{form}"))
    return out


def make_mask(form: str) -> tuple[int, AttnMask]:
    sq, kw = MASKS[form]
    return sq, AttnMask(q_len=sq, k_len=S, **kw)
