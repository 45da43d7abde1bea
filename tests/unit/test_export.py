"""``xfam export``: the model folder loads without pickle into exactly the checkpoint's model (the same logits bit for
bit, the same metadata), shared tensors are stored once, the model card says what the model is, and what cannot be
exported or loaded is refused with the fix. Checkpoints here are written without training (a freshly initialised
model is as good a test of exactness as a trained one); a trained run end to end: tests/integration/test_export_cli.py.
"""

from __future__ import annotations

import json
import pickle
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import xfam
from tests.integration.helpers import compose_cfg
from xfam.cli import main as xfam_main
from xfam.core.errors import ConfigError
from xfam.model import checkpoint, exported
from xfam.model.build import build_model
from xfam.model.export import export, stored_tensors, write_weights
from xfam.model.model_card import reconstructed_overrides

SMALL = ["model.dim=32", "model.layers=2", "model.heads=2", "model.max_len=64", "data.seq_len=32"]
BYTE_LM = {
    "name": "text",
    "task": "lm",
    "vocab_size": 257,
    "num_classes": None,
    "token_bytes": [1] * 256 + [0],
    "pad_id": None,
    "eos_id": 256,
    "bos_id": None,
    "fingerprint": "f00d",
    "tokenizer": {"kind": "byte"},
    "inputs": {"kind": "tokens"},
    "target_dim": None,
    "decision": None,
}
LISTOPS = {**BYTE_LM, "name": "listops", "task": "classify", "vocab_size": 17, "num_classes": 10, "pad_id": 0}
LISTOPS |= {"token_bytes": None, "eos_id": None, "tokenizer": None}
#: One model per kind the export must keep exact: plain, tied embeddings, one block for every layer (ALBERT), a
#: module shared by every layer's attention (Linformer's layerwise projection, on a classifier), memory, exit.
KINDS = {
    "plain": [],
    "tied": ["model.tie_embeddings=true"],
    "one_block": ["model.share_layers=true"],
    "layerwise": ["attention=linformer", "attention.sharing=layerwise", "attention.k=8", "data=listops"],
    "memory": ["memory=xl", "pos=xl", "memory.mem_len=8"],
    "early_exit": ["exit=calm"],
}


