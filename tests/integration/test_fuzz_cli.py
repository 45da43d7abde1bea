"""Bad input through the real command line, one case per kind of the in-process fuzzer
(``test_fuzz_config``) plus the cases only a run can find (the data's vocabulary, a checkpoint's).

Each ``python train.py ...`` must exit 2 with one error that names the problem and the fix, show no
traceback (unless ``XFAM_DEBUG=1``), write no checkpoint, and leave an existing run's files
byte-identical: most commands point at that run's directory (``hydra.run.dir``, ``ckpt_path=auto``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.integration.helpers import TINY, run_cli, text_data

CLEAN_EXIT = 2  # every configuration or input problem

#: (id, overrides, texts the one error must contain, where it runs: in the existing run's directory
#: with ckpt_path=auto, or in a fresh directory)
CASES = [
    ("unknown-component", ["attention=perfomer"], ["attention: unknown value 'perfomer'", "Did you mean 'performer'"]),
    (
        "unknown-key",
        ["attention=local", "attention.window=16", "attention.windw=8"],
        ["attention: unknown key 'windw'", "Did you mean 'window'"],
    ),
    ("wrong-type", ["attention=local", "attention.window=abc"], ["attention.window='abc': must be an integer"]),
    ("zero-size", ["model.dim=0"], ["model.dim=0: must be > 0"]),
    ("heads-not-dividing", ["model.heads=3"], ["model.heads=3 does not divide model.dim=32"]),
    ("incompatible-slots", ["attention=performer", "pos=shaw"], ["pos=shaw runs only inside attention", "pos in ["]),
    ("window-too-long", ["attention=local", "attention.window=5000"], ["window=5000 is larger than model.max_len=64"]),
    (  # two problems: one error that lists both
        "missing-and-empty-data",
        ["data.paths=[/definitely/not/here,{empty}]"],
        ["2 configuration problems", "'/definitely/not/here' does not exist", "is an empty folder"],
    ),
    (  # found once the data is prepared: byte ids up to 256
        "vocab-smaller-than-data",
        ["model.vocab_size=100", "+fresh=true"],
        ["model.vocab_size=100 is smaller than the data's vocabulary (257 token ids)"],
    ),
    (  # a BPE's ids reach past the checkpoint's byte vocabulary (257)
        "checkpoint-of-other-data",
        ["data.tokenizer=bpe", "data.bpe_vocab_size=300"],
        ["was trained on other data", "outside the checkpoint's vocabulary", "vocab_size: 257 ->"],
    ),
    ("checkpoint-of-other-architecture", ["model.dim=48"], ["different architecture", "model.dim: 32 -> 48"]),
]


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def existing(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One trained tiny run (its directory, the environment) and an empty folder."""
    root = tmp_path_factory.mktemp("fuzz-cli")
    env = {"XFAM_RUNS": str(root / "runs"), "HF_DATASETS_CACHE": str(root / "hf")}
    run_dir = root / "runs" / "existing"
    base = [*TINY, *text_data(corpus)]
    res = run_cli(["train.py", *base, f"hydra.run.dir={run_dir}"], env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    (root / "empty").mkdir()
    return {"root": root, "run_dir": run_dir, "env": env, "base": base, "digest": digest(run_dir)}


def checkpoints(root: Path) -> set[Path]:
    return set(root.rglob("*.ckpt"))


#: Cases run only by ``make test-slow`` (each is a ~8 s subprocess; the in-process config fuzzer covers
#: their messages in ``make test``).
SLOW = {"unknown-key", "zero-size", "heads-not-dividing", "window-too-long", "vocab-smaller-than-data"}
PARAMS = [pytest.param(*c[1:], id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW else []) for c in CASES]


@pytest.mark.parametrize(("overrides", "texts"), PARAMS)
def test_bad_input_is_one_clear_error_and_changes_nothing(overrides: list[str], texts: list[str], existing: dict):
    root, run_dir = existing["root"], existing["run_dir"]
    ckpts = checkpoints(root)
    overrides = [o.format(empty=root / "empty") for o in overrides]
    if "+fresh=true" in overrides:  # a fresh run: the existing directory would be refused first
        overrides.remove("+fresh=true")
        where = [f"hydra.run.dir={root / 'runs' / 'fresh'}"]
    else:
        where = [f"hydra.run.dir={run_dir}", "ckpt_path=auto"]
    res = run_cli(["train.py", *existing["base"], *where, *overrides], env=existing["env"])
    out = res.stdout + res.stderr
    assert res.returncode == CLEAN_EXIT, out[-3000:]
    assert res.stderr.count("xfam: error:") == 1, res.stderr
    for text in texts:
        assert text in res.stderr, f"{text!r} not in:\n{res.stderr}"
    assert "Fix:" in res.stderr or "Alternatives:" in res.stderr
    assert "Traceback" not in out
    assert checkpoints(root) == ckpts and not (root / "runs" / "fresh").exists()
    assert digest(run_dir) == existing["digest"], "the existing run's files changed"


@pytest.mark.parametrize("flag", ["XFAM_DEBUG=1", "debug=true"])
def test_debug_shows_the_traceback(flag: str, existing: dict) -> None:
    env = {**existing["env"], "XFAM_DEBUG": "1"} if flag == "XFAM_DEBUG=1" else existing["env"]
    args = [f"hydra.run.dir={existing['run_dir']}", "ckpt_path=auto", "attention=perfomer"]
    res = run_cli(["train.py", *existing["base"], *args, *([flag] if flag == "debug=true" else [])], env=env)
    assert res.returncode != 0 and "Traceback" in res.stderr and "ConfigError" in res.stderr
    assert "Did you mean 'performer'" in res.stderr
    assert digest(existing["run_dir"]) == existing["digest"]
