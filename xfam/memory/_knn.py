"""Exact top-k search for retrieval memories: chunked in torch, or through faiss (optional extra).

Both return the same neighbours on small stores (ties aside); faiss is the path for stores of
hundreds of thousands of entries on many cores. Similarity is the inner product (of normalised
vectors, i.e. cosine), the Memorizing Transformer's choice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xfam.core.errors import ConfigError

#: Store entries scored per chunk: bounds the ``[B, H, S, chunk]`` score block (memory stays O(S * chunk)).
CHUNK = 8192


def topk_inner(q: Tensor, keys: Tensor, k: int, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The ``k`` largest ``q . key`` per query: scores and indices ``[B, H, S, k]``.

    ``q [B, H, S, Dh]``, ``keys [B, H, N, Dh]``; ``allowed [B, S, N]`` (None: all) masks entries a
    query may not retrieve (another document); they score -inf. Requires ``k <= N``."""
    best_s: Tensor | None = None
    best_i: Tensor | None = None
    for start in range(0, keys.shape[2], CHUNK):
        block = keys[:, :, start : start + CHUNK]  # [B, H, C, Dh]
        scores = q @ block.transpose(-1, -2)  # [B, H, S, C]
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, None, :, start : start + CHUNK], float("-inf"))
        idx = torch.arange(start, start + block.shape[2], device=q.device).expand_as(scores)
        if best_s is not None and best_i is not None:  # (set together)
            scores, idx = torch.cat((best_s, scores), -1), torch.cat((best_i, idx), -1)
        top = scores.topk(min(k, scores.shape[-1]), dim=-1)
        best_s, best_i = top.values, idx.gather(-1, top.indices)
    assert best_s is not None and best_i is not None  # (N >= k >= 1 keys)
    return best_s, best_i


def topk_faiss(q: Tensor, keys: Tensor, k: int, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``topk_inner`` through ``faiss.IndexFlatIP`` (exact), one index per batch row and head."""
    try:
        import faiss
    except ImportError:
        raise ConfigError(
            "index=faiss needs the faiss package, which is not installed. Fix: pip install 'xfam[faiss]' "
            "(faiss-cpu), or index=exact."
        ) from None
    b, h, s, d = q.shape
    scores = q.new_full((b, h, s, k), float("-inf"))
    index = torch.zeros(b, h, s, k, dtype=torch.long, device=q.device)
    qs, ks = q.detach().float().cpu().numpy(), keys.detach().float().cpu().numpy()
    for i in range(b):
        for j in range(h):
            flat = faiss.IndexFlatIP(d)
            flat.add(ks[i, j])
            want = k if allowed is None else keys.shape[2]  # with a filter: rank everything, keep allowed
            dist, ids = flat.search(qs[i, j], want)
            dist_t, ids_t = torch.from_numpy(dist), torch.from_numpy(ids).long()
            if allowed is not None:
                ok = allowed[i].cpu().gather(1, ids_t)  # [S, N]
                dist_t = dist_t.masked_fill(~ok, float("-inf"))
                order = dist_t.argsort(dim=1, descending=True, stable=True)[:, :k]
                dist_t, ids_t = dist_t.gather(1, order), ids_t.gather(1, order)
            scores[i, j], index[i, j] = dist_t[:, :k].to(q), ids_t[:, :k].to(q.device)
    return scores, index
