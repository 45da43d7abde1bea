"""``task`` and ``model.arch``: each shape is chosen from the task, and what cannot serve a task is refused
before launch with the reason and the fix."""

from __future__ import annotations

import pytest

from tests.integration.helpers import compose_cfg
from xfam.config import validate
from xfam.core.errors import ConfigError


def problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(overrides))
    return str(err.value)


@pytest.mark.parametrize(
    ("overrides", "task", "arch", "causal"),
    [
        ([], "lm", "decoder", True),
        (["data=listops"], "classify", "encoder", False),
        (["task=mlm"], "mlm", "encoder", False),
        (["data=pytokens"], "tag", "encoder", False),
        (["data=seq2seq_toy"], "seq2seq", "encoder_decoder", True),
        (["data=seq2seq_toy", "model.arch=decoder"], "seq2seq", "decoder", True),
        (["data=docstrings", "task=seq2seq"], "seq2seq", "encoder_decoder", True),
    ],
)
def test_the_shape_follows_the_task(overrides, task, arch, causal):
    rc = validate(compose_cfg(overrides))
    assert (rc.task, rc.arch, rc.causal) == (task, arch, causal)
    assert (rc.encoder is not None) == (arch == "encoder_decoder")


def test_the_encoder_takes_its_own_attention_and_depth():
    rc = validate(compose_cfg(["data=seq2seq_toy", "encoder.layers=3", "encoder.attention={name:longformer,window:8}"]))
    assert rc.encoder.spec.layers == 3 and rc.encoder.spec.causal is False
    assert [a["name"] for a in rc.encoder.attention] == ["longformer"] * 3
    assert [a["name"] for a in rc.attention] == ["vanilla"] * rc.spec.layers


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.arch=encoder_decoder"], ["maps a source to a target", "data=docstrings"]),
        (["task=mlm", "data=listops"], ["task=mlm masks tokens of a text stream", "data=text"]),
        (["task=seq2seq"], ["task comes from the data", "data=seq2seq_toy"]),
        (["data=seq2seq_toy", "model.arch=encoder"], ["would see it", "model.arch=auto"]),
        (["task=mlm", "model.arch=decoder"], ["sees only the left"]),
        (["encoder.layers=2"], ["configures the encoder of model.arch=encoder_decoder"]),
        (["data=seq2seq_toy", "cross_attention.name=local"], ["cannot attend over another sequence", "performer"]),
        (["data=seq2seq_toy", "cross_attention.name=rfa", "+cross_attention.gate=true"], ["recency gate"]),
        (["data=seq2seq_toy", "memory=memorizing"], ["no stream to carry", "memory=none"]),
        (["data=seq2seq_toy", "model.reversible=true"], ["not cross-attention"]),
        (["data=seq2seq_toy", "encoder.attention={name:nonsense}"], ["encoder: ", "nonsense"]),
        (["data=seq2seq_toy", "pos=learned", "model.max_len=16"], ["data.source_len=32", "model.max_len=16"]),
        (
            ["data=seq2seq_toy", "pos=learned", "model.max_len=48", "model.arch=decoder"],
            ["source_len + data.target_len"],
        ),
        (["data=listops", "exit=calm"], ["per generated token", "classify"]),
    ],
)
def test_what_cannot_serve_the_task_is_refused(overrides, words):
    text = problems(overrides)
    for w in words:
        assert w in text, text
