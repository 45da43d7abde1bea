"""Third-party components: entry points (``xfam.components``) and ``+plugins=[module]``, their generated Hydra
options, and the errors of a plugin that fails."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from xfam.attention import ATTENTION
from xfam.core import plugins
from xfam.core.errors import ConfigError
from xfam.core.registry import defaults_of
from xfam.pos import POS

#: A positional encoding as a third party writes it (only ``xfam.api``); ``{name}`` is filled per test.
PLUGIN = '''
from typing import Annotated
import torch
from torch import Tensor, nn
from xfam.api import POS, PositionalEncoding, Range, ScoreBias


class Bias(ScoreBias):
    def __init__(self, heads: int, clip: int):
        super().__init__()
        self.clip = clip
        self.table = nn.Parameter(torch.zeros(heads, clip + 1))

    def pairs(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.table[:, (q_pos - k_pos).abs().clamp(max=self.clip)]


@POS.register("{name}")
class Clipped(PositionalEncoding):
    """A learned bias of the clipped distance (a test plugin)."""

    kind = "bias"
    relative = True
    paper = "test"

    def __init__(self, *, heads: int, clip: Annotated[int, Range(ge=1)] = 7, scale: tuple[float, float] = (1.0, 2.0)):
        super().__init__()
        self.bias = Bias(heads, clip)

    def score_bias(self) -> ScoreBias:
        return self.bias
'''


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A folder for plugin modules (the current directory); registrations and imports undone afterwards."""
    monkeypatch.chdir(tmp_path)
    before = {reg: dict(reg._classes) for reg in (POS, ATTENTION)}
    modules = set(sys.modules)
    path = list(sys.path)
    plugins.load_entry_points.cache_clear()
    yield tmp_path
    for reg, classes in before.items():
        reg._classes.clear()
        reg._classes.update(classes)
    for name in set(sys.modules) - modules:  # the plugin modules (not what they imported, e.g. datasets)
        if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(tmp_path)):
            del sys.modules[name]
    sys.path[:] = path
    plugins.load_entry_points.cache_clear()


def write(folder: Path, module: str, name: str, text: str = PLUGIN) -> None:
    (folder / f"{module}.py").write_text(textwrap.dedent(text.replace("{name}", name)))


class FakeDist:
    name = "acme-xfam"


def entry_points(monkeypatch: pytest.MonkeyPatch, *specs: tuple[str, str]) -> None:
    """Make ``specs`` ((name, module)) the installed ``xfam.components`` entry points of distribution acme-xfam."""
    eps = []
    for name, value in specs:
        ep = importlib.metadata.EntryPoint(name=name, value=value, group=plugins.GROUP)
        eps.append(ep._for(FakeDist()) if hasattr(ep, "_for") else ep)
    monkeypatch.setattr(plugins, "_entry_points", lambda: eps)


