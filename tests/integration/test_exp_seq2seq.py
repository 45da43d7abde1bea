"""The sequence-to-sequence experiments (scripts/exp_seq2seq.py): the decoder-only baseline has the encoder-decoder's
parameter count, every run composes and differs from its comparison only where intended, the ListOps pretraining
corpus reads back as ListOps' own ids, and (slow) each ``--quick`` path runs end to end and evaluates what its runs
trained on."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import ROOT, compose_cfg
from xfam.config import validate
from xfam.data.listops import TOKENS
from xfam.eval.forward import forward_batch
from xfam.model.build import build_data, build_model

sys.path.insert(0, str(ROOT / "scripts"))
import exp_seq2seq as xs  # noqa: E402

ARGS = argparse.Namespace(quick=False, set=[], seeds=[0, 1])


def flat(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def changed(a: dict, b: dict) -> set[str]:
    fa, fb = flat(a), flat(b)
    return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def test_decoder_only_depth_is_the_closest_parameter_count() -> None:
    cfg = compose_cfg([f"experiment={xs.ARCH}"])
    found = xs.decoder_depth(cfg)
    info = {"task": "seq2seq", "vocab_size": build_data(cfg).vocab_size, "num_classes": None}

    def built(arch: str, layers: int) -> torch.nn.Module:
        c = compose_cfg([f"experiment={xs.ARCH}", f"model.arch={arch}", f"model.layers={layers}"])
        return build_model(c, info)

    encdec = built("auto", cfg["model"]["layers"])
    assert type(encdec).__name__ == "EncoderDecoder"
    counts = {n: sum(p.numel() for p in built("decoder", n).parameters()) for n in range(1, 17)}
    target = sum(p.numel() for p in encdec.parameters())
    best = min(counts, key=lambda n: abs(counts[n] - target))
    assert (found["layers"], found["encdec_params"], found["decoder_params"]) == (best, target, counts[best])
    assert abs(counts[best] / target - 1) < 0.01, "equal parameters within 1% (the doc says so)"


def test_arch_runs_differ_only_in_shape_and_seed() -> None:
    runs = xs.arch_runs(ARGS, 5)
    cfgs = {r.label: compose_cfg([f"experiment={r.experiment}", *r.overrides]) for r in runs}
    for cfg in cfgs.values():
        validate(cfg)
    assert changed(cfgs["encdec-s0"], cfgs["decoder-s0"]) == {"model.arch", "model.layers"}
    assert changed(cfgs["encdec-s0"], cfgs["encdec-s1"]) == {"seed"}
    assert cfgs["decoder-s0"]["model"]["arch"] == "decoder" and cfgs["encdec-s0"]["task"]["eval_generate_rows"] == 0


def test_listops_runs_differ_only_in_their_start_and_budget(tmp_path: Path) -> None:
    pre, ft = compose_cfg([f"experiment={xs.PRETRAIN}"]), compose_cfg([f"experiment={xs.FINETUNE}"])
    total = pre["trainer"]["max_steps"] + ft["trainer"]["max_steps"]
    runs = {r.label: r for r in xs.mlm_runs(ARGS, tmp_path, tmp_path / "mlm.ckpt", total)}
    cfgs = {k: compose_cfg([f"experiment={r.experiment}", *r.overrides]) for k, r in runs.items()}
    validate(cfgs["scratch-s0"])
    assert changed(cfgs["scratch-s0"], cfgs["spt-s0"]) == {"init_from", "finetune.allow_mismatch"}
    assert cfgs["spt-s0"]["init_from"] == str(tmp_path / "mlm.ckpt")
    assert changed(cfgs["scratch-s0"], cfgs["scratch-long-s0"]) == {"trainer.max_steps", "callbacks.every_n_steps"}
    assert cfgs["scratch-long-s0"]["trainer"]["max_steps"] == total
    # the pretrained encoder is the fine-tuned one but for the task: same shape, so every block loads
    for key in ("dim", "layers", "heads", "ffn", "norm", "max_len"):
        assert pre["model"][key] == ft["model"][key], key
    assert pre["task"]["name"] == "mlm" and pre["task"]["random_frac"] == 0 and pre["data"]["doc_mask"]


def test_corpus_reads_back_as_listops_ids(tmp_path: Path) -> None:
    listops = ["data.num_train=60", "data.num_val=8", "data.num_test=8"]
    cfg = compose_cfg([f"experiment={xs.FINETUNE}", *listops])
    made = xs.write_corpus(cfg, tmp_path / "corpus")
    trees = xs.prepared(cfg).split("train").with_format(None)["input_ids"]
    assert made["trees"] == len(trees) == len(list((tmp_path / "corpus").glob("*.ids")))
    assert xs.write_corpus(cfg, tmp_path / "corpus") == made, "an unchanged corpus is not rewritten"
    text_cfg = compose_cfg(
        [f"experiment={xs.PRETRAIN}", f"data.paths=[{tmp_path / 'corpus'}]", "data.seq_len=16"]
        + ["data.val_fraction=0.2", "data.test_fraction=0.2"]
    )
    validate(text_cfg)
    source = build_data(text_cfg)
    source.prepare()
    eos, files = source.eos_id, [e for e in source.manifest["files"] if e["split"] == "train"]
    expected = [t for e in files for t in [*(tmp_path / "corpus" / Path(e["path"]).name).read_bytes(), eos]]
    rows = source.split("train")["tokens"].tolist()  # [rows, S + 1]
    stream = list(rows[0]) + [t for row in rows[1:] for t in row[1:]]  # rows overlap by one token
    assert stream == expected[: len(stream)], "data=text's byte tokenizer reads the files' ids back exactly"
    assert set(stream) <= set(range(1, len(TOKENS))) | {eos}, "ListOps ids (no pad, no foreign byte) and EOS"
    assert stream[0] == TOKENS.index("<cls>")


def test_help_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        xs.main(["--help"])
    assert done.value.code == 0 and "{arch,mlm,calm,all}" in capsys.readouterr().out
    xs.main(["all", "--dry-run", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("python train.py experiment=") == 8 and "refused" not in out
    assert not any(tmp_path.iterdir()), "a dry run trains and writes nothing"


# ------------------------------------------------------------------------------------------- the quick paths


def quick(which: str, tmp_path: Path) -> tuple[dict, str]:
    results = tmp_path / "results.md"
    out = xs.main([which, "--quick", "--out", str(tmp_path), "--results", str(results), "--threads", "1"])[which]
    text = results.read_text()
    section = xs.SECTIONS[which]
    assert f"<!-- experiments:{section}:start -->" in text and (tmp_path / f"results_{section}.png").exists()
    return out, text


@torch.no_grad()
def teacher_forced_loss(model: torch.nn.Module, batches: list[dict]) -> float:
    nll = count = 0.0
    for b in batches:
        logits = forward_batch(model, b).logits
        keep = b["labels"] != -100
        nll += float(torch.nn.functional.cross_entropy(logits[keep], b["labels"][keep], reduction="sum"))
        count += float(keep.sum())
    return nll / count


@pytest.mark.slow
def test_quick_arch_evaluates_what_each_shape_trained_on(tmp_path: Path) -> None:
    from xfam.model.checkpoint import load_model

    out, text = quick("arch", tmp_path)
    assert abs(out["depth"]["decoder_params"] / out["depth"]["encdec_params"] - 1) < 0.01
    for run in out["runs"]:
        assert xs.ok(run), run.reason
        model, meta = load_model(xs.ckpt_of(run))
        size = meta["config"]["data"]["batch_size"]
        rows = size * meta["config"]["trainer"]["limit_test_batches"]
        batches = xs.pair_batches(model, meta["config"], "test", rows, size)
        # the script's batches of the test split are the ones the run was tested on, in its own layout
        assert teacher_forced_loss(model, batches) == pytest.approx(run.metrics["test/loss"], rel=1e-4)
        e = out["evals"][run.label]
        assert e["rows"] == 4 and 0 <= e["chrf"] <= 100 and e["tokens"] > 0
    assert set(out["speed"]) == {"encdec", "decoder"} and "| encdec |" in text and "| decoder |" in text


@pytest.mark.slow
def test_quick_mlm_fine_tunes_from_the_pretrained_embedding_rows(tmp_path: Path) -> None:
    from xfam.model.checkpoint import load_model
    from xfam.model.checkpoint_file import read
    from xfam.model.init_from import FinetuneSpec, init_from

    out, text = quick("mlm", tmp_path)
    pre = out["pretrain"]
    assert xs.ok(pre) and all(xs.ok(r) for r in out["runs"]), [r.reason for r in out["runs"]]
    spt = next(r for r in out["runs"] if r.label == "spt-s0")
    saved = read(xs.ckpt_of(spt))["xfam"]
    cfg, info = saved["config"], saved["data_info"]
    fresh = build_model(cfg, info)
    init_from(fresh, xs.ckpt_of(pre), FinetuneSpec(allow_mismatch=True), info)
    mlm, _ = load_model(xs.ckpt_of(pre))
    assert mlm.embed.weight.shape[0] > len(TOKENS)
    assert torch.equal(fresh.embed.weight, mlm.embed.weight[: len(TOKENS)]), "ListOps' ids are rows 0..16"
    blocks = {k: v for k, v in mlm.state_dict().items() if k.startswith("blocks.")}
    assert blocks and all(torch.equal(fresh.state_dict()[k], v) for k, v in blocks.items())
    assert any(m.startswith("embed.weight") for m in out["transfer"]["mismatched"]) and "root-operator" in text


@pytest.mark.slow
def test_quick_calm_full_depth_points_agree(tmp_path: Path) -> None:
    out, text = quick("calm", tmp_path)
    static, layers = out["static"], out["layers"]
    for sweep in out["sweeps"].values():  # threshold above 1: no exits, exactly the full model
        assert sweep["thresholds"][0] > 1 and sweep["depth"][0] == layers
        assert sweep["bpb"][0] == pytest.approx(static[-1]["bpb"], rel=1e-6)
    assert [s["gen_depth"] for s in static] == pytest.approx(list(range(1, layers + 1)))
    first = out["generation"][0]
    assert first["threshold"] > 1 and first["same_as_full"] == 1.0 and first["depth"] == layers
    assert out["cli"][0]["returncode"] == 0 and "xfam calibrate" in text
