"""Nearest-neighbour search over a datastore's keys by squared Euclidean distance.

``exact``: torch, chunked over the store (and over the queries) so memory stays bounded by ``budget``
distance entries whatever the store size. Per chunk, ``|q|² - 2 q·k + |k|²`` by one matrix product;
the first chunk's top-k by ``torch.topk``, then only the entries closer than a query's current k-th
best are merged in (few, once the scan is under way). ``faiss``: an ``IndexFlatL2`` (exact as well;
FAISS's kernels, Johnson et al., 2019), the optional extra ``pip install 'xfam[faiss]'``. Both return
distances sorted ascending, so the first k' columns of a top-k are the top-k'.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.core.logs import log_once

INDEXES: tuple[str, ...] = ("exact", "faiss")
#: Distance entries (fp32) one exact-search step may hold: 2^24 = 64 MiB.
BUDGET = 1 << 24
#: Stores up to this many bytes as fp32 are held in memory for exact search; larger ones are read in chunks.
IN_MEMORY_BYTES = 4 << 30


class Index(Protocol):
    size: int

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``queries [N, D]`` -> squared distances ``[N, k]`` (ascending) and store rows ``[N, k]`` (int64)."""
        ...


class ExactIndex:
    """Brute-force search in torch over ``keys [M, D]`` (a numpy array or memmap, any float dtype)."""

    def __init__(self, keys: np.ndarray, device: str | torch.device = "cpu", budget: int = BUDGET):
        self.size, self.dim = keys.shape
        self.device, self.budget = torch.device(device), budget
        if self.device.type != "cpu" or self.size * self.dim * 4 <= IN_MEMORY_BYTES:
            self.keys: np.ndarray | Tensor = torch.from_numpy(np.array(keys, dtype=np.float32)).to(self.device)
        else:  # speed only: the same distances, read from the memmap chunk by chunk
            log_once(f"kNN-LM exact search: {self.size} keys read from disk in chunks (larger than memory budget)")
            self.keys = keys
        rows = max(1, budget // max(self.dim, 1))
        self.norms = torch.cat([(self._rows(i, i + rows) ** 2).sum(-1) for i in range(0, self.size, rows)])  # [M]

    def _rows(self, start: int, stop: int) -> Tensor:
        rows = self.keys[start:stop]
        if isinstance(rows, Tensor):
            return rows
        return torch.from_numpy(np.array(rows, dtype=np.float32)).to(self.device)  # a copy: memmaps are read-only

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        q = queries.to(self.device, torch.float32)
        n = q.shape[0]
        q_rows = min(max(n, 1), 1024)
        step = max(k, self.budget // q_rows)  # store rows per step: [q_rows, step] distances held
        out_d: list[Tensor] = []
        out_i: list[Tensor] = []
        for q0 in range(0, n, q_rows):
            qc = q[q0 : q0 + q_rows]  # [n', D]
            qn = (qc**2).sum(-1, keepdim=True)  # [n', 1]
            best_d: Tensor | None = None
            best_i: Tensor | None = None
            for s0 in range(0, self.size, step):
                kc = self._rows(s0, s0 + step)  # [m, D]
                d = torch.addmm(self.norms[s0 : s0 + kc.shape[0]].unsqueeze(0), qc, kc.T, alpha=-2)  # [n', m]
                d = d.add_(qn).clamp_min_(0)  # |q|² - 2 q·k + |k|²
                if best_d is None:
                    best_d, pick = torch.topk(d, min(k, d.shape[1]), dim=1, largest=False, sorted=True)
                    best_i = pick + s0
                else:
                    assert best_i is not None  # (set with best_d)
                    best_d, best_i = _merge(best_d, best_i, d, s0, k)
            assert best_d is not None and best_i is not None  # (a store of at least one row)
            out_d.append(best_d)
            out_i.append(best_i)
        return torch.cat(out_d), torch.cat(out_i)


def _merge(best_d: Tensor, best_i: Tensor, d: Tensor, offset: int, k: int) -> tuple[Tensor, Tensor]:
    """The top-k of the running best ``[n, k']`` (ascending) and a chunk's distances ``d [n, m]`` (store rows
    ``offset..offset+m``). Only entries closer than a row's current k-th best can enter, and once the scan
    is under way they are few: they are gathered into a ``[n, c]`` block (c = most survivors of a row)
    before one top-k over ``k' + c`` columns, instead of a top-k over all ``k' + m``."""
    full = best_d.shape[1] == k
    alive = d < best_d[:, -1:] if full else torch.ones_like(d, dtype=torch.bool)  # [n, m]
    rows, cols = alive.nonzero(as_tuple=True)  # row-major: a row's survivors are consecutive
    if rows.numel() == 0:
        return best_d, best_i
    counts = torch.bincount(rows, minlength=d.shape[0])  # [n]
    c = int(counts.max())
    start = counts.cumsum(0) - counts  # [n]: where each row's survivors begin
    slot = torch.arange(rows.numel(), device=d.device) - start[rows]
    cand_d = d.new_full((d.shape[0], c), float("inf"))
    cand_i = torch.full((d.shape[0], c), -1, dtype=torch.long, device=d.device)
    cand_d[rows, slot] = d[rows, cols]
    cand_i[rows, slot] = cols + offset
    all_d, all_i = torch.cat((best_d, cand_d), dim=1), torch.cat((best_i, cand_i), dim=1)
    top_d, pick = torch.topk(all_d, min(k, int(counts.min()) + best_d.shape[1]), dim=1, largest=False)
    return top_d, all_i.gather(1, pick)


class FaissIndex:
    """``faiss.IndexFlatL2`` over the keys (held in memory as fp32; FAISS searches on the CPU)."""

    def __init__(self, keys: np.ndarray, chunk: int = 1 << 16):
        faiss = import_faiss()
        self.size, self.dim = keys.shape
        self.index = faiss.IndexFlatL2(self.dim)
        for i in range(0, self.size, chunk):
            self.index.add(np.ascontiguousarray(keys[i : i + chunk], dtype=np.float32))

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        q = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        d, i = self.index.search(q, k)
        return torch.from_numpy(d).to(queries.device), torch.from_numpy(i).long().to(queries.device)


def import_faiss() -> Any:
    """The faiss module, or a ConfigError saying how to install it."""
    try:
        import faiss
    except ImportError as err:
        raise ConfigError(
            "index=faiss needs the faiss package, which is not installed. "
            "Fix: pip install 'xfam[faiss]' (or faiss-cpu), or index=exact."
        ) from err
    return faiss


def make_index(kind: str, keys: np.ndarray, device: str | torch.device = "cpu") -> Index:
    if kind == "exact":
        return ExactIndex(keys, device)
    if kind == "faiss":
        return FaissIndex(keys)
    raise ConfigError(f"index={kind!r} is not a kNN-LM index. Valid: {', '.join(INDEXES)}. Fix: index=exact.")


def exclude_self(dists: Tensor, rows: Tensor, self_rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """From a top-(k+1) search ``[N, k+1]``, the top-k without each query's own store row ``self_rows [N]``
    (-1: none). Non-self neighbours keep their order; when the own row was not among the k + 1 (ties at
    distance 0), the last one is dropped instead."""
    is_self = rows == self_rows.unsqueeze(-1)  # [N, k+1]
    order = torch.argsort(is_self.to(torch.int8), dim=1, stable=True)[:, :k]  # non-self first, in order
    return dists.gather(1, order), rows.gather(1, order)
