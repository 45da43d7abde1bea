"""The early-exit traversal shared by ``calm`` and ``depth_adaptive``.

After layer n (1-based) a policy's ``decide(n, before, after)`` says which tokens exit there. An
exited token's state is frozen: it is copied unchanged to every later layer ("state propagation",
CALM sec. 3.3; Elbayad et al. sec. 2.1 copy states the same way), and those later layers still run
on the copy, so the tokens after it find keys and values at every layer, computed from the copied
state, exactly as a decoder with a key/value cache needs them. The head then reads each token's
state at its exit. Decisions read only a token's own states, so a causal model stays causal.
Outside decoding the loop ends once every token has exited (no later output can change); decoding
runs every layer so each layer's cache holds the new token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Decide = Callable[[int, Tensor, Tensor], Tensor]
"""``decide(n, before [B, S, D], after [B, S, D]) -> [B, S] bool``: tokens that exit after layer n."""


def traverse_with_exits(
    x: Tensor, run_layer: Callable[[int, Tensor], Tensor], num_layers: int, decide: Decide, decoding: bool
) -> tuple[Tensor, Tensor]:
    """``x [B, S, D]`` through up to ``num_layers`` layers; returns each token's state at its exit
    ``[B, S, D]`` and the layers it used ``[B, S]`` (1..num_layers)."""
    b, s, _ = x.shape
    running = torch.ones(b, s, dtype=torch.bool, device=x.device)
    depth = torch.full((b, s), num_layers, dtype=torch.long, device=x.device)
    for step in range(num_layers):
        if not decoding and not running.any():
            break
        new = run_layer(step, x)  # frozen tokens run too: their keys and values are the propagated state's
        n = step + 1
        exits = running & decide(n, x, new) if n < num_layers else torch.zeros_like(running)
        depth = torch.where(exits, n, depth)
        x = torch.where(running.unsqueeze(-1), new, x)
        running = running & ~exits
    return x, depth


def traverse_all(x: Tensor, run_layer: Callable[[int, Tensor], Tensor], num_layers: int) -> list[Tensor]:
    """Every layer's output ``[B, S, D]`` for every token (training: every exit sees its layer)."""
    hiddens = []
    for step in range(num_layers):
        x = run_layer(step, x)
        hiddens.append(x)
    return hiddens
