"""memory=xl (Transformer-XL segment recurrence): its degenerate limit, the FIFO keeping the most recent
states, the longer evaluation memory, and the refusal of absolute positions. The contract itself
(segments with memory = one full run, stop-gradient) is in tests/contracts/test_memory_contract.py."""

from __future__ import annotations

import pytest
import torch
from doubles import build_model

from xfam.attention._base import ATTENTION
from xfam.config import streams_of
from xfam.exit._base import EXIT
from xfam.memory._base import MEMORY
from xfam.model import compat
from xfam.pos._base import POS

V = 13


def segments(model, x, seg_len, state=None):
    """Logits ``[B, S, V]`` of ``x`` run segment by segment, carrying the memory."""
    state = model.init_memory(x.shape[0], x.device) if state is None else state
    out = []
    for i in range(0, x.shape[1], seg_len):
        res = model(x[:, i : i + seg_len], memory=state)
        state = res.memory
        out.append(res.logits)
    return torch.cat(out, dim=1), state


@pytest.mark.parametrize("pos", ["xl", "rope", "alibi"])
def test_mem_len_zero_equals_no_memory(pos):
    x = torch.randint(0, V, (2, 18))
    plain = build_model(pos=pos, layers=3)
    zero = build_model(pos=pos, layers=3, memory={"name": "xl", "mem_len": 0})
    zero.load_state_dict(plain.state_dict())
    got, state = segments(zero, x, 6)
    want = torch.cat([plain(x[:, i : i + 6]).logits for i in range(0, 18, 6)], dim=1)
    assert torch.equal(got, want)
    assert state == [None, None, None]


@pytest.mark.parametrize("pos", ["xl", "rope", "t5"])
def test_a_short_memory_keeps_the_most_recent_states(pos):
    """One layer: its memory holds the embeddings of the last M tokens, so each segment's logits equal a
    fresh run on [the M tokens before the segment | segment] (a FIFO that kept the wrong M would not)."""
    model = build_model(pos=pos, layers=1, memory={"name": "xl", "mem_len": 5})
    x = torch.randint(0, V, (2, 24))
    got, state = segments(model, x, 6)
    assert state[0]["h"].shape == (2, 5, 32)
    for i in range(6, 24, 6):
        window = model(x[:, i - 5 : i + 6]).logits[:, 5:]
        assert torch.allclose(got[:, i : i + 6], window, atol=1e-5), i


def test_evaluation_keeps_the_longer_eval_memory():
    model = build_model(pos="rope", layers=1, memory={"name": "xl", "mem_len": 4, "eval_mem_len": 10})
    x = torch.randint(0, V, (1, 18))
    model.train()
    assert segments(model, x, 6)[1][0]["h"].shape[1] == 4
    model.eval()
    logits, state = segments(model, x, 6)
    assert state[0]["h"].shape[1] == 10
    # the longer memory is used: (one layer) the last segment equals a fresh run on the 10 + 6 tokens it sees
    assert torch.allclose(logits[:, 12:], model(x[:, 2:]).logits[:, 10:], atol=1e-5)


def _selection(pos: str, **memory):
    return compat.Selection(
        attention=[(ATTENTION.get("vanilla"), {}, False)],
        pos=(POS.get(pos), {}),
        memory=[(MEMORY.get("xl"), memory)] * 2,
        exit=(EXIT.get("none"), {}),
        causal=True,
        streams=True,
    )


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_absolute_positions_are_refused_unless_allowed(pos):
    (msg,) = compat.check(_selection(pos))
    assert f"pos={pos} is absolute" in msg and "pos in [" in msg and "rope" in msg and "xl" in msg
    assert "memory.allow_absolute_pos=true" in msg
    assert compat.check(_selection(pos, allow_absolute_pos=True)) == []


def test_streams_auto_follows_the_memory_and_an_explicit_choice_wins():
    xl, none = [(MEMORY.get("xl"), {})], [(MEMORY.get("none"), {})]
    assert streams_of({"streams": "auto"}, xl) == (
        True,
        "loader.streams=auto: contiguous streams, as memory=xl carries state across batches",
    )
    assert streams_of({"streams": "auto"}, none)[0] is False
    assert streams_of({"streams": False}, xl) == (False, "loader.streams=false")  # then compat refuses it
    assert streams_of({"streams": True}, none)[0] is True


@pytest.mark.parametrize("pos", ["xl", "alibi"])
def test_with_documents_marked_memory_of_another_document_is_never_seen(pos):
    """Documents cross segment boundaries; with their ids, segment k's logits equal a full run that keeps
    attention inside documents: the memory is reset at every document boundary, to the token."""
    model = build_model(pos=pos, layers=2, memory={"name": "xl", "mem_len": 24})
    x = torch.randint(0, V, (2, 18))
    docs = torch.tensor([[0] * 4 + [1] * 9 + [2] * 5, [0] * 7 + [1] * 2 + [2] * 9])  # [B, S]
    full = model(x, segments=docs).logits
    state = model.init_memory(2, x.device)
    for i in range(0, 18, 6):
        out = model(x[:, i : i + 6], segments=docs[:, i : i + 6], memory=state)
        state = out.memory
        assert torch.allclose(out.logits, full[:, i : i + 6], atol=1e-5), i
    assert torch.equal(state[0]["docs"], docs)
    # without the ids the memory would be seen across documents
    unmarked = segments(model, x, 6)[0]
    assert not torch.allclose(unmarked[:, 6:], full[:, 6:], atol=1e-4)


def test_the_lightning_module_continues_document_ids_across_batches():
    """Rows of a contiguous stream, collated batch by batch (ids restart at 0 in every batch): the module's
    carried ids make the segmented run equal one run over the whole stream with its document ids."""
    from tests.integration.helpers import compose_cfg
    from xfam.data.base import collate_lm
    from xfam.training.lit.module import XfamLitModule

    eos, s = 12, 6
    cfg = compose_cfg(["memory=xl", "memory.mem_len=32", "model.dim=32", "model.layers=2", "model.heads=2"])
    info = {"task": "lm", "vocab_size": 13, "num_classes": None, "token_bytes": None, "eos_id": eos}
    lit = XfamLitModule(cfg, info).eval()
    torch.manual_seed(0)
    stream = torch.randint(0, eos, (2, 3 * s + 1))
    stream[0, [3, 5, 6, 11]] = eos  # boundaries inside a batch and at a batch's last input (index 5)
    stream[1, [12, 16]] = eos
    whole = collate_lm([{"tokens": r} for r in stream], boundary=eos)
    want = lit.model(whole["input_ids"], segments=whole["segments"]).logits
    carry = None
    for t in range(3):
        batch = collate_lm([{"tokens": r[t * s : (t + 1) * s + 1]} for r in stream], boundary=eos)
        out, carry = lit._carried(batch, carry)
        assert torch.allclose(out.logits, want[:, t * s : (t + 1) * s], atol=1e-5), t
