"""Default blocks with memory are unchanged by the block options: a pre- and a post-norm model with
Transformer-XL memory give, on a second segment that reads the first's memory, the logits that xfam gave
before the options existed (``tests/fixtures/block_reference/make_memory_reference.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "block_reference" / "memory_models.pt"


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_memory_models_give_the_stored_logits(norm_position: str) -> None:
    torch.manual_seed(0)
    spec = ModelSpec(dim=32, layers=2, heads=4, max_len=64, norm_position=norm_position)
    memory = {"name": "xl", "mem_len": 8}
    model = XfamModel(
        spec,
        task="lm",
        vocab_size=50,
        attention={"name": "vanilla"},
        pos={"name": "xl"},
        memory=memory,
        exit={"name": "none"},
    ).eval()
    x = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = model(x, memory=model.init_memory(2, torch.device("cpu")))
        second = model(x, memory=first.memory)
    torch.testing.assert_close(second.logits, torch.load(FIXTURE)[norm_position], rtol=0, atol=1e-6)
