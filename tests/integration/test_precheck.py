"""The pre-launch check of train.py's command lines: overrides Hydra cannot parse, a user's own config
folder (``--config-dir``), and sweeps whose jobs differ in which keys exist."""

from __future__ import annotations

import csv
import json
import re
import shlex
from pathlib import Path

import pytest

from tests.integration.helpers import TINY, compose_cfg, run_cli, text_data
from xfam.core.errors import ConfigError
from xfam.core.schedule import per_layer
from xfam.training.precheck import config_groups, precheck
from xfam.training.run_names import CONFIG_DIR

CLEAN_EXIT = 2  # every configuration or input problem

#: The per-layer override as the README writes it in YAML (quoted key): Hydra's grammar cannot read it.
PER_LAYER_AS_YAML = 'attention.per_layer={"-1": {dropout: 0.1}}'


def refusal(args: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        precheck(args)
    return str(err.value)


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("pos=[", "no viable alternative at input '['"),
        ("foo", "missing EQUAL at '<EOF>'"),
        ("model.dim=[", "no viable alternative at input '['"),
        ("b]", "LexerNoViableAltException"),  # the end of an unquoted 'data.paths=[a, b]'
    ],
)
def test_an_override_hydra_cannot_parse_is_named_with_hydras_reason_and_the_grammar(override: str, why: str) -> None:
    msg = refusal(["model.layers=2", override])
    assert msg.startswith(f"override {override!r}: Hydra cannot parse it (") and why in msg, msg
    assert "See https://" not in msg and "\n" not in msg  # one line: Hydra's reason, not its link
    for grammar in ("key=value", "group=option", "+key=value", "~key", "'data.paths=[a, b]'"):
        assert grammar in msg, grammar


def test_every_unparsable_override_is_listed_at_once() -> None:
    msg = refusal(["data.paths=[a,", "b]", "pos=alibi"])
    assert "2 configuration problems" in msg and "'data.paths=[a,'" in msg and "'b]'" in msg


def test_a_per_layer_override_with_a_quoted_key_shows_the_spelling_hydra_reads() -> None:
    msg = refusal([PER_LAYER_AS_YAML])
    assert "Hydra reads dict keys without quotes" in msg, msg
    (spelling,) = re.findall(r"write ('[^']*')", msg)
    assert spelling == "'+attention.per_layer={-1: {dropout: 0.1}}'"
    (override,) = shlex.split(spelling)  # as the shell passes it
    precheck([override])  # accepted as shown
    cfg = compose_cfg(["model.layers=3", override])
    assert [layer["dropout"] for layer in per_layer(cfg["attention"], 3, "attention")] == [0.0, 0.0, 0.1]


