"""Activation checkpointing (``model.checkpoint_activations``): the recomputed backward gives the plain path's
gradients, outputs, auxiliary losses, buffer updates and RNG state, with dropout and stochastic depth on,
through the layer-to-layer ``Carry``, memory, exit=act, a learned bias memoised on the mask, an attention that
updates a buffer in its forward, and an encoder-decoder's cross-attention; it keeps fewer tensors for the
backward pass; and it is refused with reversible layers, which recompute already."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from doubles import build_model

from xfam.attention import ATTENTION
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import block_compat
from xfam.model.compat import Selection
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel
from xfam.pos import POS

V, S = 13, 12
DROP = {"dropout": 0.1, "layer_drop": 0.3}  # random masks in every block, which the recomputation must redraw

#: name -> model overrides (``build_model``'s): representative configurations, with dropout on
CASES = {
    "vanilla": {},
    "value_and_score_residual": {"value_residual": True, "residual_attn": True},  # the Carry: values, scores
    "resi_dual": {"norm_position": "resi_dual", "layer_drop": 0.0},  # the Carry: ResiDual's second stream
    "share_layers_per_layer_pos": {"share_layers": True, "pos": {"name": "learned_per_layer"}},
    "t5_bias": {"pos": {"name": "t5"}},  # a learned bias, memoised on the mask by the first layer
    "routing": {"attention": {"name": "routing", "n_clusters": 2, "window": 6}, "layer_drop": 0.0},  # EMA buffer
    "act": {"exit": {"name": "act"}, "layer_drop": 0.0},
}


def loss_of(out) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), torch.arange(out.logits[..., 0].numel()) % V) + sum(
        out.aux.values(), torch.zeros(())
    )


def one_step(model, run: Callable) -> dict:
    """Seed, run ``run(model)`` (a loss), backward: the outputs, gradients, buffers and RNG state after it."""
    torch.manual_seed(7)
    loss = run(model)
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
    }


def assert_same_step(plain, ckpt, run: Callable) -> None:
    assert plain.state_dict().keys() == ckpt.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ckpt.state_dict().values()))
    a, b = one_step(plain.train(), run), one_step(ckpt.train(), run)
    assert torch.equal(a["loss"], b["loss"])
    assert a["grads"] and a["grads"].keys() == b["grads"].keys()
    for name, g in a["grads"].items():
        assert torch.allclose(g, b["grads"][name], rtol=1e-5, atol=1e-7), name
    assert all(torch.equal(t, b["buffers"][n]) for n, t in a["buffers"].items())  # (routing's centroids)
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_the_plain_path(case):
    kw = {"layers": 3, "dim": 16, **DROP, **CASES[case]}
    plain, ckpt = build_model(**kw), build_model(**kw, checkpoint_activations=True)
    x = torch.randint(0, V, (2, S))
    assert_same_step(plain, ckpt, lambda m: loss_of(m(x)))


def test_gradients_equal_the_plain_path_with_memory():
    """Transformer-XL's memory: the second segment attends over the first's states (the memory is written from
    each layer's input, outside the recomputed block)."""
    kw = {"layers": 2, "dim": 16, "pos": "xl", "memory": {"name": "xl", "mem_len": 6}, **DROP}
    plain, ckpt = build_model(**kw), build_model(**kw, checkpoint_activations=True)
    x = torch.randint(0, V, (2, 2 * S))

    def two_segments(m):
        first = m(x[:, :S], memory=m.init_memory(2, x.device))
        return loss_of(m(x[:, S:], memory=first.memory)) + loss_of(first)

    assert_same_step(plain, ckpt, two_segments)


def encoder_decoder(checkpointing: bool) -> EncoderDecoder:
    torch.manual_seed(0)
    common = {"dim": 16, "heads": 4, "layers": 2, "max_len": 32, **DROP, "checkpoint_activations": checkpointing}
    none = {"name": "none"}
    slots = {"attention": {"name": "vanilla"}, "pos": {"name": "t5"}, "memory": none, "exit": none}
    enc = XfamModel(ModelSpec(**common, causal=False), task="encode", vocab_size=V, **slots)
    dec = XfamModel(ModelSpec(**common), task="lm", vocab_size=V, cross={"name": "vanilla"}, **slots)
    return EncoderDecoder(enc, dec)


def test_gradients_equal_the_plain_path_in_an_encoder_decoder():
    """Each decoder layer projects the source on first use (``CrossSource.kv``): the recomputation projects again."""
    src, tgt = torch.randint(0, V, (2, S)), torch.randint(0, V, (2, S - 3))
    assert_same_step(encoder_decoder(False), encoder_decoder(True), lambda m: loss_of(m(src, decoder_input_ids=tgt)))


def saved_bytes(model, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter tensors the forward saves for the backward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model(x))
    return sum(seen.values())


def test_fewer_tensors_are_kept_for_the_backward_pass():
    kw = {"layers": 4, "dim": 32, "dropout": 0.1}
    x = torch.randint(0, V, (2, 32))
    plain, ckpt = build_model(**kw).train(), build_model(**kw, checkpoint_activations=True).train()
    assert saved_bytes(ckpt, x) < saved_bytes(plain, x) / 3


def test_evaluation_and_decoding_run_the_plain_path():
    kw = {"layers": 2, "dim": 16, **DROP}
    plain, ckpt = build_model(**kw), build_model(**kw, checkpoint_activations=True)
    x = torch.randint(0, V, (2, S))
    assert torch.equal(plain(x).logits, ckpt(x).logits)
    cache = ckpt(x[:, :5], cache=ckpt.empty_cache()).cache
    assert cache is not None and all(state is not None for state in cache.layers)


def test_reversible_layers_refuse_it_with_the_reason():
    sel = Selection(
        attention=[(ATTENTION.get("vanilla"), {"name": "vanilla"}, False)],
        pos=(POS.get("rope"), {"name": "rope"}),
        memory=[(MEMORY.get("none"), {"name": "none"})],
        exit=(EXIT.get("none"), {"name": "none"}),
        causal=True,
        reversible=True,
    )
    assert block_compat.reasons(ModelSpec(layers=2, reversible=True), sel) == []
    (why,) = block_compat.reasons(ModelSpec(layers=2, reversible=True, checkpoint_activations=True), sel)
    assert "model.checkpoint_activations with model.reversible=true: the reversible stack already recomputes" in why
    assert "Fix: model.reversible=false, or drop model.checkpoint_activations" in why


@pytest.mark.slow
def test_the_experiment_script_reports_less_saved_memory_in_quick_mode(tmp_path) -> None:
    """``scripts/exp_checkpointing.py --quick`` (a fresh process per configuration) writes its table, and at each
    depth the checkpointed run keeps fewer bytes for the backward pass."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "exp_checkpointing.py"
    subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)], check=True, capture_output=True)
    assert "<!-- experiments:checkpointing:start -->" in (tmp_path / "results.md").read_text()
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    by_depth: dict = {}
    for r in rows:
        by_depth.setdefault(r["depth"], {})[bool(r["checkpoint"])] = r["saved_bytes"]
    assert by_depth and all(d[True] < d[False] for d in by_depth.values())
