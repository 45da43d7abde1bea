"""Every data source has configs/data/<name>.yaml equal to its constructor defaults, and they validate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from xfam.core.registry import defaults_of
from xfam.data import DATA

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"


def test_every_source_has_a_yaml_and_every_yaml_a_source():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == DATA.names()


@pytest.mark.parametrize("name", DATA.names())
def test_yaml_equals_signature_defaults(name):
    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert cfg == {"name": name, **defaults_of(DATA.get(name))}
    assert list(cfg) == ["name", *defaults_of(DATA.get(name))]  # same order as the signature


@pytest.mark.parametrize("name", DATA.names())
def test_defaults_validate_and_build_without_preparing(name):
    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert DATA.check(cfg, {}) == []
    src = DATA.build(cfg)
    pairs = max(cfg["source_len"], cfg["target_len"]) if "source_len" in cfg else None  # (images: no length)
    seq_len = cfg.get("seq_len", cfg.get("context", pairs))  # (data=gym: K timesteps per window)
    assert src.seq_len == seq_len and src.batch_size == cfg["batch_size"]
    with pytest.raises(RuntimeError, match="prepare"):
        src.split("train")
