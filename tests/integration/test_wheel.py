"""xfam as a user installs it: the wheel built from this checkout, installed into a fresh virtual environment, used
from a directory outside the repository, with the example plugin package (tests/plugin_example) installed beside
it through its ``xfam.components`` entry point.

The environment sees the dependencies already installed for the tests (a ``.pth`` file naming their
site-packages, as ``--system-site-packages`` does for a system interpreter's), so nothing is downloaded and the
test takes well under a minute; the checkout itself is on no path, so every command runs the installed copy, with
the configs the wheel ships.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

import xfam
from tests.integration.helpers import ROOT, TINY, text_data

PLUGIN = ROOT / "tests" / "plugin_example"


def _copy(src: Path, dst: Path) -> Path:
    """A clean copy to build from (the build leaves build/ and *.egg-info where it runs)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".pytest_cache"))
    return dst


def _pip(*args: str) -> None:
    res = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A venv holding the xfam wheel and the example plugin: its python, the wheel, a working directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "xfam", "kernels", "configs"):
        (shutil.copy if (ROOT / name).is_file() else _copy)(ROOT / name, src / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--quiet", "--wheel-dir", str(tmp / "dist"), str(src))
    (wheel,) = (tmp / "dist").glob("xfam-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    # The test environment's packages (torch, lightning, hydra, pytest ...), but not its editable xfam: a path
    # line in a .pth adds the folder without running the .pth files inside it (the editable install's finder).
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    Path(purelib, "_test_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    _pip("--python", str(python), "install", "--no-deps", "--quiet", str(wheel))
    plugin = _copy(PLUGIN, tmp / "plugin_example")
    _pip("--python", str(python), "install", "--no-deps", "--no-build-isolation", "--quiet", str(plugin))
    work = tmp / "work"
    work.mkdir()
    return {"python": python, "bin": venv / "bin", "wheel": wheel, "work": work, "plugin": plugin}


def run(env_: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``args`` run in the venv from the working directory, outside the repository, with nothing on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XFAM_DEBUG", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["XFAM_RUNS"] = str(env_["work"] / "runs")
    env["PATH"] = f"{env_['bin']}{os.pathsep}{env['PATH']}"
    return subprocess.run(list(args), cwd=env_["work"], env=env, capture_output=True, text=True, timeout=timeout)


def ok(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_the_wheel_ships_the_package_its_configs_and_kernels(installed: dict) -> None:
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for path in [*ROOT.glob("configs/**/*.yaml"), *ROOT.glob("kernels/*.py")]:
        top = "configs" if path.suffix == ".yaml" else "kernels"
        assert f"xfam/{top}/{path.relative_to(ROOT / top)}" in names, path
    for path in (ROOT / "xfam").rglob("*.py"):
        if path.parent.name not in ("configs", "kernels"):  # (their __init__ maps a checkout's folders)
            assert f"xfam/{path.relative_to(ROOT / 'xfam')}" in names, path
    assert "xfam/py.typed" in names
    assert not any(n.startswith(("tests/", "scripts/", "configs/", "kernels/")) for n in names)


def test_installed_xfam_trains_lists_evaluates_and_generates_from_anywhere(installed: dict, corpus: Path) -> None:
    where = ok(run(installed, str(installed["python"]), "-c", "import xfam; print(xfam.__file__)"))
    assert "site-packages" in where and str(ROOT) not in where
    assert ok(run(installed, "xfam", "--version")).strip() == f"xfam {xfam.__version__}"

    listed = ok(run(installed, "xfam", "list"))
    assert "performer" in listed and "[plugin: xfam-example-plugin]" in listed

    args = [*TINY, "trainer.max_steps=5", *text_data(corpus), "pos=clipped_bias", "pos.clip=4", "name=wheel"]
    out = ok(run(installed, "xfam", "train", *args))
    (ckpt,) = (installed["work"] / "runs" / "wheel").glob("*/checkpoints/last.ckpt")
    assert "finished at step 5" in out and str(ckpt.parent.parent) in out

    metrics = ok(run(installed, "xfam", "eval", f"ckpt={ckpt}", "limit=2"))
    assert "test/loss" in metrics
    text = ok(run(installed, "xfam", "generate", f"ckpt={ckpt}", "prompt=the ", "max_new_tokens=8", "temperature=0"))
    assert text.startswith("the ")


def test_hydra_help_of_the_installed_command_lists_every_group_and_the_plugin(installed: dict) -> None:
    out = ok(run(installed, "xfam", "train", "--help"))
    groups = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line and not line.startswith(" "))
    assert "performer" in groups["attention"] and "lra_listops" in groups["experiment"]
    assert "clipped_bias" in groups["pos"].split(", ")  # the plugin's generated option


def test_a_users_config_folder_works_with_the_installed_configs(installed: dict) -> None:
    """docs/extending.md's worked example: an experiment of one's own that overrides shipped groups."""
    mine = installed["work"] / "my_configs" / "experiment"
    mine.mkdir(parents=True)
    (mine / "small_performer.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /attention: performer\n  - override /pos: alibi\n"
        "  - override /model: small\nname: small_performer\ntrainer:\n  max_steps: 2000\n"
    )
    args = ["--config-dir", "my_configs", "experiment=small_performer", "attention.num_features=64"]
    out = ok(run(installed, "xfam", "train", "--cfg", "job", *args))
    cfg = yaml.safe_load(out)
    assert cfg["attention"]["name"] == "performer" and cfg["attention"]["num_features"] == 64
    assert cfg["pos"]["name"] == "alibi" and cfg["name"] == "small_performer" and cfg["trainer"]["max_steps"] == 2000
    shipped_small = yaml.safe_load((ROOT / "configs" / "model" / "small.yaml").read_text())
    assert cfg["model"]["dim"] == shipped_small["dim"]


def test_the_plugins_contract_tests_pass_against_the_installed_xfam(installed: dict) -> None:
    tests = installed["plugin"] / "tests"
    out = ok(run(installed, str(installed["python"]), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)))
    assert " passed" in out and "failed" not in out
