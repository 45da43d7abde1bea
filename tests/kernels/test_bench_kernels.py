"""``scripts/bench_kernels.py --interpret`` runs the whole benchmark pipeline on CPU (Triton's interpreter,
tiny sizes): every implementation agrees with the reference and the table lands between its markers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from xfam.kernels import runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    runtime.why_not(torch.device("cpu")) is not None, reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)


def load_script():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "scripts" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = module
    spec.loader.exec_module(module)
    return module


def test_interpret_mode_measures_checks_and_writes_the_table(tmp_path: Path, capsys) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n<!-- bench_kernels:start -->\npending\n<!-- bench_kernels:end -->\nkept\n")
    load_script().main(["--interpret", "--lengths", "32", "--cases", "alibi", "bigbird", "linear", "--out", str(out)])
    text = out.read_text()
    assert "pending" not in text and text.endswith("kept\n")  # replaced between the markers only
    for row in ("| alibi | 32 | 32 | triton |", "| alibi | 32 | 32 | sdpa |", "| bigbird | 32 | 32 | triton |"):
        assert row in text
    assert "| m=16 | 32 | 32 | triton |" in text and "| m=16 | 32 | 32 | pytorch_chunked |" in text
    # FlexAttention runs eagerly on CPU, forward only: its score and mask functions agree with SDPA's mask
    flex = [
        line
        for line in text.splitlines()
        if line.startswith(("| alibi | 32 | 32 | flex |", "| bigbird | 32 | 32 | flex"))
    ]
    assert len(flex) == 2 and all(
        line.split(" | ")[5] == "—" and float(line.split(" | ")[-1][:-2]) < 1e-5 for line in flex
    )
    assert "0 outputs off SDPA's, 0 failed calls" in capsys.readouterr().out
    assert len(out.with_suffix(".kernels.jsonl").read_text().splitlines()) == 8  # written as it went


def test_a_failing_implementation_is_listed_under_the_table_and_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    from xfam.kernels import flash_attention

    def broken(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(flash_attention, "flash_attention", broken)
    out = tmp_path / "benchmarks.md"
    with pytest.raises(SystemExit) as stop:
        load_script().main(["--interpret", "--lengths", "32", "--cases", "causal", "--no-flex", "--out", str(out)])
    assert stop.value.code == 1
    text = out.read_text()
    assert "| causal | 32 | 32 | sdpa |" in text and "| causal | 32 | 32 | triton |" not in text
    assert "- causal L=32 Dh=32 triton: FAILED RuntimeError: out of resource: shared memory" in text


def test_resume_keeps_earlier_measurements_and_runs_only_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    script = load_script()
    script.main(["--interpret", "--lengths", "32", "--cases", "window", "--no-flex", "--out", str(out)])
    first = out.with_suffix(".kernels.jsonl").read_text().splitlines()
    script.main(["--interpret", "--lengths", "32", "--cases", "window", "linear", "--no-flex", "--resume",
                 "--out", str(out)])  # fmt: skip
    lines = out.with_suffix(".kernels.jsonl").read_text().splitlines()
    assert lines[:2] == first and len(lines) == 4  # window kept as it was, linear added
    text = out.read_text()
    assert "Resumed: 2 measurements" in text and "| window | 32 | 32 | triton |" in text and "| m=16 | 32 |" in text