def test_an_entry_point_registers_its_components(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(workspace, "acme_pos", "acme_clip")
    sys.path.insert(0, str(workspace))
    entry_points(monkeypatch, ("acme", "acme_pos"))
    assert plugins.load_entry_points() == ("acme_pos",)
    assert "acme_clip" in POS and POS.get("acme_clip").__module__ == "acme_pos"
    assert plugins.origin(POS.get("acme_clip")) == "acme_pos"  # (not installed: its module names it)
    assert plugins.origin(POS.get("rope")) is None


def test_a_plugin_that_fails_to_import_is_one_error_naming_it(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(workspace, "broken_pos", "x", "import not_a_module_anywhere\n")
    sys.path.insert(0, str(workspace))
    entry_points(monkeypatch, ("broken", "broken_pos"))
    with pytest.raises(ConfigError) as err:
        plugins.load_entry_points()
    text = str(err.value)
    assert "acme-xfam" in text and "xfam.components: broken = broken_pos" in text
    assert "not_a_module_anywhere" in text and "Fix:" in text and "pip uninstall acme-xfam" in text
    with pytest.raises(ConfigError):  # reported again, not cached as loaded
        plugins.load_entry_points()


def test_a_plugin_reusing_a_name_is_refused_naming_both(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(workspace, "clash_pos", "rope")
    sys.path.insert(0, str(workspace))
    entry_points(monkeypatch, ("clash", "clash_pos"))
    with pytest.raises(ConfigError) as err:
        plugins.load_entry_points()
    text = str(err.value)
    assert "registers pos 'rope', which xfam.pos.rope already registered" in text and "another name" in text
    assert POS.get("rope").__module__ == "xfam.pos.rope"  # xfam's own stays


def test_plugins_modules_are_imported_from_the_current_directory(workspace: Path) -> None:
    write(workspace, "my_clip", "my_clip")
    plugins.load(["my_clip"])
    assert "my_clip" in POS


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (["no_such_plugin_module"], "module 'no_such_plugin_module': no module named 'no_such_plugin_module'"),
        ("my_clip", "must be a list of module paths"),
        ([3], "must be a list of module paths"),
    ],
)
def test_bad_plugins_values_are_one_clear_error(workspace: Path, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        plugins.load(value)
    assert expected in str(err.value) and "Fix:" in str(err.value)


def test_generated_option_equals_the_signature_defaults(workspace: Path) -> None:
    from xfam.training.plugin_options import option_dir, plugin_modules

    write(workspace, "gen_clip", "gen_clip")
    assert plugin_modules(["pos=rope", "+plugins=[gen_clip]", "++plugins=[gen_clip,other.mod]"]) == [
        "gen_clip",
        "other.mod",
    ]
    plugins.load(["gen_clip"])
    folder = option_dir()
    assert folder is not None and not (folder / "pos" / "rope.yaml").exists()  # xfam's own have their YAML
    option = yaml.safe_load((folder / "pos" / "gen_clip.yaml").read_text())
    assert option == {"name": "gen_clip", "clip": 7, "scale": [1.0, 2.0]}
    assert option_dir() == folder  # content-addressed: the same folder for the same components
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in defaults_of(POS.get("gen_clip")).items()} == {
        k: v for k, v in option.items() if k != "name"
    }


def test_the_pre_launch_check_knows_plugin_options(workspace: Path) -> None:
    from xfam.training.precheck import precheck

    write(workspace, "pre_clip", "pre_clip")
    precheck(["+plugins=[pre_clip]", "pos=pre_clip", "pos.clip=3"])
    precheck(["-m", "+plugins=[pre_clip]", "pos=rope,pre_clip"])  # a sweep over xfam's and the plugin's
    with pytest.raises(ConfigError) as err:
        precheck(["+plugins=[pre_clip]", "pos=pre_clp"])
    assert "Did you mean 'pre_clip'?" in str(err.value)
    with pytest.raises(ConfigError) as err:
        precheck(["+plugins=[pre_clip]", "pos=pre_clip", "pos.clp=3"])
    assert "unknown key 'clp'. Did you mean 'clip'" in str(err.value)


def test_validate_and_build_model_load_a_configs_plugins(workspace: Path) -> None:
    """A checkpoint's config names its plugins: building the model from it imports them first."""
    from tests.integration.helpers import compose_cfg
    from xfam.model.build import build_model

    write(workspace, "ckpt_clip", "ckpt_clip")
    cfg = compose_cfg(["model.dim=32", "model.layers=1", "model.heads=2"])
    cfg["plugins"] = ["ckpt_clip"]
    cfg["pos"] = {"name": "ckpt_clip", "clip": 3, "scale": [1.0, 2.0]}
    assert "ckpt_clip" not in POS
    model = build_model(cfg, {"vocab_size": 257, "task": "lm", "pad_id": None})
    assert "ckpt_clip" in POS and any("table" in n for n, _ in model.named_parameters())


def test_xfam_list_marks_plugin_components(workspace: Path, capsys: pytest.CaptureFixture) -> None:
    from xfam.cli.main import main

    write(workspace, "list_clip", "list_clip")
    main(["list", "plugins=[list_clip]"])
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("list_clip")]
    assert "[plugin: list_clip]" in line
