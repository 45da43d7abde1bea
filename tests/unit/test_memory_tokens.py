"""model.num_memory_tokens: learned memory tokens in front of every input (Burtsev et al., 2020,
arXiv:2006.11527; "registers", Darcet et al., 2023), run by every block, dropped before the head.

Checked: zero is the model without them; the input keeps its own positions; no causal leak; no leak
between packed documents (memory tokens are shared by every document and see none); memories store
the input's states only, with correct document ids; decoding with the cache equals the full forward
(the tokens enter once); the refusals (ETC, early exit, documents on run-based mechanisms, max_len)."""

from __future__ import annotations

import pytest
import torch
from doubles import assert_decode_equals_full, assert_no_causal_leak, assert_same_model, build_model

from xfam.attention import ATTENTION
from xfam.core.errors import ConfigError
from xfam.core.mask import SHARED
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import compat
from xfam.model.plan import plan_call
from xfam.pos import POS
from xfam.training.precheck import precheck

V, G = 13, 3


def big_tokens(model, seed: int = 3) -> None:
    """Memory-token embeddings as large as a token's (their init, std 0.02, is as small as the others')."""
    with torch.no_grad():
        model.aux_embed.weight.copy_(
            torch.randn(model.aux_embed.weight.shape, generator=torch.Generator().manual_seed(seed))
        )


@pytest.mark.parametrize("pos", ["none", "learned", "rope", "alibi"])
def test_zero_is_the_model_without_memory_tokens(pos):
    assert_same_model(build_model(pos=pos), build_model(pos=pos, num_memory_tokens=0), torch.randint(0, V, (2, 9)))


def test_outputs_cover_the_input_only_and_the_tokens_matter():
    model = build_model(pos="rope", num_memory_tokens=G)
    x = torch.randint(0, V, (2, 9))
    out = model(x).logits
    assert out.shape == (2, 9, V) and model.aux_embed.weight.shape == (G, 32)
    big_tokens(model)
    assert not torch.allclose(model(x).logits, out, atol=1e-3)
    classifier = build_model(task="classify", num_classes=3, num_memory_tokens=G)
    assert classifier(x).logits.shape == (2, 3)


def test_the_input_keeps_its_own_absolute_positions():
    """pos=learned: the first block's input is [memory tokens (no position) | token + table[0 .. S-1]]."""
    model = build_model(pos="learned", num_memory_tokens=G)
    x = torch.randint(0, V, (2, 9))
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    model(x)
    hook.remove()
    assert torch.equal(seen[0][:, :G], model.aux_embed.weight.expand(2, -1, -1))
    assert torch.equal(seen[0][:, G:], model.embed(x) + model.pos.table(torch.arange(9)))


@pytest.mark.parametrize("pos", ["rope", "alibi", "xl", "learned"])
def test_no_causal_leak(pos):
    model = build_model(pos=pos, num_memory_tokens=G)
    big_tokens(model)
    assert_no_causal_leak(model, V)


DOCS = torch.tensor([[0] * 4 + [1] * 6, [2] * 7 + [3] * 3])


@pytest.mark.parametrize("attention", [{"name": "vanilla"}, {"name": "local", "window": 4}])
@pytest.mark.parametrize("causal", [True, False])
def test_no_leak_between_packed_documents(attention, causal):
    """Changing document A's tokens never changes document B's outputs, while every document does see
    the memory tokens (changing them changes B). Bidirectional: memory tokens see only each other."""
    model = build_model(pos="alibi", num_memory_tokens=G, causal=causal, attention=attention)
    big_tokens(model)
    x = torch.randint(0, V, (2, 10))
    base = model(x, segments=DOCS).logits
    for a in (DOCS == 0) | (DOCS == 2), (DOCS == 1) | (DOCS == 3):  # the first, then the second documents
        y = torch.where(a, (x + 1) % V, x)
        changed = model(y, segments=DOCS).logits
        assert torch.equal(changed[~a], base[~a])
        assert not torch.allclose(changed[a], base[a], atol=1e-4)
    big_tokens(model, seed=4)
    assert not torch.allclose(model(x, segments=DOCS).logits, base, atol=1e-3)


def test_the_memory_tokens_carry_the_shared_document_id():
    model = build_model(num_memory_tokens=G)
    seg = plan_call(torch.zeros(2, 10, dtype=torch.long), None, DOCS, None, model.aux_tokens, model.aux_doc).segments
    assert (seg[:, :G] == SHARED).all() and torch.equal(seg[:, G:], DOCS)


# -- with memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("memory", ["xl", "compressive", "memorizing"])
def test_memory_stores_the_input_states_only(memory):
    cfg = {"name": memory, "mem_len": 5} if memory != "memorizing" else {"name": memory, "mem_len": 5, "topk": 4}
    model = build_model(pos="xl", layers=2, num_memory_tokens=G, memory=cfg)
    big_tokens(model)
    x = torch.randint(0, V, (2, 8))
    seen = []
    hook = model.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    out = model(x, memory=model.init_memory(2, x.device))
    hook.remove()
    h0, h1 = out.memory[0]["h"], out.memory[1]["h"]
    assert h0.shape == h1.shape == (2, 5, 32)
    assert torch.equal(h0, model.embed(x)[:, -5:])  # layer 1's input rows of the tokens (pos=xl adds none)
    assert torch.equal(h1, seen[0][:, G:][:, -5:])  # layer 2's: block 1's output rows of the tokens
    if memory == "memorizing":
        assert out.memory[0]["keys"].shape[2] == 8  # one stored key per input token
    # the next segment runs on [memory | memory tokens | segment]
    nxt = model(x, memory=out.memory)
    assert nxt.logits.shape == (2, 8, V) and nxt.memory[0]["h"].shape == (2, 5, 32)


