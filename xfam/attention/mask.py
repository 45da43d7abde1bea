"""The semantic attention mask: what each query may see, described rather than materialised.

Mechanisms never build masks themselves. They read this description and ask a helper for the
form their backend needs: a causal flag for SDPA, a dense boolean/additive tensor for reference
paths, or a position-only predicate evaluated on gathered (query, key) pairs for sparse paths.

Coordinates: keys are indexed 0..Sk-1 over [memory | cache | current segment]; query i sits at key
index ``offset + i`` with ``offset = Sk - Sq`` (the keys in front of the segment). Positional
encodings use the same coordinates, so a bias or a rotation is correct across memory and cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor


@dataclasses.dataclass(eq=False)
class AttnMask:
    """Which keys each query may attend to.

    Attributes:
        q_len, k_len: Sq and Sk (Sk >= Sq; the first Sk - Sq keys are memory or cache).
        causal: a query sees only keys at or before its own index.
        key_padding: ``[B, Sk]`` bool, True for real keys; None when nothing is padded.
        segments: ``[B, Sk]`` int document ids of the keys (packed sequences); a query sees only
            keys of its own document. The queries' ids are the last Sq columns.
        window: a query sees keys less than ``window`` indices away (causal look-back or
            bidirectional radius); None for unlimited.
    """

    q_len: int
    k_len: int
    causal: bool = False
    key_padding: Tensor | None = None
    segments: Tensor | None = None
    window: int | None = None
    _memo: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.k_len < self.q_len:
            raise ValueError(f"k_len ({self.k_len}) must be >= q_len ({self.q_len})")

    @property
    def offset(self) -> int:
        """Key index of the first query (length of memory or cache in front of it)."""
        return self.k_len - self.q_len

    @property
    def is_plain_causal(self) -> bool:
        """Exactly lower-triangular with no offset: SDPA's ``is_causal`` flag expresses it."""
        return self.causal and self.offset == 0 and self._unrestricted_otherwise

    @property
    def is_full(self) -> bool:
        """Every query sees every key: no mask tensor is needed at all."""
        # A single causal query at the end of the keys (incremental decoding) also sees them all.
        return (not self.causal or self.q_len == 1) and self._unrestricted_otherwise

    @property
    def _unrestricted_otherwise(self) -> bool:
        return self.key_padding is None and self.segments is None and self.window is None

    def positions(self, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """Query and key positions ``([Sq], [Sk])`` in key-index coordinates."""
        k_pos = torch.arange(self.k_len, device=device)
        return k_pos[self.offset :], k_pos

    def visible(self, q_idx: Tensor, k_idx: Tensor) -> Tensor:
        """Position-only visibility of gathered pairs (causal and window); broadcasts its inputs.

        ``q_idx`` are query indices 0..Sq-1, ``k_idx`` key indices 0..Sk-1. Padding and segments
        depend on the batch row; combine them with ``batch_visible``.
        """
        dist = (q_idx + self.offset) - k_idx  # >0: key lies in the past
        ok = torch.ones_like(dist, dtype=torch.bool)
        if self.causal:
            ok &= dist >= 0
        if self.window is not None:
            ok &= dist.abs() < self.window
        return ok

    def dense(self, device: torch.device | None = None) -> Tensor | None:
        """Boolean ``[B|1, 1, Sq, Sk]``, True where attention is allowed; None when all is allowed."""
        if self.is_full:
            return None
        key = ("dense", device)
        if key not in self._memo:
            q_idx = torch.arange(self.q_len, device=device)[:, None]
            k_idx = torch.arange(self.k_len, device=device)[None, :]
            ok = self.visible(q_idx, k_idx)[None, None]  # [1, 1, Sq, Sk]
            if self.key_padding is not None:
                ok = ok & self.key_padding[:, None, None, :].to(device)  # [B, 1, 1, Sk]
            if self.segments is not None:
                seg = self.segments.to(device)
                ok = ok & (seg[:, None, self.offset :, None] == seg[:, None, None, :])  # [B, 1, Sq, Sk]
            # A query that may see nothing (a left pad under a causal mask) attends to itself, so
            # softmax stays finite; its output is padding and never reaches a real token.
            diag = q_idx + self.offset == k_idx
            ok = ok | (diag & ~ok.any(-1, keepdim=True))
            self._memo[key] = ok
        return self._memo[key]

    def memo(self, key: Any, make: Any) -> Any:
        """Per-forward cache for tensors derived from this mask (shared by every layer)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]
