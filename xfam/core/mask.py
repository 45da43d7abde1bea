"""The semantic attention mask: what each query may see, described rather than materialised.

Mechanisms never build masks themselves. They read this description and ask a helper for the
form their backend needs: a causal flag for SDPA, a dense boolean/additive tensor for reference
paths, or a position-only predicate evaluated on gathered (query, key) pairs for sparse paths.

Coordinates: keys are indexed 0..Sk-1 over [memory | cache | current segment]; query i sits at key
index ``offset + i`` with ``offset = Sk - Sq`` (the keys in front of the segment). Positional
encodings use the same coordinates, so a bias or a rotation is correct across memory and cache.

Persistent keys (``persistent``, Sukhbaatar et al., 2019): the key tensors may lead with P learned
keys that have no position and that every query sees. They stand outside the coordinates above:
``offset``, ``positions``, ``visible``, ``key_padding`` and ``segments`` describe the other keys only,
and ``dense`` marks the P leading columns visible.

Cross-attention (``cross``): the queries are not among the keys (a decoder's queries over its
encoder's outputs). Sq and Sk are then independent, every query sees every real key, and only
``key_padding`` applies: no causality, window, documents or persistent keys.

Documents: a key whose document id is ``SHARED`` is seen by the queries of every document, and a
query with that id sees only such keys (memory tokens in packed rows: they never see a document, so
they carry nothing from one document to another); ``same_document`` is the rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

#: Document id of keys every document sees (and of queries that see only them): see the module docstring.
SHARED = -2


def same_document(q_seg: Tensor, k_seg: Tensor) -> Tensor:
    """May a query of document ``q_seg`` see a key of document ``k_seg`` (broadcast ids)?"""
    return (q_seg == k_seg) | (k_seg == SHARED)


@dataclasses.dataclass(eq=False)
class AttnMask:
    """Which keys each query may attend to.

    Attributes:
        q_len, k_len: Sq and Sk, the lengths of the query and key tensors (the first Sk - Sq keys are
            persistent keys, memory or cache).
        causal: a query sees only keys at or before its own index.
        key_padding: ``[B, Sk]`` bool, True for real keys; None when nothing is padded.
        segments: ``[B, Sk]`` int document ids of the keys (packed sequences); a query sees only
            keys of its own document. The queries' ids are the last Sq columns.
        window: a query sees keys less than ``window`` indices away (causal look-back or
            bidirectional radius); None for unlimited.
        persistent: P leading keys without position, visible to every query; ``key_padding``,
            ``segments``, ``offset`` and ``positions`` cover the other Sk - P keys.
        cross: the queries are not among the keys (cross-attention): only ``key_padding`` applies.
    """

    q_len: int
    k_len: int
    causal: bool = False
    key_padding: Tensor | None = None
    segments: Tensor | None = None
    window: int | None = None
    persistent: int = 0
    cross: bool = False
    _memo: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.cross:
            if self.causal or self.window is not None or self.segments is not None or self.persistent:
                raise ValueError("a cross-attention mask takes key padding only (no causal, window, segments)")
            return
        if self.k_len < self.q_len + self.persistent:
            raise ValueError(f"k_len ({self.k_len}) must be >= q_len ({self.q_len}) + persistent ({self.persistent})")

    @property
    def offset(self) -> int:
        """Key index of the first query (length of memory or cache in front of it); 0 under ``cross``."""
        return 0 if self.cross else self.k_len - self.persistent - self.q_len

    def own_keys(self, x: Tensor) -> Tensor:
        """``[..., Sk, F] -> [..., Sq, F]``: the rows a query falls back to when it may see no key (the rule of
        ``dense``): its own key, or under ``cross`` the first key."""
        if self.cross:
            return x[..., :1, :].expand(*x.shape[:-2], self.q_len, x.shape[-1])
        return x[..., self.k_len - self.persistent - self.q_len :, :]

    @property
    def is_plain_causal(self) -> bool:
        """Exactly lower-triangular with no offset: SDPA's ``is_causal`` flag expresses it."""
        return self.causal and self.offset == 0 and self.persistent == 0 and self._unrestricted_otherwise

    @property
    def is_full(self) -> bool:
        """Every query sees every key: no mask tensor is needed at all."""
        # A single causal query at the end of the keys (incremental decoding) also sees them all.
        return (not self.causal or self.q_len == 1) and self._unrestricted_otherwise

    @property
    def _unrestricted_otherwise(self) -> bool:
        return self.key_padding is None and self.segments is None and self.window is None

    def positions(self, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """Query and key positions ``([Sq], [Sk - P])`` in key-index coordinates (persistent keys have none)."""
        k_pos = torch.arange(self.k_len - self.persistent, device=device)
        return k_pos[self.offset :], k_pos

    def visible(self, q_idx: Tensor, k_idx: Tensor) -> Tensor:
        """Position-only visibility of gathered pairs (causal and window); broadcasts its inputs.

        ``q_idx`` are query indices 0..Sq-1, ``k_idx`` key indices 0..Sk-P-1 (persistent keys are always
        visible). Padding and segments depend on the batch row; see ``dense``.
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
            k_idx = torch.arange(self.k_len - self.persistent, device=device)[None, :]
            ok = self.visible(q_idx, k_idx)[None, None]  # [1, 1, Sq, Sk - P]
            if self.key_padding is not None:
                ok = ok & self.key_padding[:, None, None, :].to(device)  # [B, 1, 1, Sk - P]
            if self.segments is not None:
                seg = self.segments.to(device)
                ok = ok & same_document(seg[:, None, self.offset :, None], seg[:, None, None, :])  # [B, 1, Sq, Sk - P]
            # A query that may see nothing (a left pad under a causal mask) attends to itself, so
            # softmax stays finite; its output is padding and never reaches a real token.
            diag = (k_idx == 0) if self.cross else (q_idx + self.offset == k_idx)
            ok = ok | (diag & ~ok.any(-1, keepdim=True))
            if self.persistent:  # persistent keys: visible to every query
                ok = F.pad(ok, (self.persistent, 0), value=True)  # [B|1, 1, Sq, Sk]
            self._memo[key] = ok
        return self._memo[key]

    def memo(self, key: Any, make: Any) -> Any:
        """Per-forward cache for tensors derived from this mask (shared by every layer)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def memos(self) -> dict[Any, Any]:
        """That cache itself, for a caller that must snapshot and restore it (activation checkpointing replays a
        layer with the entries the layer first saw: ``xfam.model.stack``)."""
        return self._memo

    def forget(self) -> None:
        """Drop that cache. The reversible stack's backward recomputes one layer at a time with gradients: a
        learned bias cached in its no-grad forward (or with a graph an earlier layer's backward freed) must be
        built again, or the bias (T5's table, the dynamic MLP) gets no gradient."""
        self._memo.clear()
