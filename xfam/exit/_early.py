"""The early-exit traversal shared by ``calm`` and ``depth_adaptive``.

After layer n (1-based) a policy's ``decide(n, before, after)`` says which tokens exit there. An
exited token's state is frozen: it is copied unchanged to every later layer ("state propagation",
CALM sec. 3.3; Elbayad et al. sec. 2.1 copy states the same way). The head then reads each token's
state at its exit. Decisions read only a token's own states, so a causal model stays causal.

A later layer owes an exited token one thing: the keys and values of its copied state, which the
tokens after it attend to (in this call, or from the decode cache in later calls). So once some
tokens have exited, a layer runs through the stack's ``run_layer_rows`` (``xfam.model.propagate``):
in a decode call of one new token per row, an exited row only adds its keys and values to the
layer's decode state (norm, key/value projection, rotation; no attention, no FFN) while the running
rows run the whole layer; in a call of several rows (a prompt, a whole sequence) every row still
attends (later rows of the call read the exited rows' keys and values at every layer) and the FFN
runs for the running rows only. Outputs and decode states equal those of running every layer whole
on the copied state (what xfam did before), which a stack without ``run_layer_rows`` still does.
Outside decoding the loop ends once every token has exited (no later output can change); decoding
runs every layer so each layer's cache holds the new token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Decide = Callable[[int, Tensor, Tensor], Tensor]
"""``decide(n, before [B, S, D], after [B, S, D]) -> [B, S] bool``: tokens that exit after layer n."""

RunRows = Callable[[int, Tensor, Tensor], Tensor]
"""``run_rows(step, x [B, S, D], running [B, S]) -> [B, S, D]``: layer ``step`` for the running tokens; the others
come back unchanged, their keys and values in the decode state (``LayerStack.run_layer_rows``)."""


def traverse_with_exits(
    x: Tensor,
    run_layer: Callable[[int, Tensor], Tensor],
    num_layers: int,
    decide: Decide,
    decoding: bool,
    run_rows: RunRows | None = None,
) -> tuple[Tensor, Tensor]:
    """``x [B, S, D]`` through up to ``num_layers`` layers; returns each token's state at its exit
    ``[B, S, D]`` and the layers it used ``[B, S]`` (1..num_layers). With ``run_rows`` a layer runs only for the
    running tokens once some have exited (the others propagate their state); without it, for every token."""
    b, s, _ = x.shape
    running = torch.ones(b, s, dtype=torch.bool, device=x.device)
    depth = torch.full((b, s), num_layers, dtype=torch.long, device=x.device)
    for step in range(num_layers):
        anyone = bool(running.any())
        if not decoding and not anyone:
            break
        if run_rows is None or step == 0:
            new = run_layer(step, x)  # (exited tokens run too, on their copied state)
        else:
            new = run_rows(step, x, running)  # exited tokens only leave their keys and values
        if not anyone:  # (decoding: every token has exited, the layer only took their keys and values)
            continue
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
