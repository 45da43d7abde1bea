"""The fixed-shape decode step (``xfam.model.static_cache``, ``xfam.eval.fast_decode``): every token's logits equal
the eager cached step's and a full recompute's, across mechanisms whose state is a key/value cache, a rolling
window (wrapped many times) or running sums; greedy generation is identical; models the step cannot express
fall back to eager decoding with their reasons, and an explicit request for the step is refused."""

from __future__ import annotations

import logging

import pytest
import torch
from doubles import build_model

import xfam.core.logs
from xfam.core.errors import ConfigError
from xfam.eval import fast_decode
from xfam.eval.generate import generate
from xfam.model.plan import StaticCache
from xfam.model.static_cache import static_problems, to_static

V = 13
CASES = {  # id: (attention, pos, model options)
    "vanilla-rope-gqa": ({"name": "vanilla"}, "rope", {"kv_heads": 2}),
    "vanilla-alibi": ({"name": "vanilla"}, "alibi", {}),
    "vanilla-t5": ({"name": "vanilla"}, "t5", {}),
    "vanilla-learned-qknorm": ({"name": "vanilla"}, "learned", {"attn_qk_norm": "rms"}),
    "vanilla-sinusoidal-gate": ({"name": "vanilla"}, "sinusoidal", {"attn_gate": True, "attn_head_scale": True}),
    "vanilla-dynamic": ({"name": "vanilla"}, "dynamic", {}),
    "vanilla-xpos": ({"name": "vanilla"}, {"name": "rope", "xpos": True}, {}),
    "local-window-rope": ({"name": "local", "window": 4}, "rope", {}),
    "local-window-alibi-gqa": ({"name": "local", "window": 5}, "alibi", {"kv_heads": 2}),
    "local-block": ({"name": "local", "mode": "block", "query_block": 3, "memory": 2}, "rope", {}),
    "longformer-dilated-global": (
        {"name": "longformer", "window": 3, "dilation": 2, "global_tokens": [0, 2]},
        "rope",
        {},
    ),
    "longformer-per-head": (
        {"name": "longformer", "window": 2, "dilation": [1, 2, 1, 3], "global_tokens": []},
        "alibi",
        {},
    ),
    "longformer-dense": ({"name": "longformer", "window": None}, "t5", {}),
    "performer": ({"name": "performer"}, "none", {}),
    "performer-alibi": ({"name": "performer"}, "alibi", {}),
    "rfa-gate": ({"name": "rfa", "gate": True}, "rope", {}),
    "shared-layers-resi-dual": ({"name": "vanilla"}, "rope", {"share_layers": True, "norm_position": "resi_dual"}),
    "per-head-groups": (
        {"name": "vanilla", "per_head": [{"heads": 2}, {"heads": 2, "name": "local", "window": 3}]},
        "alibi",
        {},
    ),
}


def _model(case: str):
    attention, pos, options = CASES[case]
    return build_model(attention=attention, pos=pos, vocab_size=V, layers=3, max_len=64, **options)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fixed_shape_step_equals_the_eager_step_and_a_recompute(case: str) -> None:
    model = _model(case)
    assert static_problems(model, 64) == []
    tokens = torch.randint(0, V, (2, 30))
    with torch.no_grad():
        out = model(tokens[:, :6], cache=model.empty_cache())
        eager, static = out.cache, to_static(model, out.cache, 64)
        for t in range(6, 30):  # well past every window: the rolling windows wrap several times
            a = model(tokens[:, t : t + 1], cache=eager)
            b = model(tokens[:, t : t + 1], cache=static)
            eager = a.cache
            assert torch.allclose(a.logits, b.logits, atol=1e-5), f"token {t}"
        assert b.cache is static and int(static.pos) == 30  # states updated in place, the position advanced
        full = model(tokens).logits[:, -1]
    assert torch.allclose(b.logits[:, -1], full, atol=1e-5)


@pytest.mark.parametrize("case", ["vanilla-rope-gqa", "local-window-alibi-gqa", "performer", "longformer-per-head"])
def test_static_generation_is_identical_to_eager(case: str) -> None:
    model = _model(case)
    prompt = torch.randint(0, V, (2, 5))
    eager = generate(model, prompt, 40, temperature=0, decoder="eager")
    static = generate(model, prompt, 40, temperature=0, decoder="static")
    assert torch.equal(eager.tokens, static.tokens)
    assert torch.allclose(eager.logits, static.logits, atol=1e-5)
    sampled = [
        generate(model, prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(3), decoder=d).tokens
        for d in ("eager", "static")
    ]
    assert torch.equal(*sampled)
    full = model(static.tokens[:, :-1]).logits[:, 4:]  # cached logits still equal a full recompute
    assert torch.allclose(full, static.logits, atol=1e-5)