def test_xl_memory_keeps_document_ids_and_never_leaks_across_documents():
    model = build_model(pos="rope", layers=2, num_memory_tokens=G, memory={"name": "xl", "mem_len": 6})
    big_tokens(model)
    x1, x2 = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    seg1 = torch.tensor([[0] * 8, [0] * 3 + [1] * 5])
    seg2 = torch.tensor([[0] * 2 + [1] * 6, [2] * 8])  # row 0: doc 0 continues; row 1: a new document
    first = model(x1, segments=seg1, memory=model.init_memory(2, x1.device))
    assert all(torch.equal(st["docs"], seg1[:, -6:]) for st in first.memory)
    base = model(x2, segments=seg2, memory=first.memory).logits
    y1 = x1.clone()
    y1[0, :2], y1[1] = (y1[0, :2] + 1) % V, (y1[1] + 1) % V  # earlier tokens: doc 0 of row 0; all of row 1
    other = model(y1, segments=seg1, memory=model.init_memory(2, x1.device))
    changed = model(x2, segments=seg2, memory=other.memory).logits
    assert torch.equal(changed[1], base[1])  # row 1's new document sees nothing of the old ones
    assert torch.equal(changed[0, 2:], base[0, 2:])  # row 0's doc 1 neither
    assert not torch.allclose(changed[0, :2], base[0, :2], atol=1e-4)  # doc 0 continues: it does see its past


# -- decoding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ["none", "sinusoidal", "learned", "rope", "alibi", "xl"])
@pytest.mark.parametrize("extra", [{}, {"num_mem_kv": 2}, {"reversible": True}, {"exit": {"name": "act"}}])
def test_decode_with_the_cache_equals_the_full_forward(pos, extra):
    model = build_model(pos=pos, num_memory_tokens=G, **extra)
    big_tokens(model)
    x = torch.randint(0, V, (2, 11))
    pad = torch.ones(2, 11, dtype=torch.bool)
    pad[1, :3] = False  # a left-padded row
    for key_padding, step in ((None, 1), (pad, 1), (None, 3)):
        assert_decode_equals_full(model, x, key_padding, step=step)
    cache = model(x[:, :4], cache=model.empty_cache()).cache
    assert cache.length == G + 4  # the memory tokens enter the cache once
    assert model(x[:, 4:5], cache=cache).cache.length == G + 5


# -- refusals ---------------------------------------------------------------------------------------


def selection(attention="vanilla", exit="none", documents=False, **options):
    return compat.Selection(
        attention=[(ATTENTION.get(attention), {}, False)],
        pos=(POS.get("rope"), {}),
        memory=[(MEMORY.get("none"), {})] * 2,
        exit=(EXIT.get(exit), {}),
        causal=ATTENTION.get(attention).causal,
        documents=documents,
        **options,
    )


def test_etc_refuses_memory_tokens_before_anything_is_built():
    (msg,) = compat.check(selection("etc", num_memory_tokens=2))
    assert "model.num_memory_tokens cannot be combined with attention=etc" in msg and "Fix:" in msg
    with pytest.raises(ConfigError, match="model.num_memory_tokens cannot be combined with attention=etc"):
        precheck(["data=listops", "attention=etc", "model.num_memory_tokens=2"])


def test_early_exit_refuses_memory_tokens():
    (msg,) = compat.check(selection(exit="calm", num_memory_tokens=2))
    assert "exit=calm's per-token exit decisions" in msg and "exit in [" in msg and "act" in msg
    assert compat.check(selection(exit="act", num_memory_tokens=2)) == []


def test_documents_need_a_mechanism_that_shares_keys_across_them():
    (msg,) = compat.check(selection("performer", documents=True, num_memory_tokens=2))
    assert "attention=performer cannot express" in msg and "data.doc_mask=false" in msg
    assert "vanilla" in msg and "performer" not in msg.split("Fix:")[1]
    assert compat.check(selection("performer", num_memory_tokens=2)) == []
    assert compat.check(selection("local", documents=True, num_memory_tokens=2)) == []


def test_the_command_line_counts_memory_tokens_against_max_len():
    with pytest.raises(ConfigError) as err:
        precheck(["data=duplication", "data.seq_len=64", "model.max_len=64", "model.num_memory_tokens=4"])
    assert len(err.value.problems) == 1
    assert "model.num_memory_tokens=4 makes 68 tokens per row, more than model.max_len=64" in str(err.value)
    assert "Fix: model.max_len=68" in str(err.value)
    precheck(["data=duplication", "data.seq_len=64", "model.max_len=68", "model.num_memory_tokens=4"])
