"""The kit's test doubles and model helpers: nothing here registers a component.

TableBias       a ScoreBias of random, fixed values b[h, i, j]: not symmetric, not a function of i - j, so a
                path that transposes, shifts or drops the bias fails a parity test
ToyModifier     a ScoreModifier whose terms depend on q, on relative position and on the probabilities
build_model     a tiny seeded model (dim 32, 2 layers, 4 heads) in eval mode, any slot by name
decode_logits   a model's logits computed with its decode cache, a few tokens per call
own_components  the names of a registry's components that xfam itself defines
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.mask import AttnMask
from xfam.core.registry import Registry
from xfam.model.spec import ModelSpec
from xfam.model.transformer import Task, XfamModel


class TableBias(ScoreBias):
    """An arbitrary bias ``b[h, i, j] = table[h, i, j]`` (random, fixed): not symmetric, not a function of
    ``i - j``, so a path that transposes, shifts or drops the bias fails a parity test."""

    table: Tensor  # [H, max_pos, max_pos]

    def __init__(self, heads: int, max_pos: int = 32, seed: int = 1234):
        super().__init__()
        self.heads = heads
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("table", torch.randn(heads, max_pos, max_pos, generator=g), persistent=False)

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        q_pos, k_pos = torch.broadcast_tensors(q_pos, k_pos)
        return self.table[:, q_pos, k_pos]  # [H, *pairs]


class ToyModifier(ScoreModifier):
    """``logits``: ``+ alpha * sum_d(q_i) * (j - i)`` (depends on q and on relative position);
    ``output``: ``+ beta * sum_j p_ij (i - j) * [1, 2, ..., Dh]`` (a term computed from the probabilities).
    ``i`` and ``j`` are key-index positions (query i sits at ``offset + i``)."""

    ramp: Tensor  # [Dh]: 1, 2, ..., Dh

    def __init__(self, head_dim: int, alpha: float, beta: float):
        super().__init__()
        self.alpha, self.beta = alpha, beta
        self.register_buffer("ramp", torch.arange(1, head_dim + 1, dtype=torch.float32), persistent=False)

    def _dist(self, mask: AttnMask, like: Tensor) -> Tensor:
        q_pos, k_pos = mask.positions(like.device)
        return (q_pos[:, None] - k_pos[None, :]).to(like.dtype)  # [Sq, Sk], i - j

    def logits(self, scores: Tensor, q: Tensor, k: Tensor, mask: AttnMask) -> Tensor:
        return scores - self.alpha * q.sum(-1, keepdim=True) * self._dist(mask, scores)

    def output(self, probs: Tensor, mask: AttnMask) -> Tensor:
        mean_dist = (probs * self._dist(mask, probs)).sum(-1, keepdim=True)  # [B, H, Sq, 1]
        return self.beta * mean_dist * self.ramp.to(probs.dtype)  # [B, H, Sq, Dh]


def manual_seed(value: int) -> None:
    """``torch.manual_seed(value)``, without its cost where CUDA is not initialised (it records a stack trace on
    every call, for CUDA's lazy seeding; a contract test seeds a few times): the same CPU generator state, and
    CUDA's generators seeded too where there is CUDA."""
    torch.random.default_generator.manual_seed(value)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(value)


NO_SLOT = {"name": "none"}


def build_model(
    *,
    task: Task = "lm",
    attention: dict[str, Any] | None = None,
    pos: dict[str, Any] | str = "none",
    memory: dict[str, Any] | None = None,
    exit: dict[str, Any] | None = None,
    vocab_size: int = 13,
    num_classes: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **spec: Any,
) -> XfamModel:
    """A tiny model (dim 32, 2 layers, 4 heads unless overridden), seeded, in eval mode."""
    manual_seed(seed)
    spec = {"dim": 32, "layers": 2, "heads": 4, "max_len": 32, **spec}
    model = XfamModel(
        ModelSpec(**spec),
        task=task,
        vocab_size=vocab_size,
        num_classes=num_classes if num_classes is not None else (3 if task == "classify" else None),
        attention=attention or {"name": "vanilla"},
        pos={"name": pos} if isinstance(pos, str) else pos,
        memory=memory or NO_SLOT,
        exit=exit or NO_SLOT,
    )
    return model.to(dtype).eval()


def decode_logits(
    model: XfamModel, tokens: Tensor, prompt: int, step: int = 1, key_padding: Tensor | None = None
) -> Tensor:
    """Logits of ``tokens`` computed with the decode cache: the first ``prompt`` tokens at once, then
    ``step`` tokens per call (each with its slice of ``key_padding``); concatenated to ``[B, S, V]``."""
    pad = (lambda a, b: None) if key_padding is None else (lambda a, b: key_padding[:, a:b])
    out = model(tokens[:, :prompt], key_padding=pad(0, prompt), cache=model.empty_cache())
    logits, cache = [out.logits], out.cache
    for t in range(prompt, tokens.shape[1], step):
        out = model(tokens[:, t : t + step], key_padding=pad(t, t + step), cache=cache)
        logits.append(out.logits)
        cache = out.cache
    return torch.cat(logits, dim=1)


def assert_same_model(a: XfamModel, b: XfamModel, tokens: Tensor) -> None:
    """``a`` and ``b`` hold the same parameters and buffers and give the same logits (bit for bit)."""
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(a(tokens).logits, b(tokens).logits)


def assert_no_causal_leak(model: XfamModel, vocab_size: int, length: int = 10, at: int = 6) -> None:
    """Changing token ``at`` changes no earlier output, and does change the later ones."""
    x = torch.randint(0, vocab_size, (2, length))
    y = x.clone()
    y[:, at] = (y[:, at] + 1) % vocab_size
    a, b = model(x).logits, model(y).logits
    assert torch.equal(a[:, :at], b[:, :at])
    assert not torch.allclose(a[:, at:], b[:, at:], atol=1e-4)


def assert_decode_equals_full(
    model: XfamModel, tokens: Tensor, key_padding: Tensor | None, prompt: int = 4, step: int = 1
) -> None:
    """Cached decoding (``decode_logits``) gives the full forward's logits on every real position."""
    full = model(tokens, key_padding=key_padding).logits
    cached = decode_logits(model, tokens, prompt, step=step, key_padding=key_padding)
    real = slice(None) if key_padding is None else key_padding[:, :, None].expand_as(full)
    assert torch.allclose(cached[real], full[real], atol=1e-5), (key_padding is None, step)


def assert_gradients(model: XfamModel, nonzero: bool = False) -> None:
    """After a backward: every trainable parameter has a finite gradient (``nonzero``: not all zero either). A
    mechanism's own parameters may be idle in its degenerate limit (one bucket leaves nothing to route, a span
    covering the sequence has a flat mask): those need only be finite where they have one."""
    owned = {id(p) for block in model.blocks for p in block.attn.mechanism.parameters()}
    for name, p in model.named_parameters():
        if not p.requires_grad or (id(p) in owned and p.grad is None):
            continue
        assert p.grad is not None, f"{name} gets no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert not nonzero or id(p) in owned or p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


def own_components(registry: Registry) -> list[str]:
    """Names of the components xfam itself defines (its module starts with ``xfam.``): no test double, no plugin."""
    return [name for name, _ in registry.builtin()]
