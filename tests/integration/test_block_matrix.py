"""Compatibility is a table, not a promise: the block option x slot matrix (``xfam.model.compat.block_matrix``,
shown by ``xfam list``) against what training does with each pair.

Every cell of the matrix is run through the path ``train.py`` takes: the composed config goes through
``xfam.validate`` (with nothing allowed to be built meanwhile), and then

* an allowed pair builds through ``xfam.build_model(run_config, data_info)`` at tiny size and trains one step:
  finite loss, a finite gradient on every trainable parameter, and (causal models) no causal leak;
* a refused pair is refused by validation, before anything is built, with the matrix's reasons among the
  problems and one of them naming the option's ``model.<field>``, the column and the fix.

Columns: every attention mechanism (causal LM where it can be causal, else a bidirectional classifier),
``memory`` (Transformer-XL recurrence, Dai et al., 2019, arXiv:1901.02860, over contiguous streams), each exit
policy (CALM, Schuster et al., 2022, arXiv:2207.07061; ACT, Graves, 2016, arXiv:1603.08983; Depth-Adaptive
Transformer, Elbayad et al., 2020, arXiv:1910.10073) and ``model.reversible`` (Kitaev et al., 2020,
arXiv:2001.04451). The option x positional encoding table (attention=vanilla) has no refusals: every pair
trains, and decoding with the cache equals the full pass. The score options are a ``ScoreModifier`` chained
after a positional one (``ChainedModifier``): talking heads (Shazeer et al., 2020, arXiv:2003.02436) with Shaw's
relative positions (Shaw et al., 2018, arXiv:1803.02155) and RealFormer's residual scores (He et al., 2020,
arXiv:2012.11747) with Transformer-XL's position terms are checked to apply both.
"""

from __future__ import annotations

import functools

import pytest
import torch
from doubles import xfam_components

import xfam
from tests.integration.block_matrix_helpers import (
    SLOT_COLUMNS,
    assert_causal,
    assert_decode_equals_recompute,
    batch,
    build,
    column_names,
    config,
    nothing_built,
    option_names,
    task_of,
    train_step,
    validate,
)
from xfam.attention import ATTENTION
from xfam.cli.listing import _fmt, listing
from xfam.config.run import RunConfig
from xfam.model import block_compat, compat
from xfam.pos import POS

OPTIONS = list(block_compat.OPTIONS)
MECHANISMS = xfam_components(ATTENTION)
ENCODINGS = xfam_components(POS)


@functools.cache
def matrix() -> dict[str, dict[str, list[str]]]:
    return compat.block_matrix()


def assert_refused(problems: object, option: str, column: str) -> None:
    """Validation refused the pair with the matrix's reasons, one of which names the option, the column and
    the fix. (A bidirectional-only mechanism's column may name the direction it forces instead.)"""
    assert not isinstance(problems, RunConfig), f"validation accepted a pair the matrix refuses: {matrix()[option]}"
    reasons = matrix()[option][column]
    assert set(reasons) <= set(problems), f"the matrix says {reasons}, validation says {problems}"
    column_words = column_names(column)
    if column in ATTENTION.names() and not ATTENTION.get(column).causal:
        column_words.append("bidirectional")
    named = [
        p
        for p in problems
        if any(n in p for n in option_names(option)) and any(c in p for c in column_words) and "Fix:" in p
    ]
    assert named, f"no refusal names {option_names(option)}, {column_words} and a fix: {problems}"


# -- option x attention mechanism --------------------------------------------------------------------------


@pytest.mark.parametrize("attention", MECHANISMS)
@pytest.mark.parametrize("option", OPTIONS)
def test_option_with_attention_trains_or_is_refused_before_building(option, attention):
    result = validate(config(option, attention))
    if matrix()[option][attention]:
        assert_refused(result, option, attention)
        return
    assert isinstance(result, RunConfig), f"the matrix allows {option} with attention={attention}: {result}"
    model = train_step(result)
    if task_of(attention) == "lm":
        assert_causal(model)


# -- option x memory, exit policies, reversible ------------------------------------------------------------

SLOT_CASES = [pytest.param(option, column, id=f"{option}-{column}") for option in OPTIONS for column in SLOT_COLUMNS]


@pytest.mark.parametrize(("option", "column"), SLOT_CASES)
def test_option_with_slot_trains_or_is_refused_before_building(option, column):
    result = validate(config(option, column))
    if matrix()[option][column]:
        assert_refused(result, option, column)
        return
    assert isinstance(result, RunConfig), f"the matrix allows {option} with {column}: {result}"
    model = train_step(result)
    model.eval()
    tokens, _, _ = batch("lm")
    with torch.no_grad():
        if column == "memory":  # the second segment reads the first through the memory
            for p in model.parameters():  # (away from the init: ReZero's alpha = 0 hides every branch)
                p.add_(0.05 * torch.randn_like(p))
            state = model(tokens, memory=model.init_memory(2, tokens.device)).memory
            later, _, _ = batch("lm", seed=2)
            assert not torch.allclose(model(later, memory=state).logits, model(later).logits, atol=1e-5)
        else:  # the inference path (an exit policy's own decisions; the reversible stack without a graph)
            assert torch.isfinite(model(tokens).logits).all()
            assert_causal(model)


