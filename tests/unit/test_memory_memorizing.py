"""memory=memorizing (Wu et al. 2022): a closed gate is the local layer, the kNN attention against a
hand-written reference, exact search (chunked, faiss) against brute force, the FIFO store, documents,
and what receives gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from doubles import build_model

from xfam.memory import _knn as knn
from xfam.memory._base import MEMORY

V = 13
AT_1 = {"name": "xl", "mem_len": 0, "per_layer": {"1": {"name": "memorizing", "topk": 4, "store_size": 10}}}


def run(model, x, seg_len, segments=None):
    state, outs = model.init_memory(x.shape[0], x.device), []
    for i in range(0, x.shape[1], seg_len):
        seg = None if segments is None else segments[:, i : i + seg_len]
        res = model(x[:, i : i + seg_len], memory=state, segments=seg)
        state = res.memory
        outs.append(res)
    return outs, state


def test_a_closed_gate_is_the_local_layer():
    x = torch.randint(0, V, (2, 18))
    local = build_model(pos="rope", layers=2)
    knn_model = build_model(pos="rope", layers=2, memory=AT_1)
    knn_model.load_state_dict(local.state_dict(), strict=False)
    knn_model.memories[1].gate.data.fill_(float("-inf"))
    outs, state = run(knn_model, x, 6)
    for i, out in enumerate(outs):
        assert torch.equal(out.logits, local(x[:, 6 * i : 6 * i + 6]).logits)
    assert state[1]["keys"].shape == (2, 4, 10, 8)  # the store filled all the same (FIFO of 10)
    knn_model.memories[1].gate.data.fill_(0.0)  # open: the retrieval changes the output
    assert not torch.allclose(run(knn_model, x, 6)[0][-1].logits, outs[-1].logits)


def reference_augment(mem, keys, values, q, out):
    """Per batch row, head and query: top-k by cosine over all stored keys, softmax with the head's
    temperature, gate mix (written with loops)."""
    b, h, s, d = q.shape
    res = torch.empty_like(out)
    for i in range(b):
        for j in range(h):
            kj = F.normalize(keys[i, j // (h // keys.shape[1])], dim=-1)  # [N, Dh]
            vj = values[i, j // (h // keys.shape[1])]
            for t in range(s):
                qn = F.normalize(q[i, j, t], dim=-1)
                sim = kj @ qn
                top = sim.topk(min(mem.topk, len(sim))).indices
                w = torch.softmax(sim[top] * mem.log_scale[j].exp(), dim=0)
                g = torch.sigmoid(mem.gate[j])
                res[i, j, t] = g * (w @ vj[top]) + (1 - g) * out[i, j, t]
    return res


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_knn_attention_equals_the_reference(kv_heads):
    torch.manual_seed(0)
    mem = MEMORY.build({"name": "memorizing", "topk": 3}, heads=4, kv_heads=kv_heads, head_dim=8)
    mem.gate.data = torch.randn(4)
    keys, values = torch.randn(2, kv_heads, 11, 8), torch.randn(2, kv_heads, 11, 8)
    state = {"keys": F.normalize(keys, dim=-1), "values": values, "kdocs": None, "h": None, "docs": None}
    q, out = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    got = mem.augment(state, q, out, None)
    assert torch.allclose(got, reference_augment(mem, keys, values, q, out), atol=1e-5)


def test_chunked_and_faiss_search_equal_brute_force(monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(0)
    q, keys = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 50, 16)
    allowed = torch.rand(2, 7, 50) > 0.3
    want = (q @ keys.transpose(-1, -2)).masked_fill(~allowed[:, None], float("-inf")).topk(5, dim=-1)
    monkeypatch.setattr(knn, "CHUNK", 8)  # 7 chunks, the running top-k carried across them
    scores, idx = knn.topk_inner(q, keys, 5, allowed)
    assert torch.equal(idx, want.indices) and torch.allclose(scores, want.values)
    pytest.importorskip("faiss")
    scores, idx = knn.topk_faiss(q, keys, 5, allowed)
    assert torch.equal(idx, want.indices) and torch.allclose(scores, want.values, atol=1e-5)


def test_another_documents_pairs_are_never_retrieved():
    """Stored keys of document 0 identical to the queries (the nearest possible) are ignored by queries of
    document 1: the output equals a store holding document 1's pairs only."""
    torch.manual_seed(0)
    mem = MEMORY.build({"name": "memorizing", "topk": 2}, heads=2, kv_heads=2, head_dim=8)
    q, out = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    mine_k, mine_v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    other_k = F.normalize(q, dim=-1)  # [1, 2, 3, 8]: exactly the queries' directions
    keys = torch.cat((other_k, F.normalize(mine_k, dim=-1)), 2)
    values = torch.cat((torch.randn(1, 2, 3, 8), mine_v), 2)
    kdocs = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    state = {"keys": keys, "values": values, "kdocs": kdocs, "h": None, "docs": None}
    got = mem.augment(state, q, out, torch.ones(1, 3, dtype=torch.long))
    alone = {"keys": F.normalize(mine_k, dim=-1), "values": mine_v, "kdocs": None, "h": None, "docs": None}
    assert torch.allclose(got, mem.augment(alone, q, out, None), atol=1e-6)
    # a query of a new document (nothing of it stored) keeps its local output
    assert torch.equal(mem.augment(state, q, out, torch.full((1, 3), 2)), out)


def test_gradients_reach_queries_gate_and_temperature_not_the_store():
    model = build_model(pos="rope", layers=2, memory=AT_1).train()
    x = torch.randint(0, V, (2, 12))
    outs, state = run(model, x, 6)
    assert state[0] is None  # layer 0: xl with mem_len 0
    assert all(t is None or not t.requires_grad for t in state[1].values())
    outs[-1].logits.sum().backward()
    mem = model.memories[1]
    assert mem.gate.grad is not None and mem.gate.grad.abs().sum() > 0
    assert mem.log_scale.grad is not None and mem.log_scale.grad.abs().sum() > 0
    assert model.blocks[1].attn.qkv.weight.grad.abs().sum() > 0
