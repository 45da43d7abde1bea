"""The documentation's examples work: the worked component of the tutorial runs, and the command the reference
shows for every component passes the pre-launch check (composed and validated as `python train.py` would)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from xfam.core.errors import ConfigError
from xfam.training.precheck import precheck

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import generate_docs  # noqa: E402
from docgen import components, examples  # noqa: E402

TUTORIAL = ROOT / "docs" / "tutorials" / "add-a-component.md"


def reference_commands() -> list[tuple[str, str, str]]:
    """``(slot, name, command)`` of every built-in component, as its reference section shows it."""
    with generate_docs.builtin_only():
        return [
            (slot, name, examples.example(slot, cls).command)
            for slot in components.PAGES
            for name, cls in components.builtin(slot)
        ]


def fake_datastore(path: Path) -> Path:
    """What a datastore's check reads (its manifest), for a command that needs one (`xfam knnlm build` stands in)."""
    from xfam.knnlm.datastore import FORMAT, VERSION

    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"format": FORMAT, "version": VERSION, "count": 4096, "dim": 8}))
    return path


def test_every_reference_command_passes_the_precheck(tmp_path: Path) -> None:
    commands = reference_commands()
    assert len(commands) >= 45
    refused = []
    for slot, name, command in commands:
        words = shlex.split(command)
        assert words[:2] == ["python", "train.py"] and f"{slot}={name}" in words, command
        store = next((w for w in words if w.startswith("memory.store=")), None)
        if store is not None:  # the datastore of the setup lines the page shows before it
            words[words.index(store)] = f"memory.store={fake_datastore(tmp_path / name)}"
        try:
            precheck(words[2:])
        except ConfigError as err:
            refused.append(f"{command}: {err}")
    assert not refused, "\n".join(refused)


def test_a_refused_command_would_be_caught() -> None:
    """The check above can fail: a causal LM with an attention that cannot be causal is refused."""
    with pytest.raises(ConfigError, match="cannot be causal"):
        precheck(["attention=blockwise"])


def test_the_tutorials_component_runs() -> None:
    text = TUTORIAL.read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if '@POS.register("clipped")' in c)
    xfam_imports = re.findall(r"^(?:from|import) (xfam\S*)", code, re.M)
    assert xfam_imports == ["xfam.api"], f"the example imports only the public xfam.api: {xfam_imports}"
    namespace = {"__name__": "tutorial_example"}
    exec(compile(code, str(TUTORIAL), "exec"), namespace)  # registers pos=clipped
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