def test_a_global_position_after_the_prompt_continues_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    model = build_model(attention={"name": "longformer", "window": 2, "global_tokens": [7]}, pos="rope", max_len=32)
    prompt = torch.randint(0, V, (1, 4))  # position 7, a global query that sees every key, comes after it
    with caplog.at_level(logging.INFO, logger="xfam"):
        static = generate(model, prompt, 10, temperature=0, decoder="static")
    assert "cannot hold this prompt's state in fixed shape" in caplog.text
    eager = generate(model, prompt, 10, temperature=0, decoder="eager")
    assert torch.equal(eager.tokens, static.tokens)


REFUSED = {  # model options -> words of the reason
    "memory": ({"memory": {"name": "xl", "mem_len": 4}}, "memory model"),
    "act": ({"exit": {"name": "act"}}, "exit=act"),
    "persistent": ({"num_mem_kv": 2}, "num_mem_kv"),
    "memory-tokens": ({"num_memory_tokens": 2}, "auxiliary tokens"),
    "shift": ({"shift_tokens": 1}, "shift_tokens"),
    "talking-heads": ({"attn_talking_heads": True}, "attn_talking_heads"),
    "modifier": ({"pos": "shaw"}, "pos=shaw"),
    "bigbird": ({"attention": {"name": "bigbird", "block": 4}}, "attention=bigbird"),
    "exact-features": ({"attention": {"name": "performer", "features": "exact"}}, "features=exact"),
    "per-head-groups": (
        {
            "attention": {
                "name": "vanilla",
                "per_head": [{"heads": 2}, {"heads": 2, "name": "fixed", "stride": 4, "summary": 1}],
            }
        },
        "attention=fixed",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_step_cannot_express_is_named(case: str) -> None:
    options, words = REFUSED[case]
    model = build_model(max_len=32, **options)
    problems = static_problems(model, 32)
    assert any(words in p for p in problems), problems
    with pytest.raises(ConfigError, match="no compiled fixed-shape decode step") as err:
        fast_decode.choose(model, 1, 4, 8, "compiled")
    assert words in str(err.value) and "decoder=auto" in str(err.value)
    assert fast_decode.choose(model, 1, 4, 8, "auto") == "eager"


@pytest.mark.parametrize(
    "exit",
    [
        {"name": "calm", "measure": "saturation", "threshold": 0.85},
        {"name": "depth_adaptive", "classifier": "geometric", "threshold": 0.5},
    ],
    ids=["calm", "depth_adaptive"],
)
def test_an_early_exit_model_takes_the_fixed_shape_step_uncompiled(exit: dict) -> None:
    """Its depth varies per token: one compiled graph cannot follow it, the uncompiled step can. Skipped layers
    write the exited token's keys and values in place; tokens, depths and logits equal eager decoding's."""
    model = build_model(pos="rope", layers=4, max_len=64, exit=exit, init_std=0.3)  # (thresholds giving mixed depths)
    assert fast_decode.choose(model, 2, 5, 30, "auto") == "static"
    with pytest.raises(ConfigError, match=f"no compiled fixed-shape decode step: exit={exit['name']}"):
        fast_decode.choose(model, 2, 5, 30, "compiled")
    prompt = torch.randint(0, V, (2, 5))
    eager = generate(model, prompt, 30, temperature=0, decoder="eager")
    static = generate(model, prompt, 30, temperature=0, decoder="static")
    assert torch.equal(eager.tokens, static.tokens) and torch.equal(eager.depth, static.depth)
    assert torch.allclose(eager.logits, static.logits, atol=1e-5)
    assert (static.depth < model.num_layers).any() and (static.depth == model.num_layers).any()  # (mixed depths)


def test_a_learned_table_bounds_the_cache() -> None:
    model = build_model(pos="learned", max_len=32)
    assert fast_decode.capacity_for(model, 20) == 32  # rounded up, within the table
    assert static_problems(model, 32) == []
    assert any("model.max_len=32" in p for p in static_problems(model, 40))


def test_auto_compiles_only_what_repays_it() -> None:
    model = build_model(pos="rope")
    assert fast_decode.choose(model, 1, 8, 16, "auto") == "eager"
    assert fast_decode.choose(model, 8, 8, fast_decode.COMPILE_FROM // 8, "auto") == "compiled"
    assert fast_decode.choose(model, 1, 8, 16, "static") == "static"
    assert fast_decode.choose(model, 1, 8, 16, "eager") == "eager"
    with pytest.raises(ConfigError, match="decoder='fast'.*valid: auto, compiled, static, eager"):
        fast_decode.choose(model, 1, 8, 16, "fast")


def test_auto_names_the_faster_mode_it_leaves_to_the_user(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(xfam.core.logs, "_seen", set())  # log_once: as if nothing had been logged yet
    model = build_model(pos="rope")
    with caplog.at_level(logging.INFO, logger="xfam"):
        assert fast_decode.choose(model, 8, 8, fast_decode.COMPILE_FROM // 8, "auto") == "compiled"
        assert fast_decode.choose(model, 8, 8, fast_decode.COMPILE_FROM // 8, "auto", mode="max-autotune")
    lines = [r.getMessage() for r in caplog.records if "compiled fixed-shape step" in r.getMessage()]
    assert len(lines) == 2 and "compile_mode=max-autotune decodes about 2x faster" in lines[0]
    assert "max-autotune" not in lines[1]  # (asked for already)


def test_a_static_cache_takes_one_plain_row_per_call() -> None:
    model = build_model(pos="rope")
    with torch.no_grad():
        out = model(torch.randint(0, V, (1, 4)), cache=model.empty_cache())
        static = to_static(model, out.cache, 16)
        assert isinstance(static, StaticCache) and static.capacity == 16
        with pytest.raises(ValueError, match="one new row"):
            model(torch.randint(0, V, (1, 2)), cache=static)


def test_the_compiled_step_generates_what_the_eager_path_does() -> None:
    model = build_model(pos="rope", layers=2)
    prompt = torch.randint(0, V, (2, 6))
    eager = generate(model, prompt, 12, temperature=0, decoder="eager")
    compiled = generate(model, prompt, 12, temperature=0, decoder="compiled")
    assert torch.equal(eager.tokens, compiled.tokens)
    assert torch.allclose(eager.logits, compiled.logits, atol=1e-5)
    again = generate(model, prompt, 12, temperature=0, decoder="auto")  # compiled already: auto takes it
    assert torch.equal(again.tokens, eager.tokens)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["local-window-alibi-gqa", "performer", "longformer-dilated-global", "vanilla-t5"])
def test_every_kind_of_state_compiles(case: str) -> None:
    model = _model(case)
    prompt = torch.randint(0, V, (2, 6))
    eager = generate(model, prompt, 30, temperature=0, decoder="eager")
    compiled = generate(model, prompt, 30, temperature=0, decoder="compiled")
    assert torch.equal(eager.tokens, compiled.tokens)
    assert torch.allclose(eager.logits, compiled.logits, atol=1e-5)


def _orig(step: fast_decode.CompiledStep) -> object:
    return step.fn._torchdynamo_orig_callable.__code__  # type: ignore[attr-defined]


def test_every_model_batch_and_size_has_a_step_of_its_own() -> None:
    """Dynamo keeps graphs per code object (8 at most): steps sharing one would be evicted past 8 and, with frozen
    weights, could compute with another model's weights."""
    a, b = build_model(pos="rope"), build_model(pos="rope")
    steps = [fast_decode.compiled_step(m, batch, 16, None) for m in (a, b) for batch in (1, 2)]
    assert len({id(_orig(s)) for s in steps}) == 4
    assert fast_decode.compiled_step(a, 1, 16, None) is steps[0]  # found again, not remade
    assert fast_decode.compiled_step(a, 1, 32, None, make=False) is None


def test_a_step_with_frozen_weights_is_remade_when_the_weights_change() -> None:
    model = build_model(pos="rope")
    frozen = fast_decode.compiled_step(model, 1, 16, "max-autotune")
    plain = fast_decode.compiled_step(model, 1, 16, None)
    assert frozen is not None and plain is not None and frozen.frozen and not plain.frozen
    assert fast_decode.compiled_step(model, 1, 16, "max-autotune") is frozen
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)  # in place, as an optimizer step: same storage, a new version
    assert not frozen.current(model) and plain.current(model)
    again = fast_decode.compiled_step(model, 1, 16, "max-autotune")
    assert again is not frozen and again is not None and again.current(model)
    model.load_state_dict(build_model(pos="rope").state_dict())
    assert not again.current(model)


@pytest.mark.slow
def test_a_frozen_step_generates_with_the_current_weights() -> None:
    """compile_mode=max-autotune on a CPU freezes the weights into the step: greedy tokens equal eager decoding's,
    and after an update in place the step is recompiled, never run with the old weights."""
    model = build_model(pos="rope", layers=2)
    prompt = torch.randint(0, V, (1, 6))
    for _ in range(2):
        eager = generate(model, prompt, 12, temperature=0, decoder="eager")
        frozen = generate(model, prompt, 12, temperature=0, decoder="compiled", compile_mode="max-autotune")
        assert torch.equal(eager.tokens, frozen.tokens)
        assert torch.allclose(eager.logits, frozen.logits, atol=1e-5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