def test_validation_is_watched_for_building():
    """The guard the refusal tests validate under does catch a build."""
    run = validate(config(None))
    assert isinstance(run, RunConfig)
    with nothing_built(), pytest.raises(AssertionError, match="built"):
        xfam.build_model(run, {"task": "lm", "vocab_size": 13})


def test_the_matrix_has_every_option_and_column():
    table = matrix()
    assert list(table) == OPTIONS
    for cells in table.values():
        assert set(MECHANISMS) | set(SLOT_COLUMNS) <= set(cells)


# -- option x positional encoding (attention=vanilla) ------------------------------------------------------


#: unmarked: the score modifiers (which share the score path with the score options), a bias and an input encoding;
#: the others (rope is also the attention matrix's default) are @slow
FAST_POS = {"shaw", "xl", "da", "alibi", "learned"}


def _pos_marks(option: str, pos: str) -> list:
    return [] if pos in FAST_POS else [pytest.mark.slow]


POS_CASES = [pytest.param(o, p, id=f"{o}-pos={p}", marks=_pos_marks(o, p)) for o in OPTIONS for p in ENCODINGS]


@pytest.mark.parametrize(("option", "pos"), POS_CASES)
def test_option_with_pos_trains_and_decodes_like_the_full_pass(option, pos):
    """Every block option takes every positional encoding under vanilla attention (the score options chain
    after the score modifiers shaw, xl and da); decoding with the cache equals recomputing the prefix."""
    result = validate(config(option, "vanilla", pos=pos))
    assert isinstance(result, RunConfig), result
    model = train_step(result)
    assert_decode_equals_recompute(model)


def _same_weights_logits(plain: RunConfig, optioned: RunConfig) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Logits of ``plain``'s model and of ``optioned``'s loaded with the same weights (its own extra
    parameters at their init), and the optioned model."""
    a, b = build(plain).eval(), build(optioned, seed=5).eval()
    missing, unexpected = b.load_state_dict(a.state_dict(), strict=False)
    assert not unexpected
    tokens, _, _ = batch("lm")
    with torch.no_grad():
        return a(tokens).logits, b(tokens).logits, b


def test_talking_heads_chain_after_shaw():
    """Talking heads start as the identity mix, so with the plain model's weights the model equals plain
    pos=shaw: Shaw's terms still apply inside the chain. Mixed heads change it, and decoding still agrees."""
    plain, talking = validate(config(None, pos="shaw")), validate(config("attn_talking_heads", pos="shaw"))
    base, same, model = _same_weights_logits(plain, talking)
    assert torch.allclose(base, same, atol=1e-6)
    with torch.no_grad():
        for block in model.blocks:
            mix = block.attn.score_options
            mix.pre_mix.copy_(torch.eye(4) + 0.3 * torch.randn(4, 4))
            mix.post_mix.copy_(torch.eye(4) + 0.3 * torch.randn(4, 4))
        mixed = model(batch("lm")[0]).logits
    assert not torch.allclose(base, mixed, atol=1e-4)
    assert_decode_equals_recompute(model)
    assert_decode_equals_recompute(model, prompt=3, step=4)


def test_residual_attention_chains_after_transformer_xl_positions():
    """RealFormer's first layer has no earlier scores: a one-layer model equals plain pos=xl with the same
    weights (XL's position terms apply inside the chain); with two layers the carried scores change it."""
    one = {}
    for option in (None, "residual_attn"):
        cfg = config(option, pos="xl")
        cfg["model"]["layers"] = 1
        one[option] = validate(cfg)
    base, same, _ = _same_weights_logits(one[None], one["residual_attn"])
    assert torch.allclose(base, same, atol=1e-6)
    base, carried, model = _same_weights_logits(
        validate(config(None, pos="xl")), validate(config("residual_attn", pos="xl"))
    )
    assert not torch.allclose(base, carried, atol=1e-4)
    assert_decode_equals_recompute(model)
    assert_decode_equals_recompute(model, prompt=2, step=3)


# -- xfam list ---------------------------------------------------------------------------------------------


def test_xfam_list_shows_every_option_and_its_refusals():
    lines = listing().splitlines()
    start = lines.index("== block options (model.*; docs/blocks.md) ==")
    section = lines[start + 1 : lines.index("", start)]
    for option, spec in block_compat.OPTIONS.items():
        override = " ".join(f"model.{k}={_fmt(v)}" for k, v in spec.override.items())
        (row,) = [i for i, line in enumerate(section) if line.split()[: len(spec.override)] == override.split()]
        assert spec.what in section[row] and spec.paper in section[row]
        refused = {column for column, why in matrix()[option].items() if why}
        follow = section[row + 1] if row + 1 < len(section) else ""
        if not refused:
            assert not follow.strip().startswith("refused with:"), f"{option} is listed with refusals: {follow}"
            continue
        assert follow.strip().startswith("refused with:"), f"{option}'s refusals are not listed"
        listed = set()
        for part in follow.split("refused with:", 1)[1].strip().split("; "):
            if part.startswith("attention in ["):
                listed |= set(part[len("attention in [") : -1].split(", "))
            else:
                listed.add(part)
        assert listed == refused, option
