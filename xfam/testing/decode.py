"""The decode contract at the model level: a model's cached decoding (the prompt at once, then a few tokens per
call, each against the ``DecodeCache`` of the call before) gives the logits of recomputing the whole prefix. The
attention contract's ``test_decode_equals_full`` holds the mechanism alone to this; here its state also rides in
the model's cache through every layer, with grouped-query heads and rotary positions. A mechanism with a
fixed-shape decode step (``AttentionMechanism.static_state`` / ``decode_step``) gives the same logits through it
(``xfam.model.static_cache``) as through its eager ``decode``."""

from __future__ import annotations

import pytest
import torch

from xfam.attention import ATTENTION
from xfam.core.errors import ConfigError
from xfam.model.static_cache import to_static
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


def static_cases(comps) -> list:
    return [
        pytest.param(name, dict(comps.params), pos, id=f"{name}-{pos}")
        for name in comps.names
        if ATTENTION.get(name).causal and not ATTENTION.get(name).fixed_length
        for pos in ("rope", "alibi")
    ]


@each(("name", "params", "pos"), static_cases)
def test_fixed_shape_step_equals_eager_decoding(name, params, pos):
    # the degenerate limit, else the defaults: whichever has a fixed-shape step (the exact kernel of random-feature
    # attention decodes with a key/value cache, its defaults with running sums)
    model, why = None, ""
    for limit in (ATTENTION.get(name).exact_params(S), {}):
        attention = {"name": name, **limit, **params}
        if problems := refusals(attention=attention, pos={"name": pos}):
            pytest.skip(f"refused with pos={pos} (as validate would): {' '.join(problems)}")
        try:
            model = build_model(attention=attention, pos=pos, layers=2, kv_heads=2, max_len=S)
        except ConfigError as err:  # (defaults sized for longer sequences)
            why = why or str(err)
            continue
        if (why := model.blocks[0].attn.mechanism.static_problem() or "") == "":
            break
        model = None
    if model is None:
        pytest.skip(f"no fixed-shape decode step: {why}")
    x = torch.randint(0, V, (2, S))
    with torch.no_grad():
        out = model(x[:, :3], cache=model.empty_cache())
        eager, static = out.cache, to_static(model, out.cache, S)
        for t in range(3, S):
            a, b = model(x[:, t : t + 1], cache=eager), model(x[:, t : t + 1], cache=static)
            eager = a.cache
            assert torch.allclose(a.logits, b.logits, atol=1e-5), f"token {t}"
