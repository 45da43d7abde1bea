"""kNN-LM through the real command line: ``xfam knnlm build`` writes a datastore of a trained checkpoint,
``xfam knnlm eval`` reports the base model (equal to ``xfam eval``) and the interpolation, excludes a
token's own entry on the store's split, and refuses a datastore of another model."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import ROOT, TINY, compose_cfg, run_cli, text_data
from xfam.cli.main import main
from xfam.training.runner import train

CLEAN_EXIT = 2


def values(stdout: str) -> dict[str, float]:
    """The ``  name  value`` lines of an eval report."""
    return {k: float(v) for k, v in (line.split() for line in stdout.splitlines() if line.startswith("  "))}


@pytest.fixture(scope="module")
def store(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny trained model and a datastore of the first 20 batches of its train split (via the CLI)."""
    run_dir = tmp_path_factory.mktemp("knnlm-run")
    train(compose_cfg([*TINY, *text_data(corpus)]), run_dir)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out = run_dir / "store"
    res = run_cli(["-m", "xfam.cli", "knnlm", "build", f"ckpt={ckpt}", f"out={out}", "limit=20"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return ckpt, out


def test_build_writes_keys_values_and_a_manifest(store: tuple[Path, Path]) -> None:
    ckpt, out = store
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["split"] == "train" and manifest["batches"] == 20 and manifest["dim"] == 32
    assert manifest["checkpoint"]["path"] == str(ckpt.resolve()) and manifest["checkpoint"]["step"] == 6
    n = manifest["count"]
    assert 0 < n <= 20 * 4 * 32  # target positions of 20 batches of 4 x 32 bytes
    assert (out / "keys.bin").stat().st_size == n * 32 * 2  # fp16 keys
    assert (out / "values.bin").stat().st_size == n * 4


def test_eval_reports_base_and_interpolation_and_lambda_zero_is_xfam_eval(
    store: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    ckpt, out = store
    base = run_cli(["-m", "xfam.cli", "eval", f"ckpt={ckpt}", "limit=5"])
    assert base.returncode == 0, base.stderr[-2000:]
    ref = values(base.stdout)
    res = run_cli(["-m", "xfam.cli", "knnlm", "eval", f"ckpt={ckpt}", f"store={out}", "limit=5", "k=64", "lambda=0"])
    assert res.returncode == 0, res.stderr[-2000:]
    got = values(res.stdout)
    for m in ("loss", "ppl", "bpb", "acc"):
        assert got[f"test/{m}"] == ref[f"test/{m}"], m  # the base model, as `xfam eval` reports it
        assert got[f"test/knnlm/{m}"] == ref[f"test/{m}"], m  # lambda = 0: exactly the base model
    main(["knnlm", "eval", f"ckpt={ckpt}", f"store={out}", "limit=5", "k=64"])  # in-process: same command line
    stdout = capsys.readouterr().out
    assert "k=64 lambda=0.25 temperature=1.0 index=exact" in stdout
    got = values(stdout)
    assert got["test/loss"] == ref["test/loss"]
    # The corpus repeats its lines: neighbours from the train split carry the right next byte.
    assert got["test/knnlm/loss"] < got["test/loss"] - 0.5 and got["test/knnlm/coverage"] > 0.9
    assert got["test/knnlm/ppl"] == pytest.approx(math.exp(got["test/knnlm/loss"]), rel=1e-3)
    bytes_per_token = got["test/loss"] / math.log(2) / got["test/bpb"]  # the same targets for both
    assert got["test/knnlm/bpb"] == pytest.approx(got["test/knnlm/loss"] / math.log(2) / bytes_per_token, rel=1e-3)


def test_eval_on_the_store_split_excludes_each_tokens_own_entry(
    store: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    ckpt, out = store
    main(["knnlm", "eval", f"ckpt={ckpt}", f"store={out}", "split=train", "limit=3", "k=1", "lambda=1"])
    stdout = capsys.readouterr().out
    assert "own entries excluded" in stdout
    got = values(stdout)
    # Retrieving itself, every token's single neighbour would carry its target (coverage 1, loss 0).
    assert got["train/knnlm/coverage"] < 1.0 and got["train/knnlm/loss"] > 0.0


def test_faiss_index_gives_the_exact_result(store: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("faiss")
    ckpt, out = store
    args = ["knnlm", "eval", f"ckpt={ckpt}", f"store={out}", "limit=5", "k=64"]
    main(args)  # in-process: the same command line, without another interpreter's start-up
    exact = values(capsys.readouterr().out)
    main([*args, "index=faiss"])
    got = values(capsys.readouterr().out)
    # Both exact; neighbours tied at equal distances (repeated contexts) may be cut at k differently.
    assert got["test/knnlm/loss"] == pytest.approx(exact["test/knnlm/loss"], abs=2e-3)


def test_a_datastore_of_another_model_and_bad_options_are_clear_errors(
    store: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt, out = store
    other = tmp_path / "other"
    shutil.copytree(out, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["checkpoint"].update(path="/elsewhere/last.ckpt", step=99, weights_sha256="0" * 64)
    (other / "manifest.json").write_text(json.dumps(manifest))
    for word, message in [
        (f"store={other}", "built from another model: /elsewhere/last.ckpt (step 99"),
        ("lambda=1.5", "lambda=1.5: the interpolation weight must be in [0, 1]"),
        (f"store={tmp_path}", "not a datastore"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["knnlm", "eval", f"ckpt={ckpt}", f"store={out}", word])  # in-process, as the CLI runs it
        err = capsys.readouterr().err
        assert exc.value.code == CLEAN_EXIT and message in err and "Fix:" in err, err


def test_help() -> None:
    for args in (["knnlm", "--help"], ["knnlm", "build", "--help"], ["knnlm", "eval", "--help"]):
        res = run_cli(["-m", "xfam.cli", *args])
        assert res.returncode == 0 and "usage: xfam knnlm" in res.stdout, args
    assert "lambda" in res.stdout and "temperature" in res.stdout and "faiss" in res.stdout


def test_generate_samples_from_the_interpolation(store: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    ckpt, out = store
    args = ["generate", f"ckpt={ckpt}", "prompt=the quick", "max_new_tokens=12", "temperature=0"]
    main(args)
    plain = capsys.readouterr().out
    main([*args, f"knnlm_store={out}", "knnlm_k=8", "knnlm_lambda=0"])
    assert capsys.readouterr().out == plain  # λ = 0: the model's own greedy continuation
    main([*args, f"knnlm_store={out}", "knnlm_k=8", "knnlm_lambda=1"])
    knn = capsys.readouterr().out
    assert knn.startswith("the quick") and knn != plain  # the 6-step model alone does not continue the corpus
    with pytest.raises(SystemExit) as exc:
        main([*args, f"knnlm_store={out}", "check=true"])
    assert exc.value.code == CLEAN_EXIT and "check=true without knnlm_store" in capsys.readouterr().err


def test_sweep_script_writes_the_table_and_the_plot(
    store: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    ckpt, out = store
    spec = importlib.util.spec_from_file_location("knnlm_sweep", ROOT / "scripts" / "knnlm_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    results, png = tmp_path / "results.md", tmp_path / "knnlm.png"
    argv = ["knnlm_sweep.py", "--ckpt", str(ckpt), "--store", str(out), "--store-limit", "20", "--limit", "2"]
    argv += ["--threads", "1"]  # in-process: keep the test session's single thread
    argv += ["--ks", "8", "64", "--lambdas", "0", "0.5", "1", "--results", str(results), "--png", str(png)]
    monkeypatch.setattr(sys, "argv", argv)
    sweep.main()
    assert "reusing datastore" in capsys.readouterr().out  # the fixture's store: same model, same limit
    text = results.read_text()
    assert "<!-- experiments:knnlm:start -->" in text and "| lambda | k=8 | k=64 |" in text
    grid = json.loads((out / "sweep.json").read_text())["grid"]
    assert grid["8,0.0"]["ppl"] == grid["64,0.0"]["ppl"] == grid["base"]["ppl"]  # lambda = 0: the base model
    assert grid["64,0.5"]["ppl"] < grid["base"]["ppl"]
    assert png.stat().st_size > 1000
