"""The README stays true: its slot table is the registry's, and its worked example works."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import update_readme  # noqa: E402


def test_slot_table_matches_the_registries() -> None:
    text = update_readme.README.read_text()
    assert update_readme.render(text) == text, "README slot table is stale: run `python scripts/update_readme.py`"


def test_block_options_tables_match_the_rules() -> None:
    text = update_readme.BLOCKS_DOC.read_text()
    assert update_readme.render_blocks(text) == text, "docs/blocks.md is stale: run `python scripts/update_readme.py`"
    assert "<!-- block-table:start" in text


def test_adding_a_component_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Adding a component") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    xfam_imports = re.findall(r"^(?:from|import) (xfam\S*)", code, re.M)
    assert xfam_imports == ["xfam.api"], f"the example imports only the public xfam.api: {xfam_imports}"
    namespace = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)  # registers pos=clipped
    from xfam.api import POS

    try:
        from doubles import build_model, decode_logits

        model = build_model(pos={"name": "clipped", "clip": 3})
        with torch.no_grad():
            model.pos.bias.table.normal_()
        tokens = torch.randint(0, 13, (2, 10))
        full = model(tokens).logits
        assert torch.allclose(decode_logits(model, tokens, prompt=4, step=2), full, atol=1e-5)
        bias = model.pos.bias.pairs(torch.tensor([[9]]), torch.arange(10)[None])  # [H, 1, 10]
        assert torch.equal(bias[:, 0, :6], bias[:, 0, :1].expand(-1, 6))  # constant beyond the clip
    finally:
        POS._classes.pop("clipped")
