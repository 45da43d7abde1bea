"""State propagation of early exit (``xfam.model.propagate``, ``Stack.run_layer_rows``).

The reference is the traversal without ``run_layer_rows``: an exited token's copied state runs through every later
layer in full (what xfam did before). The partial layers must give the same logits, depths, greedy tokens and decode
caches, while the FFN (and, in one-token decode calls, the attention) of the exited rows never runs.
"""

from __future__ import annotations

import pytest
import torch
from doubles import build_model, decode_logits

from xfam.eval.generate import generate
from xfam.model import propagate
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.spec import ModelSpec
from xfam.model.stack import Stack
from xfam.model.transformer import XfamModel

L, V = 4, 11
CASES = {  # thresholds that give mixed depths on these tiny models (each test asserts it)
    "softmax": {"name": "calm", "measure": "softmax", "threshold": 0.3},
    "saturation": {"name": "calm", "measure": "saturation", "threshold": 0.85},
    "classifier": {"name": "calm", "measure": "classifier", "threshold": 0.7},
    "geometric": {"name": "depth_adaptive", "classifier": "geometric", "threshold": 0.5},
    "multinomial": {"name": "depth_adaptive", "classifier": "multinomial", "threshold": 0.0},
}
OPTIONS = {  # block options the partial layer reproduces (or falls back for)
    "rope_gqa": {"pos": "rope", "kv_heads": 2},
    "alibi": {"pos": "alibi"},
    "post_norm": {"pos": "rope", "norm_position": "post"},
    "sandwich_qknorm": {"pos": "rope", "norm_position": "sandwich", "attn_qk_norm": "rms"},
    "gate_scale_aoa": {"pos": "rope", "attn_gate": True, "attn_head_scale": True, "attn_on_attn": True},
    "value_residual": {"pos": "rope", "value_residual": True},
    "macaron_layerscale": {"pos": "rope", "macaron": True, "residual": "layerscale"},
    "swiglu_bias": {"pos": "rope", "ffn": "swiglu", "bias": True},
    "shared_layers": {"pos": "rope", "share_layers": True},
    "persistent_kv": {"pos": "rope", "num_mem_kv": 2},  # exited rows attend (kv_only_problems)
    "talking_heads": {"pos": "rope", "attn_talking_heads": True},  # exited rows attend
    "shift_tokens": {"pos": "rope", "shift_tokens": 1},  # the whole layer (full_layer_problems)
    "performer": {"pos": "rope", "attention": {"name": "performer"}},  # no key/value-only update
}


def make(case: str = "softmax", **kw):
    exit_cfg = dict(CASES[case])
    model = build_model(exit=exit_cfg, **{"layers": L, "vocab_size": V, "init_std": 0.3, **kw})
    if case == "multinomial":
        with torch.no_grad():  # favour the first and the last layer, so both occur
            model.exit.halting.bias.copy_(torch.tensor([0.5, -1.0, -1.0, 0.5]))
    return model


