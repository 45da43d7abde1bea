"""The build-time compatibility check: refusals name the reason and the alternatives that would work."""

from __future__ import annotations

from typing import Any

from xfam.attention import ATTENTION
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import compat
from xfam.model.compat import Selection
from xfam.pos import POS


def selection(
    attention: str = "vanilla",
    pos: str = "none",
    memory: str = "none",
    *,
    attention_params: dict[str, Any] | None = None,
    per_head: bool = False,
    causal: bool = True,
    streams: bool = False,
    layers: int = 2,
) -> Selection:
    return Selection(
        attention=[(ATTENTION.get(attention), attention_params or {}, per_head)],
        pos=(POS.get(pos), {}),
        memory=[(MEMORY.get(memory), {})] * layers,
        exit=(EXIT.get("none"), {}),
        causal=causal,
        streams=streams,
    )


def listed(msg: str, slot: str) -> list[str]:
    """The names in the first ``<slot> in [a, b, ...]`` of a refusal."""
    start = msg.index(f"{slot} in [") + len(f"{slot} in [")
    return msg[start : msg.index("]", start)].split(", ")


def test_every_real_pos_combines_with_vanilla():
    for name, cls in POS.items():
        if cls.__module__.startswith("xfam."):
            for causal in (True, False):
                assert compat.check(selection(pos=name, causal=causal)) == [], name


def test_mechanism_without_bias_refuses_a_bias_pos_and_lists_what_works():
    (msg,) = compat.check(selection("toy_causal_only", "alibi"))
    assert "attention=toy_causal_only cannot add a score bias, which pos=alibi is" in msg
    pos_ok = listed(msg, "pos")
    assert {"none", "rope", "sinusoidal", "learned"} <= set(pos_ok)
    assert "alibi" not in pos_ok and "toy_bias" not in pos_ok
    att_ok = listed(msg.split(" or ", 1)[1], "attention")  # attentions that would take pos=alibi
    assert "vanilla" in att_ok and "toy_causal_only" not in att_ok and "toy_linear" not in att_ok


def test_causal_only_mechanism_refuses_a_bidirectional_model():
    (msg,) = compat.check(selection("toy_causal_only", "rope", causal=False))
    assert "toy_causal_only is causal-only" in msg and "bidirectional" in msg
    alternatives = listed(msg, "attention")
    assert "vanilla" in alternatives and "toy_causal_only" not in alternatives and "toy_linear" not in alternatives
    assert compat.check(selection("toy_causal_only", "rope", causal=True)) == []


def test_all_problems_are_reported_together():
    problems = compat.check(selection("toy_linear", "alibi", causal=False))
    assert len(problems) == 2
    assert any("causal-only" in p for p in problems) and any("score bias" in p for p in problems)


def test_sdpa_cannot_host_a_modifier_and_the_message_names_the_fix():
    (msg,) = compat.check(selection("vanilla", "toy_modifier", attention_params={"backend": "sdpa"}))
    assert "pos=toy_modifier" in msg and "sdpa" in msg
    assert "attention.backend=auto" in msg and "attention.backend=torch" in msg
    for backend in ("auto", "torch"):
        assert compat.check(selection("vanilla", "toy_modifier", attention_params={"backend": backend})) == []
    assert compat.check(selection("vanilla", "alibi", attention_params={"backend": "sdpa"})) == []


def test_modifier_needs_explicit_scores():
    (msg,) = compat.check(selection("toy_causal_only", "toy_modifier"))
    assert "never forms the full score matrix" in msg and "pos=toy_modifier" in msg
    assert "vanilla" in listed(msg.split(" or ", 1)[1], "attention")


def test_modifier_refuses_a_per_head_schedule():
    (msg,) = compat.check(selection("vanilla", "toy_modifier", per_head=True))
    assert "per_head" in msg and "pos=toy_modifier" in msg
    assert "toy_modifier" not in listed(msg, "pos") and "alibi" in listed(msg, "pos")
    assert compat.check(selection("vanilla", "alibi", per_head=True)) == []


def test_memory_refuses_absolute_positions():
    for pos in ("learned", "sinusoidal"):
        (msg,) = compat.check(selection(pos=pos, memory="toy_memory", streams=True))
        assert "memory=toy_memory needs relative positions" in msg and f"pos={pos} is absolute" in msg
        assert "memory=none" in msg
    for pos in ("none", "rope", "alibi", "toy_bias"):
        assert compat.check(selection(pos=pos, memory="toy_memory", streams=True)) == [], pos


def test_memory_refuses_batches_that_are_not_streams():
    (msg,) = compat.check(selection(pos="rope", memory="toy_memory", streams=False))
    assert "memory=toy_memory needs contiguous streams" in msg and "loader.streams=auto (or true)" in msg
    # one message per memory component, not one per layer
    assert len(compat.check(selection(pos="learned", memory="toy_memory", layers=4))) == 2


def test_matrix():
    m = compat.matrix()
    assert m[("vanilla", "alibi")] is None and m[("vanilla", "toy_modifier")] is None
    assert "score bias" in m[("toy_causal_only", "alibi")]
    assert m[("toy_causal_only", "rope")] is None


def test_score_modifiers_declare_their_hosts_and_the_others_refuse_with_the_reason():
    """Shaw, Transformer-XL and DA change the dense score matrix: each names the mechanisms that can host it."""
    for pos in ("shaw", "xl", "da"):
        cls = POS.get(pos)
        assert cls.kind == "modifier" and cls.hosts == frozenset({"vanilla"}) and cls.hosts_why
        assert compat.check(selection("vanilla", pos)) == []
        for att in ("local", "lsh", "performer", "linformer"):
            (msg,) = compat.check(selection(att, pos, causal=att != "linformer"))
            assert f"pos={pos} runs only inside attention in ['vanilla']" in msg and cls.hosts_why in msg
            assert "rope" in listed(msg, "pos") and listed(msg.split(" or ", 1)[1], "attention") == ["vanilla"]


def test_setting_refusals_of_pairs_the_capability_matrix_allows():
    """``xfam list`` marks these pairs yes*: performer and rfa take ALiBi, but T5 only with the exact kernel."""
    for att in ("performer", "rfa"):
        assert compat.matrix()[(att, "t5")] is None
        (msg,) = compat.setting_refusals(att, "t5")
        assert "pos=t5 is no such decay" in msg and "attention.features=exact" in msg
        assert compat.setting_refusals(att, "alibi") == [] and compat.setting_refusals(att, "rope") == []
    assert compat.setting_refusals("vanilla", "shaw") == []
