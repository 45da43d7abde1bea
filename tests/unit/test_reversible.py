"""Reversible residual layers: the recomputed backward equals ordinary autograd, decoding works,
saved activations do not grow with depth, and what cannot run with them is refused."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model, decode_logits

from xfam.attention._base import ATTENTION
from xfam.exit._base import EXIT
from xfam.memory._base import MEMORY
from xfam.model import compat
from xfam.model.reversible import RevBlock
from xfam.model.spec import ModelSpec
from xfam.pos._base import POS


def two_stream_reference(model, tokens: torch.Tensor) -> torch.Tensor:
    """The same reversible model with every activation kept by ordinary autograd."""
    from xfam.core.context import LayerContext
    from xfam.core.mask import AttnMask

    s = tokens.shape[1]
    x = model.drop(model.pos.embed(model.embed(tokens), torch.arange(s)))
    mask = AttnMask(q_len=s, k_len=s, causal=model.causal)
    ctx = LayerContext(mask, model.pos, model.pos.score_bias(), model.pos.rotary_tables(torch.arange(s), x.dtype))
    a = b = x
    for block in model.blocks:
        rev = RevBlock(block, ctx, model.spec.ffn_chunks)
        a = a + rev.f(b)[0]
        b = b + rev.g(a)
    return model.head_logits((a + b) / 2)


@pytest.mark.parametrize("pos", ["none", "rope", "alibi", "learned", "t5", "dynamic"])
@pytest.mark.parametrize("ffn_chunks", [1, 3])
def test_gradients_equal_ordinary_autograd(pos: str, ffn_chunks: int) -> None:
    """Also for learned score biases (T5's table, the dynamic MLP: a bias cached in the no-grad forward once left
    them without gradients), and the RNG goes on as after an ordinary step (the backward's dropout replays once
    left it rewound, so the next step's masks repeated this one's)."""
    model = build_model(pos=pos, reversible=True, ffn_chunks=ffn_chunks, dropout=0.1, layers=3).train()
    tokens = torch.randint(0, 13, (2, 12))
    torch.manual_seed(7)
    model(tokens).logits.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    model.zero_grad()
    torch.manual_seed(7)  # the same dropout masks
    two_stream_reference(model, tokens).pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-5), name
    assert torch.equal(rng, torch.get_rng_state())


def test_cached_decoding_equals_full_recompute() -> None:
    model = build_model(pos="rope", reversible=True, layers=2)
    tokens = torch.randint(0, 13, (2, 11))
    with torch.no_grad():
        assert torch.allclose(decode_logits(model, tokens, prompt=4, step=3), model(tokens).logits, atol=1e-5)


def saved_bytes(model, tokens: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).logits.sum()
    return total


def test_saved_activations_do_not_grow_with_depth() -> None:
    tokens = torch.randint(0, 13, (2, 64))
    rev = [saved_bytes(build_model(reversible=True, layers=n).train(), tokens) for n in (2, 8)]
    plain = [saved_bytes(build_model(layers=n).train(), tokens) for n in (2, 8)]
    assert rev[1] == rev[0]  # the stack saves only its output
    assert plain[1] > 2 * plain[0]  # ordinary layers save activations in every layer


def _selection(**overrides):
    spec = {"attention": "vanilla", "pos": "rope", "memory": "none", "exit": "none", **overrides}
    return compat.Selection(
        attention=[(ATTENTION.get(spec["attention"]), {}, False)],
        pos=(POS.get(spec["pos"]), {}),
        memory=[(MEMORY.get(spec["memory"]), {})],
        exit=(EXIT.get(spec["exit"]), {}),
        causal=True,
        streams=True,
        reversible=True,
    )


def test_what_cannot_run_reversibly_is_refused_with_the_reason() -> None:
    assert compat.check(_selection()) == []
    (msg,) = compat.check(_selection(exit="toy_deep"))
    assert "traverses depth itself" in msg and "exit in [none" in msg
    assert any("cannot carry memory" in m for m in compat.check(_selection(memory="toy_memory")))
    (msg,) = compat.check(_selection(attention="toy_aux"))
    assert "auxiliary loss" in msg and "model.reversible=false" in msg
    assert "norm_position=pre" in ModelSpec(reversible=True, norm_position="post").problems()[0]
    assert "ffn_chunks applies to reversible" in ModelSpec(ffn_chunks=2).problems()[0]