@pytest.mark.slow  # real processes; the same paths run in process above
def test_the_shown_per_layer_spelling_trains(corpus: Path, tmp_path: Path) -> None:
    override = "+attention.per_layer={-1: {dropout: 0.1}}"
    res = run_cli(["train.py", "name=pl", *TINY, *text_data(corpus), override], env={"XFAM_RUNS": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = [p.parent for p in (tmp_path / "pl").glob("*/metrics.json")]
    assert "per_layer" in (run / "config.yaml").read_text()


@pytest.mark.slow  # real processes; the same paths run in process above
def test_unparsable_overrides_exit_2_without_a_traceback(tmp_path: Path) -> None:
    for args in (["pos=["], ["foo"], [PER_LAYER_AS_YAML]):
        res = run_cli(["train.py", *args], env={"XFAM_RUNS": str(tmp_path)})
        assert res.returncode == CLEAN_EXIT, res.stderr[-3000:]
        assert res.stderr.startswith(f"xfam: error: override {args[0]!r}") and "Traceback" not in res.stderr
    assert not any(tmp_path.iterdir())  # nothing written


# -- a user's config folder next to the repository's (--config-dir) ------------------------------------------


@pytest.fixture
def my_configs(tmp_path: Path) -> Path:
    root = tmp_path / "my_configs"
    (root / "experiment").mkdir(parents=True)
    (root / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /pos: alibi\n\nname: mine\nmodel:\n  dim: 64\n"
    )
    return root


@pytest.mark.parametrize("form", ["--config-dir DIR E", "-cd DIR E", "--config-dir=DIR E", "E model.layers=2 -cd DIR"])
def test_an_experiment_of_a_users_config_folder_is_checked_with_it(my_configs: Path, form: str) -> None:
    args = form.replace("DIR", str(my_configs)).replace("E", "experiment=mine").split()
    precheck(args)
    msg = refusal(["model.heads=3", *args] if args[0] == "experiment=mine" else [*args, "model.heads=3"])
    assert msg.startswith("model.heads=3 does not divide model.dim=64"), msg  # the user's experiment is composed
    assert "mine" in config_groups([CONFIG_DIR, my_configs])["experiment"]
    assert "mine" not in config_groups()["experiment"]


def test_a_users_config_folder_reports_its_own_mistakes(my_configs: Path) -> None:
    exp = my_configs / "experiment"
    (exp / "tabs.yaml").write_text("# @package _global_\nmodel:\n  dim: 64\n\theads: 2\n")
    (exp / "broken.yaml").write_text("# @package _global_\nmodel: {dim: 64\n")
    (exp / "badkey.yaml").write_text("# @package _global_\nmodel:\n  widht: 3\n")
    (exp / "nopackage.yaml").write_text("model:\n  dim: 64\n")
    cd = ["--config-dir", str(my_configs)]
    msg = refusal([*cd, "experiment=tabs"])
    assert msg.startswith(f"{exp / 'tabs.yaml'}, line 4: not valid YAML") and "replace the tabs" in msg, msg
    msg = refusal([*cd, "experiment=broken"])
    assert msg.startswith(f"{exp / 'broken.yaml'}, line 3: not valid YAML") and "expected ',' or '}'" in msg, msg
    assert refusal([*cd, "experiment=badkey"]).startswith("model: unknown key 'widht'.")
    assert "lacks the line '# @package _global_'" in refusal([*cd, "experiment=nopackage"])
    msg = refusal([*cd, "experiment=mien"])
    assert "experiment: unknown value 'mien'. Did you mean 'mine'?" in msg and "listops" in msg
    assert refusal(["experiment=mine"]).startswith("experiment: unknown value 'mine'")  # without the folder
    msg = refusal(["--config-dir", str(my_configs / "nope"), "experiment=mine"])
    assert msg.startswith(f"--config-dir {my_configs / 'nope'}: no such folder"), msg
    (my_configs / "model").mkdir()
    (my_configs / "model" / "small.yaml").write_text("name: small\ndim: 48\n")  # the repository's small wins
    msg = refusal([*cd, "experiment=mine"])
    assert msg.startswith(f"{my_configs / 'model' / 'small.yaml'}: configs of this name are read from"), msg


def test_hydras_other_flags_are_read_as_hydra_reads_them() -> None:
    precheck(["--config-name", "train", "-m", "pos=rope,alibi"])
    precheck(["-cn", "train", "--config-path", "configs", "pos=alibi"])
    precheck(["-cp", str(CONFIG_DIR), "--multirun", "pos=alibi"])
    assert refusal(["--config-name", "nope"]).startswith("Cannot find primary config 'nope'")
    assert refusal(["--config-path", "nope"]).startswith("--config-path nope: no such folder")
    assert refusal(["--cfg"]).startswith("argument --cfg/-c: expected one argument. Fix:")
    msg = refusal(["pos=alibi", "-m", "model.layers=2"])  # Hydra (argparse) reads one run of overrides
    assert msg.startswith("unrecognized arguments: model.layers=2") and "not between" in msg


@pytest.mark.slow  # real processes; the same paths run in process above
def test_a_users_experiment_trains_with_the_two_word_flag(my_configs: Path, corpus: Path, tmp_path: Path) -> None:
    args = ["-cd", str(my_configs), "experiment=mine", *[a for a in TINY if not a.startswith("model.dim")]]
    res = run_cli(["train.py", *args, *text_data(corpus)], env={"XFAM_RUNS": str(tmp_path / "runs")})
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = [p.parent for p in (tmp_path / "runs" / "mine").glob("*/metrics.json")]
    config = (run / "config.yaml").read_text()
    assert "dim: 64" in config and "name: alibi" in config


# -- a key that only some jobs of a sweep have --------------------------------------------------------------


def test_a_key_only_some_jobs_have_makes_only_those_jobs_invalid(capsys: pytest.CaptureFixture[str]) -> None:
    precheck(["-m", "pos=rope,alibi", "pos.rotary_dim=8"])
    err = capsys.readouterr().err
    assert "1 of 2 jobs of this sweep cannot run and will be recorded as skipped" in err
    assert "[pos=alibi pos.rotary_dim=8] pos: unknown key 'rotary_dim'. Valid keys: num_heads." in err
    msg = refusal(["-m", "pos=alibi,sinusoidal", "pos.rotary_dim=8"])  # no job has it: refused
    assert "pos: unknown key 'rotary_dim'" in msg
    msg = refusal(["-m", "pos=rope,alibi", "pos.rotery_dim=8"])  # a typo: refused, per job's valid keys
    # (the near keys: rotary_dim, and rotary_heads)
    assert "[pos=rope pos.rotery_dim=8] pos: unknown key 'rotery_dim'. Did you mean 'rotary_dim'" in msg
    msg = refusal(["-m", "model.heads=2,4", "model.widht=3"])  # the same problem in every job: once
    assert msg.startswith("model: unknown key 'widht'") and "[model.heads" not in msg


def test_a_sweep_records_a_job_whose_component_lacks_a_key_as_skipped(corpus: Path, tmp_path: Path) -> None:
    args = ["-m", "name=keys", "pos=rope,alibi", "pos.rotary_dim=8", *TINY, *text_data(corpus)]
    res = run_cli(["train.py", *args], env={"XFAM_RUNS": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1 of 2 jobs of this sweep cannot run and will be recorded as skipped" in res.stderr
    sweep = tmp_path / "keys" / "multirun"
    with open(sweep / "summary.csv") as f:
        rows = {r["status"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["ok", "skipped"]
    assert "pos=rope" in rows["ok"]["overrides"] and float(rows["ok"]["test/loss"]) > 0
    skipped = rows["skipped"]
    assert skipped["reason"].startswith("pos: unknown key 'rotary_dim'. Valid keys: num_heads. Fix:")
    assert skipped["overrides"].split()[:3] == ["name=keys", "pos=alibi", "pos.rotary_dim=8"]  # as typed
    assert "++" not in skipped["run"] and not (sweep / skipped["run"] / "config.yaml").exists()
    status = json.loads((sweep / skipped["run"] / "status.json").read_text())
    assert status["status"] == "skipped" and "pos.rotary_dim=8" in status["overrides"]
    table = (sweep / "summary.md").read_text()
    assert "| pos=alibi | skipped |" in table and "| pos=rope | ok |" in table


def test_the_readmes_own_experiment_example_is_valid(tmp_path: Path) -> None:
    text = (CONFIG_DIR.parent / "docs" / "configs.md").read_text()
    section = text[text.index("**Your own configs**") :]
    yaml_text = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    command = shlex.split(re.search(r"```bash\n(.*?)\n```", section, re.S).group(1))
    assert command[:4] == ["python", "train.py", "--config-dir", "my_configs"]
    (tmp_path / "my_configs" / "experiment").mkdir(parents=True)
    (tmp_path / "my_configs" / "experiment" / "mine.yaml").write_text(yaml_text)
    precheck(["--config-dir", str(tmp_path / "my_configs"), *command[4:]])