def write_ckpt(path: Path, overrides: list[str], info: dict | None = None, optimizer: bool = True) -> Path:
    """A checkpoint as training writes it (digest, step, an optimizer state), of a freshly built model."""
    info = info or BYTE_LM
    cfg = compose_cfg([*SMALL, *overrides])
    torch.manual_seed(1)
    model = build_model(cfg, info)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    extra = {"optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"params": [0]}]}]}
    extra = extra if optimizer else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write(
        {"xfam": checkpoint.metadata(cfg, info), "state_dict": state, "global_step": 7, "epoch": 0, **extra}, path
    )
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    info = {"layerwise": LISTOPS}
    return {kind: write_ckpt(root / f"{kind}.ckpt", overrides, info.get(kind)) for kind, overrides in KINDS.items()}


def logits(model: torch.nn.Module, seed: int = 3) -> torch.Tensor:
    """The model's output for a fixed batch of ids (its vocabulary's: the embedding's rows)."""
    tokens = torch.randint(0, model.embed.num_embeddings, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_folder_gives_the_checkpoints_model_exactly(kind: str, ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "model"
    export(ckpts[kind], out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    model, meta = xfam.load_model(ckpts[kind])
    again, meta_again = xfam.load_model(out)
    assert type(again) is type(model) and meta_again == meta  # the same metadata as the checkpoint's
    a, b = model.state_dict(), again.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(logits(model), logits(again))
    config = json.loads((out / "config.json").read_text())
    assert config["format"] == exported.FORMAT and config["format_version"] == exported.FORMAT_VERSION
    assert config["step"] == 7 and config["source"] == f"{kind}.ckpt"


def test_shared_tensors_are_stored_once_and_come_back_shared(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from safetensors import safe_open

    export(ckpts["tied"], tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        names, header = set(f.keys()), f.metadata()
    assert ("head.weight" in names) != ("embed.weight" in names)  # one of the two, once
    aliases = json.loads((tmp_path / "tied" / "config.json").read_text())["weights"]["aliases"]
    assert aliases == json.loads(header[exported.ALIASES_KEY]) and set(aliases.items()) <= {
        ("head.weight", "embed.weight"),
        ("embed.weight", "head.weight"),
    }
    model, _ = xfam.load_model(tmp_path / "tied")
    assert model.head.weight is model.embed.weight  # still tied: training on from it keeps one matrix

    export(ckpts["layerwise"], tmp_path / "shared")
    with safe_open(str(tmp_path / "shared" / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    model, _ = xfam.load_model(tmp_path / "shared")
    unique = {p.data_ptr() for p in model.state_dict().values()}
    assert len(stored) == len(unique) < len(model.state_dict())  # the projection once for every layer
    assert model.blocks[1].attn.mechanism.proj_k is model.blocks[0].attn.mechanism.proj_k


def test_views_and_non_contiguous_tensors_are_written_as_their_values(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    state = {
        "w": base,
        "same": base,  # an alias
        "t": base.t(),  # non-contiguous view of the same storage
        "row": base[1],  # part of it
        "strided": torch.arange(10.0)[::2],
        "empty": torch.zeros(0, 4),
        "flag": torch.tensor(True),
        "half": torch.ones(2, dtype=torch.bfloat16),
    }
    tensors, aliases = stored_tensors(state)
    assert aliases == {"same": "w"}
    write_weights(tensors, aliases, tmp_path / "model.safetensors")  # safetensors refuses shared memory: none left
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "model.safetensors"))
    for name, t in state.items():
        got = back[aliases.get(name, name)]
        assert got.dtype == t.dtype and torch.equal(got, t), name


def test_loading_the_folder_uses_no_pickle(ckpts: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    export(ckpts["memory"], tmp_path / "m")
    expected, _ = xfam.load_model(ckpts["memory"])

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    class NoUnpickler:
        def __init__(self, *args, **kwargs):
            raise AssertionError("pickle used")

    for owner, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(owner, name, NoUnpickler if name == "Unpickler" else refuse)
    model, meta = xfam.load_model(tmp_path / "m")
    assert meta["config"]["memory"]["name"] == "xl" and torch.equal(logits(model), logits(expected))
    with pytest.raises((AssertionError, ConfigError)):  # the same guard stops a checkpoint's load: it bites
        xfam.load_model(ckpts["memory"])


def tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "the": 2, "quick": 3, "fox": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    return tok.to_str(pretty=True) + "\r\n"  # (bytes a reader must give back as they are, line ends included)


def test_a_pretrained_tokenizer_is_a_tokenizer_json_beside_the_weights(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from xfam.data.tokenize import tokenizer_from_state

    text = tiny_tokenizer_json()
    state = {"kind": "pretrained", "json": text, "special": {"eos": "</s>", "bos": None, "pad": None}}
    info = {**BYTE_LM, "vocab_size": 5, "token_bytes": [0, 0, 3, 5, 3], "eos_id": 1, "tokenizer": state}
    ckpt = write_ckpt(tmp_path / "tok.ckpt", [], info)
    export(ckpt, tmp_path / "m")
    assert (tmp_path / "m" / "tokenizer.json").read_bytes() == text.encode()
    assert json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    saved = json.loads((tmp_path / "m" / "config.json").read_text())["data_info"]["tokenizer"]
    assert saved == {"kind": "pretrained", "special": state["special"], "file": "tokenizer.json"}  # no text twice
    _, meta = xfam.load_model(tmp_path / "m")
    assert meta["data_info"]["tokenizer"] == state  # exactly what the checkpoint holds
    assert Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json")).encode("the quick fox").ids == [2, 3, 4]
    assert tokenizer_from_state(meta["data_info"]["tokenizer"]).encode("the fox") == [2, 4]


def test_the_model_card_says_what_the_model_is(ckpts: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "runs" / "demo"
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    shutil.copy(ckpts["memory"], ckpt)
    (run / "metrics.json").write_text(json.dumps({"step": 9, "val/loss": 2.5, "test/bpb": 1.25}))
    (run / "data_manifest.json").write_text(json.dumps({"source": "text", "roots": ["/home/me/corpus"], "files": []}))
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- memory=xl\n- pos=xl\n- data.paths=[a b]\n")
    export(ckpt, tmp_path / "m")
    card = (tmp_path / "m" / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: xfam" in front and "- memory-xl" in front and "pipeline_tag: text-generation" in front
    from xfam.memory import MEMORY
    from xfam.pos import POS

    for cls in (MEMORY.get("xl"), POS.get("xl")):
        assert cls.paper and cls.paper in body
    model, _ = xfam.load_model(ckpt)
    params = sum(p.numel() for p in model.parameters())
    assert f"| parameters | {params:,} " in body and "| layers | 2 |" in body and "| vocabulary | 257 |" in body
    assert "From the run's `metrics.json`, step 9 (the exported checkpoint is at step 7)" in body
    assert "| val/loss | 2.5000 |" in body and "| test/bpb | 1.2500 |" in body
    assert "python train.py memory=xl pos=xl 'data.paths=[a b]'" in body and "`.hydra/overrides.yaml`" in body
    assert "| roots | …/corpus |" in body and "/home/me" not in body
    assert 'xfam.load_model("DIR")' in body and "xfam generate ckpt=DIR" in body


def test_without_a_run_directory_the_card_says_so_and_reconstructs_the_command(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    export(ckpts["early_exit"], tmp_path / "m")
    card = (tmp_path / "m" / "README.md").read_text()
    assert "No metrics were found beside the checkpoint" in card
    assert "data manifest (`data_manifest.json`) was not found" in card
    assert "reconstructed from the config" in card and "exit=calm" in card


def test_the_reconstructed_command_composes_the_same_architecture() -> None:
    overrides = [*SMALL, "memory=xl", "pos=xl", "memory.mem_len=8", "exit=calm", "attention.dropout=0.1", "seed=3"]
    cfg = compose_cfg(overrides)
    again = compose_cfg(reconstructed_overrides(cfg))
    for section in ("model", "attention", "pos", "memory", "exit", "data", "optim", "seed"):
        assert again[section] == cfg[section], section
    assert "memory=xl" in reconstructed_overrides(cfg) and "model.name=tiny" not in reconstructed_overrides(cfg)
    assert shlex.split(" ".join(map(shlex.quote, reconstructed_overrides(cfg)))) == reconstructed_overrides(cfg)


def test_an_occupied_out_or_an_unreadable_checkpoint_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"exists and is not empty\. Fix: .*force=true"):
        export(ckpts["plain"], out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written
    (out / "tokenizer.json").write_text("{}")  # an earlier export's file this one does not write
    export(ckpts["plain"], out, force=True)
    names = sorted(p.name for p in out.iterdir())
    assert (
        names == ["README.md", "config.json", "model.safetensors", "notes.txt"]
        and (out / "notes.txt").read_text() == "mine"
    )
    with pytest.raises(ConfigError, match="is a file"):
        export(ckpts["plain"], tmp_path / "out" / "notes.txt")
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        export(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_folder_that_is_not_whole_or_of_an_unknown_layout_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    def fresh(name: str) -> Path:
        export(ckpts["plain"], tmp_path / name)
        return tmp_path / name

    def edit_config(folder: Path, **changes) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    folder = fresh("format")
    edit_config(folder, format="transformers")
    with pytest.raises(ConfigError, match="has format 'transformers', not 'xfam-model'"):
        xfam.load_model(folder)
    folder = fresh("version")
    edit_config(folder, format_version=exported.FORMAT_VERSION + 1)
    with pytest.raises(ConfigError, match="Fix: upgrade xfam"):
        xfam.load_model(folder)
    folder = fresh("missing")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        xfam.load_model(folder)
    folder = fresh("changed")
    raw = bytearray((folder / "model.safetensors").read_bytes())
    raw[-3] ^= 0x10
    (folder / "model.safetensors").write_bytes(raw)
    with pytest.raises(ConfigError, match="does not match the SHA-256"):
        xfam.load_model(folder)
    folder = fresh("garbled")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read as JSON"):
        xfam.load_model(folder)


def test_training_state_readers_refuse_the_folder_and_sharded_folders_still_work(
    ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from xfam.cli import convert
    from xfam.cli.commands import checkpoint_file, ckpt

    export(ckpts["tied"], tmp_path / "m")
    with pytest.raises(ConfigError, match="is an exported model folder .* Fix: pass the training checkpoint"):
        checkpoint.read(tmp_path / "m")
    for argv in (["convert", f"ckpt={tmp_path / 'm'}", "out=x"], ["export", f"ckpt={tmp_path / 'm'}", "out=y"]):
        with pytest.raises(SystemExit) as stop:
            xfam_main.main(argv)
        assert stop.value.code == 2 and "is an exported model folder" in capsys.readouterr().err
    # a sharded checkpoint (a folder with meta.pt) stays one, exports, and loads as before
    single = write_ckpt(tmp_path / "single.ckpt", ["model.tie_embeddings=true"], optimizer=False)
    convert.run(type("Args", (), {"ckpt": str(single), "out": str(tmp_path / "sharded.ckpt"), "overwrite": False})())
    sharded = tmp_path / "sharded.ckpt"
    assert not exported.is_exported(sharded) and checkpoint_file(ckpt(), str(sharded)) is None
    assert checkpoint_file(ckpt(), str(tmp_path / "m")) is None
    export(sharded, tmp_path / "from_sharded")
    model, _ = xfam.load_model(sharded)
    again, _ = xfam.load_model(tmp_path / "from_sharded")
    assert torch.equal(logits(model), logits(again))
    assert "neither a sharded checkpoint" in (checkpoint_file(ckpt(), str(tmp_path)) or "")


def test_fine_tuning_starts_from_an_exported_folder_as_from_its_checkpoint(ckpts: dict[str, Path], tmp_path) -> None:
    """``init_from=DIR`` (the weights of a published model): the same tensors as ``init_from`` of the checkpoint."""
    from xfam.model.init_from import FinetuneSpec, finetune_problems, init_from

    out = tmp_path / "model"
    export(ckpts["tied"], out)
    cfg = compose_cfg([*SMALL, *KINDS["tied"], f"init_from={out}"])
    assert finetune_problems(cfg) == []
    models = []
    for source in (ckpts["tied"], out):
        torch.manual_seed(5)
        model = build_model(cfg, BYTE_LM)
        init_from(model, source, FinetuneSpec())
        models.append(model.state_dict())
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    (out / "model.safetensors").unlink()  # an incomplete copy: refused before the run starts
    assert "model.safetensors" in " ".join(finetune_problems({**cfg, "init_from": str(out)}))
