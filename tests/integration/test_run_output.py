"""What a run prints: every log line once (Lightning's included, which has a console handler of its own), and an
end-of-run summary that names only the files the run wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.helpers import TINY, run_cli, text_data


@pytest.mark.parametrize("curve", [True, False])
def test_log_lines_print_once_and_the_summary_names_what_was_written(corpus: Path, tmp_path: Path, curve: bool) -> None:
    args = [*TINY, *text_data(corpus), f"callbacks.loss_curve={str(curve).lower()}", "name=output"]
    res = run_cli(["train.py", *args], env={"XFAM_RUNS": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    printed = res.stdout + res.stderr
    for text in ("GPU available:", "`Trainer.fit` stopped", "finished at step 6", "outputs in"):
        assert printed.count(text) == 1, (text, printed[-3000:])
    (log_file,) = tmp_path.glob("output/*/train.log")
    assert log_file.read_text().count("`Trainer.fit` stopped") == 1  # Lightning's lines reach the run's log too
    curves = list(tmp_path.glob("output/*/loss_curve.png"))
    assert ("loss curve:" in printed) == curve == bool(curves)
