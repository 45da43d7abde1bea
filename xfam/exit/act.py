"""Universal Transformer with Adaptive Computation Time (Dehghani et al., ICLR 2019, arXiv:1807.03819, sec. 2.1-2.2;
ACT: Graves, 2016, arXiv:1603.08983, sec. 2).

One weight-shared block is applied up to T = ``model.layers`` times (``blocks_needed = 1``). Before step
t the coordinate embedding is added (``xfam.core.sinusoid``: the step signal, and the position signal
too when ``position_signal``). ``mode=act``: per position, a halting unit p_t = sigmoid(w . s_t + b) reads
the state, and with N the first step at which the running sum of p reaches 1 - eps (or T):

    weights  w_t = p_t for t < N,   w_N = R = 1 - sum_{t<N} p_t        (sum_t w_t = 1 exactly)
    output   y   = sum_t w_t * block(s_t)                               (the mean-field ACT output)
    ponder   rho = N + R,           aux loss  tau * mean over real positions of rho

A position that has halted keeps its state unchanged ("copied") while the others go on, so later
steps still see its keys and values; the loop stops early only when every position has halted
(outputs are fixed once a position halts, so stopping early changes nothing), and decoding always
runs all T steps so every step's key/value cache stays complete. Halting depends only on a
position's own state, so causality is preserved. ``mode=fixed``: T steps for every position (a
weight-tied T-layer stack; with ``signal=false`` exactly the shared block applied T times).
Shapes: x ``[B, S, D]``, halting quantities ``[B, S]``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from torch import Tensor, nn

from xfam.core.registry import Range
from xfam.core.sinusoid import TimestepSignal
from xfam.core.stack import LayerStack
from xfam.exit._base import EXIT, ExitOutput, ExitPolicy


@EXIT.register("act")
class ACT(ExitPolicy):
    """Universal Transformer: one shared block, up to ``model.layers`` steps, per-position ACT halting.

    Args:
        dim: model width (injected).
        mode: ``act`` (adaptive halting with a ponder cost) or ``fixed`` (every step for every position).
        eps: halting threshold 1 - eps (Graves: 0.01).
        tau: ponder cost weight (the aux loss is tau * mean(N + R)).
        halting_bias: initial bias of the halting unit (1.0 in the UT code: p starts near 0.73).
        signal: add the coordinate embedding before every step.
        position_signal: include the position part of it (the paper); false when ``pos`` already
            encodes positions (the default: xfam's pos slot owns positions).
    """

    paper = "Dehghani et al., ICLR 2019, arXiv:1807.03819 (Universal Transformers); Graves, 2016, arXiv:1603.08983"

    def __init__(
        self,
        *,
        dim: int,
        mode: Literal["act", "fixed"] = "act",
        eps: Annotated[float, Range(gt=0.0, lt=1.0)] = 0.01,
        tau: Annotated[float, Range(ge=0.0)] = 0.01,
        halting_bias: float = 1.0,
        signal: bool = True,
        position_signal: bool = False,
    ):
        super().__init__()
        self.mode, self.eps, self.tau = mode, eps, tau
        self.signal = TimestepSignal(dim, positions=position_signal) if signal else None
        self.halt = nn.Linear(dim, 1)
        nn.init.normal_(self.halt.weight, std=0.02)
        nn.init.constant_(self.halt.bias, halting_bias)

    def own_init_modules(self) -> list[nn.Module]:
        return [self.halt]  # the model's init must not reset the halting bias

    def blocks_needed(self, num_layers: int) -> int:
        return 1

    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        if selection.has_memory:
            return [
                "exit=act applies one shared block for a per-position number of steps; carrying memory "
                "across those steps is not implemented. Fix: memory=none, or exit=none."
            ]
        return []

    def _step_input(self, x: Tensor, step: int, positions: Tensor | None) -> Tensor:
        if self.signal is None:
            return x
        pos = positions if positions is not None else torch.arange(x.shape[1], device=x.device)
        return self.signal(x, pos, step)

    def forward(self, x: Tensor, stack: LayerStack) -> ExitOutput:
        num_layers, positions = stack.num_layers, stack.positions
        if self.mode == "fixed":
            for step in range(num_layers):
                x = stack.run_layer(step, self._step_input(x, step, positions))
            return ExitOutput(hidden=x)
        b, s, _ = x.shape
        total = x.new_zeros(b, s)  # sum of p_t of the steps taken so far
        remainder = x.new_zeros(b, s)  # R, set at the halting step
        steps = x.new_zeros(b, s)  # N
        running = torch.ones(b, s, dtype=torch.bool, device=x.device)
        out = torch.zeros_like(x)
        threshold = 1.0 - self.eps
        for step in range(num_layers):
            if not stack.decoding and not running.any():
                break  # every output is final; decoding goes on so every step's cache is complete
            state = self._step_input(x, step, positions)  # [B, S, D]
            p = torch.sigmoid(self.halt(state)).squeeze(-1)  # [B, S]
            last = step == num_layers - 1
            halts = running & ((total + p > threshold) | last)  # halting at this step (forced at T)
            goes_on = running & ~halts
            remainder = torch.where(halts, 1.0 - total, remainder)  # R = 1 - sum_{t<N} p_t, at N
            weight = torch.where(goes_on, p, torch.where(halts, remainder, 0.0))  # w_t: p_t, or R at N
            total = total + torch.where(goes_on, p, 0.0)
            steps = steps + running.to(x.dtype)
            new = stack.run_layer(step, state)  # [B, S, D]
            out = out + weight.unsqueeze(-1) * new
            x = torch.where(running.unsqueeze(-1), new, x)  # halted positions keep their state
            running = goes_on
        ponder = steps + remainder  # rho = N + R, [B, S]
        real = stack.key_padding if stack.key_padding is not None else torch.ones_like(running)
        cost = (ponder * real).sum() / real.sum().clamp_min(1)
        # for inspection and tests: N, R, sum_{t<N} p_t and rho per position (detached: no graph is kept alive)
        self.last = {
            k: v.detach()
            for k, v in {"steps": steps, "remainder": remainder, "halted_sum": total, "ponder": ponder}.items()
        }
        return ExitOutput(hidden=out, aux={"ponder": self.tau * cost}, depth=steps)