def tokens(b: int = 3, s: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def whole_layers(monkeypatch):
    """Within ``with whole_layers():`` the stack has no ``run_layer_rows``: exited tokens run every layer whole."""

    class Ctx:
        def __enter__(self):
            monkeypatch.delattr(Stack, "run_layer_rows")

        def __exit__(self, *exc):
            monkeypatch.undo()

    return Ctx


def assert_mixed(depth: torch.Tensor) -> None:
    assert depth.min() < L and depth.max() > 1 and len(set(depth.flatten().tolist())) > 1


def cache_kv(cache) -> list[torch.Tensor]:
    """Every tensor of every layer's decode state, in order."""
    out = []
    for state in cache.layers:
        inner = state.get("mechanism", state)
        out += [t for t in (inner or {}).values() if isinstance(t, torch.Tensor)]
    return out


@pytest.mark.parametrize("case", CASES)
def test_whole_sequence_equals_running_every_layer(case, whole_layers):
    model, x = make(case), tokens()
    with torch.no_grad():
        out = model(x)
        with whole_layers():
            ref = model(x)
    assert_mixed(out.depth)
    assert torch.equal(out.depth, ref.depth)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("batch,select", [(1, 0.5), (3, 0.0), (3, 1.0)])
def test_greedy_generation_is_unchanged(case, batch, select, whole_layers, monkeypatch):
    """At batch 3 once with every mixed call attending all rows, once with the running rows' caches copied out."""
    monkeypatch.setattr(propagate, "SELECT_BELOW", select)
    model, prompt = make(case), tokens(b=batch, s=5, seed=3)
    with torch.no_grad():
        gen = generate(model, prompt, 12, temperature=0, decoder="eager")
        with whole_layers():
            ref = generate(model, prompt, 12, temperature=0, decoder="eager")
    assert_mixed(gen.depth)
    assert torch.equal(gen.tokens, ref.tokens)
    assert torch.equal(gen.depth, ref.depth)
    assert torch.allclose(gen.logits, ref.logits, atol=1e-5)


@pytest.mark.parametrize("case", ["softmax", "geometric"])
@pytest.mark.parametrize("prompt,step", [(3, 1), (1, 2)])
def test_decode_cache_holds_the_same_keys_and_values(case, prompt, step, whole_layers):
    """Calls of one and of two tokens: the cache of every layer equals the whole layers' (keys and values of the
    copied state), and so do the logits."""
    model, x = make(case), tokens(s=11)
    with torch.no_grad():
        logits, cache = decode_with_cache(model, x, prompt, step)
        with whole_layers():
            ref_logits, ref_cache = decode_with_cache(model, x, prompt, step)
        full = model(x)
    assert_mixed(full.depth)
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    assert torch.allclose(logits, full.logits, atol=1e-5)
    got, want = cache_kv(cache), cache_kv(ref_cache)
    assert len(got) == len(want) == 2 * L
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def decode_with_cache(model, x, prompt, step):
    out = model(x[:, :prompt], cache=model.empty_cache())
    logits = [out.logits]
    for t in range(prompt, x.shape[1], step):
        out = model(x[:, t : t + step], cache=out.cache)
        logits.append(out.logits)
    return torch.cat(logits, 1), out.cache


@pytest.mark.parametrize("option", OPTIONS)
def test_block_options_are_reproduced_or_fall_back(option, whole_layers):
    kw = dict(OPTIONS[option])
    model, x = make("softmax", **kw), tokens()
    with torch.no_grad():
        out, dec = model(x), decode_logits(model, x, prompt=3)
        gen = generate(model, x[:, :4], 8, temperature=0, decoder="eager")
        with whole_layers():
            ref, ref_dec = model(x), decode_logits(model, x, prompt=3)
            ref_gen = generate(model, x[:, :4], 8, temperature=0, decoder="eager")
    assert len(set(out.depth.flatten().tolist())) > 1
    assert torch.equal(out.depth, ref.depth)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    assert torch.allclose(dec, ref_dec, atol=1e-5)
    assert torch.equal(gen.tokens, ref_gen.tokens)
    assert torch.allclose(gen.logits, ref_gen.logits, atol=1e-5)


# -- what runs for exited rows -------------------------------------------------------------------


class Calls:
    """Rows that reached each layer's FFN and attention mechanism (hooks on the modules)."""

    def __init__(self, model):
        self.ffn: list[tuple[int, int]] = []  # (layer, rows)
        self.attn: list[tuple[int, int]] = []  # (layer, batch rows of the queries)
        self.handles = []
        for i, blk in enumerate(model.blocks):
            self.handles.append(blk.ffn.register_forward_hook(lambda m, a, o, i=i: self.ffn.append((i, rows(a[0])))))
            mech = blk.attn.mechanism
            self.handles.append(mech.register_forward_hook(lambda m, a, o, i=i: self.attn.append((i, a[0].shape[0]))))

    def clear(self) -> None:
        self.ffn.clear()
        self.attn.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def rows(x: torch.Tensor) -> int:
    return x.shape[0] * x.shape[1]


def test_an_exited_token_costs_only_keys_and_values_at_batch_one():
    """exit_at=1: every token leaves after layer 1. In the one-token decode calls, layers 2.. run neither their
    FFN nor their attention, and their caches still grow by one token each call."""
    model = build_model(exit={"name": "calm", "exit_at": 1}, layers=L, vocab_size=V, init_std=0.3, pos="rope")
    x = tokens(b=1, s=9)
    calls = Calls(model)
    with torch.no_grad():
        out = model(x[:, :4], cache=model.empty_cache())
        assert [i for i, _ in calls.ffn] == [0]  # the prompt: FFN of layer 1 only ...
        assert sorted(i for i, _ in calls.attn) == list(range(L))  # ... attention everywhere (later prompt tokens)
        for t in range(4, 9):
            calls.clear()
            out = model(x[:, t : t + 1], cache=out.cache)
            assert calls.ffn == [(0, 1)] and calls.attn == [(0, 1)]
            assert out.cache.length == t + 1
            assert all(st["k"].shape[2] == t + 1 for st in out.cache.layers)
    calls.remove()


@pytest.mark.parametrize("case", ["softmax", "geometric"])
def test_the_ffn_runs_for_running_rows_only(case, monkeypatch):
    """Each layer's FFN sees exactly the rows that have not exited (in whole sequences and in decode calls), and in
    a one-token decode call (with the running rows' caches copied out) the attention of the running rows only."""
    monkeypatch.setattr(propagate, "SELECT_BELOW", 1.0)
    model = make(case)
    calls = Calls(model)
    x = tokens(b=3, s=10)
    with torch.no_grad():
        out = model(x)
        assert_mixed(out.depth)
        want = [(i, int((out.depth > i).sum())) for i in range(L) if (out.depth > i).any()]
        assert calls.ffn == want
        out = model(x[:, :4], cache=model.empty_cache())
        seen = 0
        for t in range(4, 10):
            calls.clear()
            out = model(x[:, t : t + 1], cache=out.cache)
            depth = out.depth[:, 0]
            assert calls.ffn == [(i, int((depth > i).sum())) for i in range(L) if (depth > i).any()]
            assert calls.attn == [(i, int((depth > i).sum())) for i in range(L) if (depth > i).any()]
            seen += bool((depth > 0).all() and (depth < L).any())
        assert seen > 0  # some call had exited rows
    calls.remove()


def test_fallbacks_are_logged(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(propagate, "log_once", said.append)
    with torch.no_grad():
        make("softmax", pos="rope", shift_tokens=1)(tokens())
        make("softmax", pos="rope", attention={"name": "performer"})(tokens()[:, :4], cache=None)
    assert said and all("run the whole layer" in m and "shift_tokens" in m for m in said)
    said.clear()
    with torch.no_grad():
        model = make("softmax", pos="rope", attention={"name": "performer"})
        generate(model, tokens()[:, :4], 6, temperature=0, decoder="eager")
    assert said and all("attend as running ones" in m and "performer" in m for m in said)
    assert propagate.kv_only_problems(make("softmax", attention={"name": "performer"}).blocks[1])
    assert not propagate.kv_only_problems(make("softmax").blocks[1])


def test_an_encoder_decoders_decoder(whole_layers):
    """CALM on the decoder of an encoder-decoder (cross-attention: exited rows skip their FFN only)."""
    torch.manual_seed(0)
    common = {"dim": 32, "heads": 4, "layers": L, "max_len": 32, "init_std": 0.3}
    none = {"name": "none"}
    slots = {"attention": {"name": "vanilla"}, "pos": {"name": "t5"}, "memory": none}
    enc = XfamModel(ModelSpec(**common, causal=False), task="encode", vocab_size=V, exit=none, **slots)
    dec = XfamModel(
        ModelSpec(**common), task="lm", vocab_size=V, cross={"name": "vanilla"}, exit=CASES["softmax"], **slots
    )
    model = EncoderDecoder(enc, dec).eval()
    src, tgt = tokens(seed=4), tokens(s=9, seed=5)

    def run():
        full = model(src, decoder_input_ids=tgt)
        out = model(src, decoder_input_ids=tgt[:, :2], cache=model.empty_cache())
        logits = [out.logits]
        for t in range(2, tgt.shape[1]):
            out = model(None, decoder_input_ids=tgt[:, t : t + 1], cache=out.cache)
            logits.append(out.logits)
        return full, torch.cat(logits, 1)

    with torch.no_grad():
        (full, dec_logits) = run()
        with whole_layers():
            (ref, ref_dec) = run()
    assert_mixed(full.depth)
    assert torch.equal(full.depth, ref.depth)
    assert torch.allclose(full.logits, ref.logits, atol=1e-5)
    assert torch.allclose(dec_logits, ref_dec, atol=1e-5) and torch.allclose(dec_logits, full.logits, atol=1e-5)
