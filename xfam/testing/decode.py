"""The decode contract at the model level: a model's cached decoding (the prompt at once, then a few tokens per
call, each against the ``DecodeCache`` of the call before) gives the logits of recomputing the whole prefix. The
attention contract's ``test_decode_equals_full`` holds the mechanism alone to this; here its state also rides in
the model's cache through every layer, with grouped-query heads and rotary positions."""

from __future__ import annotations

import pytest
import torch

from xfam.attention import ATTENTION
from xfam.testing._compat import refusals
from xfam.testing._suite import each
from xfam.testing.doubles import build_model, decode_logits

V, S = 13, 14
#: (kv_heads, prompt, step): grouped-query heads; a prompt, then 2 tokens per call and 1 in the last call
SCHEDULES = [(2, 3, 2)]


def decode_cases(comps) -> list:
    out = []
    for name in comps.names:
        cls = ATTENTION.get(name)
        if cls.causal and not cls.fixed_length:
            for kv_heads, prompt, step in SCHEDULES:
                label = f"{name}-kv{kv_heads}-prompt{prompt}-step{step}"
                out.append(pytest.param(name, dict(comps.params), kv_heads, prompt, step, id=label))
    return out


@each(("name", "params", "kv_heads", "prompt", "step"), decode_cases)
def test_model_decoding_equals_full_recompute(name, params, kv_heads, prompt, step):
    attention = {"name": name, **ATTENTION.get(name).exact_params(S), **params}
    if problems := refusals(attention=attention, pos={"name": "rope"}):
        pytest.skip(f"refused with pos=rope (as validate would): {' '.join(problems)}")
    model = build_model(attention=attention, pos="rope", layers=3, kv_heads=kv_heads, max_len=S)
    x = torch.randint(0, V, (2, S))
    assert torch.allclose(decode_logits(model, x, prompt, step), model(x).logits, atol=1e-5)
