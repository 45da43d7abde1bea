"""Optimiser groups and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch
from doubles import build_model

from xfam.config.specs import OptimSpec
from xfam.training.lit.optim import lr_factor, make_optimizer, param_groups


def test_only_weight_matrices_decay() -> None:
    model = build_model(pos="learned", bias=True, tie_embeddings=True)
    decay, no_decay = param_groups(model, OptimSpec())
    decay_ids = {id(p) for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert id(model.blocks[0].attn.qkv.weight) in decay_ids
    for p in (model.embed.weight, model.pos.table.weight, model.blocks[0].norm1.weight, model.blocks[0].attn.qkv.bias):
        assert id(p) not in decay_ids
    n_params = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_params  # tied weights counted once
    with_emb = param_groups(model, OptimSpec(decay_embeddings=True))[0]
    assert id(model.embed.weight) in {id(p) for p in with_emb["params"]}


def test_tables_bias_vectors_and_memory_vectors_never_decay() -> None:
    """The rule is the kind of parameter, not its number of dimensions: T5's and Shaw's position tables, XL's u
    and v, DA's per-head scalars and persistent memory vectors are 2-D or more and were decayed; XL's W_R and the
    other components' declared matrices (``decay_params``) are weights and decay."""
    spec = OptimSpec()
    for pos, kept, decayed in (
        ("t5", ["pos.bias.table"], []),
        ("shaw", ["pos.keys", "pos.values"], []),
        ("xl", ["pos.u", "pos.v"], ["pos.w_r"]),
        ("da", ["pos.alpha", "pos.beta"], []),
    ):
        model = build_model(pos=pos, num_mem_kv=2)
        names = {id(p): n for n, p in model.named_parameters()}
        decay = {names[id(p)] for p in param_groups(model, spec)[0]["params"]}
        assert not decay & {*kept, "blocks.0.attn.persistent_k", "blocks.0.attn.persistent_v"}, pos
        assert set(decayed) <= decay and "blocks.0.attn.qkv.weight" in decay, pos
    for cfg, task, matrix in (
        ({"name": "sinkhorn"}, "lm", "w_p"),
        ({"name": "rfa", "gate": True}, "lm", "gate_w"),
        ({"name": "linformer", "k": 16}, "classify", "proj_k.weight"),
    ):
        model = build_model(attention=cfg, max_len=128, task=task)
        attention, decayed_ids = cfg["name"], {id(q) for q in param_groups(model, spec)[0]["params"]}
        decay = {n for n, p in model.named_parameters() if id(p) in decayed_ids}
        assert any(n.endswith(matrix) for n in decay), attention
        assert not any(n.endswith(("b_p", "b_b", "gate_b")) for n in decay), attention


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_then_schedule(schedule: str) -> None:
    spec = OptimSpec(warmup_steps=10, schedule=schedule, min_lr_ratio=0.1)
    assert lr_factor(0, spec, 100) == pytest.approx(1 / 11)
    assert lr_factor(9, spec, 100) == pytest.approx(10 / 11)
    assert lr_factor(10, spec, 100) == pytest.approx(1.0)
    end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[schedule]
    assert lr_factor(100, spec, 100) == pytest.approx(end)
    assert lr_factor(500, spec, 100) == pytest.approx(end)  # past the end: the floor, not a new cycle
    if schedule == "cosine":
        assert lr_factor(55, spec, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_scheduler_steps_the_optimizer_lr() -> None:
    model = build_model()
    out = make_optimizer(model, OptimSpec(lr=1e-2, warmup_steps=4), total_steps=20)
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([1e-2 * (i + 1) / 5 for i in range(4)] + [1e-2])
    assert out["lr_scheduler"]["interval"] == "step"
    assert isinstance(opt, torch.optim.AdamW)
