"""memory=compressive (Rae et al. 2020): no compressed slots is Transformer-XL, each compression
function against its definition, the queues' order and sizes, the reconstruction losses reach only
the compression network, and document ids follow the slots."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model

from xfam.attention._base import ATTENTION
from xfam.exit._base import EXIT
from xfam.memory._base import MEMORY
from xfam.model import compat
from xfam.pos._base import POS

V = 13


def run(model, x, seg_len, **kw):
    state, out = model.init_memory(x.shape[0], x.device), []
    for i in range(0, x.shape[1], seg_len):
        res = model(x[:, i : i + seg_len], memory=state, **kw)
        state = res.memory
        out.append(res)
    return out, state


def compressive(**kw):
    return {"name": "compressive", "mem_len": 6, "compressed_len": 4, "rate": 2, **kw}


@pytest.mark.parametrize("compression", ["max", "mean", "conv", "dilated_conv", "most_used"])
def test_no_compressed_slots_equals_xl(compression):
    x = torch.randint(0, V, (2, 24))
    xl = build_model(pos="rope", layers=2, memory={"name": "xl", "mem_len": 6}).train()
    loss = "attention" if compression in ("conv", "dilated_conv") else "none"
    cfg = compressive(compressed_len=0, compression=compression, loss=loss)
    comp = build_model(pos="rope", layers=2, memory=cfg).train()
    comp.load_state_dict(xl.state_dict(), strict=False)
    torch.manual_seed(1)
    a, _ = run(xl, x, 6)
    torch.manual_seed(1)
    b, _ = run(comp, x, 6)
    for ra, rb in zip(a, b):
        assert torch.equal(ra.logits, rb.logits) and rb.aux == {}


def test_queues_evict_into_compressed_slots_oldest_first():
    """mean pooling, mem 6, rate 2, 4 slots, segments of 4: after 3 segments (12 states) the memory holds
    states 6..11, and the compressed memory the means of (0,1), (2,3), (4,5)."""
    model = build_model(pos="rope", layers=1, memory=compressive(compression="mean", loss="none"))
    x = torch.randint(0, V, (1, 12))
    _, state = run(model, x, 4)
    emb = model.embed(x)  # layer 0's inputs are the embeddings (pos=rope adds nothing to them)
    st = state[0]
    assert torch.allclose(st["h"], emb[:, 6:])
    assert torch.allclose(st["ch"], emb[:, :6].view(1, 3, 2, 32).mean(2))
    assert st["pending"] is None
    assert torch.allclose(model.memories[0].read(st), torch.cat((st["ch"], st["h"]), 1))
    # two more segments: 8 more states evicted, 4 more slots -> the FIFO keeps the newest 4 of 7
    _, state = run(model, torch.randint(0, V, (1, 20)), 4)
    assert state[0]["ch"].shape[1] == 4 and state[0]["h"].shape[1] == 6


def test_a_remainder_waits_until_its_group_is_complete():
    model = build_model(pos="rope", layers=1, memory=compressive(compression="max", loss="none", rate=4))
    x = torch.randint(0, V, (1, 9))
    _, state = run(model, x, 3)  # 9 states, 6 kept: 3 evicted, fewer than one group of 4
    assert state[0]["ch"] is None and state[0]["pending"].shape[1] == 3
    emb = model.embed(x)
    _, state = run(model, torch.cat((x, x[:, :3]), 1), 3)  # 3 more evicted: one group, one left waiting
    assert torch.allclose(state[0]["ch"], emb[:, :4].amax(1, keepdim=True))
    assert state[0]["pending"].shape[1] == 2


def test_conv_and_dilated_conv_against_their_definitions():
    mem = MEMORY.build(compressive(compression="dilated_conv"), dim=8)
    old = torch.randn(2, 6, 8)
    got = mem.compress(old)  # [2, 3, 8]: y_t = W0 x_{t-2} + W1 x_t + b (dilation 2, zero before 0), then conv
    w0, w1 = mem.dilate.weight[..., 0], mem.dilate.weight[..., 1]  # [D_out, D_in]
    before = torch.cat((torch.zeros(2, 2, 8), old[:, :-2]), 1)
    y = before @ w0.T + old @ w1.T + mem.dilate.bias
    wc = mem.conv.weight  # [D_out, D_in, 2]
    slot = lambda j: y[:, 2 * j] @ wc[..., 0].T + y[:, 2 * j + 1] @ wc[..., 1].T + mem.conv.bias  # noqa: E731
    want = torch.stack([slot(j) for j in range(3)], 1)
    assert torch.allclose(got, want, atol=1e-6)
    conv = MEMORY.build(compressive(compression="conv"), dim=8)
    want = torch.stack(
        [
            old[:, 2 * j] @ conv.conv.weight[..., 0].T + old[:, 2 * j + 1] @ conv.conv.weight[..., 1].T + conv.conv.bias
            for j in range(3)
        ],
        1,
    )
    assert torch.allclose(conv.compress(old), want, atol=1e-6)


@pytest.mark.parametrize("rate", [2, 3, 4])
@pytest.mark.parametrize("compression", ["max", "mean", "conv", "dilated_conv"])
def test_every_evicted_state_reaches_its_own_slot(compression, rate):
    """Kernel c, stride c and dilation 2 read only every other state: for even c half of them reached no slot."""
    loss = "attention" if compression in ("conv", "dilated_conv") else "none"
    mem = MEMORY.build(compressive(compression=compression, rate=rate, loss=loss), dim=8)
    old = torch.randn(1, 4 * rate, 8, requires_grad=True)
    slots = mem.compress(old)  # [1, 4, 8]
    for j in range(4):
        (grad,) = torch.autograd.grad(slots[:, j].sum(), old, retain_graph=True)
        reached = grad.abs().sum(-1)[0] > 0  # [4c]
        group = torch.zeros(4 * rate, dtype=torch.bool)
        group[j * rate : (j + 1) * rate] = True
        assert reached[group].all() if compression != "max" else reached[group].any()
        lower = (j - (compression == "dilated_conv")) * rate  # dilated: the group before it too
        assert not reached[: max(lower, 0)].any() and not reached[(j + 1) * rate :].any()


def test_most_used_keeps_the_state_that_received_most_attention():
    mem = MEMORY.build(compressive(compression="most_used", loss="none"), dim=4)
    old = torch.arange(24.0).view(1, 6, 4)
    usage = torch.tensor([[0.1, 0.9, 0.5, 0.2, 0.3, 0.3]])
    assert torch.equal(mem.compress(old, usage), old[:, [1, 2, 4]])


@pytest.mark.parametrize("loss", ["attention", "autoencoding"])
def test_the_reconstruction_loss_trains_only_the_compression_network(loss):
    model = build_model(pos="rope", layers=2, memory=compressive(compression="conv", loss=loss)).train()
    outs, _ = run(model, torch.randint(0, V, (2, 16)), 4)
    name = f"memory/{loss}_reconstruction"
    total = sum(o.aux[name] for o in outs if name in o.aux)
    assert total.requires_grad and total > 0
    model.zero_grad()
    total.backward()
    for n, p in model.named_parameters():
        learns = ".conv." in n or ".decoder." in n or ".dilate." in n
        assert (p.grad is not None and p.grad.abs().sum() > 0) == learns, n


def test_memory_tensors_are_detached():
    model = build_model(pos="rope", layers=2, memory=compressive(compression="conv")).train()
    _, state = run(model, torch.randint(0, V, (2, 16)), 4)
    for st in state:
        assert all(t is None or not t.requires_grad for t in st.values())


def test_documents_follow_the_slots():
    """A slot carries the document of its last state; a query never sees a slot of another document."""
    model = build_model(pos="rope", layers=1, memory=compressive(compression="mean", loss="none"))
    x = torch.randint(0, V, (1, 16))
    docs = torch.tensor([[0] * 7 + [1] * 9])
    state = model.init_memory(1, x.device)
    for i in range(0, 16, 4):
        out = model(x[:, i : i + 4], segments=docs[:, i : i + 4], memory=state)
        state = out.memory
    st = state[0]
    # 10 states evicted, 5 slots, the newest 4 kept: states (2,3) (4,5) (6,7) (8,9) -> documents of 3, 5, 7, 9
    assert torch.equal(st["cdocs"], torch.tensor([[0, 0, 1, 1]]))
    emb = model.embed(x)
    assert torch.allclose(st["ch"][:, 2], emb[:, 7])  # the mixed group (6, 7) keeps only document 1's state
    assert torch.equal(st["docs"], docs[:, 10:])
    assert torch.equal(model.memories[0].read_segments(st), torch.cat((st["cdocs"], st["docs"]), 1))


@pytest.mark.parametrize("compression", ["max", "mean", "conv", "dilated_conv", "most_used"])
def test_a_document_never_sees_the_compressed_states_of_another(compression):
    """Changing tokens of document 0 leaves every output of document 1 unchanged, although a compressed group
    straddles the boundary (states 6, 7 at rate 2). Pooling the whole group leaked 0.0117 into document 1."""
    loss = "attention" if compression in ("conv", "dilated_conv") else "none"
    model = build_model(pos="rope", layers=2, memory=compressive(compression=compression, loss=loss, rate=2))
    x = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 7 + [1] * 13])

    def doc1_logits(tokens):
        state, out = model.init_memory(1, tokens.device), []
        for i in range(0, 20, 4):
            res = model(tokens[:, i : i + 4], segments=docs[:, i : i + 4], memory=state)
            state = res.memory
            out.append(res.logits)
        return torch.cat(out, 1)[:, 7:]

    changed = x.clone()
    changed[0, :7] = (changed[0, :7] + 1) % V  # all of document 0
    assert torch.equal(doc1_logits(x), doc1_logits(changed))


def test_parameter_free_compression_with_a_loss_is_refused():
    sel = compat.Selection(
        attention=[(ATTENTION.get("vanilla"), {}, False)],
        pos=(POS.get("rope"), {}),
        memory=[(MEMORY.get("compressive"), {"compression": "max", "loss": "attention"})],
        exit=(EXIT.get("none"), {}),
        causal=True,
        streams=True,
    )
    (msg,) = compat.check(sel)
    assert "compression=max has no parameters" in msg and "memory.loss=none" in msg
