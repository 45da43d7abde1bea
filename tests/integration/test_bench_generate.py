"""scripts/bench_generate.py: its roofline counts what a step must read and compute (the keys a query sees, the
weights once), both systems decode the same model shape (but for x-transformers' FFN biases), and a quick run
checks the compiled path's greedy tokens against eager decoding's and writes its table and chart into
docs/decoding.md's marked section only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_generate as bg  # noqa: E402

pytest.importorskip("x_transformers")


def test_the_step_cost_follows_the_keys_each_mechanism_reads() -> None:
    flops_256, bytes_256 = bg.step_cost("vanilla", 1, 256)
    flops_512, bytes_512 = bg.step_cost("vanilla", 1, 512)
    per_key = 4 * bg.LAYERS * bg.DIM  # q.k and p.v: 2 multiply-adds per key and channel, each layer
    assert flops_512 - flops_256 == 256 * per_key and bytes_512 - bytes_256 == 256 * 2 * 4 * bg.LAYERS * bg.DIM
    assert bg.step_cost("local", 1, 4096) == bg.step_cost("local", 1, 256)  # a window of 256 keys
    assert bg.step_cost("performer", 1, 4096) == bg.step_cost("performer", 1, 256)  # running sums
    weights = 4 * (bg.LAYERS * 12 * bg.DIM**2 + bg.DIM * bg.VOCAB)
    assert bytes_256 - 2 * 4 * bg.LAYERS * 256 * bg.DIM == weights  # read once per step, whatever the batch
    flops_8, bytes_8 = bg.step_cost("vanilla", 8, 256)
    assert flops_8 == 8 * flops_256 and bytes_8 - weights == 8 * (bytes_256 - weights)


def test_both_systems_have_the_same_weights() -> None:
    xfam, xt = bg.build_xfam("vanilla"), bg.build_xtransformers("vanilla")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    ffn_biases = bg.LAYERS * (4 * bg.DIM + bg.DIM)  # x-transformers' FFN has biases; xfam's (bias=false) not
    assert count(xt) == count(xfam) + ffn_biases


@pytest.mark.slow
def test_a_quick_run_writes_its_section_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "decoding.md").write_text(f"# Fast decoding\n\nprose\n\n{bg.MARKERS[0]}\nold\n{bg.MARKERS[1]}\n\nafter\n")
    monkeypatch.setattr(bg, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench_generate.py", "--quick"])
    bg.main()
    text = (docs / "decoding.md").read_text()
    assert text.startswith("# Fast decoding\n\nprose") and text.endswith("after\n") and "old" not in text
    assert "| vanilla | 1 | 64 | xfam compiled |" in text and (docs / "decoding.png").stat().st_size > 0
