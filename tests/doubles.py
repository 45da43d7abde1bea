"""Test doubles: one toy component per contract between slots, used only in tests.

Each is small enough to check by hand and proves one contract of the core (docs/architecture.md):

    toy_bias         pos, kind "bias":     b[h, i, j] = -scale (h + 1) (i - j)^2
    toy_modifier     pos, kind "modifier": logits + alpha * sum(q_i) * (j - i); output + beta * E_p[i - j] * (1..Dh)
    toy_causal_only  attention: causal-only, accepts no score bias (capability refusals)
    toy_linear       attention: causal linear attention with running sums as decode state (not a KV cache)
    toy_record       attention: softmax attention with q scaled by ``temp``; records its constructor params
    toy_memory       memory: Transformer-XL-like, keeps the last ``mem_len`` layer inputs, detached
    toy_deep         exit: deep supervision, an aux loss from head(h_l) at every layer, reports depth
    toy_stop         exit: runs only the first ``stop_after`` layers

They register into the real registries; their ``__module__`` does not start with ``xfam.``, so the
registry/YAML bijection and the registry-driven contract tests ignore them. The doubles that register nothing
(``TableBias``, ``ToyModifier``) and the model helpers (``build_model``, ``decode_logits`` ...) are the contract
test kit's, ``xfam.testing.doubles``, re-exported here. ``conftest.py`` imports
this module once as ``doubles`` (import it under that name only, or the toys register twice).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.api import (
    ATTENTION,
    EXIT,
    MEMORY,
    POS,
    AttentionMechanism,
    DecodeState,
    ExitOutput,
    ExitPolicy,
    LayerStack,
    LayerView,
    Memory,
    MemoryState,
    PositionalEncoding,
    Range,
    ScoreBias,
    ScoreModifier,
    expand_kv,
)
from xfam.attention.vanilla import reference_attention

# The non-registering doubles and model helpers live in the contract test kit (xfam.testing.doubles), so a
# component author's tests use the same ones; re-exported here for xfam's own tests.
from xfam.testing.doubles import (  # noqa: F401
    NO_SLOT,
    TableBias,
    ToyModifier,
    assert_decode_equals_full,
    assert_no_causal_leak,
    assert_same_model,
    build_model,
    decode_logits,
)
from xfam.testing.doubles import own_components as xfam_components  # noqa: F401

# -- score biases ------------------------------------------------------------------------------


class QuadraticBias(ScoreBias):
    """``b[h, i, j] = -scale * (h + 1) * (i - j)^2``."""

    def __init__(self, heads: int, scale: float):
        super().__init__()
        self.heads = heads
        self.register_buffer("coef", scale * torch.arange(1, heads + 1, dtype=torch.float32), persistent=False)

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        d = (q_pos - k_pos).to(self.coef.dtype)
        return -self.coef.view(-1, *([1] * d.dim())) * d**2  # [H, *pairs]


def quadratic_bias_value(h: int, i: int, j: int, scale: float) -> float:
    """The toy bias written out, for hand-computed expectations."""
    return -scale * (h + 1) * (i - j) ** 2


@POS.register("toy_bias")
class ToyBiasPos(PositionalEncoding):
    """A ``bias`` encoding whose ScoreBias is ``-scale (h + 1) (i - j)^2``."""

    kind = "bias"
    relative = True

    def __init__(self, *, heads: int, scale: float = 0.1):
        super().__init__()
        self.bias = QuadraticBias(heads, scale)

    def score_bias(self) -> ScoreBias:
        return self.bias


# -- score modifier ----------------------------------------------------------------------------


@POS.register("toy_modifier")
class ToyModifierPos(PositionalEncoding):
    """A ``modifier`` encoding (same modifier in every layer)."""

    kind = "modifier"
    relative = True

    def __init__(self, *, head_dim: int, alpha: float = 0.1, beta: float = 0.05):
        super().__init__()
        self.mod = ToyModifier(head_dim, alpha, beta)

    def score_modifier(self, layer: int) -> ScoreModifier:
        return self.mod


# -- attention mechanisms ----------------------------------------------------------------------


@ATTENTION.register("toy_causal_only")
class ToyCausalOnly(AttentionMechanism):
    """Causal softmax attention that cannot be bidirectional and accepts no score bias."""

    causal = True
    bidirectional = False
    accepts_bias = False

    def __init__(self) -> None:
        super().__init__()

    def forward(self, q, k, v, mask, bias=None, modifier=None) -> Tensor:
        return reference_attention(q, k, v, mask)


def elu1(x: Tensor) -> Tensor:
    return F.elu(x) + 1


@ATTENTION.register("toy_linear")
class ToyLinear(AttentionMechanism):
    """Causal linear attention (Katharopoulos et al., 2020) with ``phi = elu + 1``:
    ``o_i = phi(q_i) S_i / (phi(q_i) . z_i)`` with ``S_i = sum_{j<=i} phi(k_j) v_j^T``, ``z_i = sum_{j<=i} phi(k_j)``.

    ``forward`` is the quadratic form with the mask; ``decode`` keeps only ``(S, z)``, so its state does
    not grow with the sequence (the decode-state contract for state that is not a KV cache).
    """

    causal = True
    bidirectional = False
    accepts_bias = False

    def __init__(self) -> None:
        super().__init__()

    def forward(self, q, k, v, mask, bias=None, modifier=None) -> Tensor:
        heads = q.shape[1]
        k, v = expand_kv(k, heads), expand_kv(v, heads)  # [B, H, Sk, Dh]
        a = torch.einsum("bhqd,bhkd->bhqk", elu1(q), elu1(k))  # [B, H, Sq, Sk]
        allowed = mask.dense(q.device)
        if allowed is not None:
            a = a * allowed
        return (a @ v) / a.sum(-1, keepdim=True)

    def decode(self, q, k, v, state, mask, bias=None, modifier=None) -> tuple[Tensor, DecodeState]:
        heads = q.shape[1]
        fq, fk, v = elu1(q), elu1(expand_kv(k, heads)), expand_kv(v, heads)
        s = torch.einsum("bhsd,bhse->bhsde", fk, v).cumsum(2)  # [B, H, Sq, Dh, Dh]
        z = fk.cumsum(2)  # [B, H, Sq, Dh]
        if state is not None:
            s = s + state["s"][:, :, None]
            z = z + state["z"][:, :, None]
        num = torch.einsum("bhsd,bhsde->bhse", fq, s)
        den = (fq * z).sum(-1, keepdim=True)
        return num / den, {"s": s[:, :, -1], "z": z[:, :, -1]}


@ATTENTION.register("toy_record")
class ToyRecord(AttentionMechanism):
    """Softmax attention with queries scaled by ``temp``; keeps the parameters it was built with."""

    def __init__(self, *, temp: float = 1.0, tag: str = "", heads: int, kv_heads: int, layer: int = -1):
        super().__init__()
        self.temp = temp
        self.params = {"temp": temp, "tag": tag, "heads": heads, "kv_heads": kv_heads, "layer": layer}

    def forward(self, q, k, v, mask, bias=None, modifier=None) -> Tensor:
        return reference_attention(q * self.temp, k, v, mask, bias, modifier)


# -- memory ------------------------------------------------------------------------------------


@MEMORY.register("toy_memory")
class ToyMemory(Memory):
    """Transformer-XL-like memory of one layer: the last ``mem_len`` inputs of the layer, detached."""

    def __init__(self, *, mem_len: Annotated[int, Range(ge=1)] = 16):
        super().__init__()
        self.mem_len = mem_len

    def read(self, state: MemoryState) -> Tensor | None:
        return state

    def write(self, state: MemoryState, hidden: Tensor, view: LayerView) -> tuple[MemoryState, dict[str, Tensor]]:
        new = hidden.detach() if state is None else torch.cat((state, hidden.detach()), dim=1)  # [B, M + S, D]
        return new[:, -self.mem_len :], {}


# -- exit policies -----------------------------------------------------------------------------


@EXIT.register("toy_deep")
class ToyDeep(ExitPolicy):
    """Deep supervision: ``aux["deep"] = sum_l mean(logsumexp(head(h_l)))`` over every layer's output;
    depth is ``num_layers`` for every token. Keeps the per-layer outputs in ``self.last_hiddens``."""

    def __init__(self) -> None:
        super().__init__()
        self.last_hiddens: list[Tensor] = []

    def forward(self, x: Tensor, stack: LayerStack) -> ExitOutput:
        hiddens = []
        for step in range(stack.num_layers):
            x = stack.run_layer(step, x)
            hiddens.append(x)
        self.last_hiddens = hiddens
        loss = sum(stack.head(h).logsumexp(-1).mean() for h in hiddens)
        depth = torch.full(x.shape[:2], stack.num_layers, device=x.device)
        return ExitOutput(hidden=x, aux={"deep": loss}, depth=depth)


@EXIT.register("toy_stop")
class ToyStop(ExitPolicy):
    """Every token stops after the first ``stop_after`` layers (every layer under ``full_depth()``)."""

    early_exit = True

    def __init__(self, *, stop_after: Annotated[int, Range(ge=1)] = 1):
        super().__init__()
        self.stop_after = stop_after
        self.full = False

    @contextlib.contextmanager
    def full_depth(self) -> Iterator[None]:
        self.full, before = True, self.full
        try:
            yield
        finally:
            self.full = before

    def forward(self, x: Tensor, stack: LayerStack) -> ExitOutput:
        n = stack.num_layers if self.full else min(self.stop_after, stack.num_layers)
        for step in range(n):
            x = stack.run_layer(step, x)
        return ExitOutput(hidden=x, depth=torch.full(x.shape[:2], n, device=x.device))


# -- helpers -----------------------------------------------------------------------------------


@dataclasses.dataclass
class ToyStack:
    """A ``LayerStack`` around a plain ``run_layer(step, x)`` function, to drive an exit policy alone."""

    layer: Callable[[int, Tensor], Tensor]
    num_layers: int
    head_fn: Callable[..., Tensor] | None = None
    positions: Tensor | None = None
    key_padding: Tensor | None = None
    decoding: bool = False
    targets: Tensor | None = None

    def run_layer(self, step: int, x: Tensor) -> Tensor:
        return self.layer(step, x)

    def head(self, x: Tensor, proj: nn.Module | None = None) -> Tensor:
        return self.head_fn(x, proj) if proj is not None else self.head_fn(x)


@ATTENTION.register("toy_aux")
class ToyAux(AttentionMechanism):
    """Dense attention that owns an auxiliary loss, ``weight * mean(q^2)``: proves the channel by
    which mechanisms (adaptive span, routing) return their losses."""

    aux_loss = True

    def __init__(self, *, weight: float = 0.5) -> None:
        super().__init__()
        self.weight = weight
        self._aux: dict[str, Tensor] = {}

    def forward(self, q, k, v, mask, bias=None, modifier=None) -> Tensor:
        self._aux = {"toy": self.weight * q.pow(2).mean()}
        return reference_attention(q, k, v, mask, bias)

    def aux_losses(self) -> dict[str, Tensor]:
        return self._aux
